"""`iterserve profile`, `iterserve simulate`, `iterserve plan`: capacity answers in seconds.

profile  times real engine steps on this machine (or builds a labelled roofline estimate for a GPU
         not at hand) and saves a step-time model as JSON.
simulate replays a workload or trace through the engine's real scheduler and block pool, with the
         forward pass replaced by the profile's step model; writes `bench serve`'s result JSON.
plan     finds the fewest replicas (and their max-num-seqs) that meet SLOs at a given rate.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import resource
import sys
import time
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from iterserve.bench.client import ClientError, parse_slo, print_table
from iterserve.bench.conversation import ConversationFraming, ConversationOptions, conversation_framing
from iterserve.bench.compare import write_report
from iterserve.bench.report import MODES, ModeRun, direction_notes, saturation_summary
from iterserve.bench.tune import parse_int_list, slo_met
from iterserve.bench.common import one_line
from iterserve.bench.sketch import DEFAULT_RELATIVE_ERROR
from iterserve.bench.streaming_result import StreamingResult
from iterserve.bench.workload import (RequestSpec, Workload, WorkloadError, add_workload_args, describe_workload,
                                      workload_stream_from_args)
from iterserve.config import EngineConfig
from iterserve.engine_args import add_engine_args, engine_config_from_args, engine_flags_from_args
from iterserve.sim.analytic import GPUS, MODEL_SHAPES, analytic_profile
from iterserve.sim.profile import Profile
from iterserve.routing import POLICIES
from iterserve.sim.step_model import errors_line

if TYPE_CHECKING:
    from iterserve.sim.simulator import SimRun

# what an adapter row adds to a step (sim/lora.py): SmolLM2-135M, rank 16, 16-row decode steps on Zen 5
# (docs/server.md's LoRA section); another model or host: measure with benchmarks/lora_throughput.py
LORA_TOKEN_COST_US = 20.0
LORA_ADAPTER_COST_US = 1500.0
RECORDS_LIMIT = 200_000  # above this many requests, results keep no per-step or per-token detail, and
# `simulate` keeps a streaming summary instead of per-request records (unless --compare-out, which plots them)


# ---------------------------------------------------------------- profile

def cmd_profile(args: argparse.Namespace) -> int:
    if args.calibrate and (args.analytic or not args.server_overhead):
        raise ValueError("--calibrate refits on a server's own steps: it needs --server-overhead (and no --analytic)")
    if args.analytic:
        if args.gpu is None:
            raise ValueError("--analytic needs --gpu (one of " + ", ".join(GPUS) + ")")
        prof = analytic_profile(args.gpu, args.model_shape or args.model or "llama-2-7b",
                                gpu_memory_utilization=args.gpu_memory_utilization,
                                flops_efficiency=args.flops_efficiency,
                                bandwidth_efficiency=args.bandwidth_efficiency,
                                overhead_s=args.overhead_ms / 1e3)
    else:
        from iterserve.sim.measure import ProfileGrid, measure_profile  # loads torch and the model

        grid = ProfileGrid()
        if args.quick:
            grid = ProfileGrid(decode_batches=[1, 4, 16], context_lens=[128, 512], prefill_chunks=[32, 256],
                               mixed_decode=[4], mixed_chunks=[64], later_chunks=[64])
        config = engine_config_from_args(args, model=args.model or "smollm2-135m")
        prof = measure_profile(config, grid, args.repeats, progress=not args.no_progress)
        if args.server_overhead:
            from iterserve.model.loader import load_tokenizer, resolve_model  # the tokenizer, only here
            from iterserve.sim.measure_server import measure_server_overhead

            print("profile: measuring the server's overhead (a server with the same engine flags)", file=sys.stderr)
            prof.server_overhead, prof.in_service_samples = measure_server_overhead(
                config.model, engine_flags_from_args(args), load_tokenizer(resolve_model(config.model)),
                config.max_seqs_per_step,
                max_prompt=config.max_input_len, max_output=config.max_output_len, moe=prof.moe)
            print("profile: the grid's step model on the server's own steps: " + in_service_line(prof), file=sys.stderr)
            if args.calibrate:
                prof = prof.calibrated()
                print("profile: --calibrate: refitted on the grid and the server's steps together; on the server's "
                      "steps now: " + in_service_line(prof), file=sys.stderr)
    prof.save(args.out)
    print(prof.describe())
    if prof.moe is not None:
        print(f"experts: {prof.moe.describe()}")
    if prof.fit:
        print(f"fit over {prof.fit['points']} steps: mean |error| {prof.fit['mean_abs_rel_err']:.1%}, "
              f"max {prof.fit['max_abs_rel_err']:.1%}")
    if prof.server_overhead is not None:
        oh = prof.server_overhead
        print(f"server overhead: gap {oh.gap_s[0] * 1e3:.2f} ms + {oh.gap_s[1] * 1e3:.3f} ms/seq after each step, "
              f"{oh.admit_s * 1e3:.2f} ms per admission, arrival {oh.arrival_s[0] * 1e3:.1f} ms + "
              f"{oh.arrival_s[1] * 1e6:.2f} us/prompt token, first token +{oh.first_token_s * 1e3:.1f} ms, "
              f"finish +{oh.finish_s * 1e3:.1f} ms")
    if prof.note:
        print(prof.note)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def in_service_line(prof: Profile) -> str:
    return errors_line(prof.in_service_errors()) or "no steps recorded"


def add_profile_parser(sub: Any) -> None:
    p = sub.add_parser("profile", help="measure (or estimate) step times and fit a step-time model for simulate",
                       description="Times real engine steps over a grid of decode batch sizes, KV context "
                                   "lengths, prefill chunk sizes, mixed steps and decode rows sharing prefix-cached "
                                   "blocks, and fits t = c0 + c_seq*seqs + c_tok*tokens + c_pre*prefill_tokens + "
                                   "c_dkv*distinct decode KV + c_shared*shared decode KV + c_pkv*prefill_kv + "
                                   "c_pcached*cached-context prefill KV + the engine's weight cut-over steps "
                                   "(non-negative least squares on relative error; docs/benchmarks/simulator.md has "
                                   "the terms). --analytic instead builds a roofline estimate from a GPU's published "
                                   "peaks and the model's shape.")
    p.add_argument("model", nargs="?", default=None,
                   help="model to time (a .gguf, a Hugging Face folder, or smollm2-135m, the default); "
                        "with --analytic, a known shape name")
    p.add_argument("--out", default="profile.json", help="where to write the profile (default profile.json)")
    p.add_argument("--repeats", type=int, default=5,
                   help="passes over the grid, each timing every shape once in its own order; the median per shape "
                        "is kept (default 5: passes spread a shared machine's slow stretches over all shapes)")
    p.add_argument("--quick", action="store_true", help="a small grid (a smoke test, not a calibration)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--server-overhead", action="store_true",
                   help="also start a server with the same engine flags and fit what it costs besides the forward "
                        "passes (the gap between steps, per-request arrival / first-token / finish delays; about "
                        "a minute): the simulator charges these, which matters most for small models")
    p.add_argument("--calibrate", action="store_true",
                   help="with --server-overhead: fit the step model on the grid's steps and the server's own steps "
                        "together (steps taken in service, with the HTTP front end and the load client on the same "
                        "cores, can be slower than the grid's isolated repeats). The fit's error on the server's steps "
                        "is printed either way")
    a = p.add_argument_group("analytic (an estimate for hardware not at hand)")
    a.add_argument("--analytic", action="store_true", help="roofline estimate instead of measuring")
    a.add_argument("--gpu", choices=sorted(GPUS), help="the GPU's published peaks")
    a.add_argument("--model-shape", help=f"{', '.join(MODEL_SHAPES)}, or a config.json")
    a.add_argument("--flops-efficiency", type=float, default=0.5, help="share of peak FLOP/s reached (default 0.5)")
    a.add_argument("--bandwidth-efficiency", type=float, default=0.7,
                   help="share of peak memory bandwidth reached (default 0.7)")
    a.add_argument("--overhead-ms", type=float, default=2.0, help="fixed cost per step (default 2 ms)")
    add_engine_args(p)
    p.set_defaults(func=cmd_profile)


# ---------------------------------------------------------------- simulate

def sim_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    k = getattr(args, "spec_tokens", None)
    if k is not None and "speculative_config" not in overrides:  # --spec-tokens: k of the config (ngram by default)
        base = dict(getattr(args, "speculative_config", None) or {}) if not isinstance(
            getattr(args, "speculative_config", None), str) else json.loads(args.speculative_config)
        overrides["speculative_config"] = {**base, "num_speculative_tokens": k} if k else None
    return engine_config_from_args(args, model=getattr(args, "model", None) or "simulated", **overrides)


def spec_acceptance(args: argparse.Namespace) -> float | None:
    """--spec-acceptance, or alpha measured from a saved /v1/scheduler answer (--spec-from): its
    `speculative` totals' acceptance rate inverted at their drafts per verify row."""
    from iterserve.sim.speculative import alpha_from_totals

    alpha, path = getattr(args, "spec_acceptance", None), getattr(args, "spec_from", None)
    if path is None:
        return alpha
    if alpha is not None:
        raise ValueError("give --spec-acceptance or --spec-from, not both")
    data = json.loads(Path(path).read_text())
    totals = data.get("speculative") or {}
    alpha = alpha_from_totals(int(totals.get("num_drafts") or 0), int(totals.get("draft_tokens") or 0),
                              int(totals.get("accepted_tokens") or 0))
    if alpha is None:
        raise ValueError(f"{path}: no speculative totals with drafts (save a /v1/scheduler answer of a server that "
                         "ran with --speculative-config)")
    print(f"simulate: acceptance {alpha:.3f} per draft token, from {path}'s measured rate "
          f"{totals['accepted_tokens'] / totals['draft_tokens']:.1%} at "
          f"{totals['draft_tokens'] / totals['num_drafts']:.2f} drafts per verify row", file=sys.stderr)
    return alpha


