"""The decode step of this checkout against another checkout's, whole: each run a fresh process with
one checkout first on its path (its Python and its own kernel build), the two in turns (A, B, B, A,
...), so that a shared host's noise hits both alike. Prints per checkout the median ms a step and,
per projection shape (out x in features), that projection's ms inside the step.

Why the whole step and not the kernel alone: a kernel timed alone (`ab_gguf_gemm.py`) runs with
nothing between its calls, where in the step each projection follows other kernels and Python. And
why many runs: on the shared 2-core AMX Xeon (2026-12-06) the same two builds gave 2-5 % either way
in sets of 4-5 pairs, and 10 pairs in turns 1.025x in a loaded hour and 1.006x in a quiet one.

    python benchmarks/ab_step.py --baseline-src OLD_CHECKOUT --model FILE.gguf --batch 16 --runs 5

OLD_CHECKOUT is a worktree of the other commit (`git worktree add ../base COMMIT`). The child runs
this file's --child mode with OLD_CHECKOUT on PYTHONPATH, and refuses to run if `iterserve` then
comes from anywhere else. The projections are timed around each call (perf_counter, ~1 us a call);
the step's median is over --steps steps after --warmup.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent


def child(args: argparse.Namespace) -> int:
    """One run in this process: the step's median and each projection shape's ms a step, as JSON."""
    sys.path.insert(0, str(HERE))
    import iterserve
    import iterserve.platform.cpu_linear as cpu_linear
    from decode_speed import start_decode_batch  # sibling script
    from iterserve.llm import LLM

    where = Path(iterserve.__file__).resolve().parent.parent
    if where != Path(args.child).resolve():
        raise SystemExit(f"ab_step: iterserve came from {where}, not {args.child}")
    real = cpu_linear._cpu_linear  # looked up per call by CpuLinear.forward
    spent: dict[str, float] = defaultdict(float)

    def timed(x, packed, layout, out_features, *a, **k):
        t = time.perf_counter()
        y = real(x, packed, layout, out_features, *a, **k)
        spent[f"{out_features}x{x.shape[1]}"] += time.perf_counter() - t
        return y

    cpu_linear._cpu_linear = timed
    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory)
    start_decode_batch(llm, args.batch, args.context, args.warmup + args.steps + 2)
    engine = llm.engine
    for _ in range(args.warmup):
        engine.step()
    spent.clear()
    walls = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - t) * 1e3)
    if not spent:  # the projections went through torch.ops, not the module function patched above
        raise SystemExit("ab_step: no projection call was timed (CpuLinear did not call _cpu_linear directly)")
    print(json.dumps({"step_ms": statistics.median(walls),
                      "projections_ms": {k: v * 1e3 / args.steps for k, v in sorted(spent.items())}}))
    return 0


def run_one(src: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(src), "--model", args.model,
           "--batch", str(args.batch), "--context", str(args.context), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--kv-cache-memory", args.kv_cache_memory]
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(cmd, env=env, cwd=src, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"ab_step: the run of {src} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-src", help="the other checkout (a git worktree of the old commit)")
    ap.add_argument("--model", required=True, help="a model path or name, as `iterserve serve` takes it")
    ap.add_argument("--batch", type=int, default=16, help="sequences decoding together: the step's rows")
    ap.add_argument("--context", type=int, default=128, help="each sequence's prompt tokens")
    ap.add_argument("--steps", type=int, default=30, help="steps timed a run")
    ap.add_argument("--warmup", type=int, default=3, help="steps run before the timed ones")
    ap.add_argument("--runs", type=int, default=5, help="runs of each checkout, in turns")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if not args.baseline_src:
        ap.error("--baseline-src is required")
    sys.path.insert(0, str(HERE))
    from machine import figures_line, machine_figures  # sibling script

    print(figures_line(machine_figures()), flush=True)
    builds = {"old": Path(args.baseline_src).resolve(), "new": CHECKOUT}
    results: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(args.runs):
        for label in (("old", "new") if r % 2 == 0 else ("new", "old")):
            res = run_one(builds[label], args)
            results[label].append(res)
            print(f"run {r + 1} {label}: {res['step_ms']:.1f} ms a step", flush=True)
    med = {label: statistics.median(x["step_ms"] for x in rs) for label, rs in results.items()}
    print(f"\nstep, median of {args.runs} runs: old {med['old']:.1f} ms, new {med['new']:.1f} ms "
          f"(old / new x{med['old'] / med['new']:.3f})")
    print("| projection (out x in) | old ms a step | new ms a step | old / new |\n|---|---:|---:|---:|")
    for shape in results["old"][0]["projections_ms"]:
        o = statistics.median(x["projections_ms"].get(shape, 0.0) for x in results["old"])
        n = statistics.median(x["projections_ms"].get(shape, 0.0) for x in results["new"])
        print(f"| {shape} | {o:.2f} | {n:.2f} | x{o / n:.3f} |" if n else f"| {shape} | {o:.2f} | - | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
