"""`iterserve compare`: static vs continuous batching, same model, same traffic, side by side.

Starts `iterserve serve` twice on the model (continuous batching with --max-num-seqs 16 and static
batching with --max-batch-size 8; every other engine flag the same). First each server's capacity
is measured at saturation (the workload's requests all sent at once); then the identical workload
is replayed against each at one offered load while the engine's step records are polled. It prints
the table of the chat bot case in docs/seed-case.md (utilisation, mean / p95 latency and queue
time at the offered load; capacity at saturation; the change), says why wherever a row goes
against the case's direction, and writes under --out a summary, compare.json (the table, its
numbers, the workload, the capacities, host, commit and command), and PNG plots: utilisation and batch size
over time, latency CDFs, queue time by arrival, KV usage. The raw records, static.json and
continuous.json (every request and every engine step), and the server logs go to --raw-dir (a new
folder under runs/ by default), from which --replot redraws the report.

The default workload is bursty Poisson traffic shaped like the chat bot case's (docs/seed-case.md):
a base rate with bursts at 6x it, its average rate set to --load (default 0.5) of static batching's
measured capacity, as the case's 3.3 req/s were of its static server's 6.7: neither mode is
saturated on average, both are during the bursts, and no row sets a saturated run against an
unsaturated one. On the embedded model and a 2-core CPU the whole command takes a few minutes.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Sequence

import httpx

from iterserve.bench.client import ClientError, RunResult, run_load
from iterserve.bench.html_report import render_html_report
from iterserve.bench.launcher import ServerProcess
from iterserve.bench.common import load_average, one_line
from iterserve.bench.report import (MODES, ModeRun, comparison, direction_notes, markdown_table,
                                    saturation_summary, write_plots)
from iterserve.bench.summary import default_raw_dir, run_info, write_json
from iterserve.bench.timeline import SchedulerPoller, Timeline
from iterserve.bench.workload import (RequestSpec, add_workload_args, build_prompts, describe_workload,
                                      workload_from_args)
from iterserve.config import EngineConfig

# The default traffic: the chat bot case's shape (docs/seed-case.md; a base Poisson rate with bursts
# to 6x it, see seed_shape) at an average rate of --load x static batching's capacity measured at
# saturation, as in the case (3.3 req/s offered to a 6.7 req/s static server). Lengths are within the case's limits (input <= 1024, output <= 256) but short, because a
# CPU prefills slowly and a few minutes must hold several bursts; outputs vary widely, as chat
# answers do, which is what a static batch pays for in padding.
WORKLOAD_DEFAULTS: dict[str, Any] = dict(
    rate=None, peak_rate=None, burst_every=None, burst_len=None, time_scale=None, num_requests=36,
    input_len=(16, 64), output_len=(8, 96), max_input_len=1024, max_output_len=256,
)
DEFAULT_LOAD = 0.5  # docs/seed-case.md: 3.3 req/s offered, 6.7 req/s static capacity
SEED_PEAK_OVER_BASE = 6.0  # docs/seed-case.md: 300 ms mean gap (3.3 req/s), peaks of 20 req/s
BURST_DUTY = 0.2  # share of the time in bursts
BURST_CYCLES = 3  # bursts in a default run
RATED_WORKLOADS = ("poisson", "gamma", "bursty", "constant")
WARMUP_REQUESTS = 2


def server_flags(mode: str, args: argparse.Namespace) -> list[str]:
    """Engine flags for one mode: only the batching differs; limits and --server-args are shared."""
    common = ["--max-input-len", str(args.max_input_len), "--max-output-len", str(args.max_output_len),
              *shlex.split(args.server_args)]
    if mode == "static":
        return ["--batching", "static", "--max-batch-size", str(args.max_batch_size),
                "--batch-timeout", f"{args.batch_timeout:g}", *common]
    return ["--batching", "continuous", "--max-num-seqs", str(args.max_num_seqs), *common]


async def current_step(base_url: str) -> int:
    """The server's step counter now: a replay's step records are the ones after it."""
    async with httpx.AsyncClient() as http:
        try:
            resp = await http.get(base_url.rstrip("/") + "/v1/scheduler", timeout=30.0)
            resp.raise_for_status()
            return int(resp.json()["step"])
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise ClientError(f"{base_url} has no iterserve /v1/scheduler ({one_line(e)}): "
                              "compare needs iterserve servers") from None


async def replay(base_url: str, specs: Sequence[RequestSpec], timeout_s: float | None = None,
                 progress: bool = True, warmup: bool = True) -> tuple[RunResult, Timeline]:
    """Warm up, then replay `specs` while polling the engine's step records."""
    if warmup:
        warm = [RequestSpec(i, 0.0, 8, 4, specs[i % len(specs)].prompt) for i in range(WARMUP_REQUESTS)]
        await run_load(base_url, warm, progress=False)
    start_step = await current_step(base_url)
    poller = SchedulerPoller(base_url, t0=time.perf_counter(), start_step=start_step)
    stop = asyncio.Event()
    polling = asyncio.create_task(poller.run(stop))
    try:
        result = await run_load(base_url, specs, timeout_s=timeout_s, progress=progress)
    finally:
        stop.set()
        await polling
    return result, poller.result(t0=result.started_at)  # on the load client's clock


