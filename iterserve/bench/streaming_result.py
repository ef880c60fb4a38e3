"""A run's summary kept as it goes, without its per-request records (the simulator's long runs).

Why: `RunResult` derives its summary from every `RequestRecord`, which is right for a measured run
(hundreds of requests, whose records are the raw data) but not for a simulated day at 1,000 req/s.
`StreamingResult` folds each record in and drops it: counts and token sums are exact, means exact
(sums), peak concurrency exact (a sweep over send / end events kept only while they can still be
reordered), and the percentiles come from `QuantileSketch`es with a stated relative error. Its
`summary()` has `RunResult.summary()`'s fields, so `compare` and `print_table` read it as they
read a measured run; `summary()["percentiles"]` says the percentiles are a sketch's, and its bound.
"""
from __future__ import annotations

import collections
import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from iterserve.bench.client import RequestRecord, Slo
from iterserve.bench.sketch import DEFAULT_RELATIVE_ERROR, QuantileSketch

_METRICS = {"ttft_ms": "ttft_s", "tpot_ms": "tpot_s", "e2e_ms": "e2e_s", "queue_time_ms": "queue_time_s"}


class ConcurrencySweep:
    """Most requests in flight at once, as `client.peak_concurrency` counts it (ends first on ties),
    from events that arrive out of order: the caller promises no future event is earlier than the
    `advance` watermark, so only events between it and the present are held."""

    def __init__(self) -> None:
        self._events: list[tuple[float, int]] = []  # (time, +1 send / -1 end): -1 sorts first on ties
        self.running = 0
        self.peak = 0

    def sent(self, t: float) -> None:
        heapq.heappush(self._events, (t, 1))

    def ended(self, t: float) -> None:
        heapq.heappush(self._events, (t, -1))

    def advance(self, watermark: float = math.inf) -> None:
        """Sweeps the events before `watermark` (all of them by default: the run is over)."""
        events = self._events
        while events and events[0][0] < watermark:
            self.running += heapq.heappop(events)[1]
            self.peak = max(self.peak, self.running)

    @property
    def held(self) -> int:
        return len(self._events)


@dataclass
class StreamingResult:
    """`RunResult`'s interface (summary, to_dict, completed, failed, slo_report) from folded records."""

    base_url: str
    model: str
    endpoint: str
    slos: list[Slo] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    relative_error: float = DEFAULT_RELATIVE_ERROR
    keep_itl: bool = True
    duration_s: float = 0.0
    records: list[RequestRecord] = field(default_factory=list)  # always empty: nothing per request is kept

    def __post_init__(self) -> None:
        self.sketches = {name: QuantileSketch(self.relative_error) for name in (*_METRICS, "itl_ms")}
        self.slo_sketches = [QuantileSketch(self.relative_error) if s.percentile is not None else None
                             for s in self.slos]
        self.slo_met = [0] * len(self.slos)
        self.good = 0
        self.completed = 0
        self.failed = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.last_end_s = 0.0
        self.errors: collections.Counter[str] = collections.Counter()
        self.concurrency = ConcurrencySweep()

    def sent(self, t: float) -> None:
        """A request that the server accepted left the client at t (rejected ones never count in
        flight: their send and end are the same instant, and ends sort first)."""
        self.concurrency.sent(t)

    def add(self, record: RequestRecord) -> None:
        """Folds one finished (or failed) request in; the record can then be dropped."""
        if record.end_at_s is not None:
            self.last_end_s = max(self.last_end_s, record.end_at_s)
        if not record.success:
            self.failed += 1
            self.errors[record.error] += 1
            return
        self.concurrency.ended(record.end_at_s)
        self.completed += 1
        self.output_tokens += record.output_tokens
        self.input_tokens += record.prompt_tokens if record.prompt_tokens is not None else record.input_len
        for name, attr in _METRICS.items():
            value = getattr(record, attr)
            if value is not None:
                self.sketches[name].add(value)
        if self.keep_itl and record.itl_s:
            self.sketches["itl_ms"].add_many(record.itl_s)
        good = True
        for i, slo in enumerate(self.slos):
            met = slo.met_by(record)
            self.slo_met[i] += met
            good = good and met
            sketch, value = self.slo_sketches[i], slo.value(record)
            if sketch is not None and value is not None:
                sketch.add(value)
        self.good += good

    def advance(self, watermark: float) -> None:
        """No request will be sent or end before `watermark` any more (see ConcurrencySweep)."""
        self.concurrency.advance(watermark)

    def finish(self, duration_s: float) -> None:
        self.concurrency.advance()
        self.duration_s = duration_s

    def _per_s(self, count: float) -> float:
        return count / self.duration_s if self.duration_s > 0 else 0.0

    def error_counts(self) -> collections.Counter[str]:
        return self.errors

    def latency_stats(self) -> dict[str, dict[str, float | None]]:
        out = {}
        for name, sketch in self.sketches.items():
            p50, p95, p99 = (sketch.quantile(q) for q in (0.5, 0.95, 0.99))
            ms = lambda v: None if v is None else v * 1e3  # noqa: E731
            out[name] = {"mean": ms(sketch.mean), "median": ms(p50), "p95": ms(p95), "p99": ms(p99),
                         "count": sketch.count}
        return out

    def slo_report(self) -> dict[str, Any]:
        rows = []
        for slo, met, sketch in zip(self.slos, self.slo_met, self.slo_sketches):
            row: dict[str, Any] = {"slo": slo.text, "metric": slo.metric, "threshold_ms": slo.threshold_s * 1e3,
                                   "requests_met": met}
            if sketch is not None:
                value = sketch.quantile(slo.percentile / 100)
                row["percentile"] = slo.percentile
                row["run_value_ms"] = None if value is None else value * 1e3
                row["run_met"] = value is not None and value <= slo.threshold_s
            rows.append(row)
        return {"goodput": self._per_s(self.good) if self.slos else None,
                "good_requests": self.good if self.slos else None, "slos": rows}

    def summary(self) -> dict[str, Any]:
        return {"completed": self.completed, "failed": self.failed, "duration_s": self.duration_s,
                "request_throughput": self._per_s(self.completed),
                "output_throughput": self._per_s(self.output_tokens),
                "total_token_throughput": self._per_s(self.input_tokens + self.output_tokens),
                "total_input_tokens": self.input_tokens, "total_output_tokens": self.output_tokens,
                "peak_concurrency": self.concurrency.peak,
                **self.latency_stats(), **self.slo_report(),
                "percentiles": {"method": "sketch", "relative_error": self.relative_error,
                                "note": f"percentiles from log-bucket sketches, each within "
                                        f"{self.relative_error:.1%} (relative) of the exact value; "
                                        "means, counts and peak concurrency exact; no per-request records"}}

    def to_dict(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "model": self.model, "endpoint": self.endpoint,
                "meta": self.meta, "summary": self.summary(), "records": []}
