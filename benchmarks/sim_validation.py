"""Validate the capacity simulator: real replays against `iterserve serve` vs simulations of the same
requests, with a step profile fitted beforehand in a separate run (issue 21's error table).

For each workload (the Azure conversation trace, the bursty traffic of docs/seed-case.md, and the multi-turn
workload where the workload module has one), each batching mode (static max_batch_size 8,
continuous max-num-seqs 16) and each load (light, near capacity, overloaded: fractions of the
continuous engine's capacity as the simulator predicts it), this starts a server, replays the
requests while polling its step records, simulates the identical requests with the same engine
flags, and prints measured vs simulated: request throughput (target: within 5%), mean and p95 e2e
latency (10%), TTFT p50 (15%).

The profile is fitted first, in its own process, with the server-overhead terms
(`iterserve profile --server-overhead`); each run is also simulated without those terms, so the table
says what they bought, with the step model calibrated in service, scaled by anchor steps timed just
before the replay (the host's speed then: a prediction), and scaled by the replay's own steps (post
hoc: what is left of a miss once the host's speed is known is the simulator's own). Each replay gets a fresh server (no prefix cache carried between runs). A run
that fails is recorded as failed and the rest go on; the summary is rewritten after every run.

Needs a quiet machine: step times measured under other load make both the profile and the replays
noise. One command does it all (about 20 minutes on 2 cores at the defaults; it prints its plan,
with the replays' total length, before starting):

    .venv/bin/python benchmarks/sim_validation.py --out runs/sim-validation
    .venv/bin/python benchmarks/sim_validation.py --tiny        # smoke run: every path, numbers meaningless

Writes under --out: summary.md (host line, command, commit, the table with pass/miss per target),
validation.json (every run's measured and simulated summaries), profile.json, the servers' logs.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from iterserve.bench.common import load_average
from iterserve.bench.compare import current_step, replay
from iterserve.bench.conversation import (ConversationOptions, build_conversations, conversation_framing,
                                          run_conversations)
from iterserve.bench.launcher import ServerProcess
from machine import figures_line, machine_figures
from iterserve.bench.summary import git_commit
from iterserve.bench.timeline import SchedulerPoller
from iterserve.bench.report import ModeRun
from iterserve.bench.workload import WORKLOADS, RequestSpec, build_prompts, bursty, make_workload, trace
from iterserve.engine_args import add_engine_args, engine_config_from_args
from iterserve.llm import LLM
from iterserve.model.loader import load_tokenizer, resolve_model
from iterserve.sampling import SamplingParams
from iterserve.sim.measure import StepShape, time_step
from iterserve.sim.profile import Profile
from iterserve.sim.simulator import conversation_plans, simulate
from iterserve.sim.step_model import (LinearStepModel, StepFeatures, errors_by_kind, errors_line, record_features,
                                      step_features)

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
CONVERSATIONS = {"light": 2, "near": 8, "over": 16}
# a conversation's last turn resends its whole history (400 + 3 x (64 + 128) + 64 tokens at most): the
# servers and the simulation accept that much, so no turn is refused on either side
MULTI_TURN_MAX_INPUT = 1536


def conversation_options(load: str, args: argparse.Namespace) -> ConversationOptions:
    return ConversationOptions(num_conversations=CONVERSATIONS[load], turns=2 if args.tiny else 4,
                               system_prompt_len=32 if args.tiny else 400, user_len=(8, 16) if args.tiny else (16, 64),
                               output_len=args.max_output_len, think_time_s=1.0, stagger_s=2.0, seed=args.seed)


async def conversations_polled(base_url: str, convs) -> tuple[dict, list[dict]]:
    """The multi-turn replay while polling the server's step records: (summary, steps)."""
    poller = SchedulerPoller(base_url, start_step=await current_step(base_url))
    stop = asyncio.Event()
    polling = asyncio.create_task(poller.run(stop))
    try:
        result = await run_conversations(base_url, convs, endpoint="completions", progress=False)
    finally:
        stop.set()
        await polling
    return result.summary(), poller.result().steps


