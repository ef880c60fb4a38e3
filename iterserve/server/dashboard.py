"""The live scheduler dashboard: `GET /dashboard` (one page, shipped as package data) fed by
`GET /v1/scheduler/stream` (server-sent events, a few a second whatever the step rate).

Why a hub between the engine and the browsers: the engine may step hundreds of times a second and a
page needs a few frames. While at least one stream is open, the engine thread only appends each
StepRecord to a list (one lock and one append per step) and, once per tick, copies the block tables
when asked (`AsyncEngine.call_in_engine_thread`, between steps, O(held blocks)). One asyncio task
turns what gathered since the last tick into one message (sums, maxima and the step range, so that
no step is lost from the counts) and hands the same bytes to every open stream. Nothing is gathered
while no stream is open.

The API key guards the stream but not the page (PAGE_PATHS: it holds no data); EventSource cannot
send an Authorization header, so the page reads the stream with fetch() and sends the key itself
(see static/dashboard.js).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, StreamingResponse
from starlette.staticfiles import StaticFiles

from iterserve.core.block_pool import BlockMap
from iterserve.engine import LLMEngine, StepRecord
from iterserve.request import RequestOutput
from iterserve.server.async_engine import AsyncEngine

log = logging.getLogger("iterserve.server")

# The page and its script and style hold no data (the page asks for the key and sends it with the
# stream's request), so an API key guard lets them through; the stream itself is guarded.
PAGE_PATHS = ("/dashboard", "/dashboard/static/dashboard.js", "/dashboard/static/dashboard.css")


@dataclass
class StreamConfig:
    interval_s: float = 0.25  # one message per tick: 4 a second
    latency_window_s: float = 60.0  # rolling TTFT / e2e / queue-time percentiles over this window
    max_backlog: int = 64  # ticks a slow reader may fall behind before its stream is closed (it reconnects)


def engine_info(llm: LLMEngine, served_model_name: str, model: str) -> dict:
    """The engine's configuration as the dashboard, /v1/scheduler and the config-info metric show
    it: every EngineConfig switch, what was resolved at start (device, dtype, kernels, limits, cache
    size), and the sequences one step may hold (the batch-size chart's limit line). `model` is the
    model as answers may name it (api.model_name: no path on this machine)."""
    cfg = llm.config
    return {**asdict(cfg), **llm.resolved_config(), "model": model, "served_model_name": served_model_name,
            "step_limit": cfg.max_batch_size if cfg.batching == "static" else cfg.max_num_seqs}


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted list (None when empty)."""
    if not sorted_values:
        return None
    rank = min(len(sorted_values), max(1, math.ceil(q / 100 * len(sorted_values))))
    return sorted_values[rank - 1]


def aggregate_steps(steps: list[StepRecord]) -> dict:
    """One tick's steps as sums and maxima. Sequences per step split three ways: a prefill row
    (a prompt chunk), a decode row and a padding row (static batching's finished members);
    decode_tokens counts padding rows, as the engine reports them."""
    if not steps:
        return {"steps": 0}
    return {
        "steps": len(steps), "first_step": steps[0].step, "last_step": steps[-1].step,
        "busy_s": sum(s.duration for s in steps),
        "seqs_prefill": sum(s.batch_size - s.decode_tokens for s in steps),
        "seqs_decode": sum(s.decode_tokens - s.num_padding for s in steps),
        "seqs_padding": sum(s.num_padding for s in steps),
        "batch_max": max(s.batch_size for s in steps),
        "prefill_tokens": sum(s.prefill_tokens for s in steps),
        "decode_tokens": sum(s.decode_tokens - s.num_padding for s in steps),
        "waiting_max": max(s.num_waiting for s in steps),
        "preempted": sum(len(s.preempted) for s in steps),
        "finished": sum(len(s.finished) for s in steps),
    }


class SchedulerStream:
    """The hub: gathers step records on the engine thread, sends one aggregate per tick."""

    def __init__(self, engine: AsyncEngine, info: dict, config: StreamConfig | None = None) -> None:
        self.engine = engine
        self.info = info
        self.config = config or StreamConfig()
        self.start_id = uuid.uuid4().hex[:12]  # a page tells a restarted server by this
        self._lock = threading.Lock()
        self._pending: list[StepRecord] = []
        self._active = False  # read by the engine thread: gather only while someone listens
        self._subscribers: set[asyncio.Queue[bytes | None]] = set()
        self._task: asyncio.Task | None = None
        self._map: BlockMap | None = None  # latest copy, written by the engine thread
        self._sent_map: BlockMap | None = None
        self._map_message: dict | None = None
        self._owners: dict[str, int] = {}  # request id -> small number the page colours by
        self._owner_ids = itertools.count()
        self._latencies: deque[tuple[float, float | None, float | None, float | None]] = deque()
        self._last_tick = time.monotonic()
        engine.step_listeners.append(self._on_step)
        engine.finish_listeners.append(self._on_finish)

    # ---- engine thread -------------------------------------------------------------------------
    def _on_step(self, rec: StepRecord) -> None:
        if self._active:
            with self._lock:
                self._pending.append(rec)

    def _take_map(self) -> None:
        self._map = self.engine.engine.pool.block_map()

    # ---- event loop ----------------------------------------------------------------------------
    def _on_finish(self, out: RequestOutput) -> None:
        if self._active:
            t = out.times
            self._latencies.append((time.monotonic(), t.queue_time, t.ttft, t.e2e))

    async def subscribe(self) -> AsyncIterator[bytes]:
        """One client's stream: a `hello` event (configuration, full block map), then a `tick`
        event per interval until the client goes away."""
        if self.engine.shutting_down:
            return
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(self.config.max_backlog)
        self._subscribers.add(queue)
        if not self._active:
            self._active = True
            with self._lock:
                self._pending.clear()  # steps from before anyone listened are not this stream's
            self._latencies.clear()
            self._last_tick = time.monotonic()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        self.engine.call_in_engine_thread(self._take_map)
        try:
            hello = {"start_id": self.start_id, "interval_s": self.config.interval_s,
                     "latency_window_s": self.config.latency_window_s, "config": self.info,
                     "uptime_s": time.monotonic() - self.engine.engine.start_time,
                     "step": self.engine.state.step_count,
                     "blocks": self.block_map_message()}  # None at first: the first tick brings it
            yield sse("hello", hello)
            while True:
                data = await queue.get()
                if data is None:
                    return
                yield data
        finally:
            self._subscribers.discard(queue)
            if not self._subscribers:
                self._active = False

    async def _run(self) -> None:
        next_at = time.monotonic()
        try:
            while self._subscribers and not self.engine.shutting_down:
                next_at += self.config.interval_s
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                data = sse("tick", self.tick(time.monotonic()))
                for q in list(self._subscribers):
                    if q.qsize() >= self.config.max_backlog - 1:
                        log.warning("scheduler stream: a reader fell %d ticks behind; closing its stream",
                                    self.config.max_backlog)
                        self._close(q)  # rather than drop ticks: its counts would have a gap
                    else:
                        q.put_nowait(data)
                self.engine.call_in_engine_thread(self._take_map)
        finally:  # server shutdown (the streams must end, or uvicorn waits for them) or a bug
            for q in list(self._subscribers):
                self._close(q)

    def _close(self, q: asyncio.Queue[bytes | None]) -> None:
        self._subscribers.discard(q)
        q.put_nowait(None)
        if not self._subscribers:
            self._active = False

    def tick(self, now: float) -> dict:
        with self._lock:
            steps, self._pending = self._pending, []
        state = self.engine.state
        msg = {"t": now - self.engine.engine.start_time, "dt": now - self._last_tick, **aggregate_steps(steps),
               "step": state.step_count, "running": state.running, "waiting": state.waiting,
               "kv_used": state.kv.used_blocks, "kv_total": state.kv.total_blocks, "kv_tokens": state.kv.tokens_stored,
               "busy_fraction": self.engine.busy_fraction(), "latency": self._latency_stats(now)}
        self._last_tick = now
        blocks = self.block_map_message(changed_only=True)
        if blocks is not None:
            msg["blocks"] = blocks
        return msg

    def _latency_stats(self, now: float) -> dict:
        lat = self._latencies
        while lat and lat[0][0] < now - self.config.latency_window_s:
            lat.popleft()
        out: dict[str, float | int | None] = {"n": len(lat)}
        for i, name in ((1, "queue"), (2, "ttft"), (3, "e2e")):
            values = sorted(v[i] for v in lat if v[i] is not None)
            out[f"{name}_p50"], out[f"{name}_p95"] = percentile(values, 50), percentile(values, 95)
        return out

    def block_map_message(self, changed_only: bool = False) -> dict | None:
        """The block map as the page draws it: total, [owner number, block ids] per request, and
        the cached blocks. Owner numbers are small and stable while a request lives."""
        bm = self._map
        if bm is None or (changed_only and bm is self._sent_map):
            return None
        if bm is not self._sent_map:
            live = {rid for rid, _ in bm.held}
            for rid in [r for r in self._owners if r not in live]:
                del self._owners[rid]
            held = [[self._owners.setdefault(rid, next(self._owner_ids)), list(blocks)] for rid, blocks in bm.held]
            self._map_message = {"total": bm.num_blocks, "held": held, "cached": list(bm.cached)}
            self._sent_map = bm
        return self._map_message


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def static_text(name: str) -> str:
    return resources.files("iterserve.server").joinpath("static", name).read_text()


def dashboard_router(stream: SchedulerStream) -> APIRouter:
    """/dashboard (the page), /dashboard/static/* (its script and style), /v1/scheduler/stream."""
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


def static_files() -> StaticFiles:
    return StaticFiles(packages=[("iterserve.server", "static")])
