"""Engine timelines from iterserve's `/v1/scheduler`: the same measurement for every batching mode.

During a run a `SchedulerPoller` asks the server every ~0.5 s for the step records it has not seen
yet (`?since_step=N`). Each record says when a step started (seconds since the server started),
how long it took, how many sequences it computed (padding included), and how much KV it held. The
server's clock is mapped onto the run's clock from the poll round trips, so step records and the
load client's request records share one time axis.

From the steps, `windows()` derives what the plots and the table show:
- busy fraction: time inside steps / window length (what nvidia-smi's "GPU utilisation" means);
- useful fraction: the same, with each step weighted by its share of real (non-padding) sequences,
  so static batching's padding work does not count as useful;
- batch size, active sequences and KV usage, averaged over the time of the steps in the window.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx
import numpy as np

POLL_INTERVAL_S = 0.5


@dataclass
class Snapshot:
    """The server's state at one poll, on the run's clock."""

    t: float
    running: int
    waiting: int
    kv_usage: float
    busy_fraction: float
    gpu_util: float | None = None


@dataclass
class Timeline:
    """Step records (dicts as `/v1/scheduler` sends them, plus `t_run`: the start on the run's
    clock) and the snapshots taken while polling."""

    batching: str = ""
    steps: list[dict[str, Any]] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    clock_offset_s: float | None = None  # run time = server time + offset
    clock_error_s: float | None = None  # the offset is known to within +- this (half the best round trip)
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"batching": self.batching, "clock_offset_s": self.clock_offset_s,
                "clock_error_s": self.clock_error_s, "config": self.config,
                "steps": self.steps, "snapshots": [asdict(s) for s in self.snapshots]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Timeline":
        return cls(d.get("batching", ""), list(d.get("steps", [])),
                   [Snapshot(**s) for s in d.get("snapshots", [])], d.get("clock_offset_s"),
                   d.get("clock_error_s"), dict(d.get("config", {})))

    # ---- derived series ---------------------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        """Per-step columns: start (run clock), duration, batch, padding, active, kv_usage."""
        s = self.steps
        col = lambda k: np.array([float(x.get(k) or 0) for x in s])  # noqa: E731
        batch, padding = col("batch_size"), col("num_padding")
        total = col("kv_total_blocks")
        return {"start": col("t_run"), "duration": col("duration"), "batch": batch, "padding": padding,
                "active": batch - padding,
                "kv_usage": np.divide(col("kv_used_blocks"), total, out=np.zeros_like(total), where=total > 0)}

    def busy_between(self, t0: float, t1: float) -> tuple[float, float]:
        """(busy, useful) fractions of [t0, t1]."""
        if t1 <= t0:
            return 0.0, 0.0
        a = self.arrays()
        overlap = _overlap(a["start"], a["duration"], t0, t1)
        share = _useful_share(a)
        return float(overlap.sum() / (t1 - t0)), float((overlap * share).sum() / (t1 - t0))

    def windows(self, t_end: float, window_s: float = 2.0, t_start: float = 0.0) -> dict[str, list[float]]:
        """Consecutive windows over [t_start, t_end]: busy and useful fractions, and time-weighted
        mean batch size, active sequences and KV usage (NaN where no step ran)."""
        a = self.arrays()
        share = _useful_share(a)
        out: dict[str, list[float]] = {k: [] for k in ("t", "busy", "useful", "batch", "active", "kv_usage")}
        count = max(1, int(np.ceil((t_end - t_start) / window_s - 1e-9)))
        for lo in t_start + window_s * np.arange(count):
            hi = min(lo + window_s, t_end) if t_end > lo else lo + window_s  # the last one may be shorter
            ov = _overlap(a["start"], a["duration"], lo, hi)
            busy = ov.sum()
            out["t"].append(float((lo + hi) / 2))
            out["busy"].append(float(busy / (hi - lo)))
            out["useful"].append(float((ov * share).sum() / (hi - lo)))
            for key in ("batch", "active", "kv_usage"):
                out[key].append(float((ov * a[key]).sum() / busy) if busy > 0 else float("nan"))
        return out

    def step_stats(self) -> dict[str, float | int | None]:
        """Totals over all steps: time-weighted mean batch / active, padding share of sequence-steps,
        and the tokens decoded per second in steps taken while requests were queued (saturation)."""
        a = self.arrays()
        busy = a["duration"].sum()
        seq_steps = a["batch"].sum()
        weighted = lambda k: float((a[k] * a["duration"]).sum() / busy) if busy > 0 else None  # noqa: E731
        # saturated: steps taken while requests waited, so the server ran as full as it could
        queued = np.array([float(x.get("num_waiting") or 0) > 0 for x in self.steps], dtype=bool)
        decoded = np.array([float(x.get("decode_tokens") or 0) for x in self.steps]) - a["padding"]
        saturated_s = float(a["duration"][queued].sum()) if len(queued) else 0.0
        return {"num_steps": len(self.steps), "busy_s": float(busy), "saturated_s": saturated_s,
                "saturated_decode_tps": float(decoded[queued].sum() / saturated_s) if saturated_s else None,
                "mean_batch_size": weighted("batch"),
                "mean_active_seqs": weighted("active"), "mean_kv_usage": weighted("kv_usage"),
                "padding_share": float(a["padding"].sum() / seq_steps) if seq_steps else None,
                "max_batch_size": int(a["batch"].max()) if len(a["batch"]) else 0}


def _overlap(start: np.ndarray, duration: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Seconds of each step inside [lo, hi)."""
    return np.clip(np.minimum(start + duration, hi) - np.maximum(start, lo), 0.0, None)


