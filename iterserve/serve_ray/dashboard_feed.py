"""The dashboard behind the Ray ingress: each replica's ticks carried to the ingress, labelled with
the replica and merged into the ingress's own stream (one panel per replica on the page).

How step records travel: each replica already pushes a report through Serve's routing stats every
stats period (EngineReplica.record_routing_stats: load for the router, /v1/scheduler, /metrics),
and the ingress reads the latest one. The replica adds one tick of its own steps per report
(ReplicaFeed: the single server's EngineTicks, so a step costs the engine thread one append, and
the sums are made on the replica's event loop), not the raw step records: a report then stays a few
kilobytes whatever the step rate. Pulling instead (the ingress calling each replica through its
handle) would queue behind requests and Serve's own probes and costs a round trip per replica per
tick. Serve's controller pulls the reports and passes on only the newest, so one may be skipped:
the report carries the last `keep` ticks with sequence numbers, and the ingress takes those it has
not seen yet (ReplicaTicks), so no step is lost unless the ingress falls `keep` periods behind (the
page then counts a gap).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from iterserve.server.async_engine import AsyncEngine
from iterserve.server.engine_ticks import MAX_KEYS, SUM_KEYS, EngineTicks

RANGE_KEYS = ("first_step", "last_step")


class ReplicaFeed:
    """Replica side: one tick per routing-stats report, the last `keep` of them numbered, and the
    latest block map with the number of the tick that changed it. Gathers from the first report on
    (a replica cannot know whether a page is open; the cost is an append per step)."""

    def __init__(self, engine: AsyncEngine, info: dict, latency_window_s: float = 60.0, keep: int = 25) -> None:
        self.ticks = EngineTicks(engine, info, latency_window_s)
        self.ring: deque[dict] = deque(maxlen=keep)
        self.seq = 0
        self.blocks: dict | None = None
        self.blocks_seq = 0

    def report(self, now: float) -> dict:
        if not self.ticks.active:
            self.ticks.start()
        tick = self.ticks.tick(now)
        self.seq += 1
        blocks = tick.pop("blocks", None)
        if blocks is not None:
            self.blocks, self.blocks_seq = blocks, self.seq
        self.ring.append({"seq": self.seq, **tick})
        return {"seq": self.seq, "ticks": list(self.ring), "blocks": self.blocks, "blocks_seq": self.blocks_seq}


def merge_ticks(ticks: list[dict]) -> dict:
    """Consecutive ticks of one engine as one: counts summed, maxima kept, the step range from the
    first busy tick to the last busy one, dt summed, and the state (t, running, KV, latency...) of
    the latest."""
    out = {k: v for k, v in ticks[-1].items() if k not in (*SUM_KEYS, *MAX_KEYS, *RANGE_KEYS, "seq")}
    out["dt"] = sum(t["dt"] for t in ticks)
    busy = [t for t in ticks if t.get("steps")]
    out["steps"] = sum(t["steps"] for t in busy)
    if busy:
        out.update({k: sum(t[k] for t in busy) for k in SUM_KEYS})
        out.update({k: max(t[k] for t in busy) for k in MAX_KEYS})
        out["first_step"], out["last_step"] = busy[0]["first_step"], busy[-1]["last_step"]
    return out


class ReplicaTicks:
    """Ingress side, the TickSource of its SchedulerStream: per tick, each replica's ticks not yet
    sent, merged and labelled with the replica id; its config and full block map the first time
    the hub sees it (a replica restarted by Serve comes back under a new id) and the block map
    again whenever it changed. `live` lists the replicas now reporting, so the page drops the
    panels of the others."""

    def __init__(self, reports: Callable[[], dict[str, dict]], closed: Callable[[], bool]) -> None:
        self.reports = reports  # replica id -> its latest routing-stats report
        self._closed = closed
        self.active = False
        self._seen: dict[str, tuple[int, int]] = {}  # replica -> (last tick seq sent, block map seq sent)
        self._start = self._last_tick = time.monotonic()

    @property
    def closed(self) -> bool:
        return self._closed()

    def _feeds(self) -> dict[str, dict]:
        return {rid: rep for rid, rep in self.reports().items() if rep.get("dashboard")}

    def start(self) -> None:
        if not self.active:
            self.active = True
            self._seen.clear()
            self._last_tick = time.monotonic()

    def stop(self) -> None:
        self.active = False

    def hello(self) -> dict:
        """Every replica's full state for a new reader (the ticks that follow carry what changed)."""
        return {"replicas": [{"replica": rid, "config": rep["scheduler"]["config"],
                              "uptime_s": rep["scheduler"]["uptime_s"], "step": rep["scheduler"]["step"],
                              "blocks": rep["dashboard"]["blocks"]} for rid, rep in self._feeds().items()]}

    def tick(self, now: float) -> dict:
        feeds = self._feeds()
        parts = []
        for rid, rep in feeds.items():
            feed = rep["dashboard"]
            seen = self._seen.get(rid)
            if seen is not None and feed["seq"] < seen[0]:  # not the feed the hub saw: start afresh
                seen = None
            new = [t for t in feed["ticks"] if t["seq"] > seen[0]] if seen else feed["ticks"][-1:]
            if not new:
                continue
            part = {"replica": rid, **merge_ticks(new)}
            if seen is None:
                part["config"] = rep["scheduler"]["config"]
            if feed["blocks"] is not None and (seen is None or feed["blocks_seq"] > seen[1]):
                part["blocks"] = feed["blocks"]
            self._seen[rid] = (new[-1]["seq"], feed["blocks_seq"])
            parts.append(part)
        for rid in [r for r in self._seen if r not in feeds]:
            del self._seen[rid]
        msg = {"t": now - self._start, "dt": now - self._last_tick, "live": sorted(feeds), "replicas": parts}
        self._last_tick = now
        return msg