def prompt_framing(model: str) -> ConversationFraming:
    """The multi-turn prompts' framing tokens, counted with `model`'s tokenizer where it is a model
    this machine has (a measured profile names one), else by the word estimate."""
    from iterserve.model.loader import ModelNotFound, load_tokenizer, resolve_model  # only for multi-turn

    tokenizer = None
    if model:
        try:
            tokenizer = load_tokenizer(resolve_model(model))
        except (ModelNotFound, OSError, ValueError):
            pass
    framing = conversation_framing(tokenizer)
    how = f"counted with {model}'s tokenizer" if tokenizer is not None else "estimated from words"
    print(f"simulate: multi-turn prompts framed by {framing.system} / {framing.user} / {framing.answer} tokens around "
          f"the system prompt / each user message / each answer ({how})", file=sys.stderr)
    return framing


def sim_workload(args: argparse.Namespace, model: str = "") -> tuple[Workload | Sequence[RequestSpec], list]:
    """(requests, conversations): the multi-turn workload is conversations (their prompts framed as
    `model`'s tokenizer counts the real ones), every other a lazy request workload (drawn as the
    simulation reaches it; see `bench.workload.Workload`)."""
    from iterserve.sim.simulator import conversation_plans  # loads torch (through Request): not at --help time

    params = describe_workload(args)
    if params.pop("kind") == "multi-turn":
        return [], conversation_plans(ConversationOptions(**params), prompt_framing(model))
    return workload_stream_from_args(args), []