def _useful_share(a: dict[str, np.ndarray]) -> np.ndarray:
    return np.divide(a["active"], a["batch"], out=np.zeros_like(a["batch"]), where=a["batch"] > 0)


class SchedulerPoller:
    """Polls `/v1/scheduler?since_step=N` and keeps every new step record, on the run's clock.

    `start_step` skips what happened before the run (warm-up). The run's clock is the caller's:
    `clock()` returns seconds since the run started (time.perf_counter() - t0 by default).
    """

    def __init__(self, base_url: str, t0: float | None = None, interval_s: float = POLL_INTERVAL_S,
                 start_step: int = 0, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.t0 = time.perf_counter() if t0 is None else t0
        self.interval_s = interval_s
        self.last_step = start_step
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeline = Timeline()
        self._raw: list[dict[str, Any]] = []
        self._offset_lo = -float("inf")  # run time - server time, bounded by each round trip
        self._offset_hi = float("inf")
        self.errors = 0

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    async def poll_once(self, http: httpx.AsyncClient) -> dict[str, Any]:
        sent = self.clock()
        resp = await http.get(f"{self.base_url}/v1/scheduler", params={"since_step": self.last_step},
                              headers=self.headers, timeout=10.0)
        resp.raise_for_status()
        got = self.clock()
        data = resp.json()
        uptime = float(data["uptime_s"])
        self._offset_lo = max(self._offset_lo, sent - uptime)
        self._offset_hi = min(self._offset_hi, got - uptime)
        for step in data.get("steps", []):
            if step["step"] > self.last_step:
                self._raw.append(step)
                self.last_step = step["step"]
        self.timeline.batching = data.get("batching", self.timeline.batching)
        self.timeline.config = data.get("config", self.timeline.config)
        kv = data.get("kv_cache") or {}
        self.timeline.snapshots.append(Snapshot(
            t=(sent + got) / 2, running=int(data.get("running", 0)), waiting=int(data.get("waiting", 0)),
            kv_usage=float(kv.get("usage", 0.0)), busy_fraction=float(data.get("busy_fraction", 0.0)),
            gpu_util=data.get("gpu_util")))
        return data

    async def run(self, stop: asyncio.Event) -> None:
        """Polls until `stop` is set, then once more so the last steps are in."""
        async with httpx.AsyncClient() as http:
            while not stop.is_set():
                try:
                    await self.poll_once(http)
                except (httpx.HTTPError, ValueError, KeyError):
                    self.errors += 1  # a missed poll loses nothing: the next asks since the same step
                try:
                    await asyncio.wait_for(stop.wait(), self.interval_s)
                except TimeoutError:
                    pass
            try:
                await self.poll_once(http)
            except (httpx.HTTPError, ValueError, KeyError):
                self.errors += 1

    def result(self, t0: float | None = None) -> Timeline:
        """The timeline with each step's start on the run's clock; `t0` (a time.perf_counter()
        value) re-bases it onto a run that started at another moment than the poller's t0."""
        tl = self.timeline
        shift = 0.0 if t0 is None else self.t0 - t0
        offset = error = None
        if self._offset_hi < float("inf"):
            offset = (self._offset_lo + self._offset_hi) / 2 + shift
            error = (self._offset_hi - self._offset_lo) / 2
        steps = [{**s, "t_run": float(s["t"]) + (offset or 0.0)} for s in self._raw]
        snapshots = [replace(s, t=s.t + shift) for s in tl.snapshots]
        return Timeline(tl.batching, steps, snapshots, offset, error, dict(tl.config))