def fit_profile(model: str, path: Path, flags: list[str], tiny: bool = False) -> None:
    """`iterserve profile MODEL FLAGS` in a process and run of its own, as a user would fit it,
    written to `path` (tiny: a quick grid, one repeat). Shared with tune_sim_check.py."""
    cmd = [sys.executable, "-m", "iterserve.cli", "profile", model, "--out", str(path), "--no-progress", *flags]
    subprocess.run(cmd + (["--quick", "--repeats", "1"] if tiny else []), check=True,
                   env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})


def engine_config(flags: list[str], model: str):
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(flags), model=model)


def step_check(model: str, flags: list[str], specs: list[RequestSpec], profile: Profile) -> str:
    """The step model alone, on the real engine's own steps (in process, no HTTP): each step's
    measured runner time against the profile's prediction for the same SchedulerOutput. Tells a
    step-model miss apart from what the simulator leaves out (HTTP, streaming, the engine loop)."""
    llm = LLM(config=engine_config(flags, model))
    runner, block_size = llm.engine.runner, llm.engine.config.block_size
    measured: list[tuple[StepFeatures, float]] = []
    execute = runner.execute

    def timed(sched):
        t0 = time.perf_counter()
        out = execute(sched)
        measured.append((step_features(sched, block_size), time.perf_counter() - t0))
        return out

    runner.execute = timed
    prompts = [[1 + (s.index * 7 + j) % 1000 for j in range(s.input_len)] for s in specs]
    llm.generate(prompts, [SamplingParams(max_tokens=s.output_len, ignore_eos=True, temperature=0.0) for s in specs],
                 use_tqdm=False)
    return "step model on the engine's own steps (" + errors_line(errors_by_kind(profile.step_model, measured)) + ")"


def errors(real: dict, sim: dict) -> dict[str, tuple[float | None, float | None]]:
    pick = {"throughput": lambda s: s["request_throughput"], "e2e_mean": lambda s: s["e2e_ms"]["mean"],
            "e2e_p95": lambda s: s["e2e_ms"]["p95"], "ttft_p50": lambda s: s["ttft_ms"]["median"]}
    out = {}
    for k, f in pick.items():
        try:
            out[k] = (f(real), f(sim))
        except (KeyError, TypeError):  # no successful request on one side
            out[k] = (None, None)
    return out


def rel_error(real: float | None, sim: float | None) -> float | None:
    return None if real is None or sim is None or not real else (sim - real) / real


def work(steps: list[dict]) -> dict:
    """What the engine computed in a run (from step records, real or simulated): steps, tokens, busy time."""
    return {"steps": len(steps), "prefill_tokens": sum(int(s["prefill_tokens"]) for s in steps),
            "decode_tokens": sum(int(s["decode_tokens"]) for s in steps),
            "busy_s": sum(float(s["duration"]) for s in steps)}


def server_step_errors(steps: list[dict], profile: Profile) -> dict[str, dict]:
    """The step model on a real server's own steps during the replay (`step_model.errors_by_kind`)."""
    pairs = ((record_features(s), float(s["duration"])) for s in steps)
    return errors_by_kind(profile.step_model, ((f, t) for f, t in pairs if f is not None))


def host_speed(steps: list[dict], profile: Profile) -> float | None:
    """The replay's own steps' runner time over what the step model predicts for them (all steps,
    time-weighted): how much slower (> 1) or faster this host ran during the replay than the
    profile says. Post hoc: a simulation scaled by it is what the simulator would have predicted
    had it known the host's speed during the run, which separates a drifting host from a miss in
    the simulator's structure."""
    pairs = [(f, float(s["duration"])) for s in steps if (f := record_features(s)) is not None]
    predicted = sum(profile.step_model.predict(f) for f, _ in pairs)
    return sum(t for _, t in pairs) / predicted if predicted > 0 else None


