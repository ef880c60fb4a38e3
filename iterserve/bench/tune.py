"""`iterserve tune`: replay one workload against iterserve for every config in a grid, pick the best.

The advice that closes the chat bot case of docs/seed-case.md: max-num-seqs and block size are best
chosen by replaying one's own traffic. For each (max-num-seqs, block-size[, max-num-batched-tokens])
this starts a fresh server, sends a short warm-up, replays the same requests at the same arrival times, and reads the
server's per-step records (/v1/scheduler) for KV usage and internal fragmentation. It reports
throughput, goodput under the SLOs, latency, queue time and KV figures per config, names the best
config that meets the SLOs (or, when none does, the one that came closest: `rank_key`), and says why
(the trade-offs in `explain`). A time budget bounds the
whole sweep: configs left when it runs out are skipped, and said so.

With --simulate and an acceptance probability (--spec-acceptance), num_speculative_tokens is one more
dimension (--num-speculative-tokens 0,2,4: 0 = off): the simulator prices each verify row and draws
its accepted drafts (sim/speculative.py), so the sweep shows where drafting pays (few running
requests, spare compute) and where it only costs (a full batch); the finalists' real replays run
with `--speculative-config`.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import httpx
import numpy as np
from tqdm import tqdm

from iterserve.bench.client import ClientError, RunResult, Slo, parse_slo, run_load
from iterserve.bench import common
from iterserve.bench.launcher import ServerProcess
from iterserve.bench.summary import default_raw_dir, run_info, write_json
from iterserve.bench.workload import (RequestSpec, add_workload_args, build_prompts, describe_workload,
                                      workload_from_args)
from iterserve.engine_args import add_engine_args, engine_config_from_args
from iterserve.sim.profile import Profile
from iterserve.config import SpeculativeConfig

DEFAULT_SLO = "e2e_p95=2s"  # the chat bot case's goal (docs/seed-case.md)
WARMUP_TOKENS = 8
REQUEST_KEYS = ("index", "scheduled_s", "input_len", "max_tokens", "success", "ttft_s", "tpot_s", "e2e_s",
                "queue_time_s", "output_tokens")


@dataclass(frozen=True)
class GridPoint:
    max_num_seqs: int
    block_size: int
    max_num_batched_tokens: int | None = None
    num_speculative_tokens: int | None = None  # None: not a dimension of this sweep; 0: speculation off
    spec_method: str = "ngram"  # the proposer the finalists' real replays draft with

    def speculative_config(self) -> dict[str, Any] | None:
        """The point's --speculative-config (None when off or not swept)."""
        if not self.num_speculative_tokens:
            return None
        return {"method": self.spec_method, "num_speculative_tokens": self.num_speculative_tokens}

    def server_flags(self) -> list[str]:
        flags = ["--max-num-seqs", str(self.max_num_seqs), "--block-size", str(self.block_size)]
        if self.max_num_batched_tokens is not None:
            flags += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        spec = self.speculative_config()
        if spec is not None:
            flags += ["--speculative-config", json.dumps(spec)]
        return flags

    def slug(self) -> str:
        """For file names: seqs16_block16[_tok2048][_spec4]."""
        tok = f"_tok{self.max_num_batched_tokens}" if self.max_num_batched_tokens else ""
        spec = f"_spec{self.num_speculative_tokens}" if self.num_speculative_tokens is not None else ""
        return f"seqs{self.max_num_seqs}_block{self.block_size}{tok}{spec}"

    def label(self) -> str:
        text = f"seqs={self.max_num_seqs} block={self.block_size}"
        text += f" tokens={self.max_num_batched_tokens}" if self.max_num_batched_tokens else ""
        if self.num_speculative_tokens is not None:
            text += f" spec={self.num_speculative_tokens or 'off'}"
        return text


@dataclass
class KvStats:
    """From the server's per-step records: how full the KV cache was and how much of it was padding."""

    steps: int = 0
    mean_batch: float | None = None
    mean_step_ms: float | None = None
    kv_usage_mean: float | None = None  # share of blocks in use, weighted by step time
    kv_usage_peak: float | None = None
    internal_fragmentation: float | None = None  # allocated slots holding no token, weighted by step time
    preemptions: int = 0


