"""The static-vs-continuous report: one summary per run, the side-by-side table, and the plots.

Everything here reads what `iterserve compare` saved (the load client's `RunResult.to_dict()` and
the engine `Timeline`), so a report can be redrawn from the JSON files without rerunning.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from iterserve.bench import common
from iterserve.bench.timeline import Timeline

MODES = ("static", "continuous")
COLORS = {"static": "tab:orange", "continuous": "tab:blue"}

# targets for continuous vs static, from the chat bot case's changes (docs/seed-case.md)
TARGET_THROUGHPUT_RATIO = 2.0
TARGET_P95_REDUCTION = 0.40
TARGET_QUEUE_REDUCTION = 0.90
TARGET_UTILISATION = 0.80


@dataclass
class ModeRun:
    """One server, one replay: what the load client saw and what the engine did."""

    mode: str
    result: dict[str, Any]  # RunResult.to_dict()
    timeline: Timeline
    server_flags: list[str] = field(default_factory=list)
    # the same server with every request present from the start: its capacity (`saturation_summary`)
    saturation: dict[str, Any] | None = None

    @property
    def summary(self) -> dict[str, Any]:
        return self.result["summary"]

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.result["records"]

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "server_flags": self.server_flags, "metrics": self.metrics(),
                "result": self.result, "timeline": self.timeline.to_dict(), "saturation": self.saturation}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModeRun":
        return cls(d["mode"], d["result"], Timeline.from_dict(d["timeline"]), list(d.get("server_flags", [])),
                   d.get("saturation"))

    def metrics(self) -> dict[str, Any]:
        """The numbers of the table: latencies in seconds, utilisation as a fraction of the run."""
        s = self.summary
        duration = float(s["duration_s"])
        busy, useful = self.timeline.busy_between(0.0, duration)
        sec = lambda key, stat: None if s[key][stat] is None else s[key][stat] / 1e3  # noqa: E731
        stats = self.timeline.step_stats()
        busy_s = stats["busy_s"]
        return {"utilisation": busy, "useful_utilisation": useful,
                "mean_latency_s": sec("e2e_ms", "mean"), "p95_latency_s": sec("e2e_ms", "p95"),
                "mean_queue_s": sec("queue_time_ms", "mean"), "p95_queue_s": sec("queue_time_ms", "p95"),
                "mean_ttft_s": sec("ttft_ms", "mean"), "p95_ttft_s": sec("ttft_ms", "p95"),
                "request_throughput": s["request_throughput"], "output_throughput": s["output_throughput"],
                "completed": s["completed"], "failed": s["failed"], "duration_s": duration,
                # what the engine served per second of work: its throughput if kept busy all the time
                # with this mix, a lower bound of the saturated one where its batches were not full
                "busy_throughput": s["completed"] / busy_s if busy_s else None,
                "busy_output_throughput": s["total_output_tokens"] / busy_s if busy_s else None,
                "peak_concurrency": s["peak_concurrency"], **stats,
                **{f"saturated_{k}": v for k, v in (self.saturation or {}).items()}}


def saturation_summary(result: dict[str, Any], timeline: Timeline) -> dict[str, Any]:
    """A saturation run (every request present at the start) reduced to what the table shows:
    the requests and output tokens per second it sustained, and its useful utilisation."""
    s = result["summary"]
    busy, useful = timeline.busy_between(0.0, float(s["duration_s"]))
    return {"request_throughput": s["request_throughput"], "output_throughput": s["output_throughput"],
            "utilisation": busy, "useful_utilisation": useful, "completed": s["completed"],
            "failed": s["failed"], "duration_s": s["duration_s"]}


# ---------------------------------------------------------------- the table

@dataclass(frozen=True)
class Row:
    label: str
    key: str
    fmt: Callable[[float], str]
    better: str  # "higher" | "lower" | "" (no verdict)
    target: str = ""


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _s(x: float) -> str:
    return f"{x:.2f} s"


def _ms(x: float) -> str:
    return f"{1e3 * x:.0f} ms"


ROWS = (
    Row("Utilisation (busy fraction)", "utilisation", _pct, "higher", f"continuous ≥ {_pct(TARGET_UTILISATION)}"),
    Row("Useful utilisation (no padding)", "useful_utilisation", _pct, "higher"),
    Row("Mean latency (e2e)", "mean_latency_s", _s, "lower"),
    Row("P95 latency (e2e)", "p95_latency_s", _s, "lower", f"≥ {_pct(TARGET_P95_REDUCTION)} lower"),
    Row("Mean queue time", "mean_queue_s", _ms, "lower", f"≥ {_pct(TARGET_QUEUE_REDUCTION)} lower"),
    Row("Mean TTFT", "mean_ttft_s", _ms, "lower"),
    Row("Throughput over the run (req/s)", "request_throughput", lambda x: f"{x:.3f}", "higher"),
    Row("Output throughput over the run (tok/s)", "output_throughput", lambda x: f"{x:.1f}", "higher"),
    Row("Capacity: req/s at saturation", "saturated_request_throughput", lambda x: f"{x:.3f}", "higher",
        f"≥ {TARGET_THROUGHPUT_RATIO:g}×"),
    Row("Capacity: output tok/s at saturation", "saturated_output_throughput", lambda x: f"{x:.1f}", "higher"),
    Row("Useful utilisation at saturation", "saturated_useful_utilisation", _pct, "higher"),
    Row("Decode tok/s while requests queued", "saturated_decode_tps", lambda x: f"{x:.1f}", "higher"),
    Row("Mean active sequences per step", "mean_active_seqs", lambda x: f"{x:.1f}", "higher"),
    Row("Padding share of sequence-steps", "padding_share", _pct, ""),
    Row("Completed / failed", "completed", str, ""),
)


def change(row: Row, static: float | None, cont: float | None) -> str:
    """Continuous relative to static: percentage points for utilisation, else percent (× for throughput)."""
    if static is None or cont is None or row.key in ("completed", "padding_share"):
        return ""
    if "utilisation" in row.key:
        return f"{100 * (cont - static):+.0f} pts"
    if static == 0:
        return ""
    pct = 100 * (cont - static) / static
    text = f"{pct:+.1f}%" if 99.5 <= abs(pct) < 100 else f"{pct:+.0f}%"  # never round 99.6% to 100%
    return text + (f" ({cont / static:.2f}×)" if "throughput" in row.key else "")


def target_met(key: str, static: dict[str, Any], cont: dict[str, Any]) -> bool | None:
    """Whether this row's target (docs/seed-case.md) holds; None where it has no target or no data."""
    s, c = static.get(key), cont.get(key)
    if key == "utilisation":
        return None if c is None else c >= TARGET_UTILISATION
    if s is None or c is None or s <= 0:
        return None
    if key == "saturated_request_throughput":
        return c / s >= TARGET_THROUGHPUT_RATIO
    if key == "p95_latency_s":
        return 1 - c / s >= TARGET_P95_REDUCTION
    if key == "mean_queue_s":
        return 1 - c / s >= TARGET_QUEUE_REDUCTION
    return None


