"""iterserve against peer servers (llama.cpp's llama-server, vLLM for CPU) on this machine: the
same client and the same requests for each, one table with iterserve/peer ratios, and JSON.

Each system is started on a free loopback port, warmed up, measured and stopped before the next
one starts (back to back, in the order of --peers; the 1-minute load average is recorded around
each). The peers are the ones ../shared/peers/ installs and starts (README there); a peer that is
not installed or does not start is reported as skipped, with the reason. All speak OpenAI
/v1/completions; requests are streamed, greedy, ignore_eos, with prompts of real prose cut to
exact token counts of the model's tokenizer (all serve SmolLM2-135M-Instruct from the same GGUF:
llama.cpp as Q4_1, vLLM and iterserve dequantised).

Workloads (defaults; --quick shrinks them to a smoke test: ~1 minute for iterserve and llama.cpp,
plus ~2-3 minutes of vLLM start-up):
  single      5 requests one after another, 12-token prompts, 128 output tokens: decode tok/s
              per request, (n-1) / (last token - first token), and TTFT (medians)
  concurrent  16 requests at once, 12-token prompts, 64 output tokens: output tok/s, mean / p95
              latency
  poisson     60 requests, Poisson arrivals at --rate 2 req/s, prompts 50-500 and outputs 16-256
              tokens (issue 3's mix), seed 0: p50 / p95 latency, p95 TTFT, output tok/s
  offline     (--offline) benchmarks/offline_vs_hf.py's mixed-length set in this process:
              iterserve's engine vs transformers `generate` in static batches of 8
  vllm bench  (--vllm-bench) vLLM's own client, `vllm bench serve`, against each server: random
              128 in / 64 out at 4 req/s (32 prompts), and prefill-heavy 1024 / 16 at 1 req/s
              (benchmarks/peers/vllm_bench.py); its own table

The matrix of issue 35 (models x prompt shapes x loads, all measured with `vllm bench serve`, the
targets judged per cell) is benchmarks/peer_matrix.py, built on this module's peers and on
benchmarks/peers/matrix.py.

The run first prints the host: CPU model, cores, the speed-deciding flags, a copy bandwidth and a
bf16 GEMM figure (benchmarks/machine.py), which also go into the JSON.

Usage (repo root; benchmarks/vs_peers.py runs it, this module holds the plan, the metrics and
the table, which the tests import):

    .venv/bin/python benchmarks/vs_peers.py                      # every installed system, full run
    .venv/bin/python benchmarks/vs_peers.py --quick --peers iterserve,llamacpp
    .venv/bin/python benchmarks/vs_peers.py --iterserve-args "" --iterserve-args "--dtype bfloat16" \\
        --peers vllm,iterserve,llamacpp --rate 3 --offline --out results/vs_peers.json

--out gets a summary (the table, every system's metrics and settings, the plan, host, commit and
command: a few KB, the file to commit); --raw-dir (default: a new folder under runs/, ignored by
git) gets the same report with every request's record.

--iterserve-args may repeat: each gives one iterserve column (flags of `iterserve serve`), all run
where "iterserve" stands in --peers. The peers read their settings from the environment (NP,
THREADS, MAX_NUM_SEQS, VLLM_CPU_OMP_THREADS_BIND, VLLM_EXTRA_ARGS, ...: see the start scripts).
Ratios are iterserve / peer for every row: above 1 is better for tok/s rows, below 1 for latency.
Run it on a quiet machine: with other jobs on the 2 cores, llama.cpp's figures in smoke runs here
varied 2-3x from run to run.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from iterserve.bench.client import ClientError, RequestRecord, RunResult, run_load
from iterserve.bench.common import markdown_table, one_line
from peers.systems import KINDS, System
from iterserve.bench.workload import RequestSpec, all_at_once, build_prompts, poisson

REPO = Path(__file__).resolve().parents[2]  # the checkout this package is installed from (pip install -e)
DEFAULT_PEERS_DIR = REPO.parent / "shared" / "peers"
DEFAULT_PEERS_HOME = Path.home() / ".cache" / "iterserve-peers"
TRANSFORMERS = "transformers"  # the offline row's baseline column
SERVER_WORKLOADS = ("single", "concurrent", "poisson")


# ---------------------------------------------------------------- what to run

@dataclass(frozen=True)
class Plan:
    """Every workload's size; one Plan is used for all systems of a run."""

    single_requests: int = 5
    single_prompt: int = 12
    single_output: int = 128
    concurrency: int = 16
    concurrent_prompt: int = 12
    concurrent_output: int = 64
    poisson_requests: int = 60
    rate: float = 2.0
    poisson_input: tuple[int, int] = (50, 500)
    poisson_output: tuple[int, int] = (16, 256)
    seed: int = 0
    warmup_requests: int = 2
    offline_requests: int = 64