def scaled(profile: Profile, factor: float) -> Profile:
    """The profile with its (linear) step model's every coefficient times `factor`."""
    m = profile.step_model
    return dataclasses.replace(profile, step_model=LinearStepModel([c * factor for c in m.coef], m.twin_max_tokens,
                                                                   m.head_max_seqs))


def work_line(r: dict) -> str:
    """One point's work, real vs simulated, and the step model on the server's steps."""
    w = r.get("work") or {}
    real, sim = w.get("real") or {}, w.get("sim") or {}
    parts = [f"{k} {real.get(k, 0):.4g} / {sim.get(k, 0):.4g}" for k in ("steps", "prefill_tokens", "decode_tokens", "busy_s")]
    steps = errors_line(r.get("server_steps") or {})
    speed = (f"; host speed before the replay (anchors) {r['anchor_speed']:.2f}x the profile's" if r.get("anchor_speed") else "")
    speed += f"; during it (its own steps) {r['host_speed']:.2f}x" if r.get("host_speed") else ""
    return (f"- {r['workload']} {r['load']} {r['mode']}: real / sim " + ", ".join(parts)
            + f"; step model on the server's steps: {steps or '-'}{speed}")


# a decode step of one row, one of eight and a prompt chunk: the regimes a replay's busy time is made of
ANCHORS = (StepShape([(128, 1)]), StepShape([(512, 1)] * 8), StepShape([(0, 256)]))


class AnchorClock:
    """The host's speed just before a replay, against the profile: the ANCHORS timed in this process
    on an engine of its own (idle while the replay's server runs), each shape's median of five runs
    over the step model's prediction for it, the median of those. A shared VM's speed drifts over
    tens of minutes; scaling the step model by this is what re-profiling before each replay would
    do, in two seconds, and uses nothing from the replay itself."""

    def __init__(self, model: str, flags: list[str], profile: Profile) -> None:
        self.engine = LLM(config=engine_config(flags, model)).engine
        self.profile = profile
        self.rng = np.random.default_rng(0)

    def speed(self) -> float:
        ratios = []
        for shape in ANCHORS:
            runs = [got for k in range(5) if (got := time_step(self.engine, shape, self.rng, warmup=k == 0))]
            if runs:
                ratios.append(statistics.median(t for _, t in runs) / self.profile.step_model.predict(runs[0][0]))
        return statistics.median(ratios) if ratios else 1.0


ALTERNATIVES = (("errors_no_overhead", "without overhead terms"), ("errors_calibrated", "step model calibrated in service"),
                ("errors_anchored", "step model scaled by anchor steps timed before the replay"),
                ("errors_host_speed", "step model scaled to the replay's own step speed (post hoc)"))


def table(rows: list[dict]) -> tuple[str, int, int, dict[str, int]]:
    """The markdown table; targets met and checked; and targets met by each alternative simulation
    (errors only, one column each: without the overhead terms, with the in-service calibrated step model)."""
    head = "| workload | load | mode | " + " | ".join(f"{k} real / sim / error (target {v:.0%})"
                                                    for k, v in TARGETS.items()) + " | " + " | ".join(
        label for _, label in ALTERNATIVES) + " |"
    lines, met, checked = [head, "|" + "---|" * (3 + len(TARGETS) + len(ALTERNATIVES))], 0, 0
    alt_met = {key: 0 for key, _ in ALTERNATIVES}
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['workload']} | {r['load']} | {r['mode']} | failed: {r['error']} |"
                         + " |" * (len(TARGETS) + len(ALTERNATIVES) - 1))
            continue
        cells, alts = [], {key: [] for key, _ in ALTERNATIVES}
        for k, (real, sim) in r["errors"].items():
            e = rel_error(real, sim)
            if e is None:
                cells.append("-")
                continue
            ok = abs(e) <= TARGETS[k]
            met, checked = met + ok, checked + 1
            cells.append(f"{real:.3g} / {sim:.3g} / {e:+.0%} {'pass' if ok else 'MISS'}")
            for key, _ in ALTERNATIVES:
                e0 = rel_error(*r[key][k]) if key in r else None
                alts[key].append("-" if e0 is None else f"{e0:+.0%}")
                alt_met[key] += e0 is not None and abs(e0) <= TARGETS[k]
        lines.append(f"| {r['workload']} | {r['load']} | {r['mode']} | " + " | ".join(cells) + " | "
                     + " | ".join(" / ".join(alts[key]) for key, _ in ALTERNATIVES) + " |")
    return "\n".join(lines), met, checked, alt_met