def lora_policy(args: argparse.Namespace):
    """--lora-adapters N (and its costs), or None."""
    n = getattr(args, "lora_adapters", None)
    if not n:
        return None
    from iterserve.sim.lora import LoRAPolicy
    return LoRAPolicy(n, args.lora_fraction, args.lora_token_cost_us * 1e-6, args.lora_adapter_cost_us * 1e-6)


def run_sim(args: argparse.Namespace, profile: Profile, specs: Workload | Sequence[RequestSpec], config: EngineConfig,
            replicas: int | None = None, slos: list | None = None, conversations: list | None = None,
            records: bool = False) -> SimRun:
    """records: keep every request's record even above RECORDS_LIMIT (compare's plots read them)."""
    from iterserve.sim.simulator import simulate  # loads torch (through Request): not at --help time

    big = len(specs) > RECORDS_LIMIT
    streaming = getattr(args, "streaming_summary", False) or (big and not records)
    run = simulate(specs, config, profile, replicas or args.replicas, args.router, keep_steps=not (big or streaming),
                   keep_itl=not big, slos=slos or [], sample_replicas=getattr(args, "sample_replicas", None),
                   conversations=conversations or [], streaming_summary=streaming,
                   spec_acceptance=spec_acceptance(args) if config.speculative_config is not None else None,
                   spec_draft_fraction=getattr(args, "spec_draft_fraction", 1.0), lora=lora_policy(args))
    engine = {**config.__dict__, "speculative_config": dataclasses.asdict(config.speculative_config)
              if config.speculative_config is not None else None}
    run.result.meta.update(workload=describe_workload(args), engine=engine, profile=profile.describe(),
                           estimate=profile.estimate)
    if run.stats.get("speculative"):  # what `bench serve` reads off a real server's counters
        run.result.meta["spec_decode"] = run.stats["speculative"]
    return run


