"""The seed case at its own scale, in the capacity simulator: Llama-2-7B on one A100-class GPU
(an analytic roofline profile, an estimate), the case's traffic, static max_batch_size 8 vs
continuous max-num-seqs 16, printed next to the case's figures (docs/seed-case.md).

Traffic: the case's arrivals (Poisson, 300 ms mean gap overall, bursts to 20 req/s: a 1 s burst
every 10 s over a 1.48 req/s base, so that the mean is 3.33 req/s) with chat lengths taken in order
from the Azure 2023 conversation trace, clamped to the case's limits (input <= 1024, output <= 256).
Latency, queueing and utilisation are measured at that offered load; throughput, as the case's
6.7 -> 15.2 req/s can only be, at saturation (every request present from the start), per mode.

    .venv/bin/python benchmarks/seed_case_sim.py [--gpu a100-80gb] [--requests 3000] [--short-answers]
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from iterserve.bench.report import ModeRun
from iterserve.bench.workload import RequestSpec, bursty, trace
from iterserve.config import EngineConfig
from iterserve.sim.analytic import GPUS, analytic_profile
from iterserve.sim.simulator import simulate

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "azure_llm_2023_conv.csv"
SEED = {"utilisation": (0.45, 0.82), "mean_latency_s": (1.2, 0.6), "p95_latency_s": (2.8, 1.5),
        "mean_queue_s": (0.8, 0.05), "capacity": (6.7, 15.2)}
MODES = {"static": dict(batching="static", max_batch_size=8, batch_timeout_ms=100.0),
         "continuous": dict(batching="continuous", max_num_seqs=16)}


def seed_workload(n: int, trace_path: Path, short_answers: bool, seed: int = 0) -> list[RequestSpec]:
    arrivals = bursty(n, base_rate=1.48, peak_rate=20.0, burst_every_s=10.0, burst_len_s=1.0, seed=seed)
    if short_answers:
        rng = np.random.default_rng(seed)
        lens = [(int(rng.integers(16, 1025)), int(rng.integers(8, 65))) for _ in range(n)]
    else:
        rows = trace(trace_path, max_input_len=1024, max_output_len=256)
        lens = [(rows[i % len(rows)].input_len, rows[i % len(rows)].output_len) for i in range(n)]
    return [RequestSpec(s.index, s.arrival_s, i, o) for s, (i, o) in zip(arrivals, lens)]


def run(gpu: str, n: int, trace_path: Path, short_answers: bool) -> str:
    prof = analytic_profile(gpu, "llama-2-7b")
    specs = seed_workload(n, trace_path, short_answers)
    saturated = [dataclasses.replace(s, arrival_s=0.0) for s in specs]
    got: dict[str, dict] = {}
    t0 = time.perf_counter()
    for mode, flags in MODES.items():
        cfg = EngineConfig(max_model_len=2048, **flags)
        at_load = simulate(specs, cfg, prof)
        m = ModeRun(mode, at_load.result.to_dict(), at_load.timelines[0]).metrics()
        sat_run = simulate(saturated, cfg, prof)
        sat = sat_run.result.summary()
        m["capacity"] = sat["request_throughput"]
        m["saturated_useful_utilisation"] = sat_run.timelines[0].busy_between(0.0, sat["duration_s"])[1]
        m["offered"] = at_load.result.summary()["request_throughput"]
        got[mode] = m
    wall = time.perf_counter() - t0
    rows = [("Utilisation (busy fraction) at the offered load", "utilisation", lambda x: f"{100 * x:.0f}%"),
            ("Useful utilisation (padding excluded)", "useful_utilisation", lambda x: f"{100 * x:.0f}%"),
            ("Mean latency (e2e)", "mean_latency_s", lambda x: f"{x:.2f} s"),
            ("P95 latency (e2e)", "p95_latency_s", lambda x: f"{x:.2f} s"),
            ("Mean queue time", "mean_queue_s", lambda x: f"{1e3 * x:.0f} ms"),
            ("Capacity at saturation (req/s)", "capacity", lambda x: f"{x:.1f}"),
            ("Useful utilisation at saturation", "saturated_useful_utilisation", lambda x: f"{100 * x:.0f}%")]
    lines = ["| metric | case: static | case: continuous | sim: static | sim: continuous | sim change | direction |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for label, key, fmt in rows:
        s, c = got["static"][key], got["continuous"][key]
        case = SEED.get(key)
        change = f"{100 * (c - s):+.0f} pts" if "utilisation" in key else (
            f"{c / s:.2f}x" if key == "capacity" else f"{100 * (c - s) / s:+.0f}%")
        if case:
            agree = "agrees" if (case[1] - case[0]) * (c - s) > 0 else "differs"
        else:
            agree = ""
        lines.append(f"| {label} | {fmt(case[0]) if case else ''} | {fmt(case[1]) if case else ''} | {fmt(s)} | "
                     f"{fmt(c)} | {change} | {agree} |")
    what = "outputs 8-64 tokens (short answers), inputs 16-1024" if short_answers else \
        "lengths from the Azure 2023 conversation trace clamped to 1024/256"
    lines.append("")
    lines.append(f"{n} requests, {what}; offered {got['continuous']['offered']:.2f} req/s on average; "
                 f"{prof.describe()}; both modes and both loads simulated in {wall:.1f} s.")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", default="a100-80gb", choices=sorted(GPUS))
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--short-answers", action="store_true", help="outputs of 8-64 tokens instead of the trace's")
    args = p.parse_args()
    print(run(args.gpu, args.requests, args.trace, args.short_answers))


if __name__ == "__main__":
    main()