# ---------------------------------------------------------------- sizing the default load

def saturation_specs(specs: Sequence[RequestSpec], n: int) -> list[RequestSpec]:
    """`n` requests with the workload's lengths (cycled), all at t=0, each with its own prompt."""
    return [RequestSpec(i, 0.0, specs[i % len(specs)].input_len, specs[i % len(specs)].output_len)
            for i in range(n)]


def saturate(base_url: str, mode: str, burst: Sequence[RequestSpec], args: argparse.Namespace) -> dict[str, Any]:
    """The server's capacity: `burst` all sent at once, so that it runs as full as it can for most
    of the run; what the case's throughput row (6.7 -> 15.2 req/s) can only be."""
    print(f"compare: {mode}: capacity: {len(burst)} requests at once against {base_url}", file=sys.stderr)
    result, timeline = asyncio.run(replay(base_url, burst, args.timeout, progress=False))
    return saturation_summary(result.to_dict(), timeline)


def seed_shape(base_rate: float, num_requests: int) -> dict[str, float]:
    """The chat bot case's burst pattern (docs/seed-case.md) around `base_rate`: bursts at 6x it for
    a fifth of the time, the period set so that the run spans BURST_CYCLES bursts."""
    mean = base_rate * mean_over_base()
    every = num_requests / (BURST_CYCLES * mean)
    return {"peak_rate": SEED_PEAK_OVER_BASE * base_rate, "burst_every": every, "burst_len": BURST_DUTY * every}


def mean_over_base() -> float:
    return 1 - BURST_DUTY + BURST_DUTY * SEED_PEAK_OVER_BASE


def needs_sizing(args: argparse.Namespace) -> bool:
    """No --rate for a synthetic workload, or no --time-scale for a trace: size it by --load."""
    return ((args.workload in RATED_WORKLOADS and args.rate is None)
            or (args.workload == "trace" and args.time_scale is None))


def fill_burst_shape(args: argparse.Namespace) -> None:
    if args.workload == "bursty" and args.rate is not None:
        for key, value in seed_shape(args.rate, args.num_requests).items():
            if getattr(args, key) is None:
                setattr(args, key, value)


def provisional_workload(args: argparse.Namespace) -> list[RequestSpec]:
    """The workload at rate 1 / time scale 1 where those are still to be sized: checks every flag
    and the trace before a server starts, and gives the requests the capacity runs send."""
    ns = copy.copy(args)
    ns.rate = 1.0 if ns.rate is None else ns.rate
    ns.time_scale = 1.0 if ns.time_scale is None else ns.time_scale
    fill_burst_shape(ns)
    return workload_from_args(ns)


def size_load(args: argparse.Namespace, mean_rate: float, provisional: Sequence[RequestSpec]) -> None:
    """Sets --rate (or --time-scale for a trace) so that requests arrive at `mean_rate` on average."""
    if args.workload == "trace":
        span = max(s.arrival_s for s in provisional)
        rate_at_scale_1 = (len(provisional) - 1) / span if span > 0 else mean_rate
        args.time_scale = rate_at_scale_1 / mean_rate
    else:
        args.rate = mean_rate / mean_over_base() if args.workload == "bursty" else mean_rate
    fill_burst_shape(args)


# ---------------------------------------------------------------- running the two servers

@contextlib.contextmanager
def serving(mode: str, args: argparse.Namespace, raw_dir: Path) -> Iterator[str]:
    """The base URL of an iterserve for `mode`: the one given, or one started here."""
    url = getattr(args, f"{mode}_url")
    if url:
        yield url
        return
    flags = server_flags(mode, args)
    srv = ServerProcess([args.model, *flags], log_path=raw_dir / "logs" / f"server-{mode}.log")
    print(f"compare: {mode}: starting iterserve serve {shlex.join([args.model, *flags])}", file=sys.stderr)
    try:
        srv.start()
    except RuntimeError as e:
        raise ClientError(f"{mode} server: {one_line(e)}") from None
    try:
        yield srv.base_url
    finally:
        srv.stop()