def kv_stats(steps: Sequence[dict[str, Any]], block_size: int) -> KvStats:
    """Summarises /v1/scheduler step records; steps with nothing in the cache count only for batch."""
    busy = [s for s in steps if s.get("batch_size", 0) > 0]
    if not busy:
        return KvStats()
    dur = np.array([max(float(s.get("duration", 0.0)), 1e-6) for s in busy])
    used = np.array([float(s.get("kv_used_blocks", 0)) for s in busy])
    total = np.array([max(float(s.get("kv_total_blocks", 1)), 1.0) for s in busy])
    tokens = np.array([float(s.get("kv_tokens", 0)) for s in busy])
    usage = used / total
    held = used > 0
    frag = None
    if held.any():
        f = 1.0 - tokens[held] / (used[held] * block_size)
        frag = float(np.average(np.clip(f, 0.0, 1.0), weights=dur[held]))
    return KvStats(steps=len(busy),
                   mean_batch=float(np.mean([s["batch_size"] for s in busy])),
                   mean_step_ms=float(dur.mean() * 1e3),
                   kv_usage_mean=float(np.average(usage, weights=dur)), kv_usage_peak=float(usage.max()),
                   internal_fragmentation=frag,
                   preemptions=int(sum(s.get("num_preempted", 0) for s in busy)))


@dataclass
class ConfigResult:
    point: GridPoint
    status: str  # "ok", "skipped" (budget), "failed" (server did not start / run broke)
    detail: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    kv: KvStats = field(default_factory=KvStats)
    slo_met: bool = False
    wall_s: float = 0.0
    load_avg: float | None = None  # the machine's 1-minute load average after the replay: other jobs skew results
    requests: list[dict[str, Any]] = field(default_factory=list)  # per request, to re-judge other SLOs later

    def metric(self, name: str) -> float | None:
        """goodput (req/s), throughput (output tok/s), or any summary key."""
        key = {"goodput": "goodput", "throughput": "output_throughput"}.get(name, name)
        value = self.summary.get(key)
        return float(value) if isinstance(value, (int, float)) else None

    def to_dict(self, with_requests: bool = True) -> dict[str, Any]:
        """Everything; without the per-request records (`with_requests=False`) for the summary."""
        d = {"config": dataclasses.asdict(self.point), "status": self.status, "detail": self.detail,
             "slo_met": self.slo_met, "wall_s": self.wall_s, "load_avg": self.load_avg,
             "kv": dataclasses.asdict(self.kv), "summary": self.summary}
        return {**d, "requests": self.requests} if with_requests else d


    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ConfigResult":
        """Reads back one entry of tune.json, summary or raw (e.g. to redraw the heat-map)."""
        return cls(GridPoint(**d["config"]), d["status"], d.get("detail", ""), d.get("summary") or {},
                   KvStats(**d.get("kv") or {}), d.get("slo_met", False), d.get("wall_s", 0.0),
                   d.get("load_avg"), d.get("requests") or [])


def slo_met(result: RunResult) -> bool:
    """All requests completed, each percentile SLO met by the run, each plain SLO by every request."""
    if result.failed or not result.completed:
        return False
    report = result.slo_report()
    for row in report["slos"]:
        if "run_met" in row:
            if not row["run_met"]:
                return False
        elif row["requests_met"] < result.completed:
            return False
    return True


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


# ---------------------------------------------------------------- one config