QUICK = Plan(single_requests=2, single_output=32, concurrent_output=16, poisson_requests=8,
             poisson_input=(50, 200), poisson_output=(16, 48), offline_requests=4)


def variant_label(args: Sequence[str]) -> str:
    """`iterserve` for default flags, else e.g. `iterserve[dtype=bfloat16,log-scheduler]`."""
    parts: list[str] = []
    for arg in args:
        if arg.startswith("-"):
            parts.append(arg.lstrip("-"))
        elif parts:
            parts[-1] += f"={arg}"
        else:
            parts.append(arg)
    return f"iterserve[{','.join(parts)}]" if parts else "iterserve"


def systems_from_args(peers: str, iterserve_args: Sequence[str] | None) -> list[System]:
    """The systems in run order: "iterserve" in --peers expands to every --iterserve-args variant."""
    names = [n.strip() for n in peers.split(",") if n.strip()]
    unknown = [n for n in names if n not in KINDS]
    if unknown or not names or len(set(names)) < len(names):
        raise ValueError(f"--peers wants distinct names from {','.join(KINDS)}; got {peers!r}")
    variants = [tuple(shlex.split(a)) for a in (iterserve_args or [""])]
    systems: list[System] = []
    for name in names:
        if name != "iterserve":
            systems.append(System(name, name))
            continue
        for args in variants:
            label = variant_label(args)
            taken = sum(s.label.split("#")[0] == label for s in systems)
            systems.append(System(f"{label}#{taken + 1}" if taken else label, "iterserve", args))
    return systems


def plan_from_args(args: argparse.Namespace) -> Plan:
    base = QUICK if args.quick else Plan()
    overrides = {k: getattr(args, k) for k in ("rate", "poisson_requests", "single_requests", "seed",
                                              "offline_requests") if getattr(args, k) is not None}
    return dataclasses.replace(base, **overrides)


# ---------------------------------------------------------------- workloads and their metrics

@dataclass
class Workloads:
    single: list[RequestSpec]
    concurrent: list[RequestSpec]
    poisson: list[RequestSpec]
    warmup: list[RequestSpec]


def build_workloads(plan: Plan, tokenizer: Any) -> Workloads:
    """The identical requests every system gets (prompts cut to exact token counts)."""
    single = all_at_once(plan.single_requests, seed=plan.seed, input_len=plan.single_prompt,
                         output_len=plan.single_output)
    concurrent = all_at_once(plan.concurrency, seed=plan.seed, input_len=plan.concurrent_prompt,
                             output_len=plan.concurrent_output)
    mixed = poisson(plan.poisson_requests, plan.rate, seed=plan.seed, input_len=plan.poisson_input,
                    output_len=plan.poisson_output)
    warmup = all_at_once(plan.warmup_requests, seed=plan.seed, input_len=16, output_len=8)
    for specs in (single, concurrent, mixed, warmup):
        build_prompts(specs, tokenizer)
    return Workloads(single, concurrent, mixed, warmup)