def comparison(static: ModeRun, cont: ModeRun) -> dict[str, Any]:
    """The side-by-side numbers, the changes and the target verdicts, as JSON-able data."""
    ms, mc = static.metrics(), cont.metrics()
    rows = []
    for row in ROWS:
        met = target_met(row.key, ms, mc)
        rows.append({"metric": row.label, "key": row.key, "static": ms.get(row.key), "continuous": mc.get(row.key),
                     "change": change(row, ms.get(row.key), mc.get(row.key)), "target": row.target,
                     "target_met": met})
    return {"static": ms, "continuous": mc, "rows": rows, "direction_notes": direction_notes(ms, mc)}


# the case's rows (docs/seed-case.md) and why each can go the other way on a given machine and run
SEED_DIRECTION_REASONS = {
    "utilisation": "utilisation here is time inside engine steps; at one offered load both modes do the same "
                   "useful work and static batching spends more step-time on it (padding, part-full batches), "
                   "so its busy fraction is the higher one unless continuous batching runs near its own "
                   "capacity. The case's 45% -> 82% fits each mode measured near its capacity: compare "
                   "'Useful utilisation at saturation'",
    "mean_latency_s": "continuous batching was not faster on average here: look at the queue-time and batch-size "
                      "plots; with few requests one long output can decide the mean",
    "p95_latency_s": "the slowest requests were not faster with continuous batching here: with few requests the "
                     "p95 is one or two requests; a longer run (--num-requests) settles it",
    "mean_queue_s": "requests did not queue less with continuous batching here: the offered load may exceed its "
                    "capacity (see the capacity rows) or the bursts dominate",
    "saturated_request_throughput": "continuous batching did not serve more at saturation here: on a CPU a step "
                                    "costs nearly its tokens' compute, so batching gains less than on a GPU",
}