def parse_spec_list(text: str) -> list[int]:
    """--num-speculative-tokens: integers from 0 (speculation off) to 16."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 <= v <= 16 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers from 0 (off) to 16, got {text!r}")
    return values


async def _collect_steps(base_url: str, out: list[dict[str, Any]], interval: float = 0.5) -> None:
    """Appends every new /v1/scheduler step record until cancelled (the server keeps a bounded ring)."""
    last: int | None = None
    async with httpx.AsyncClient(base_url=base_url, timeout=5.0) as http:
        while True:
            try:
                query = f"?since_step={last}" if last is not None else ""
                resp = await http.get("/v1/scheduler" + query)
                steps = resp.json().get("steps") or [] if resp.status_code == 200 else []
            except (httpx.HTTPError, ValueError, AttributeError):
                steps = []
            fresh = [s for s in steps if isinstance(s, dict) and "step" in s and (last is None or s["step"] > last)]
            if last is None:
                fresh = []  # the first call only marks where the replay starts (warm-up steps are before)
                last = max([-1] + [int(s["step"]) for s in steps if isinstance(s, dict) and "step" in s])
            out.extend(fresh)
            if fresh:
                last = max(int(s["step"]) for s in fresh)
            await asyncio.sleep(interval)


async def _replay(base_url: str, specs: Sequence[RequestSpec], slos: Sequence[Slo], timeout_s: float,
                  endpoint: str, ignore_eos: bool) -> tuple[RunResult, list[dict[str, Any]]]:
    warm = [RequestSpec(i, 0.0, 16, WARMUP_TOKENS, specs[i % len(specs)].prompt) for i in range(2)]
    await run_load(base_url, warm, endpoint=endpoint, ignore_eos=ignore_eos, progress=False)
    steps: list[dict[str, Any]] = []
    collector = asyncio.ensure_future(_collect_steps(base_url, steps))
    await asyncio.sleep(0.05)  # let the collector mark the starting step
    try:
        result = await run_load(base_url, specs, endpoint=endpoint, ignore_eos=ignore_eos, progress=False,
                                slos=slos, timeout_s=timeout_s)
        await asyncio.sleep(0.6)  # one more collection after the last request
    finally:
        collector.cancel()
        await asyncio.gather(collector, return_exceptions=True)
    return result, steps


def run_config(point: GridPoint, model: str, server_args: Sequence[str], specs: Sequence[RequestSpec],
               slos: Sequence[Slo], timeout_s: float, endpoint: str = "completions",
               ignore_eos: bool = True, log_dir: Path | None = None) -> ConfigResult:
    """Start a server with this config, replay, stop it; failures become a 'failed' result."""
    start = time.perf_counter()
    log_path = log_dir / f"server_{point.slug()}.log" if log_dir is not None else None
    srv = ServerProcess([model, *point.server_flags(), *server_args], log_path=log_path)
    try:
        with srv:
            result, steps = asyncio.run(_replay(srv.base_url, specs, slos, timeout_s, endpoint, ignore_eos))
    except Exception as e:  # noqa: BLE001 - one config failing must not end the sweep
        return ConfigResult(point, "failed", " ".join(str(e).split())[:300], wall_s=time.perf_counter() - start)
    return ConfigResult(point, "ok", summary=result.summary(), kv=kv_stats(steps, point.block_size),
                        slo_met=slo_met(result), wall_s=time.perf_counter() - start, load_avg=_load_1m(),
                        requests=[{k: getattr(r, k) for k in REQUEST_KEYS} for r in result.records])


def _load_1m() -> float | None:
    load = common.load_average()
    return None if load is None else load[0]


# ---------------------------------------------------------------- the sweep and its conclusion

def slo_shortfall(r: ConfigResult) -> float:
    """How far a run is from its percentile SLOs: the largest run pXX / threshold (1 or below: met;
    0 where no percentile SLO was set). Plain per-request SLOs show in goodput instead."""
    ratios = [math.inf if row.get("run_value_ms") is None else row["run_value_ms"] / row["threshold_ms"]
              for row in r.summary.get("slos") or [] if row.get("percentile") is not None and row.get("threshold_ms")]
    return max(ratios, default=0.0)


def rank_key(r: ConfigResult) -> tuple:
    """Tune's order: configurations meeting the SLOs first, by goodput, then throughput; below them
    the rest, closest to their percentile SLOs first (what a user asking for p95 <= 2 s wants when
    nothing gets there), then goodput and throughput."""
    good, tput = r.metric("goodput") or 0.0, r.metric("throughput") or 0.0
    return (1, 0.0, good, tput) if r.slo_met else (0, -slo_shortfall(r), good, tput)


def best_config(results: Sequence[ConfigResult]) -> tuple[ConfigResult | None, bool]:
    """(best, met): the highest goodput among configs meeting the SLOs (throughput breaks ties);
    if none meets them, the one closest to its percentile SLOs (`rank_key`), with met=False."""
    ok = [r for r in results if r.status == "ok"]
    if not ok:
        return None, False
    best = max(ok, key=rank_key)
    return best, best.slo_met


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def explain(results: Sequence[ConfigResult], best: ConfigResult | None, met: bool,
            slos: Sequence[Slo]) -> list[str]:
    """The conclusion in words, with this sweep's own numbers for each trade-off."""
    slo_text = ", ".join(s.text for s in slos) or "no SLO"
    ok = [r for r in results if r.status == "ok"]
    if best is None:
        return ["no configuration completed a run"]
    lines = [f"best: {best.point.label()} "
             + (f"meets {slo_text}" if met else f"(no configuration met {slo_text}; this one came closest"
                + (f", at {slo_shortfall(best):.2f}x its percentile bound" if slo_shortfall(best) else ", by goodput") + ")")
             + f" with goodput {best.metric('goodput') or 0:.3g} req/s, "
               f"{best.metric('throughput') or 0:.1f} output tok/s, "
               f"e2e p95 {best.summary['e2e_ms']['p95'] or 0:.0f} ms"]
    same_seqs = sorted((r for r in ok if r.point.max_num_seqs == best.point.max_num_seqs
                        and r.point.max_num_batched_tokens == best.point.max_num_batched_tokens),
                       key=lambda r: r.point.block_size)
    if len(same_seqs) >= 2:
        lo, hi = same_seqs[0], same_seqs[-1]
        lines.append(
            f"block size (at max-num-seqs {best.point.max_num_seqs}): {lo.point.block_size} -> {hi.point.block_size} "
            f"changed internal fragmentation {_pct(lo.kv.internal_fragmentation)} -> "
            f"{_pct(hi.kv.internal_fragmentation)} "
            f"and mean step time {lo.kv.mean_step_ms or 0:.1f} -> {hi.kv.mean_step_ms or 0:.1f} ms. Small blocks "
            "waste fewer slots but mean longer block tables (more block-table and slot-mapping work per step); "
            "large blocks leave slots allocated but unfilled at the end of every sequence, which only matters "
            "once the KV cache is what limits the batch")
    same_block = sorted((r for r in ok if r.point.block_size == best.point.block_size
                         and r.point.max_num_batched_tokens == best.point.max_num_batched_tokens),
                        key=lambda r: r.point.max_num_seqs)
    if len(same_block) >= 2:
        parts = [f"{r.point.max_num_seqs}: {r.metric('throughput') or 0:.0f} tok/s, p95 "
                 f"{r.summary['e2e_ms']['p95'] or 0:.0f} ms, queue {r.summary['queue_time_ms']['mean'] or 0:.0f} ms, "
                 f"mean batch {r.kv.mean_batch or 0:.1f}" for r in same_block]
        lines.append(f"max-num-seqs (at block size {best.point.block_size}): " + "; ".join(parts) + ". Too few "
                     "sequences and requests queue; more sequences raise throughput until each step's compute "
                     "(or the KV cache) is the limit, after which every request's tokens just come slower")
    peaks = [r.kv.kv_usage_peak for r in ok if r.kv.kv_usage_peak is not None]
    preempted = sum(r.kv.preemptions for r in ok)
    if peaks and max(peaks) < 0.9 and not preempted:
        lines.append(f"KV cache: peak usage at most {_pct(max(peaks))} and no preemptions, so the cache never "
                     "limited the batch here: block size could only act through per-step overhead, and "
                     "fragmentation cost memory that was not needed")
    elif preempted:
        lines.append(f"KV cache: {preempted} preemptions in all, peak usage up to {_pct(max(peaks or [0]))}: "
                     "the cache limited the batch, where large blocks' unfilled slots cost throughput")
    loads = [r.load_avg for r in ok if r.load_avg is not None]
    if loads:
        lines.append(f"machine load (1-minute average after each replay) was {min(loads):.1f}-{max(loads):.1f}: "
                     "where other jobs share the CPU, differences of a few tens of percent between configs "
                     "can be noise; repeat the best few before trusting a ranking")
    return lines