def _speed_line(run: SimRun, cpu_s: float | None = None, wall_s: float | None = None) -> str:
    """How fast the simulation ran: requests simulated, wall and CPU time (of the simulation, and of
    the whole command when given), peak RSS of the process."""
    s = run.stats
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    return (f"simulate: {s['requests']} requests of {s['offered_requests']} offered"
            + (f" ({s['simulated_replicas']} of {s['replicas']} replicas)" if s['simulated_replicas'] < s['replicas']
               else "") + f", {s['steps']} steps, {s['simulated_s']:.1f} s simulated in "
            f"{s['wall_s']:.2f} s wall ({s['speedup']:.0f}x real time, {s['requests_per_wall_s']:.0f} req/s, "
            f"{s['steps'] / max(s['wall_s'], 1e-9):.0f} steps/s); busy "
            + ", ".join(f"{b:.0%}" for b in s["busy_fraction"][:8])
            + (" ..." if len(s["busy_fraction"]) > 8 else "")
            + (f"; command: {wall_s:.2f} s wall, {cpu_s:.2f} s CPU (imports, workload, simulation, report)"
               if cpu_s is not None and wall_s is not None else "")
            + f"; peak RSS {peak_rss_mb:.0f} MB"
            + ("; per-request records not kept (streaming summary)" if isinstance(run.result, StreamingResult) else ""))


def cmd_simulate(args: argparse.Namespace) -> int:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    try:
        profile = Profile.load(args.profile)
        slos = [parse_slo(t) for t in args.slo]
        specs, conversations = sim_workload(args, profile.model)
        if args.compare_out:
            if conversations:
                raise WorkloadError("--compare-out needs a request list; multi-turn is conversations")
            if args.streaming_summary:
                raise WorkloadError("--compare-out plots every request's record: drop --streaming-summary")
            runs = {}
            at_once = [dataclasses.replace(s, arrival_s=0.0) for s in specs]
            for mode in MODES:
                cfg = sim_config(args, batching=mode)
                run = run_sim(args, profile, specs, cfg, slos=slos, records=True)
                print(_speed_line(run), file=sys.stderr)
                sat = run_sim(args, profile, at_once, cfg, records=True)
                runs[mode] = ModeRun(mode, run.result.to_dict(), run.timelines[0], [f"--batching {mode}"],
                                     saturation_summary(sat.result.to_dict(), sat.timelines[0]))
            meta = {"simulated": True, "profile": profile.describe(), "estimate": profile.estimate,
                    "workload": describe_workload(args)}
            print(write_report(runs, Path(args.compare_out), 2.0, meta))
            for note in direction_notes(runs["static"].metrics(), runs["continuous"].metrics()):
                print(f"- {note}")
            return 0
        run = run_sim(args, profile, specs, sim_config(args), slos=slos, conversations=conversations)
    except (WorkloadError, ClientError) as e:
        raise ValueError(one_line(e)) from None
    result = run.result
    result.base_url = f"simulated ({profile.describe()})"
    print_table(result)
    if args.result_json:
        path = Path(args.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = result.to_dict()
        if args.steps:
            data["timelines"] = [t.to_dict() for t in run.timelines]
        path.write_text(json.dumps(data, indent=1))
    print(_speed_line(run, time.process_time() - cpu0, time.perf_counter() - wall0), file=sys.stderr)
    return 0 if result.completed else 1


def _sim_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, metavar="P.json", help="a step profile from `iterserve profile`")
    p.add_argument("--replicas", type=int, default=1, help="independent engines behind the router (default 1)")
    p.add_argument("--router", choices=list(POLICIES), default="round-robin",
                   help="how arrivals are spread over replicas, by the policy `serve --replicas` routes with "
                        "(iterserve/routing.py; prefix is the deployment's default, with its default thresholds); "
                        "default round-robin")
    p.add_argument("--slo", action="extend", nargs="+", default=[], metavar="SPEC",
                   help="e.g. ttft=500ms e2e_p95=2s; goodput counts requests meeting all")
    s = p.add_argument_group("speculative decoding (sim/speculative.py)")
    s.add_argument("--spec-tokens", type=int, default=None, metavar="K",
                   help="drafts per verify row (0: off); the method is --speculative-config's, else ngram")
    s.add_argument("--spec-acceptance", type=float, default=None, metavar="ALPHA",
                   help="probability that each next draft token is accepted (0..1): needed with speculation")
    s.add_argument("--spec-from", metavar="SCHEDULER.json",
                   help="measure ALPHA from a saved /v1/scheduler answer's speculative totals instead")
    s.add_argument("--spec-draft-fraction", type=float, default=1.0, metavar="F",
                   help="share of decode rows that draft at all (prompt lookup misses some; default 1)")
    lo = p.add_argument_group("LoRA adapters (sim/lora.py)")
    lo.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                    help="spread the requests over N adapters (0: none), resident in --max-loras slots by the "
                         "engine's rule: a request whose adapter has no slot waits")
    lo.add_argument("--lora-fraction", type=float, default=1.0, metavar="F",
                    help="share of requests that carry an adapter (default 1; the rest use the base model)")
    lo.add_argument("--lora-token-cost-us", type=float, default=LORA_TOKEN_COST_US, metavar="US",
                    help="microseconds an adapter row adds to a step per token (default: SmolLM2, rank 16, "
                         "measured on Zen 5: docs/server.md; benchmarks/lora_throughput.py prints a host's)")
    lo.add_argument("--lora-adapter-cost-us", type=float, default=LORA_ADAPTER_COST_US, metavar="US",
                    help="microseconds each distinct adapter in a step adds (default: as above)")
    add_engine_args(p)
    add_workload_args(p)