def direction_notes(ms: dict[str, Any], mc: dict[str, Any]) -> list[str]:
    """For each of the case's rows where continuous batching is not ahead of static, why not."""
    notes = []
    for row in ROWS:
        reason = SEED_DIRECTION_REASONS.get(row.key)
        s, c = ms.get(row.key), mc.get(row.key)
        if reason is None or s is None or c is None:
            continue
        if (c > s) if row.better == "higher" else (c < s):
            continue
        notes.append(f"{row.label}: static {row.fmt(s)}, continuous {row.fmt(c)}, not the case's direction: {reason}.")
    return notes


TABLE_HEADER = ("metric", "static", "continuous", "change", "target")


def table_rows(static: ModeRun, cont: ModeRun) -> list[tuple[str, str, str, str, str]]:
    """The chat bot case's table (docs/seed-case.md), side by side, as formatted cells (one tuple
    per metric, in TABLE_HEADER's order)."""
    ms, mc = static.metrics(), cont.metrics()
    rows = []
    for row in ROWS:
        if row.key == "completed":
            cells = [f"{m['completed']} / {m['failed']}" for m in (ms, mc)]
        else:
            cells = ["-" if m.get(row.key) is None else row.fmt(m[row.key]) for m in (ms, mc)]
        met = target_met(row.key, ms, mc)
        verdict = "" if not row.target else f"{row.target} {'met' if met else 'missed' if met is False else 'n/a'}"
        rows.append((row.label, cells[0], cells[1], change(row, ms.get(row.key), mc.get(row.key)), verdict))
    return rows


def markdown_table(static: ModeRun, cont: ModeRun) -> str:
    """The table as Markdown (readable in a terminal, pasteable in docs)."""
    return common.markdown_table([TABLE_HEADER, *table_rows(static, cont)], "lrrrl")


# ---------------------------------------------------------------- plots

def _run_end(runs: dict[str, ModeRun]) -> float:
    return max(float(r.summary["duration_s"]) for r in runs.values())


def plot_utilisation(runs: dict[str, ModeRun], path: Path, window_s: float) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), sharex=True, squeeze=False)
    for ax, (mode, run) in zip(axes[:, 0], runs.items()):
        w = run.timeline.windows(float(run.summary["duration_s"]), window_s)
        m = run.metrics()
        ax.plot(w["t"], w["busy"], color=COLORS[mode], lw=1.8, label="busy fraction (time in steps)")
        if run.timeline.steps and any(s.get("num_padding") for s in run.timeline.steps):
            ax.plot(w["t"], w["useful"], color="0.3", lw=1.2, ls="--", label="useful (padding excluded)")
        gpu = [(s.t, s.gpu_util) for s in run.timeline.snapshots if s.gpu_util is not None]
        if gpu:
            t, g = zip(*gpu)
            ax.plot(t, np.asarray(g, dtype=float) / (100.0 if max(g) > 1.0 else 1.0), color="tab:green",
                    lw=1, label="GPU utilisation (NVML)")
        ax.axvline(run.summary["duration_s"], color="0.6", lw=0.8, ls=":")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("fraction")
        ax.set_title(f"{mode}: utilisation {m['utilisation']:.0%} over the run ({window_s:g} s windows)",
                     fontsize=10, loc="left")
        ax.legend(loc="lower right", fontsize=8)
    axes[-1, 0].set_xlabel("time since the run started (s)")
    _save(fig, path)


