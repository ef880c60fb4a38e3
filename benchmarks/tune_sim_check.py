"""Does `iterserve tune --simulate` pick a configuration as good as a real sweep would (issue 21)?

On the conversation trace: a small grid of max-num-seqs x block size, each configuration replayed for
real against a fresh `iterserve serve` (tune's own `run_config`) and simulated with a profile fitted
beforehand in a separate process (with its server-overhead terms). `tune --simulate --verify N`
chooses as tune does: it ranks the simulated sweep by tune's rule (the highest goodput among
configurations meeting the SLO, else the closest to it), replays the N best for real and takes the best
of those as measured (`simulated_choice`); here their replays are the sweep's own. The target: that
choice's measured e2e p95 within 10% of the best measured e2e p95 of the whole grid. Also reported,
not judged: the simulator's top pick alone (--verify 0), with the profile as fitted and with its step
model calibrated in service. The load is the trace's arrival pattern scaled to --load x the capacity the simulator predicts
for the largest max-num-seqs, so that the batch limit matters.

    .venv/bin/python benchmarks/tune_sim_check.py --out runs/tune-sim-check   # about 10 minutes on 2 cores
    .venv/bin/python benchmarks/tune_sim_check.py --tiny                      # smoke run, numbers meaningless

Writes summary.md (host line, command, the predicted vs measured table, pass/miss) and
tune_check.json under --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import shlex
import sys
import time
from pathlib import Path

from iterserve.bench.client import parse_slo
from machine import figures_line, machine_figures
from iterserve.bench.summary import git_commit
from iterserve.bench.tune import GridPoint, best_config, ranked, run_config
from iterserve.bench.workload import RequestSpec, build_prompts, trace
from iterserve.model.loader import load_tokenizer, resolve_model
from iterserve.sim.profile import Profile
from iterserve.sim.tune_simulated import predicted_vs_measured, simulate_config, simulated_choice
from sim_validation import TRACE, fit_profile  # sibling script

TARGET = 0.10


def conversation_specs(path: Path, n: int, rate: float, max_input: int, max_output: int) -> list[RequestSpec]:
    rows = trace(path, num_requests=n, max_input_len=max_input, max_output_len=max_output)
    span = max(s.arrival_s for s in rows) or 1.0
    scale = (len(rows) - 1) / span / rate
    return [dataclasses.replace(s, arrival_s=s.arrival_s * scale) for s in rows]


def p95(r) -> float | None:
    return r.summary["e2e_ms"]["p95"] if r.status == "ok" and r.summary.get("e2e_ms") else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--profile", type=Path, help="a profile fitted beforehand (default: fit one now, in its own process)")
    p.add_argument("--seqs", default="4,8,16", help="max-num-seqs values (default 4,8,16)")
    p.add_argument("--blocks", default="16,32", help="block sizes (default 16,32)")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--load", type=float, default=0.8,
                   help="arrival rate as a share of the simulated capacity at the largest max-num-seqs (default 0.8)")
    p.add_argument("--verify", type=int, default=3, help="tune's --verify: finalists replayed (default 3)")
    p.add_argument("--slo", default="e2e_p95=2s", help="tune's SLO for the choice (default e2e_p95=2s)")
    p.add_argument("--server-args", default="", help="other engine flags for every server and simulation")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("runs/tune-sim-check"))
    p.add_argument("--tiny", action="store_true", help="smoke run: 2 configs of 6 requests, a quick profile")
    args = p.parse_args()
    command = shlex.join(["python", "benchmarks/tune_sim_check.py", *sys.argv[1:]])
    if args.tiny:
        args.seqs, args.blocks, args.num_requests = "4,16", "16", 6
        args.max_input_len, args.max_output_len = 128, 16
    if not args.trace.exists():
        raise SystemExit(f"no trace at {args.trace} (--trace PATH)")
    args.out.mkdir(parents=True, exist_ok=True)
    host = machine_figures()
    print(figures_line(host), file=sys.stderr)
    extra = shlex.split(args.server_args) + ["--max-input-len", str(args.max_input_len),
                                             "--max-output-len", str(args.max_output_len)]
    points = [GridPoint(s, b) for s, b in itertools.product(map(int, args.seqs.split(",")), map(int, args.blocks.split(",")))]
    prof_path = args.profile or args.out / "profile.json"
    if args.profile is None:
        top = max(pt.max_num_seqs for pt in points)
        fit_profile(args.model, prof_path, ["--server-overhead", "--max-num-seqs", str(top), *extra], args.tiny)
    profile = Profile.load(prof_path)
    slos = [parse_slo(args.slo)]
    probe = conversation_specs(args.trace, args.num_requests, 1.0, args.max_input_len, args.max_output_len)
    biggest = max(points, key=lambda pt: (pt.max_num_seqs, pt.block_size))
    sat = [dataclasses.replace(s, arrival_s=0.0) for s in probe]
    cap = simulate_config(biggest, profile, extra, sat, slos).summary["request_throughput"]
    specs = conversation_specs(args.trace, args.num_requests, args.load * cap, args.max_input_len, args.max_output_len)
    build_prompts(specs, load_tokenizer(resolve_model(args.model)))
    last = max(s.arrival_s for s in specs)
    print(f"tune check: {len(points)} configs x {len(specs)} requests at {args.load * cap:.2f} req/s "
          f"(simulated capacity {cap:.2f} req/s; {last:.0f} s of arrivals each)", file=sys.stderr)
    t0 = time.perf_counter()
    simulated = [simulate_config(pt, profile, extra, specs, slos) for pt in points]
    sim_s = time.perf_counter() - t0
    measured = []
    for pt in points:
        print(f"tune check: replaying {pt.label()}", file=sys.stderr)
        measured.append(run_config(pt, args.model, extra, specs, slos, last + 300.0, log_dir=args.out / "logs"))
    real_of = {r.point: r for r in measured}
    valid = [r for r in measured if p95(r) is not None]
    lines = [f"tune --simulate check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {git_commit()}",
             "", figures_line(host), f"command: `{command}`", f"profile: {profile.describe()}",
             f"workload: conversation trace, {len(specs)} requests at {args.load * cap:.2f} req/s; SLO {args.slo}; "
             f"simulated the grid in {sim_s:.1f} s", "",
             predicted_vs_measured([(s, real_of[s.point]) for s in simulated]), ""]
    def judge(label: str, pick) -> bool | None:
        if pick is None or not valid or p95(real_of[pick.point]) is None:
            lines.append(f"{label}: no verdict: the chosen configuration or every real replay failed (see logs/)")
            return None
        best = min(valid, key=p95)
        got, want = p95(real_of[pick.point]), p95(best)
        ok = (got - want) / want <= TARGET
        lines.append(f"{label}: {pick.point.label()}, measured e2e p95 {got:.0f} ms; best measured: "
                     f"{best.point.label()}, {want:.0f} ms; {100 * (got - want) / want:+.0f}% "
                     f"(target within {TARGET:.0%}): {'pass' if ok else 'MISS'}")
        return ok

    finalists = [real_of[r.point] for r in ranked(simulated)[:max(args.verify, 0)]]
    chosen, source = simulated_choice(simulated, finalists)
    verdict = judge(f"`tune --simulate --verify {args.verify}` chose ({source})", chosen)
    judge("the simulator's top pick alone (--verify 0)", best_config(simulated)[0])
    if profile.in_service_samples:  # the same sweep with the step model calibrated in service (profile --calibrate)
        calibrated = [simulate_config(pt, profile.calibrated(), extra, specs, slos) for pt in points]
        judge(f"with the step model calibrated in service (`profile --calibrate`), --verify {args.verify}",
              simulated_choice(calibrated, [real_of[r.point] for r in ranked(calibrated)[:max(args.verify, 0)]])[0])
        judge("with the step model calibrated in service, the top pick alone", best_config(calibrated)[0])
    lines.append("load average (1 min) after each replay: "
                 + ", ".join("-" if r.load_avg is None else f"{r.load_avg:.1f}" for r in measured))
    summary = "\n".join(lines) + "\n"
    (args.out / "summary.md").write_text(summary)
    (args.out / "tune_check.json").write_text(json.dumps(
        {"command": command, "commit": git_commit(), "host": host, "profile": profile.to_dict(), "pass": verdict,
         "chosen": chosen.point.label() if chosen else None, "verify": args.verify,
         "simulated": [r.to_dict(with_requests=False) for r in simulated],
         "measured": [r.to_dict(with_requests=False) for r in measured]}, indent=1, default=str))
    print(summary)
    print(f"wrote {args.out / 'summary.md'}", file=sys.stderr)
    return 0 if verdict is not None else 1


if __name__ == "__main__":
    sys.exit(main())