def add_simulate_parser(sub: Any) -> None:
    p = sub.add_parser("simulate", conflict_handler="resolve",
                       help="replay a workload through the real scheduler with a fitted step-time model",
                       description="Discrete-event simulation of the engine: the real Scheduler / "
                                   "StaticScheduler and BlockPool decide every step; the profile's step model "
                                   "says how long it takes. Same workload and engine flags as bench and serve; "
                                   "--result-json writes bench serve's JSON, --compare-out compare's report.")
    _sim_args(p)
    p.add_argument("--sample-replicas", type=int, default=None, metavar="K",
                   help="with --replicas N and round-robin: simulate only K of them, exactly, with the "
                        "requests round-robin sends them (the cost is per simulated request)")
    p.add_argument("--streaming-summary", action="store_true",
                   help=f"keep no per-request record: counts and means exact, percentiles from quantile sketches "
                        f"within {DEFAULT_RELATIVE_ERROR * 100:g}%% (relative), memory bounded however many requests "
                        f"(automatic above {RECORDS_LIMIT:,} requests)")
    p.add_argument("--result-json", metavar="PATH",
                   help="write bench serve's summary and every request here (no requests with a streaming summary)")
    p.add_argument("--steps", action="store_true", help="with --result-json: add each replica's step records")
    p.add_argument("--compare-out", metavar="DIR",
                   help="simulate static and continuous batching and write compare's table, JSON and plots")
    p.set_defaults(func=cmd_simulate)


# ---------------------------------------------------------------- plan