def plot_batch_size(runs: dict[str, ModeRun], path: Path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), sharex=True, squeeze=False)
    for ax, (mode, run) in zip(axes[:, 0], runs.items()):
        a = run.timeline.arrays()
        if len(a["start"]):
            # each step drawn as a box over its own time span, so idle gaps between steps show as 0
            end = a["start"] + a["duration"]
            t = np.column_stack([a["start"], a["start"], end, end]).ravel()
            box = lambda v: (np.outer(v, [0, 1, 1, 0])).ravel()  # noqa: E731
            active, total = box(a["active"]), box(a["batch"])
            ax.fill_between(t, 0, active, color=COLORS[mode], alpha=0.8, lw=0, label="active sequences")
            if a["padding"].any():
                ax.fill_between(t, active, total, color="0.75", lw=0, label="padding (finished, still computed)")
        limit = run.timeline.config.get("max_batch_size" if mode == "static" else "max_num_seqs")
        if limit:
            ax.axhline(limit, color="0.4", lw=0.8, ls="--", label=f"limit {limit}")
        waiting = [(s.t, s.waiting) for s in run.timeline.snapshots]
        if waiting:
            tw, nw = zip(*waiting)
            ax2 = ax.twinx()
            ax2.step(tw, nw, where="post", color="tab:red", lw=1, label="waiting requests")
            ax2.set_ylabel("waiting", color="tab:red")
            ax2.set_ylim(0, max(1.0, 1.05 * max(nw)))
            ax2.legend(loc="upper right", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("sequences in step")
        ax.set_title(f"{mode}: batch size per engine step", fontsize=10, loc="left")
        ax.legend(loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("time since the run started (s)")
    _save(fig, path)


def _ok(run: ModeRun, key: str) -> np.ndarray:
    return np.array([r[key] for r in run.records if r["success"] and r[key] is not None], dtype=float)


def plot_latency_cdf(runs: dict[str, ModeRun], path: Path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, (key, label) in zip(axes, (("e2e_s", "end-to-end latency (s)"), ("ttft_s", "time to first token (s)"))):
        for mode, run in runs.items():
            v = np.sort(_ok(run, key))
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", color=COLORS[mode], label=mode)
                ax.axvline(np.percentile(v, 95), color=COLORS[mode], lw=0.8, ls=":")
        ax.set_xlabel(label)
        ax.set_ylabel("share of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    axes[0].set_title("latency CDF (dotted: p95)", fontsize=10, loc="left")
    _save(fig, path)


def plot_queue_time(runs: dict[str, ModeRun], path: Path) -> None:
    plt = common.pyplot()
    fig, (ax, ax_rate) = plt.subplots(2, 1, figsize=(10, 4.8), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for mode, run in runs.items():
        recs = [r for r in run.records if r["success"] and r["queue_time_s"] is not None]
        ax.scatter([r["scheduled_s"] for r in recs], [r["queue_time_s"] for r in recs], s=10,
                   color=COLORS[mode], alpha=0.8, label=f"{mode} (mean {run.metrics()['mean_queue_s'] or 0:.2f} s)")
    ax.set_ylabel("queue time (s)")
    ax.set_title("time each request waited before its first step, by arrival", fontsize=10, loc="left")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    arrivals = np.array([r["scheduled_s"] for r in next(iter(runs.values())).records])
    if len(arrivals):
        bins = np.arange(0, arrivals.max() + 1.0, 1.0)
        ax_rate.hist(arrivals, bins=bins if len(bins) > 1 else 1, color="0.5")
    ax_rate.set_ylabel("arrivals / s")
    ax_rate.set_xlabel("arrival time (s since the run started)")
    _save(fig, path)


def plot_kv_usage(runs: dict[str, ModeRun], path: Path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(10, 3))
    end = _run_end(runs)
    for mode, run in runs.items():
        a = run.timeline.arrays()
        ax.plot(a["start"], a["kv_usage"], color=COLORS[mode], lw=1, label=f"{mode}: KV blocks held")
        block = run.timeline.config.get("block_size")
        if block and len(a["start"]):
            slots = np.array([float(s.get("kv_total_blocks") or 0) * block for s in run.timeline.steps])
            stored = np.array([float(s.get("kv_tokens") or 0) for s in run.timeline.steps])
            ax.plot(a["start"], np.divide(stored, slots, out=np.zeros_like(slots), where=slots > 0),
                    color=COLORS[mode], lw=0.8, ls="--", label=f"{mode}: tokens stored")
    ax.set_xlim(0, end)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("share of the KV cache")
    ax.set_xlabel("time since the run started (s)")
    ax.set_title("KV cache held (static reserves the batch's longest possible sequence up front)",
                 fontsize=10, loc="left")
    ax.legend(loc="upper right", fontsize=8)
    _save(fig, path)


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    common.pyplot().close(fig)


def write_plots(runs: dict[str, ModeRun], out: Path, window_s: float = 2.0) -> list[Path]:
    paths = {"utilisation": out / "utilisation.png", "batch_size": out / "batch_size.png",
             "latency_cdf": out / "latency_cdf.png", "queue_time": out / "queue_time.png",
             "kv_usage": out / "kv_usage.png"}
    plot_utilisation(runs, paths["utilisation"], window_s)
    plot_batch_size(runs, paths["batch_size"])
    plot_latency_cdf(runs, paths["latency_cdf"])
    plot_queue_time(runs, paths["queue_time"])
    plot_kv_usage(runs, paths["kv_usage"])
    return list(paths.values())