def run_mode(mode: str, base_url: str, args: argparse.Namespace, specs: Sequence[RequestSpec]) -> ModeRun:
    load_before = load_average()
    t0 = time.perf_counter()
    print(f"compare: {mode}: replaying {len(specs)} requests (last arrival "
          f"{max(s.arrival_s for s in specs):.0f} s) against {base_url}", file=sys.stderr)
    result, timeline = asyncio.run(replay(base_url, specs, args.timeout, not args.no_progress))
    if timeline.batching and timeline.batching != mode:
        raise ClientError(f"the {mode} server at {base_url} reports batching={timeline.batching!r}")
    flags = server_flags(mode, args)
    result.meta.update(mode=mode, server_flags=flags, wall_s=time.perf_counter() - t0,
                       loadavg_before=load_before, loadavg_after=load_average())
    return ModeRun(mode, result.to_dict(), timeline, flags)


def _tokenizer(model: str) -> Any:
    """The model's tokenizer, for exact prompt lengths; None (~0.75 words/token) if it won't load here."""
    from iterserve.model.loader import load_tokenizer, resolve_model  # torch: import only when needed

    try:
        return load_tokenizer(resolve_model(model))
    except Exception:  # noqa: BLE001 - approximate lengths are still the same for both modes
        return None


def run_both(args: argparse.Namespace, raw_dir: Path, meta: dict[str, Any]) -> dict[str, ModeRun]:
    """Both servers up; each one's capacity first (it sizes the default load), then the identical
    workload at the offered load, continuous first."""
    provisional = provisional_workload(args)
    tokenizer = _tokenizer(args.model)
    burst = saturation_specs(provisional, args.saturation_requests or max(len(provisional), 4 * args.max_num_seqs))
    build_prompts(burst, tokenizer)
    with contextlib.ExitStack() as stack:
        urls = {mode: stack.enter_context(serving(mode, args, raw_dir)) for mode in ("continuous", "static")}
        capacity = {mode: saturate(urls[mode], mode, burst, args) for mode in ("continuous", "static")}
        meta["capacity"] = capacity
        if needs_sizing(args):
            mean_rate = args.load * capacity["static"]["request_throughput"]
            size_load(args, mean_rate, provisional)
            meta["capacity"].update(load=args.load, mean_rate=mean_rate)
            print(f"compare: capacity static {capacity['static']['request_throughput']:.3f}, continuous "
                  f"{capacity['continuous']['request_throughput']:.3f} req/s; offering {mean_rate:.3f} req/s "
                  f"on average (--load {args.load:g} x static's)", file=sys.stderr)
        fill_burst_shape(args)
        specs = workload_from_args(args)
        build_prompts(specs, tokenizer)
        meta.update(workload=describe_workload(args), num_requests=len(specs))
        runs = {mode: run_mode(mode, urls[mode], args, specs) for mode in ("continuous", "static")}
    for mode, run in runs.items():
        run.saturation = capacity[mode]
    return {mode: runs[mode] for mode in MODES}


def write_raw(runs: dict[str, ModeRun], raw_dir: Path) -> None:
    """Every request and engine step of each mode, for --replot and later analysis (not for git)."""
    for mode, run in runs.items():
        write_json(raw_dir / f"{mode}.json", run.to_dict(), compact=True)


def write_report(runs: dict[str, ModeRun], out: Path, window_s: float, meta: dict[str, Any]) -> str:
    """Writes the summary (compare.json), the plots and report.html; returns the table."""
    table = markdown_table(runs["static"], runs["continuous"])
    write_json(out / "compare.json", {**meta, **comparison(runs["static"], runs["continuous"]), "table": table})
    plots = write_plots(runs, out, window_s)
    (out / "report.html").write_text(render_html_report(runs, meta, plots))
    return table


def load_runs(raw_dir: Path) -> dict[str, ModeRun]:
    runs = {}
    for mode in MODES:
        path = raw_dir / f"{mode}.json"
        try:
            runs[mode] = ModeRun.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"cannot read {path}: {one_line(e)}") from None
    return runs


