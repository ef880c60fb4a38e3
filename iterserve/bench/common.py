"""Helpers every benchmark tool shares, in one place: an error in one line, a Markdown table,
latency statistics, best-of-N timing, the machine's load average, and pyplot without a display.

Each exists once so that the tools' outputs agree (the same percentiles, the same table syntax) and a
fix reaches all of them.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

PERCENTILES = (50, 95, 99)


def one_line(exc: BaseException) -> str:
    """An exception as one short line, for error messages that never show a traceback."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def markdown_table(rows: Sequence[Sequence[str]], align: str = "") -> str:
    """rows[0] is the header. `align` has one letter a column, "l" or "r" (numbers); columns it
    does not cover are left-aligned."""
    head, *body = rows
    rule = ["---:" if align[i:i + 1] == "r" else "---" for i in range(len(head))]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in (head, rule, *body))


def latency_stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean, median, p95 and p99 in milliseconds of latencies given in seconds (None when empty)."""
    if len(values_s) == 0:
        return {"mean": None, "median": None, "p95": None, "p99": None, "count": 0}
    ms = np.asarray(values_s, dtype=float) * 1e3
    p50, p95, p99 = np.percentile(ms, PERCENTILES)
    return {"mean": float(ms.mean()), "median": float(p50), "p95": float(p95), "p99": float(p99),
            "count": int(ms.size)}


def best_time(fn: Callable[[], Any], rounds: int = 5, inner: int = 1, warmup: bool = True) -> float:
    """Seconds per call of fn: the best of `rounds` rounds of `inner` calls each (the minimum is the
    figure least moved by other processes), after one untimed call unless `warmup` is False."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages, recorded next to timings because other jobs on the
    same cores change them; None where the platform has none."""
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display). Imported on first use:
    matplotlib takes a second to import and only the plotting paths need it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
