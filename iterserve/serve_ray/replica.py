"""EngineReplica: one Ray Serve replica = one LLMEngine with its AsyncEngine loop.

The ingress has validated and tokenised the request already; a replica only admits it (or says why
not: the 503 of --max-waiting is per replica) and streams its RequestOutputs back through a Serve
streaming handle. The first item of every stream is the admission verdict, so the ingress can answer
an error before it sends any byte, exactly as the single-process server does. Outputs are coalesced:
the first is sent at once (time to first token is the engine's), later ones at most every
`stream_interval_s`, merged into one (each Ray message costs CPU in this replica, the ingress and
their event loops, on the same cores as the engines when one machine runs them all). When the ingress
cancels the stream (its client went away) Serve cancels this generator, and the request is aborted
here, which frees its KV blocks at the next step boundary.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch
from ray import serve

from iterserve.config import EngineConfig
from iterserve.engine import LLMEngine
from iterserve.request import RequestOutput, RequestRejected
from iterserve.sampling import SamplingParams
from iterserve.serve_ray.dashboard_feed import ReplicaFeed
from iterserve.server.api import log_finished, model_name, scheduler_state
from iterserve.server.async_engine import AsyncEngine
from iterserve.server.dashboard import StreamConfig, engine_info
from iterserve.server.metrics import ServerMetrics
from iterserve.server.serving import ServerSettings


@dataclass(frozen=True)
class Admission:
    """The first item of a replica's stream: admitted, or refused with the engine's reason."""

    error: str | None = None
    status_code: int = 400
    replica: str = ""


@dataclass(frozen=True)
class EngineInfo:
    """What the ingress needs to validate requests as the engines will (replica.describe())."""

    config: EngineConfig
    max_model_len: int
    max_input_len: int
    max_output_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int


def coalesce(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: their tokens, text and logprobs in order, the prompt
    logprobs whichever carries them, the last one's state (finished, reason, counts, times, embedding)."""
    if len(outputs) == 1:
        return outputs[0]
    return dataclasses.replace(outputs[-1], new_token_ids=[t for o in outputs for t in o.new_token_ids],
                               text_delta="".join(o.text_delta for o in outputs),
                               new_logprobs=[lp for o in outputs for lp in o.new_logprobs],
                               prompt_logprobs=next((o.prompt_logprobs for o in outputs
                                                     if o.prompt_logprobs is not None), None))


class EngineReplica:
    """Deployed by app.py with serve.deployment(...) options (replicas, CPUs/GPUs, router)."""

    def __init__(self, config: EngineConfig, settings: ServerSettings, stream_interval_s: float = 0.0) -> None:
        self.stream_interval_s = stream_interval_s
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.settings = settings
        self.engine = AsyncEngine(LLMEngine(config))
        llm = self.engine.engine
        self.info = engine_info(llm, settings.served_model_name, model_name(llm.config.model))
        self.metrics = ServerMetrics(self.engine, settings.served_model_name, vllm_names=settings.vllm_metrics,
                                     info=self.info)
        self.engine.finish_listeners.append(log_finished)
        self.feed = ReplicaFeed(self.engine, self.info, StreamConfig().latency_window_s)
        self.received_total = 0
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (unit use): a name that still says which process
            self.replica_id = f"pid{os.getpid()}"

    def _started(self) -> AsyncEngine:
        """The engine thread starts on the first call, on the replica's event loop (outputs are
        delivered to the loop that started it; __init__ may run elsewhere)."""
        if self.engine._thread is None:
            self.engine.start()
        return self.engine

    # ---- requests -----------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, waited_s: float = 0.0,
                       prefix_leader: str | None = None) -> AsyncIterator[Admission | list[RequestOutput]]:
        """Admission, then the request's outputs, each list one output coalescing what arrived since
        the last yield.
        waited_s: time already spent since arrival at the ingress (clocks differ between hosts)."""
        engine = self._started()
        self.received_total += 1
        try:
            stream = await engine.add_request(request_id, prompt_token_ids, params, priority=priority,
                                              arrival_time=time.monotonic() - waited_s,
                                              prefix_leader=prefix_leader)
        except RequestRejected as e:
            yield Admission(str(e), e.status_code, self.replica_id)
            return
        yield Admission(replica=self.replica_id)
        sent_at = -float("inf")  # the first output goes at once
        try:
            while not stream.finished:
                batch = [await stream.queue.get()]
                wait = sent_at + self.stream_interval_s - time.monotonic()
                if wait > 0 and not batch[-1].finished:
                    await asyncio.sleep(wait)
                while not stream.queue.empty():
                    batch.append(stream.queue.get_nowait())
                stream.finished = batch[-1].finished
                sent_at = time.monotonic()
                yield [coalesce(batch)]
        finally:
            if not stream.finished:  # cancelled: the ingress's client went away
                engine.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self._started().abort(request_id)

    # ---- state --------------------------------------------------------------------------------------
    async def describe(self) -> EngineInfo:
        llm = self.engine.engine
        return EngineInfo(llm.config, llm.max_model_len, llm.max_input_len, llm.max_output_len,
                          llm.model_config.vocab_size, tuple(llm.model_config.eos_token_ids), llm.config.block_size)

    async def record_routing_stats(self) -> dict:
        """Serve calls this every request_routing_stats_period_s (and so starts the engine as soon as
        the replica is up) and hands the answer to the router in the ingress. Besides the load the
        router needs (policy.ReplicaLoad), it carries what the ingress shows for this replica: its
        /v1/scheduler answer with the latest steps, its Prometheus text and its dashboard ticks
        (dashboard_feed.py). Pushed, not pulled: a call pinned to one replica through Serve's
        routing can wait behind its queue-length probes."""
        engine = self._started()
        state = engine.state
        return {"running": state.running, "waiting": state.waiting, "kv_usage": state.kv.usage,
                "received_total": self.received_total, "ready": engine.health() is None,
                "scheduler": {"replica": self.replica_id, "pid": os.getpid(),
                              **scheduler_state(engine, self.info)},
                "metrics": self.metrics.render().decode(), "dashboard": self.feed.report(time.monotonic())}

    async def check_health(self) -> None:
        """Serve's health check: a replica whose engine thread died is restarted."""
        reason = self._started().health()
        if reason is not None and self.engine.ready.is_set():  # not while warming up
            raise RuntimeError(reason)