class Validation:
    """Runs one point after another, keeping every result and rewriting the summary after each."""

    def __init__(self, args: argparse.Namespace, profile: Profile, host: dict, command: str) -> None:
        self.args, self.profile, self.host, self.command = args, profile, host, command
        self.bare = Profile.from_dict({**profile.to_dict(), "server_overhead": None})
        # the step model refitted with the profile's in-service steps too (`iterserve profile --calibrate`)
        self.calibrated = profile.calibrated() if profile.in_service_samples else None
        self.rows: list[dict] = []
        self.step_check = ""
        self.anchors: AnchorClock | None = None  # set by main where the step model is linear
        self.capacity: dict[str, float] = {}  # req/s per request-list workload: the loads are fractions of it

    def point(self, kind: str, load: str, mode: str, flags: list[str], run_real, sim_input: dict) -> None:
        t0 = time.perf_counter()
        row: dict = {"workload": kind, "load": load, "mode": mode, "load_avg_before": load_average()}
        try:
            anchored = self.anchors.speed() if self.anchors else None
            real, real_steps = run_real()
            config = engine_config(flags, self.args.model)
            run = simulate(config=config, profile=self.profile, **sim_input)
            sim = run.result.summary()
            row.update(work={"real": work(real_steps), "sim": work(run.timelines[0].steps)},
                       server_steps=server_step_errors(real_steps, self.profile))
            bare = simulate(config=config, profile=self.bare, **sim_input).result.summary()
            if self.calibrated is not None:
                cal = simulate(config=config, profile=self.calibrated, **sim_input).result.summary()
                row.update(sim_calibrated=cal, errors_calibrated=errors(real, cal))
            if anchored:
                pre = simulate(config=config, profile=scaled(self.profile, anchored), **sim_input).result.summary()
                row.update(anchor_speed=anchored, sim_anchored=pre, errors_anchored=errors(real, pre))
            speed = host_speed(real_steps, self.profile) if isinstance(self.profile.step_model, LinearStepModel) else None
            if speed:
                fast = simulate(config=config, profile=scaled(self.profile, speed), **sim_input).result.summary()
                row.update(host_speed=speed, sim_host_speed=fast, errors_host_speed=errors(real, fast))
            row.update(real=real, sim=sim, errors=errors(real, sim), errors_no_overhead=errors(real, bare),
                       completed=(real["completed"], sim["completed"]), failed=(real["failed"], sim["failed"]))
            print(f"{kind} {load} {mode}: " + ", ".join(
                f"{k} {'-' if a is None else round(a, 3)} vs {'-' if b is None else round(b, 3)}"
                for k, (a, b) in row["errors"].items()), file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - one point's failure must not lose the others
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
        row["wall_s"] = time.perf_counter() - t0
        row["load_avg_after"] = load_average()
        self.rows.append(row)
        self.write()

    def write(self) -> str:
        text, met, checked, alt_met = table(self.rows)
        oh = self.profile.server_overhead
        lines = [f"Simulator validation, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {git_commit()}",
                 "", figures_line(self.host), f"command: `{self.command}`",
                 f"profile: {self.profile.describe()}; step fit mean |error| "
                 f"{self.profile.fit.get('mean_abs_rel_err', float('nan')):.1%} over {self.profile.fit.get('points')} shapes",
                 ("server overhead: " + (f"gap {oh.gap_s[0] * 1e3:.2f} ms + {oh.gap_s[1] * 1e3:.3f} ms/seq, admission "
                                         f"{oh.admit_s * 1e3:.2f} ms, arrival {oh.arrival_s[0] * 1e3:.1f} ms + "
                                         f"{oh.arrival_s[1] * 1e6:.1f} us/token, first token {oh.first_token_s * 1e3:.1f} ms,"
                                         f" finish {oh.finish_s * 1e3:.1f} ms" if oh else "none")),
                 "load average (1 min) before/after each run: "
                 + ", ".join(f"{r['load_avg_before'][0]:.1f}/{r['load_avg_after'][0]:.1f}" for r in self.rows
                             if r.get("load_avg_before") and r.get("load_avg_after")),
                 "", text, "", f"targets met: {met} of {checked} ("
                 + ", ".join(f"{label}: {alt_met[key]}" for key, label in ALTERNATIVES) + ")",
                 "", self.step_check, "", "in-service steps in the profile (the step model on the server's own steps "
                 "while its overhead was measured): " + (errors_line(self.profile.in_service_errors()) or "none"), "",
                 "Work per run (engine steps, prompt tokens computed, decode tokens, busy seconds; real / "
                 "simulated) and the step model on the real server's own steps (mean error, mean |error|):",
                 *[work_line(r) for r in self.rows if r.get("work")]]
        summary = "\n".join(lines) + "\n"
        out = self.args.out
        (out / "summary.md").write_text(summary)
        (out / "validation.json").write_text(json.dumps(
            {"command": self.command, "commit": git_commit(), "host": self.host, "profile": self.profile.to_dict(),
             "runs": self.rows, "table": text, "targets_met": [met, checked], "alternatives_met": alt_met,
             "step_check": self.step_check, "capacity": self.capacity},
            indent=1, default=str))
        return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--profile", type=Path, help="a profile fitted beforehand (default: fit one now, in its own process)")
    p.add_argument("--no-server-overhead", action="store_true",
                   help="fit the profile without its server-overhead terms (default: with them)")
    p.add_argument("--workloads", default="conversation,bursty,multi-turn")
    p.add_argument("--modes", default="static,continuous")
    p.add_argument("--loads", default="light,near,over")
    p.add_argument("--num-requests", type=int, default=48, help="requests per replay (default 48)")
    p.add_argument("--server-args", default="", help="engine flags for both the servers and the simulation")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rates-of", type=Path, metavar="VALIDATION_JSON",
                   help="offer the loads of an earlier run (its capacities, in its validation.json) instead of this "
                        "profile's: the very same requests at the same times, for sim_validation_spread.py")
    p.add_argument("--out", type=Path, default=Path("runs/sim-validation"))
    p.add_argument("--tiny", action="store_true",
                   help="smoke run: every workload and mode at one load with 6 requests (2 conversations of 2 "
                        "turns), a quick profile; proves the paths, its numbers mean nothing")
    args = p.parse_args()
    command = shlex.join(["python", "benchmarks/sim_validation.py", *sys.argv[1:]])
    if args.tiny:
        args.num_requests, args.loads = 6, "light"
        args.max_input_len, args.max_output_len = 128, 16
    unknown = set(args.workloads.split(",")) - {"conversation", "bursty", "multi-turn"} - set(WORKLOADS)
    if unknown or set(args.modes.split(",")) - set(MODE_FLAGS) or set(args.loads.split(",")) - set(LOADS):
        raise SystemExit(f"unknown workload, mode or load in {args.workloads} / {args.modes} / {args.loads}")
    if "conversation" in args.workloads.split(",") and not args.trace.exists():
        raise SystemExit(f"no trace at {args.trace} (--trace PATH, or leave out the conversation workload)")
    args.out.mkdir(parents=True, exist_ok=True)
    host = machine_figures()
    print(figures_line(host), file=sys.stderr)
    extra = shlex.split(args.server_args) + ["--max-input-len", str(args.max_input_len),
                                             "--max-output-len", str(args.max_output_len)]
    prof_path = args.profile or args.out / "profile.json"
    if args.profile is None:
        fit_profile(args.model, prof_path, [*extra, *MODE_FLAGS["continuous"]]
                    + ([] if args.no_server_overhead else ["--server-overhead"]), args.tiny)
    profile = Profile.load(prof_path)
    tokenizer = load_tokenizer(resolve_model(args.model))
    framing = conversation_framing(tokenizer)  # the multi-turn prompts' "User:" / "Assistant:" tokens
    v = Validation(args, profile, host, command)
    kinds = [k for k in args.workloads.split(",") if k != "multi-turn"]
    # the continuous engine's capacity, as the simulator predicts it on the lengths of each workload
    cont = engine_config(MODE_FLAGS["continuous"] + extra, args.model)
    caps = json.loads(args.rates_of.read_text()).get("capacity", {}) if args.rates_of else {}
    for kind in kinds:
        if kind not in caps:
            sat = [dataclasses.replace(s, arrival_s=0.0) for s in workload(kind, args.num_requests, 1.0, args)]
            caps[kind] = simulate(sat, cont, profile).result.summary()["request_throughput"]
    v.capacity = caps
    # how long the replays will take, as the simulator sees them (server starts come on top)
    planned = 0.0
    for mode in args.modes.split(","):
        for load in args.loads.split(","):
            for k in kinds:
                planned += simulate(workload(k, args.num_requests, LOADS[load] * caps[k], args),
                                    engine_config(MODE_FLAGS[mode] + extra, args.model), profile).result.duration_s
            if "multi-turn" in args.workloads.split(","):
                flags = MODE_FLAGS[mode] + extra + ["--max-input-len", str(MULTI_TURN_MAX_INPUT)]
                planned += simulate([], engine_config(flags, args.model), profile,
                                    conversations=conversation_plans(conversation_options(load, args), framing)).result.duration_s
    print(f"plan: predicted capacity {', '.join(f'{k} {c:.2f} req/s' for k, c in caps.items())}; the replays "
          f"take about {planned / 60:.0f} min as simulated, plus a server start for each", file=sys.stderr)
    if kinds:
        v.step_check = step_check(args.model, MODE_FLAGS["continuous"] + extra,
                                  workload(kinds[0], args.num_requests, 1.0, args), profile)
        print(v.step_check, file=sys.stderr)
    if isinstance(profile.step_model, LinearStepModel):
        v.anchors = AnchorClock(args.model, MODE_FLAGS["continuous"] + extra, profile)
    if "multi-turn" in args.workloads.split(","):  # conversations, not a request list: sized by their number
        for load in args.loads.split(","):
            opts = conversation_options(load, args)
            for mode in args.modes.split(","):
                flags = MODE_FLAGS[mode] + extra + ["--max-input-len", str(MULTI_TURN_MAX_INPUT)]

                def run_real(flags=flags, opts=opts, log=args.out / f"server-multi-turn-{load}-{mode}.log"):
                    with ServerProcess([args.model, *flags], log_path=log) as srv:
                        return asyncio.run(conversations_polled(srv.base_url, build_conversations(opts, tokenizer)))
                v.point("multi-turn", load, mode, flags, run_real,
                        {"specs": [], "conversations": conversation_plans(opts, framing)})
    for kind in kinds:
        for load in args.loads.split(","):
            specs = workload(kind, args.num_requests, LOADS[load] * caps[kind], args)
            build_prompts(specs, tokenizer)
            for mode in args.modes.split(","):
                flags = MODE_FLAGS[mode] + extra

                def run_real(flags=flags, specs=specs, log=args.out / f"server-{kind}-{load}-{mode}.log"):
                    with ServerProcess([args.model, *flags], log_path=log) as srv:
                        result, timeline = asyncio.run(replay(srv.base_url, specs, progress=False))
                    return ({**result.summary(), "engine": ModeRun(mode, result.to_dict(), timeline).metrics()},
                            timeline.steps)
                v.point(kind, load, mode, flags, run_real, {"specs": specs})
    print(v.write())
    print(f"wrote {args.out / 'summary.md'} and {args.out / 'validation.json'}", file=sys.stderr)
    return 1 if any(r.get("error") for r in v.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
