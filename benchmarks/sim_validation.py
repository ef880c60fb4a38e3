"""Validate the capacity simulator: real replays against `iterserve serve` vs simulations of the same
requests, with a step profile fitted beforehand in a separate run (issue 21's error table).

For each workload (the Azure conversation trace, the bursty traffic of docs/seed-case.md, and the multi-turn
workload where the workload module has one), each batching mode (static max_batch_size 8,
continuous max-num-seqs 16) and each load (light, near capacity, overloaded: fractions of the
continuous engine's capacity as the simulator predicts it), this starts a server, replays the
requests while polling its step records, simulates the identical requests with the same engine
flags, and prints measured vs simulated: request throughput (target: within 5%), mean and p95 e2e
latency (10%), TTFT p50 (15%).

Needs a quiet machine: step times measured under other load make both the profile and the replays
noise. One command does it all (about an hour on 2 cores at the defaults):

    .venv/bin/python benchmarks/sim_validation.py --out runs/sim-validation
    .venv/bin/python benchmarks/sim_validation.py --tiny        # smoke run: minutes, numbers meaningless
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from iterserve.bench.compare import replay
from iterserve.bench.conversation import ConversationOptions, build_conversations, run_conversations
from iterserve.bench.launcher import ServerProcess
from iterserve.bench.report import ModeRun
from iterserve.bench.workload import WORKLOADS, RequestSpec, build_prompts, bursty, make_workload, trace
from iterserve.engine_args import add_engine_args, engine_config_from_args
from iterserve.llm import LLM
from iterserve.model.loader import load_tokenizer, resolve_model
from iterserve.sim.profile import Profile
from iterserve.sampling import SamplingParams
from iterserve.sim.simulator import conversation_plans, simulate
from iterserve.sim.step_model import StepFeatures, step_features

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "azure_llm_2023_conv.csv"
MODE_FLAGS = {"static": ["--batching", "static", "--max-batch-size", "8", "--batch-timeout", "100"],
              "continuous": ["--batching", "continuous", "--max-num-seqs", "16"]}
LOADS = {"light": 0.3, "near": 0.9, "over": 1.5}
TARGETS = {"throughput": 0.05, "e2e_mean": 0.10, "e2e_p95": 0.10, "ttft_p50": 0.15}


def workload(kind: str, n: int, rate: float, args: argparse.Namespace) -> list[RequestSpec]:
    """`n` requests of `kind` arriving at `rate` req/s on average, lengths clamped to the limits."""
    lim = dict(max_input_len=args.max_input_len, max_output_len=args.max_output_len)
    if kind == "conversation":
        rows = trace(args.trace, num_requests=n, **lim)
        span = max(s.arrival_s for s in rows) or 1.0
        scale = (len(rows) - 1) / span / rate
        return [dataclasses.replace(s, arrival_s=s.arrival_s * scale) for s in rows]
    if kind == "bursty":  # docs/seed-case.md's shape: bursts at 6x the base for a fifth of the time
        base = rate / 2.0
        every = max(n / (3 * rate), 1.0)
        return bursty(n, base_rate=base, peak_rate=6 * base, burst_every_s=every, burst_len_s=every / 5,
                      seed=args.seed, input_len=(16, 256), output_len=(8, 128), **lim)
    if kind in WORKLOADS and kind != "multi-turn":
        return make_workload(kind, num_requests=n, rate=rate, seed=args.seed, **lim)
    raise SystemExit(f"unknown workload {kind!r}")


# multi-turn: the load is the number of concurrent conversations (closed loop within each)
CONVERSATIONS = {"light": 2, "near": 8, "over": 24}


def conversation_options(load: str, args: argparse.Namespace) -> ConversationOptions:
    return ConversationOptions(num_conversations=CONVERSATIONS[load], turns=2 if args.tiny else 6,
                               system_prompt_len=32 if args.tiny else 400, user_len=(8, 16) if args.tiny else (16, 64),
                               output_len=args.max_output_len, think_time_s=1.0, stagger_s=2.0, seed=args.seed)


def engine_config(flags: list[str], model: str):
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(flags), model=model)


def step_check(model: str, flags: list[str], specs: list[RequestSpec], profile: Profile) -> str:
    """The step model alone, on the real engine's own steps (in process, no HTTP): each step's
    measured runner time against the profile's prediction for the same SchedulerOutput. Tells a
    step-model miss apart from what the simulator leaves out (HTTP, streaming, the engine loop)."""
    llm = LLM(config=engine_config(flags, model))
    runner = llm.engine.runner
    measured: list[tuple[StepFeatures, float]] = []
    execute = runner.execute

    def timed(sched):
        t0 = time.perf_counter()
        out = execute(sched)
        measured.append((step_features(sched), time.perf_counter() - t0))
        return out

    runner.execute = timed
    prompts = [[1 + (s.index * 7 + j) % 1000 for j in range(s.input_len)] for s in specs]
    llm.generate(prompts, [SamplingParams(max_tokens=s.output_len, ignore_eos=True, temperature=0.0) for s in specs],
                 use_tqdm=False)
    kinds: dict[str, list[float]] = {"decode": [], "prefill": [], "mixed": []}
    for f, t in measured:
        kind = "decode" if not f.prefill_tokens else ("prefill" if f.seqs == 1 else "mixed")
        kinds[kind].append((profile.step_model.predict(f) - t) / t)
    parts = [f"{k}: {len(v)} steps, mean error {100 * sum(v) / len(v):+.0f}%, mean |error| "
             f"{100 * sum(abs(x) for x in v) / len(v):.0f}%" for k, v in kinds.items() if v]
    return "step model on the engine's own steps (" + "; ".join(parts) + ")"


def errors(real: dict, sim: dict) -> dict[str, tuple[float | None, float | None]]:
    pick = {"throughput": lambda s: s["request_throughput"], "e2e_mean": lambda s: s["e2e_ms"]["mean"],
            "e2e_p95": lambda s: s["e2e_ms"]["p95"], "ttft_p50": lambda s: s["ttft_ms"]["median"]}
    return {k: (f(real), f(sim)) for k, f in pick.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--profile", type=Path, help="a profile fitted beforehand (default: fit one now, in its own process)")
    p.add_argument("--workloads", default="conversation,bursty,multi-turn")
    p.add_argument("--modes", default="static,continuous")
    p.add_argument("--loads", default="light,near,over")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--server-args", default="", help="engine flags for both the servers and the simulation")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/sim-validation"))
    p.add_argument("--tiny", action="store_true",
                   help="smoke run: 6 requests (2 conversations of 2 turns), one load, quick profile")
    args = p.parse_args()
    if args.tiny:
        args.num_requests, args.loads = 6, "light"
        args.max_input_len, args.max_output_len = 128, 16
    args.out.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.server_args) + ["--max-input-len", str(args.max_input_len),
                                             "--max-output-len", str(args.max_output_len)]
    prof_path = args.profile or args.out / "profile.json"
    if args.profile is None:  # a separate process and run, as a user would fit it
        cmd = [sys.executable, "-m", "iterserve.cli", "profile", args.model, "--out", str(prof_path), *extra]
        subprocess.run(cmd + (["--quick", "--repeats", "1"] if args.tiny else []), check=True)
    profile = Profile.load(prof_path)
    tokenizer = load_tokenizer(resolve_model(args.model))
    rows, raw = [], []
    first = workload(next(k for k in args.workloads.split(",") if k != "multi-turn"), args.num_requests, 1.0, args)
    check = step_check(args.model, MODE_FLAGS["continuous"] + extra, first, profile)
    print(check, file=sys.stderr)
    kinds = [k for k in args.workloads.split(",") if k in ("conversation", "bursty") or k in WORKLOADS]
    skipped = sorted(set(args.workloads.split(",")) - set(kinds))
    if "multi-turn" in kinds:  # conversations, not a request list: sized by their number
        kinds.remove("multi-turn")
        for load in args.loads.split(","):
            opts = conversation_options(load, args)
            for mode in args.modes.split(","):
                flags = MODE_FLAGS[mode] + extra
                with ServerProcess([args.model, *flags], log_path=args.out / f"server-multi-{load}-{mode}.log") as srv:
                    result = asyncio.run(run_conversations(srv.base_url, build_conversations(opts, tokenizer),
                                                           endpoint="completions", progress=False))
                real = result.summary()
                sim = simulate([], engine_config(flags, args.model), profile,
                               conversations=conversation_plans(opts)).result.summary()
                err = errors(real, sim)
                rows.append(("multi-turn", load, mode, err))
                raw.append({"workload": "multi-turn", "load": load, "mode": mode, "conversations": opts.num_conversations,
                            "real": real, "sim": sim, "errors": err})
                print(f"multi-turn {load} {mode}: {real['completed']} / {sim['completed']} turns completed "
                      f"(real / sim), {real['failed']} / {sim['failed']} failed", file=sys.stderr)
    # the continuous engine's capacity, as the simulator predicts it on the lengths of each workload
    for kind in kinds:
        probe = workload(kind, args.num_requests, 1.0, args)
        sat = [dataclasses.replace(s, arrival_s=0.0) for s in probe]
        cap = simulate(sat, engine_config(MODE_FLAGS["continuous"] + extra, args.model), profile
                       ).result.summary()["request_throughput"]
        for load in args.loads.split(","):
            specs = workload(kind, args.num_requests, LOADS[load] * cap, args)
            build_prompts(specs, tokenizer)
            for mode in args.modes.split(","):
                flags = MODE_FLAGS[mode] + extra
                t0 = time.perf_counter()
                with ServerProcess([args.model, *flags], log_path=args.out / f"server-{kind}-{load}-{mode}.log") as srv:
                    result, timeline = asyncio.run(replay(srv.base_url, specs, progress=False))
                real = result.summary()
                sim = simulate(specs, engine_config(flags, args.model), profile).result.summary()
                err = errors(real, sim)
                rows.append((kind, load, mode, err))
                raw.append({"workload": kind, "load": load, "mode": mode, "rate": LOADS[load] * cap,
                            "real": ModeRun(mode, result.to_dict(), timeline).metrics(), "sim": sim,
                            "errors": {k: v for k, v in err.items()}, "wall_s": time.perf_counter() - t0})
                print(f"{kind} {load} {mode}: " + ", ".join(
                    f"{k} {a if a is None else round(a, 3)} vs {b if b is None else round(b, 3)}"
                    for k, (a, b) in err.items()), file=sys.stderr)
    head = "| workload | load | mode | " + " | ".join(f"{k} real / sim / err (target {v:.0%})"
                                                    for k, v in TARGETS.items()) + " |"
    lines = [head, "|" + "---|" * (3 + len(TARGETS))]
    for kind, load, mode, err in rows:
        cells = []
        for k, (real, sim) in err.items():
            if real is None or sim is None or not real:
                cells.append("-")
                continue
            e = (sim - real) / real
            cells.append(f"{real:.3g} / {sim:.3g} / {e:+.0%}{'' if abs(e) <= TARGETS[k] else ' MISS'}")
        lines.append(f"| {kind} | {load} | {mode} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    print(f"\n{check}")
    if skipped:
        print(f"\nskipped (unknown workload): {', '.join(skipped)}")
    (args.out / "validation.json").write_text(json.dumps({"profile": profile.to_dict(), "runs": raw,
                                                          "table": table, "step_check": check}, indent=1))
    print(f"wrote {args.out / 'validation.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