def rate_specs(args: argparse.Namespace, rate: float) -> Workload | Sequence[RequestSpec]:
    """The workload offered at `rate` req/s on average (a trace is time-scaled to it)."""
    ns = copy.copy(args)
    if (ns.workload or ("trace" if ns.trace else "poisson")) == "trace":
        ns.time_scale = 1.0
        base = workload_stream_from_args(ns)
        span = max(s.arrival_s for s in base)
        natural = (len(base) - 1) / span if span > 0 else rate
        ns.time_scale = natural / rate
    else:
        ns.rate = rate
    return workload_stream_from_args(ns)


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        profile = Profile.load(args.profile)
        slos = [parse_slo(t) for t in (args.slo or ["e2e_p95=2s"])]
        target = args.target_rate * (1.0 + args.margin)
        specs = rate_specs(args, target)
    except (WorkloadError, ClientError) as e:
        raise ValueError(one_line(e)) from None
    rows = []
    print(f"plan: {len(specs)} requests at {target:.3g} req/s ({args.target_rate:g} + {args.margin:.0%} margin), "
          f"SLO {' '.join(s.text for s in slos)}; {profile.describe()}", file=sys.stderr)
    for seqs in args.seqs_grid:
        cfg = sim_config(args, max_num_seqs=seqs)
        ok = lambda n: slo_met(run_sim(args, profile, specs, cfg, n, slos).result)  # noqa: E731
        lo, hi = 0, 1
        while not ok(hi):  # doubling, then bisection: O(log N) simulations
            lo, hi = hi, hi * 2
            if hi > args.max_replicas:
                hi = None
                break
        if hi is not None:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        rows.append((seqs, hi))
        print(f"plan: max-num-seqs {seqs}: " + (f"{hi} replicas" if hi else f"> {args.max_replicas} replicas"),
              file=sys.stderr)
    feasible = [(n, seqs) for seqs, n in rows if n]
    if not feasible:
        print(f"no configuration met the SLO with up to {args.max_replicas} replicas")
        return 1
    n, seqs = min(feasible)
    best = run_sim(args, profile, specs, sim_config(args, max_num_seqs=seqs), n, slos)
    at_rate = run_sim(args, profile, rate_specs(args, args.target_rate), sim_config(args, max_num_seqs=seqs), n, slos)
    print(f"| max-num-seqs | replicas needed at {target:.3g} req/s |\n|---:|---:|")
    for seqs_i, n_i in rows:
        print(f"| {seqs_i} | {n_i if n_i else '> ' + str(args.max_replicas)} |")
    print(f"\nplan: {n} replicas x max-num-seqs {seqs} ({args.router}) meet "
          f"{' '.join(s.text for s in slos)} at {target:.3g} req/s ({args.margin:.0%} above the target "
          f"{args.target_rate:g} req/s).")
    for label, run in (("at target + margin", best), ("at the target", at_rate)):
        s = run.result.summary()
        slo_text = "; ".join(f"{r['slo']} run value {r.get('run_value_ms') or 0:.0f} ms"
                             if "run_value_ms" in r else f"{r['slo']} met by {r['requests_met']}/{s['completed']}"
                             for r in s["slos"])
        print(f"  {label}: e2e p95 {s['e2e_ms']['p95'] or 0:.0f} ms, TTFT p95 {s['ttft_ms']['p95'] or 0:.0f} ms, "
              f"busy {sum(run.stats['busy_fraction']) / n:.0%} per replica; {slo_text}")
    if n > 1:
        fewer = run_sim(args, profile, specs, sim_config(args, max_num_seqs=seqs), n - 1, slos).result.summary()
        print(f"  with {n - 1} replicas: e2e p95 {fewer['e2e_ms']['p95'] or 0:.0f} ms (SLO missed)")
    if profile.estimate:
        print(f"  note: {profile.note}")
    return 0


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", conflict_handler="resolve",
                       help="fewest replicas (and their max-num-seqs) meeting SLOs at a rate, by simulation",
                       description="For each max-num-seqs, finds by simulation the fewest replicas behind the "
                                   "router that meet every SLO with the workload (or trace, time-scaled) offered "
                                   "at --target-rate x (1 + --margin).")
    _sim_args(p)
    p.add_argument("--target-rate", type=float, required=True, metavar="R", help="requests/s to plan for")
    p.add_argument("--margin", type=float, default=0.2, help="plan for this much more traffic (default 0.2)")
    p.add_argument("--seqs-grid", type=parse_int_list, default=[8, 16, 32, 64], metavar="N,N,...",
                   help="max-num-seqs values to try (default 8,16,32,64)")
    p.add_argument("--max-replicas", type=int, default=256, help="give up above this many (default 256)")
    p.set_defaults(func=cmd_plan, router="least-loaded")


def add_parser(sub: Any) -> None:
    add_profile_parser(sub)
    add_simulate_parser(sub)
    add_plan_parser(sub)