def decode_rate(rec: RequestRecord) -> float | None:
    """Tokens/s after the first one: (n - 1) / (last token's arrival - first token's arrival)."""
    span = sum(rec.itl_s)
    return (rec.output_tokens - 1) / span if rec.success and rec.output_tokens > 1 and span > 0 else None


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _checks(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Failures, and outputs shorter than asked (a server that ignored ignore_eos)."""
    ok = [r for r in records if r.success]
    errors = sorted({r.error for r in records if not r.success})
    return {"completed": len(ok), "failed": len(records) - len(ok),
            "short_outputs": sum(r.output_tokens != r.max_tokens for r in ok), "errors": errors[:3]}


def single_metrics(records: Sequence[RequestRecord]) -> dict[str, Any]:
    rates = [decode_rate(r) for r in records]
    ttfts = [r.ttft_s * 1e3 if r.ttft_s is not None else None for r in records]
    return {"decode_tok_s": _median(rates), "ttft_ms": _median(ttfts), **_checks(records),
            "decode_tok_s_each": rates, "ttft_ms_each": ttfts,
            "records": [dataclasses.asdict(r) for r in records]}


def load_metrics(result: RunResult) -> dict[str, Any]:
    s = result.summary()
    return {"model": result.model, "output_tok_s": s["output_throughput"], "request_s": s["request_throughput"],
            "latency_mean_ms": s["e2e_ms"]["mean"], "latency_p50_ms": s["e2e_ms"]["median"],
            "latency_p95_ms": s["e2e_ms"]["p95"], "ttft_p50_ms": s["ttft_ms"]["median"],
            "ttft_p95_ms": s["ttft_ms"]["p95"], "duration_s": s["duration_s"],
            "peak_concurrency": s["peak_concurrency"], **_checks(result.records),
            "records": [dataclasses.asdict(r) for r in result.records]}


async def _single(url: str, specs: Sequence[RequestSpec]) -> list[RequestRecord]:
    return [(await run_load(url, [s], progress=False)).records[0] for s in specs]


def measure(url: str, work: Workloads, say) -> dict[str, Any]:
    """Warm-up, then each workload; a workload the client cannot run records its error."""
    asyncio.run(run_load(url, work.warmup, progress=False))
    out: dict[str, Any] = {}
    jobs = {"single": lambda: single_metrics(asyncio.run(_single(url, work.single))),
            "concurrent": lambda: load_metrics(asyncio.run(run_load(url, work.concurrent, progress=False))),
            "poisson": lambda: load_metrics(asyncio.run(run_load(url, work.poisson, progress=False)))}
    for name, job in jobs.items():
        t0 = time.perf_counter()
        try:
            out[name] = job()
        except ClientError as e:
            out[name] = {"error": one_line(e)}
        say(f"  {name}: {time.perf_counter() - t0:.0f} s "
            f"{ {k: round(v, 1) for k, v in out[name].items() if isinstance(v, float)} }")
    return out


# ---------------------------------------------------------------- the table

@dataclass(frozen=True)
class Row:
    key: str  # workload.metric
    label: str
    better: str  # "higher" or "lower"


def table_rows(plan: Plan, offline: bool) -> list[Row]:
    single = f"single stream ({plan.single_output} tok)"
    conc = f"{plan.concurrency} concurrent x {plan.concurrent_output} tok"
    (i0, i1), (o0, o1) = plan.poisson_input, plan.poisson_output
    pois = f"Poisson {plan.rate:g} req/s x {plan.poisson_requests} (in {i0}-{i1}, out {o0}-{o1})"
    rows = [Row("single.decode_tok_s", f"{single}: decode tok/s", "higher"),
            Row("single.ttft_ms", f"{single}: TTFT ms", "lower"),
            Row("concurrent.output_tok_s", f"{conc}: output tok/s", "higher"),
            Row("concurrent.latency_mean_ms", f"{conc}: latency mean ms", "lower"),
            Row("concurrent.latency_p95_ms", f"{conc}: latency p95 ms", "lower"),
            Row("poisson.latency_p50_ms", f"{pois}: latency p50 ms", "lower"),
            Row("poisson.latency_p95_ms", f"{pois}: latency p95 ms", "lower"),
            Row("poisson.ttft_p95_ms", f"{pois}: TTFT p95 ms", "lower"),
            Row("poisson.output_tok_s", f"{pois}: output tok/s", "higher")]
    if offline:
        rows.append(Row("offline.output_tok_s",
                        f"offline {plan.offline_requests} mixed-length requests: output tok/s", "higher"))
    return rows


def flat_metrics(workloads: dict[str, Any]) -> dict[str, float | None]:
    """{"single": {"ttft_ms": 31.0, ...}, ...} -> {"single.ttft_ms": 31.0, ...} (numbers only)."""
    return {f"{w}.{k}": v for w, metrics in workloads.items() for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def build_table(rows: Sequence[Row], values: dict[str, dict[str, float | None]],
                ours: Sequence[str], theirs: Sequence[str]) -> list[list[str]]:
    """Header + one line per row: each system's value, then every ours/theirs ratio."""
    pairs = [(o, t) for o in ours for t in theirs]
    head = ["metric", "better", *ours, *theirs, *(f"{o}/{t}" for o, t in pairs)]
    lines = [head]
    for row in rows:
        get = lambda system: values.get(system, {}).get(row.key)  # noqa: E731
        cells = [_num(get(s)) for s in (*ours, *theirs)]
        ratios = [ratio(get(o), get(t)) for o, t in pairs]
        lines.append([row.label, row.better, *cells, *("-" if r is None else f"{r:.2f}x" for r in ratios)])
    lines.append(["failed requests", "lower", *(_failed(values.get(s, {})) for s in (*ours, *theirs)),
                  *["-"] * len(pairs)])
    return lines


def _failed(values: dict[str, float | None]) -> str:
    """Failed requests over the server workloads; "-" for a system that ran none (transformers)."""
    counts = [values[key] for w in SERVER_WORKLOADS if (key := f"{w}.failed") in values]
    return str(int(sum(v or 0 for v in counts))) if counts else "-"


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}"


def markdown(lines: Sequence[Sequence[str]]) -> str:
    """The table with its metric and verdict columns left-aligned and the numbers right-aligned."""
    return markdown_table(lines, "ll" + "r" * (len(lines[0]) - 2))


