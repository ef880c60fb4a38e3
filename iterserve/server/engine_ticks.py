"""One engine's dashboard ticks: its step records since the last tick as sums and maxima, its live
state, rolling latencies and its block map. The single server's stream (dashboard.py) sends one
tick per interval; a Ray replica (serve_ray/replica.py) makes one per routing-stats report.

Why ticks and not step records: the engine may step hundreds of times a second and a page needs a
few frames. While gathering, the engine thread only appends each StepRecord to a list (one lock and
one append per step) and, once per tick, copies the block tables when asked
(`AsyncEngine.call_in_engine_thread`, between steps, O(held blocks)); the sums are made on the event
loop. A tick keeps the step range it covers, so that a reader can tell that no step was lost.
"""
from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque

from iterserve.core.block_pool import BlockMap
from iterserve.engine import StepRecord
from iterserve.request import RequestOutput
from iterserve.server.async_engine import AsyncEngine

# How the counts of several ticks combine into one (serve_ray/dashboard_feed.merge_ticks): the keys
# aggregate_steps sums, and those it takes the maximum of. Every other key is a state: the latest wins.
SUM_KEYS = ("steps", "busy_s", "seqs_prefill", "seqs_decode", "seqs_padding", "prefill_tokens", "decode_tokens",
            "preempted", "finished", "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")
MAX_KEYS = ("batch_max", "waiting_max")


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted list (None when empty)."""
    if not sorted_values:
        return None
    rank = min(len(sorted_values), max(1, math.ceil(q / 100 * len(sorted_values))))
    return sorted_values[rank - 1]


def aggregate_steps(steps: list[StepRecord]) -> dict:
    """One tick's steps as sums and maxima. Sequences per step split three ways: a prefill row
    (a prompt chunk), a decode row and a padding row (static batching's finished members);
    decode_tokens counts padding rows, as the engine reports them. A speculative verify row counts
    once among the decode rows although decode_tokens holds each of its positions (its drafts plus
    one); the spec_* sums are the drafts verified and accepted (the page's acceptance rate)."""
    if not steps:
        return {"steps": 0}
    return {
        "steps": len(steps), "first_step": steps[0].step, "last_step": steps[-1].step,
        "busy_s": sum(s.duration for s in steps),
        "seqs_prefill": sum(s.batch_size - s.decode_tokens + s.spec_draft_tokens for s in steps),
        "seqs_decode": sum(s.decode_tokens - s.spec_draft_tokens - s.num_padding for s in steps),
        "seqs_padding": sum(s.num_padding for s in steps),
        "batch_max": max(s.batch_size for s in steps),
        "prefill_tokens": sum(s.prefill_tokens for s in steps),
        "decode_tokens": sum(s.decode_tokens - s.num_padding for s in steps),
        "waiting_max": max(s.num_waiting for s in steps),
        "preempted": sum(len(s.preempted) for s in steps),
        "finished": sum(len(s.finished) for s in steps),
        "spec_drafts": sum(s.spec_num_drafts for s in steps),
        "spec_draft_tokens": sum(s.spec_draft_tokens for s in steps),
        "spec_accepted_tokens": sum(s.spec_accepted_tokens for s in steps),
    }


class EngineTicks:
    """Gathers one AsyncEngine's steps and finished requests between start() and stop(), and turns
    what gathered since the last tick into one tick message. Nothing is gathered while stopped."""

    def __init__(self, engine: AsyncEngine, info: dict, latency_window_s: float = 60.0) -> None:
        self.engine = engine
        self.info = info  # the engine's configuration (dashboard.engine_info), sent in the hello
        self.latency_window_s = latency_window_s  # rolling TTFT / e2e / queue-time percentiles over this window
        self.active = False  # read by the engine thread: gather only while someone listens
        self._lock = threading.Lock()
        self._pending: list[StepRecord] = []
        self._map: BlockMap | None = None  # latest copy, written by the engine thread
        self._sent_map: BlockMap | None = None
        self._map_message: dict | None = None
        self._owners: dict[str, int] = {}  # request id -> small number the page colours by
        self._owner_ids = itertools.count()
        self._latencies: deque[tuple[float, float | None, float | None, float | None]] = deque()
        self._last_tick = time.monotonic()
        engine.step_listeners.append(self._on_step)
        engine.finish_listeners.append(self._on_finish)

    @property
    def closed(self) -> bool:
        return self.engine.shutting_down

    # ---- engine thread -------------------------------------------------------------------------
    def _on_step(self, rec: StepRecord) -> None:
        if self.active:
            with self._lock:
                self._pending.append(rec)

    def _take_map(self) -> None:
        self._map = self.engine.engine.pool.block_map()

    # ---- event loop ----------------------------------------------------------------------------
    def _on_finish(self, out: RequestOutput) -> None:
        if self.active:
            t = out.times
            self._latencies.append((time.monotonic(), t.queue_time, t.ttft, t.e2e))

    def start(self) -> None:
        """Gather from now on; steps from before are not this reader's."""
        if not self.active:
            self.active = True
            with self._lock:
                self._pending.clear()
            self._latencies.clear()
            self._last_tick = time.monotonic()
        self.refresh_map()

    def stop(self) -> None:
        self.active = False

    def refresh_map(self) -> None:
        """A fresh copy of the block tables before the engine's next step (for the next tick)."""
        self.engine.call_in_engine_thread(self._take_map)

    def hello(self) -> dict:
        """What a new reader needs before the first tick: configuration, uptime, step count and the
        full block map (None until the engine thread has copied it: the first tick brings it)."""
        return {"config": self.info, "uptime_s": time.monotonic() - self.engine.engine.start_time, "step": self.engine.state.step_count,
                "blocks": self.block_map_message()}

    def tick(self, now: float) -> dict:
        """The steps since the last tick, the engine's state now, and the block map when it changed."""
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
        self.refresh_map()
        return msg

    def _latency_stats(self, now: float) -> dict:
        lat = self._latencies
        while lat and lat[0][0] < now - self.latency_window_s:
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
        if bm is None:
            return None
        if bm != self._sent_map:  # a fresh copy each tick; equal tuples (an idle engine) are no change
            live = {rid for rid, _ in bm.held}
            for rid in [r for r in self._owners if r not in live]:
                del self._owners[rid]
            held = [[self._owners.setdefault(rid, next(self._owner_ids)), list(blocks)] for rid, blocks in bm.held]
            self._map_message = {"total": bm.num_blocks, "held": held, "cached": list(bm.cached)}
            self._sent_map = bm
        elif changed_only:
            return None
        return self._map_message
