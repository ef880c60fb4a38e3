"""The live scheduler dashboard: `GET /dashboard` (one page, shipped as package data) fed by
`GET /v1/scheduler/stream` (server-sent events, a few a second whatever the step rate), on the
single server and on the Ray Serve ingress alike.

SchedulerStream is the hub between a TickSource and the browsers: one asyncio task asks the source
for one tick per interval and hands the same bytes to every open stream; the source gathers only
while a stream is open. The single server's source is its engine's EngineTicks (engine_ticks.py);
the ingress's merges its replicas' ticks, each labelled with its replica (serve_ray/dashboard_feed.py),
and the page draws one panel per replica.

The API key guards the stream but not the page (PAGE_PATHS: it holds no data); EventSource cannot
send an Authorization header, so the page reads the stream with fetch() and sends the key itself
(see static/dashboard.js). A page tells a restarted server by the hello's start_id and starts afresh.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Protocol

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse, StreamingResponse
from starlette.staticfiles import StaticFiles

from iterserve.engine import LLMEngine

log = logging.getLogger("iterserve.server")

# The page and its script and style hold no data (the page asks for the key and sends it with the
# stream's request), so an API key guard lets them through; the stream itself is guarded.
PAGE_PATHS = ("/dashboard", "/dashboard/static/dashboard.js", "/dashboard/static/dashboard.css")


@dataclass
class StreamConfig:
    interval_s: float = 0.25  # one message per tick: 4 a second
    latency_window_s: float = 60.0  # rolling TTFT / e2e / queue-time percentiles over this window
    max_backlog: int = 64  # ticks a slow reader may fall behind before its stream is closed (it reconnects)


class TickSource(Protocol):
    """What SchedulerStream streams: EngineTicks (one engine) or ReplicaTicks (the Ray replicas)."""

    @property
    def closed(self) -> bool: ...  # the server is shutting down: end every stream

    def start(self) -> None: ...  # a reader arrived: gather from now on

    def stop(self) -> None: ...  # the last reader left: gather nothing

    def hello(self) -> dict: ...  # a new reader's first message: the full state

    def tick(self, now: float) -> dict: ...  # what happened since the last tick


def engine_info(llm: LLMEngine, served_model_name: str, model: str) -> dict:
    """The engine's configuration as the dashboard, /v1/scheduler and the config-info metric show
    it: every EngineConfig switch, what was resolved at start (device, dtype, kernels, limits, cache
    size), and the sequences one step may hold (the batch-size chart's limit line). `model` is the
    model as answers may name it (api.model_name: no path on this machine)."""
    cfg = llm.config
    pooling = getattr(llm, "pooling", None)  # /v1/embeddings' pooling as resolved (None: refused)
    return {**asdict(cfg), **llm.resolved_config(), "model": model, "served_model_name": served_model_name,
            "step_limit": cfg.max_batch_size if cfg.batching == "static" else cfg.max_num_seqs,
            "embedding_pooling": pooling.method if pooling is not None else None}


class SchedulerStream:
    """The hub: one tick per interval from the source, the same bytes to every open stream."""

    def __init__(self, source: TickSource, config: StreamConfig | None = None) -> None:
        self.source = source
        self.config = config or StreamConfig()
        self.start_id = uuid.uuid4().hex[:12]  # a page tells a restarted server by this
        self._subscribers: set[asyncio.Queue[bytes | None]] = set()
        self._task: asyncio.Task | None = None

    async def subscribe(self) -> AsyncIterator[bytes]:
        """One client's stream: a `hello` event (the source's full state), then a `tick` event per
        interval until the client goes away or the server shuts down."""
        if self.source.closed:
            return
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(self.config.max_backlog)
        self._subscribers.add(queue)
        self.source.start()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            yield sse("hello", {"start_id": self.start_id, "interval_s": self.config.interval_s,
                                "latency_window_s": self.config.latency_window_s, **self.source.hello()})
            while True:
                data = await queue.get()
                if data is None:
                    return
                yield data
        finally:
            self._discard(queue)

    async def _run(self) -> None:
        next_at = time.monotonic()
        try:
            while self._subscribers and not self.source.closed:
                next_at += self.config.interval_s
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                data = sse("tick", self.source.tick(time.monotonic()))
                for q in list(self._subscribers):
                    if q.qsize() >= self.config.max_backlog - 1:
                        log.warning("scheduler stream: a reader fell %d ticks behind; closing its stream",
                                    self.config.max_backlog)
                        self._close(q)  # rather than drop ticks: its counts would have a gap
                    else:
                        q.put_nowait(data)
        finally:  # server shutdown (the streams must end, or uvicorn waits for them) or a bug
            for q in list(self._subscribers):
                self._close(q)

    def _close(self, q: asyncio.Queue[bytes | None]) -> None:
        q.put_nowait(None)
        self._discard(q)

    def _discard(self, q: asyncio.Queue[bytes | None]) -> None:
        if q in self._subscribers:
            self._subscribers.discard(q)
            if not self._subscribers:
                self.source.stop()


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def static_text(name: str) -> str:
    return resources.files("iterserve.server").joinpath("static", name).read_text()


def add_dashboard(app: FastAPI, stream: SchedulerStream) -> None:
    """/dashboard (the page), /dashboard/static/* (its script and style), /v1/scheduler/stream."""
    app.include_router(dashboard_router(stream))
    app.mount("/dashboard/static", StaticFiles(packages=[("iterserve.server", "static")]), name="dashboard-static")


def dashboard_router(stream: SchedulerStream) -> APIRouter:
    router = APIRouter()

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(static_text("dashboard.html"), headers={"Cache-Control": "no-cache"})

    # not in the OpenAPI schema: a stream that never ends would hang a schema-driven test client
    @router.get("/v1/scheduler/stream", include_in_schema=False)
    async def scheduler_stream() -> StreamingResponse:
        return StreamingResponse(stream.subscribe(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router