def engine_flags(args: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """An iterserve variant's `serve` flags as (dtype, other EngineConfig fields that differ from
    the defaults), for the in-process engine; server-only flags are ignored."""
    from iterserve.engine_args import add_engine_args
    from iterserve.config import EngineConfig

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    given, default = vars(parser.parse_known_args(list(args))[0]), vars(parser.parse_args([]))
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "dtype"}
    changed = {k: v for k, v in given.items() if k in fields and v != default[k]}
    return given["dtype"], changed


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default=",".join(KINDS),
                    help=f"systems in run order, from {','.join(KINDS)} (default: all; ones not installed "
                    "are skipped)")
    ap.add_argument("--iterserve-args", action="append", metavar="'FLAGS'",
                    help="iterserve serve flags, e.g. '--dtype bfloat16'; repeat for more iterserve columns")
    ap.add_argument("--model", default="smollm2-135m", help="iterserve's model (the peers serve their own copy)")
    ap.add_argument("--quick", action="store_true", help="few, short requests: a smoke test")
    ap.add_argument("--rate", type=float, help="Poisson arrival rate, req/s (default 2)")
    ap.add_argument("--poisson-requests", type=int, help="Poisson requests (default 60, quick 8)")
    ap.add_argument("--single-requests", type=int, help="sequential single-stream requests (default 5, quick 2)")
    ap.add_argument("--seed", type=int, help="workload seed (default 0)")
    ap.add_argument("--offline", action="store_true",
                    help="also run offline_vs_hf.py's comparison against transformers (slow: ~10 min)")
    ap.add_argument("--vllm-bench", action="store_true",
                    help="also run vLLM's `vllm bench serve` client ($PEERS/vvenv) against each server "
                         "(random 128/64 at 4 req/s and prefill-heavy 1024/16 at 1 req/s; "
                         "--quick: 4 short requests and 2 of 1024 in / 4 out)")
    ap.add_argument("--offline-requests", type=int, help="offline requests (default 64, quick 4)")
    ap.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR,
                    help="the peer scripts (default: ../shared/peers from the repo root)")
    ap.add_argument("--startup-timeout", type=float, default=900.0,
                    help="seconds a system may take to answer /health (vLLM needs ~100-140)")
    ap.add_argument("--log-dir", type=Path, help="iterserve server logs (default: logs/ in --raw-dir)")
    ap.add_argument("--out", type=Path, default=Path("results/vs_peers.json"),
                    help="the summary: table, metrics, plan, host, commit, command (default %(default)s)")
    ap.add_argument("--raw-dir", type=Path, help="the full report with every request's record goes to "
                    "vs_peers.json here (default: a new folder under runs/)")
    args = ap.parse_args(argv)
    try:
        args.systems = systems_from_args(args.peers, args.iterserve_args)
    except ValueError as e:
        ap.error(str(e))
    return args


@dataclass
class Report:
    plan: Plan
    systems: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    offline: dict[str, Any] | None = None
    interrupted: bool = False


def values_of(report: Report) -> dict[str, dict[str, float | None]]:
    values = {label: flat_metrics(r["workloads"]) for label, r in report.systems.items()}
    for label, run in (report.offline or {}).items():
        if isinstance(run, dict) and "output_tok_s" in run:
            values.setdefault(label, {})["offline.output_tok_s"] = run["output_tok_s"]
    return values


def report_table(report: Report, systems: Sequence[System]) -> list[list[str]]:
    """The table of what ran: iterserve columns first, then the peers (and transformers)."""
    values = values_of(report)
    kinds = {s.label: s.kind for s in systems}
    ours = [label for label in values if kinds.get(label) == "iterserve"]
    theirs = [label for label in values if kinds.get(label) != "iterserve"]
    return build_table(table_rows(report.plan, report.offline is not None), values, ours, theirs)


RAW_KEYS = ("records", "decode_tok_s_each", "ttft_ms_each")  # per-request lists: raw report only


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """The report without its per-request records: what goes to --out (and into git)."""
    systems = {label: {**run, "workloads": {name: {k: v for k, v in w.items() if k not in RAW_KEYS}
                                            for name, w in run["workloads"].items()}}
               for label, run in result["systems"].items()}
    return {**result, "systems": systems}


def notes(report: Report) -> list[str]:
    """Skipped systems and workloads with errors, failures or outputs shorter than asked."""
    lines = [f"skipped {label}: {reason}" for label, reason in report.skipped.items()]
    for label, r in report.systems.items():
        for name, w in r["workloads"].items():
            if w.get("error") or w.get("failed") or w.get("short_outputs"):
                lines.append(f"warning {label} {name}: {w.get('error') or ''} failed {w.get('failed', 0)}, "
                             f"short outputs {w.get('short_outputs', 0)} {w.get('errors') or ''}")
    return lines