def cmd_compare(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.window <= 0:
        raise ValueError("--window must be > 0")
    if args.replot:
        meta = json.loads((out / "compare.json").read_text()) if (out / "compare.json").exists() else {}
        meta = {k: v for k, v in meta.items() if k not in ("static", "continuous", "rows", "table")}
        raw_dir = Path(args.raw_dir or meta.get("raw_dir") or out)
        runs = load_runs(raw_dir)
    else:
        args.workload = args.workload or ("trace" if args.trace else "bursty")
        if args.load <= 0:
            raise ValueError("--load must be > 0")
        if args.saturation_requests is not None and args.saturation_requests < 1:
            raise ValueError("--saturation-requests must be >= 1")
        provisional_workload(args)  # bad flags or trace files fail now, before any server starts
        if not (args.static_url and args.continuous_url):
            from iterserve.model.loader import resolve_model

            resolve_model(args.model)
        command = ["iterserve", *sys.argv[1:]] if sys.argv[1:2] == ["compare"] else None  # None: called in-process
        raw_dir = Path(args.raw_dir) if args.raw_dir else default_raw_dir("compare")
        meta = {**run_info(command), "model": args.model, "raw_dir": str(raw_dir)}
        try:
            runs = run_both(args, raw_dir, meta)
        except ClientError as e:
            raise ValueError(one_line(e)) from None
        write_raw(runs, raw_dir)
    table = write_report(runs, out, args.window, meta)
    print(table)
    for note in direction_notes(runs["static"].metrics(), runs["continuous"].metrics()):
        print(f"- {note}")
    print(f"compare: wrote {out}/compare.json, the plots and report.html; raw records in {raw_dir}", file=sys.stderr)
    return 0 if all(r.summary["completed"] for r in runs.values()) else 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("compare", help="static vs continuous batching side by side on the same traffic",
                              description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--model", default="smollm2-135m",
                   help="a .gguf file, a Hugging Face folder, or smollm2-135m (default)")
    p.add_argument("--out", default="compare-results", metavar="DIR",
                   help="writes the summary compare.json, the plots and report.html (the table and plots in one page) here")
    p.add_argument("--raw-dir", metavar="DIR",
                   help="writes static.json and continuous.json (every request and engine step) and the server "
                        "logs here (default: a new folder under runs/); with --replot, reads them from here "
                        "(default: the folder compare.json names)")
    p.add_argument("--max-batch-size", type=int, default=8, help="static batching: batch size (default 8)")
    p.add_argument("--batch-timeout", type=float, default=EngineConfig().batch_timeout_ms, metavar="MS",
                   help="static batching: the oldest request's wait before a partial batch starts")
    p.add_argument("--max-num-seqs", type=int, default=16, help="continuous batching: sequences per step (default 16)")
    p.add_argument("--server-args", default="", metavar="'FLAGS'",
                   help="other engine flags for both servers, e.g. '--threads 2 --block-size 32'")
    p.add_argument("--static-url", metavar="URL", help="use this running static iterserve instead of starting one")
    p.add_argument("--continuous-url", metavar="URL", help="use this running continuous iterserve instead")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="bound on each replay (default: last arrival + 600 s)")
    p.add_argument("--window", type=float, default=2.0, metavar="S", help="utilisation window of the plots")
    p.add_argument("--replot", action="store_true", help="redraw the table and plots from --out's JSON files")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--saturation-requests", type=int, default=None, metavar="N",
                   help="requests sent at once to measure each mode's capacity, with the workload's lengths "
                        "(default: the workload's count or 4 x --max-num-seqs, whichever is larger, so that "
                        "the final drain is a small part of the run)")
    p.add_argument("--load", type=float, default=DEFAULT_LOAD,
                   help="without --rate (--time-scale for a trace): offer this share of static batching's capacity, "
                        f"measured at saturation first (default {DEFAULT_LOAD:g}, as in the chat bot case: 3.3 req/s "
                        "offered to a 6.7 req/s static server)")
    add_workload_args(p)
    compare_help = {
        "workload": "arrival process (default: trace when --trace is given, else bursty)",
        "rate": "requests/s; the base rate for bursty (default: sized by --load)",
        "peak_rate": "bursty: rate inside bursts (default: 6x the base rate, as in docs/seed-case.md)",
        "burst_every": f"bursty: a burst starts every S seconds (default: {BURST_CYCLES} bursts per run)",
        "burst_len": f"bursty: each burst lasts S seconds (default: {BURST_DUTY:g} of the period)",
        "time_scale": "trace: arrival = (t - t0) * SCALE (default: sized by --load)",
        "num_requests": f"requests per mode (default {WORKLOAD_DEFAULTS['num_requests']}), or trace rows",
        "input_len": "prompt tokens (default 16:64)", "output_len": "output tokens (default 8:96)",
        "max_input_len": "clamp prompt lengths, and both servers' --max-input-len (default 1024)",
        "max_output_len": "clamp output lengths, and both servers' --max-output-len (default 256)",
    }
    for action in p._actions:
        action.help = compare_help.get(action.dest, action.help)
    p.set_defaults(func=cmd_compare, **WORKLOAD_DEFAULTS)
    return p