def markdown_table(results: Sequence[ConfigResult]) -> str:
    with_tokens = any(r.point.max_num_batched_tokens for r in results)
    with_spec = any(r.point.num_speculative_tokens is not None for r in results)
    head = ["max-num-seqs", "block", *(["batched tok"] if with_tokens else []), *(["spec k"] if with_spec else []),
            "status", "out tok/s", "req/s",
            "goodput", "e2e mean ms", "e2e p95 ms", "TTFT p95 ms", "queue mean ms", "KV mean", "KV peak",
            "frag", "preempt", "batch", "step ms", "load", "SLO"]
    rows = [head]
    f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    order = lambda r: (r.point.max_num_seqs, r.point.block_size, r.point.max_num_batched_tokens or 0,  # noqa: E731
                       r.point.num_speculative_tokens or 0)
    for r in sorted(results, key=order):
        s = r.summary
        cells = [str(r.point.max_num_seqs), str(r.point.block_size),
                 *([str(r.point.max_num_batched_tokens or "-")] if with_tokens else []),
                 *([str(r.point.num_speculative_tokens or "off")] if with_spec else []), r.status]
        if r.status == "ok":
            cells += [f(s["output_throughput"]), f(s["request_throughput"], 2), f(s["goodput"], 2),
                      f(s["e2e_ms"]["mean"], 0), f(s["e2e_ms"]["p95"], 0), f(s["ttft_ms"]["p95"], 0),
                      f(s["queue_time_ms"]["mean"], 0), _pct(r.kv.kv_usage_mean), _pct(r.kv.kv_usage_peak),
                      _pct(r.kv.internal_fragmentation), str(r.kv.preemptions), f(r.kv.mean_batch),
                      f(r.kv.mean_step_ms), f(r.load_avg),
                      "met" if r.slo_met else "missed"]
        else:
            cells += ["-"] * (len(head) - len(cells) - 1) + [r.detail[:60] or r.status]
        rows.append(cells)
    return common.markdown_table(rows)


def plot_heatmap(results: Sequence[ConfigResult], path: Path, metric: str = "goodput",
                 title: str = "") -> None:
    """max-num-seqs (rows) x block size (columns), one panel per max-num-batched-tokens value."""
    plt = common.pyplot()

    seqs = sorted({r.point.max_num_seqs for r in results})
    blocks = sorted({r.point.block_size for r in results})
    tokens = sorted({r.point.max_num_batched_tokens for r in results}, key=lambda t: t or 0)
    best, _ = best_config(results)
    fig, axes = plt.subplots(1, len(tokens), figsize=(1.6 * len(blocks) * len(tokens) + 2.5, 0.8 * len(seqs) + 2),
                             squeeze=False)
    values = [v for r in results if (v := r.metric(metric)) is not None]
    vmax = max(values) if values else 1.0
    for ax, tok in zip(axes[0], tokens):
        grid = np.full((len(seqs), len(blocks)), np.nan)
        for r in results:
            if r.point.max_num_batched_tokens == tok and (v := r.metric(metric)) is not None:
                grid[seqs.index(r.point.max_num_seqs), blocks.index(r.point.block_size)] = v
        im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=vmax or 1.0, origin="lower", aspect="auto")
        for r in results:
            if r.point.max_num_batched_tokens != tok:
                continue
            y, x = seqs.index(r.point.max_num_seqs), blocks.index(r.point.block_size)
            v = r.metric(metric)
            text = r.status if v is None else f"{v:.3g}" + ("" if r.slo_met else "\nSLO missed")
            ax.text(x, y, text, ha="center", va="center", fontsize=8,
                    color="white" if v is None or v < 0.6 * vmax else "black")
            if r is best:
                ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", lw=2.5))
        ax.set_xticks(range(len(blocks)), [str(b) for b in blocks])
        ax.set_yticks(range(len(seqs)), [str(s) for s in seqs])
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("max-num-seqs")
        if tok:
            ax.set_title(f"max-num-batched-tokens {tok}", fontsize=9)
    unit = {"goodput": "goodput (req/s meeting the SLO)", "throughput": "output tokens/s"}.get(metric, metric)
    fig.colorbar(im, ax=list(axes[0]), label=unit)
    fig.suptitle(title or f"iterserve tune: {unit}; red = best", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


@dataclass
class Sweep:
    """A whole tune run: what was replayed, each config's result, and the conclusion."""

    model: str
    workload: dict[str, Any]
    slos: list[Slo]
    results: list[ConfigResult]
    budget_minutes: float | None
    skipped_for_budget: int = 0
    conclusion: list[str] = field(default_factory=list)

    def to_dict(self, with_requests: bool = True) -> dict[str, Any]:
        best, met = best_config(self.results)
        return {"model": self.model, "workload": self.workload, "slos": [s.text for s in self.slos],
                "budget_minutes": self.budget_minutes, "skipped_for_budget": self.skipped_for_budget,
                "best": dataclasses.asdict(best.point) if best else None, "best_meets_slo": met,
                "conclusion": self.conclusion, "results": [r.to_dict(with_requests) for r in self.results]}


def sweep(points: Sequence[GridPoint], model: str, server_args: Sequence[str], specs: Sequence[RequestSpec],
          slos: Sequence[Slo], budget_minutes: float | None = None, run_grace_s: float = 120.0,
          endpoint: str = "completions", ignore_eos: bool = True, log_dir: Path | None = None,
          progress: bool = True, workload: dict[str, Any] | None = None) -> Sweep:
    """Runs every config in order until the budget is spent; the rest are recorded as skipped."""
    deadline = time.monotonic() + budget_minutes * 60 if budget_minutes else None
    last_arrival = max(s.arrival_s for s in specs)
    results: list[ConfigResult] = []
    bar = tqdm(points, disable=not progress, unit="config", desc="tune")
    for point in bar:
        bar.set_postfix_str(point.label())
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            results.append(ConfigResult(point, "skipped", "time budget spent"))
            continue
        timeout = last_arrival + run_grace_s
        if left is not None:
            timeout = max(min(timeout, left), 10.0)
        results.append(run_config(point, model, server_args, specs, slos, timeout, endpoint, ignore_eos, log_dir))
    bar.close()
    skipped = sum(r.status == "skipped" for r in results)
    out = Sweep(model, workload or {}, list(slos), results, budget_minutes, skipped)
    best, met = best_config(results)
    out.conclusion = explain(results, best, met, slos)
    if skipped:
        out.conclusion.append(f"{skipped} of {len(results)} configs were skipped: the "
                              f"{budget_minutes:g}-minute budget ran out")
    return out


# ---------------------------------------------------------------- in the simulator first (--simulate)

def simulate_config(point: GridPoint, profile: Profile, server_args: Sequence[str], specs: Sequence[RequestSpec],
                    slos: Sequence[Slo], spec_acceptance: float | None = None,
                    spec_draft_fraction: float = 1.0) -> ConfigResult:
    """The config's replay in the capacity simulator (iterserve/sim): the engine's scheduler and
    block pool, the profile's step times; a ConfigResult like a real replay's. A point with
    num_speculative_tokens drafts that many per decode row, accepted with `spec_acceptance` per token
    (the rest of a --speculative-config in server_args, such as disable_by_batch_size, is kept)."""
    from iterserve.sim.simulator import simulate  # loads torch (through Request): only when asked for

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    overrides = {"max_num_seqs": point.max_num_seqs, "block_size": point.block_size}
    if point.max_num_batched_tokens is not None:
        overrides["max_num_batched_tokens"] = point.max_num_batched_tokens
    parsed = parser.parse_args(list(server_args))
    config = engine_config_from_args(parsed, **overrides)
    if point.num_speculative_tokens is not None:
        base = config.speculative_config
        spec = (None if not point.num_speculative_tokens else
                dataclasses.replace(base, num_speculative_tokens=point.num_speculative_tokens)
                if base is not None else SpeculativeConfig(**point.speculative_config()))
        try:  # built again so that EngineConfig's checks (no static batching) hold for the point
            config = engine_config_from_args(parsed, **overrides, speculative_config=spec)
        except ValueError as e:
            return ConfigResult(point, "failed", str(e))
    run = simulate(specs, config, profile, slos=slos, spec_acceptance=spec_acceptance,
                   spec_draft_fraction=spec_draft_fraction)
    return ConfigResult(point, "ok", "simulated", run.result.summary(), kv_stats(run.timelines[0].steps, point.block_size),
                        slo_met(run.result), run.stats["wall_s"])


def ranked(results: Sequence[ConfigResult]) -> list[ConfigResult]:
    """best_config's order (`rank_key`), best first."""
    return sorted((r for r in results if r.status == "ok"), key=rank_key, reverse=True)


def simulated_choice(simulated: Sequence[ConfigResult], verified: Sequence[ConfigResult]) -> tuple[ConfigResult | None, str]:
    """`tune --simulate`'s answer and where it comes from: the best of the real replays of the
    simulator's finalists (tune's rule on measurements), because the simulator's job is to cut the
    grid to a few candidates and a step-time model cannot see a difference smaller than the host's
    noise (configs it prices alike, such as block sizes at low KV use, tie); the simulated best
    only when nothing was verified or no replay completed."""
    best_real, _ = best_config(verified)
    if best_real is not None:
        return best_real, f"measured best of the {len(verified)} verified"
    best_sim, _ = best_config(simulated)
    return best_sim, "simulated best (nothing verified)" if not verified else "simulated best (no replay completed)"


def predicted_vs_measured(pairs: Sequence[tuple[ConfigResult, ConfigResult]]) -> str:
    """Each verified config: the simulator's prediction next to the real replay, and the error."""
    cols = (("req/s", lambda s: s["request_throughput"]), ("out tok/s", lambda s: s["output_throughput"]),
            ("e2e mean ms", lambda s: s["e2e_ms"]["mean"]), ("e2e p95 ms", lambda s: s["e2e_ms"]["p95"]),
            ("TTFT p50 ms", lambda s: s["ttft_ms"]["median"]))
    head = ["config"] + [f"{name} {kind}" for name, _ in cols for kind in ("sim", "real", "err")] + ["SLO sim/real"]
    rows = [head]
    for sim, real in pairs:
        cells = [sim.point.label()]
        for _, get in cols:
            p = get(sim.summary) if sim.summary else None
            m = get(real.summary) if real.status == "ok" else None
            err = f"{100 * (p - m) / m:+.0f}%" if p is not None and m else "-"
            cells += ["-" if p is None else f"{p:.1f}", "-" if m is None else f"{m:.1f}", err]
        cells.append(f"{'met' if sim.slo_met else 'missed'}/{('met' if real.slo_met else 'missed') if real.status == 'ok' else real.status}")
        rows.append(cells)
    return common.markdown_table(rows)


# ---------------------------------------------------------------- command line

def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tune", help="replay a workload against iterserve over a config grid",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="model for `iterserve serve` (default smollm2-135m)")
    p.add_argument("--max-num-seqs", dest="grid_seqs", type=parse_int_list, default=[4, 8, 16, 32],
                   metavar="N,N,...", help="values to try (default 4,8,16,32)")
    p.add_argument("--block-size", dest="grid_blocks", type=parse_int_list, default=[8, 16, 32],
                   metavar="N,N,...", help="values to try (default 8,16,32)")
    p.add_argument("--max-num-batched-tokens", dest="grid_tokens", type=parse_int_list, default=None,
                   metavar="N,N,...", help="values to try (default: the server's default only)")
    p.add_argument("--server-args", default="", metavar="'FLAGS'",
                   help="other engine flags for every server, e.g. '--threads 2 --kv-cache-memory 256MiB'")
    p.add_argument("--slo", action="extend", nargs="+", default=None, metavar="SPEC",
                   help=f"e.g. ttft=500ms e2e_p95=2s (default {DEFAULT_SLO}); goodput counts requests meeting all")
    p.add_argument("--budget-minutes", type=float, default=None,
                   help="stop starting new configs after this long; the rest are reported as skipped")
    p.add_argument("--run-grace", type=float, default=120.0, metavar="S",
                   help="per config: the replay may run this long past the last arrival (default 120 s)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="force each request's output length (default on)")
    p.add_argument("--metric", choices=("goodput", "throughput"), default="goodput", help="heat-map value")
    p.add_argument("--out", default="tune-results", metavar="DIR",
                   help="writes the summary tune.json, tune.md (table + conclusion) and heatmap.png here")
    p.add_argument("--raw-dir", metavar="DIR",
                   help="writes tune.json with every request of every config, and the server logs, here "
                        "(default: a new folder under runs/)")
    p.add_argument("--shuffle", action="store_true",
                   help="run the configs in a random order (seeded by --seed), so that a drift in machine "
                        "load does not line up with one axis of the grid")
    p.add_argument("--simulate", metavar="P.json",
                   help="sweep the grid in the capacity simulator with this step profile (`iterserve profile`), "
                        "seconds per config, then verify the best --verify configs by real replay")
    p.add_argument("--verify", type=int, default=3, metavar="N",
                   help="with --simulate: replay the N best simulated configs for real and choose the best of "
                        "them as measured (default 3; 0: none, the simulated best is the choice)")
    s = p.add_argument_group("speculative decoding (with --simulate)")
    s.add_argument("--num-speculative-tokens", dest="grid_spec", type=parse_spec_list, default=None, metavar="K,K,...",
                   help="drafts per verify row to try, 0 = off (e.g. 0,2,4,8; needs --spec-acceptance)")
    s.add_argument("--spec-acceptance", type=float, default=None, metavar="ALPHA",
                   help="probability that each next draft token is accepted, 0..1 (measured: see `iterserve "
                        "simulate --spec-from`)")
    s.add_argument("--spec-draft-fraction", type=float, default=1.0, metavar="F",
                   help="share of decode rows that draft at all (default 1)")
    s.add_argument("--spec-method", choices=("ngram", "suffix"), default="ngram",
                   help="the proposer of the verified finalists' real replays (default ngram)")
    p.add_argument("--no-progress", action="store_true")
    add_workload_args(p)
    p.set_defaults(func=cmd_tune)
    return p


def _prompts_for(model: str, specs: list[RequestSpec]) -> None:
    """Exact-length prompts with the model's own tokenizer when it loads; else ~0.75 words/token."""
    try:
        from iterserve.model.loader import load_tokenizer, resolve_model

        tokenizer = load_tokenizer(resolve_model(model))
    except Exception:  # noqa: BLE001 - an approximate prompt length is an acceptable fallback
        tokenizer = None
    build_prompts(specs, tokenizer)


def cmd_tune(args: argparse.Namespace) -> int:
    try:
        slos = [parse_slo(text) for text in (args.slo or [DEFAULT_SLO])]
    except ClientError as e:
        raise ValueError(str(e)) from None
    if args.budget_minutes is not None and args.budget_minutes <= 0:
        raise ValueError("--budget-minutes must be > 0")
    specs = workload_from_args(args)
    _prompts_for(args.model, specs)
    grid_spec = getattr(args, "grid_spec", None)
    if grid_spec is not None:
        if not args.simulate or getattr(args, "spec_acceptance", None) is None:
            raise ValueError("--num-speculative-tokens is a dimension of the simulated sweep: give --simulate and "
                             "--spec-acceptance (a real sweep takes --speculative-config in --server-args)")
        if any(not 0 <= k <= 16 for k in grid_spec):
            raise ValueError("--num-speculative-tokens: values from 0 (off) to 16")
    points = [GridPoint(s, b, t, k, getattr(args, "spec_method", "ngram")) for s, b, t, k in
              itertools.product(args.grid_seqs, args.grid_blocks, args.grid_tokens or [None], grid_spec or [None])]
    if args.shuffle:
        random.Random(args.seed).shuffle(points)
    out = Path(args.out)
    raw_dir = Path(args.raw_dir) if args.raw_dir else default_raw_dir("tune")
    command = ["iterserve", *sys.argv[1:]] if sys.argv[1:2] == ["tune"] else None  # None: called in-process
    info = {**run_info(command), "raw_dir": str(raw_dir)}
    workload = describe_workload(args)
    print(f"tune: {len(points)} configs x {len(specs)} requests "
          f"(last arrival {max(s.arrival_s for s in specs):.1f} s), SLO {', '.join(s.text for s in slos)}",
          file=sys.stderr)
    if args.simulate:
        return cmd_tune_simulated(args, points, specs, slos, out, raw_dir, {**info, "workload": workload})
    result = sweep(points, args.model, shlex.split(args.server_args), specs, slos, args.budget_minutes,
                   args.run_grace, args.endpoint, args.ignore_eos, raw_dir / "logs", not args.no_progress, workload)
    table = markdown_table(result.results)
    print(table)
    print()
    for line in result.conclusion:
        print(f"- {line}")
    write_json(raw_dir / "tune.json", {**info, **result.to_dict()})
    write_json(out / "tune.json", {**info, **result.to_dict(with_requests=False)})
    (out / "tune.md").write_text(table + "\n\n" + "\n".join(f"- {line}" for line in result.conclusion) + "\n")
    what = workload.get("kind", "")
    if what == "trace":
        what = f"{Path(workload['path']).name} x{workload['time_scale']:g}"
    title = (f"iterserve tune: {args.metric} over the grid, SLO {', '.join(s.text for s in slos)}; red = best\n"
             f"{Path(args.model).name}, {len(specs)} requests ({what})")
    plot_heatmap(result.results, out / "heatmap.png", args.metric, title)
    print(f"wrote {out / 'tune.json'}, {out / 'tune.md'}, {out / 'heatmap.png'}; raw records in {raw_dir}",
          file=sys.stderr)
    return 0 if any(r.status == "ok" for r in result.results) else 1


def cmd_tune_simulated(args: argparse.Namespace, points: Sequence[GridPoint], specs: Sequence[RequestSpec],
                       slos: Sequence[Slo], out: Path, raw_dir: Path, info: dict[str, Any]) -> int:
    """The whole grid in the simulator, then the best few replayed for real, side by side."""
    profile = Profile.load(args.simulate)
    server_args = shlex.split(args.server_args)
    t0 = time.perf_counter()
    acceptance = getattr(args, "spec_acceptance", None)
    simulated = [simulate_config(p, profile, server_args, specs, slos, acceptance,
                                 getattr(args, "spec_draft_fraction", 1.0)) for p in points]
    print(f"tune: simulated {len(points)} configs in {time.perf_counter() - t0:.1f} s ({profile.describe()})",
          file=sys.stderr)
    table = markdown_table(simulated)
    print(table)
    finalists = ranked(simulated)[:max(args.verify, 0)]
    pairs = []
    for sim in finalists:
        print(f"tune: verifying {sim.point.label()} by real replay", file=sys.stderr)
        real = run_config(sim.point, args.model, server_args, specs, slos, max(s.arrival_s for s in specs)
                          + args.run_grace, args.endpoint, args.ignore_eos, raw_dir / "logs")
        pairs.append((sim, real))
    comparison = predicted_vs_measured(pairs) if pairs else ""
    best_sim, met = best_config(simulated)
    measured = [real for _, real in pairs]
    chosen, source = simulated_choice(simulated, measured)
    lines = [f"simulated best: {best_sim.point.label()} ({'meets' if met else 'misses'} the SLOs)"
             if best_sim else "no simulated configuration completed"]
    if best_sim is not None and best_sim.point.num_speculative_tokens is not None:
        k = best_sim.point.num_speculative_tokens
        lines.append(f"speculative decoding: the simulator chose num_speculative_tokens={k}" + (
            " (off: drafting did not pay on this workload)" if not k else
            f" at acceptance {acceptance:g} per draft token") + "")
    if chosen is not None:
        lines.append(f"chosen: {chosen.point.label()} ({source}; "
                     f"{'meets' if chosen.slo_met else 'misses'} the SLOs"
                     f"{' as measured' if any(chosen is r for r in measured) else ', as simulated'})")
    if comparison:
        print("\npredicted (sim) vs measured (real):\n" + comparison)
    for line in lines:
        print(f"- {line}")
    head = {**info, "model": args.model, "slos": [s.text for s in slos], "profile": args.simulate,
            "profile_describes": profile.describe(), "conclusion": lines,
            "chosen": chosen.point.label() if chosen else None}
    for path, full in ((raw_dir / "tune.json", True), (out / "tune.json", False)):
        write_json(path, {**head, "simulated": [r.to_dict(with_requests=full) for r in simulated],
                          "verified": [r.to_dict(with_requests=full) for r in measured]})
    (out / "tune.md").write_text(table + "\n\n" + comparison + "\n\n" + "\n".join(f"- {x}" for x in lines) + "\n")
    print(f"wrote {out / 'tune.json'}, {out / 'tune.md'}; raw records in {raw_dir}", file=sys.stderr)
    return 0 if simulated else 1
