"""Measure a real server's overhead terms (`sim/overhead.py`) from its own step records.

Starts `iterserve serve` with the profile's engine flags and replays two small workloads with the
bench client while polling `/v1/scheduler` (each step's start and runner time, on the client's
clock, `bench/compare.replay`):

- isolated requests (one at a time, each sent when the previous one has ended; prompts of several
  lengths): for each, the time from sending it
  to its first step's start (arrival term, fitted against prompt length), from the end of the step
  that sampled its first token to the client receiving it, and from its last step's end to the
  response's end;
- bursts of concurrent requests (2, 8 and the engine's batch limit): the gaps between back-to-back
  steps, fitted against the step's sequences and the next step's admissions.

The server runs in its own process, as in production; what the client's own process costs on the
same cores is therefore part of the figures, as it is of any measured run on one machine.
"""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from iterserve.bench.compare import replay
from iterserve.bench.launcher import ServerProcess
from iterserve.bench.workload import RequestSpec, build_prompts
from iterserve.sim.overhead import ServerOverhead, fit_gaps, nonnegative_lstsq
from iterserve.sim.moe import MoeRouting
from iterserve.sim.step_model import record_features

ISOLATED_PROMPTS = (16, 128, 512)
ISOLATED_OUTPUT = 8


def isolated_terms(records: list[Any], steps: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per request that ran alone (no other request's window overlaps its own): prompt length,
    arrival delay, first-token delay, finish delay (seconds)."""
    windows = [(r.sent_at_s, r.end_at_s) for r in records if r.success]
    out: dict[str, list[float]] = {"prompt": [], "arrival": [], "first_token": [], "finish": []}
    for r in records:
        if not r.success or r.ttft_s is None:
            continue
        lo, hi = r.sent_at_s, r.end_at_s
        if sum(1 for a, b in windows if a < hi and b > lo) > 1:
            continue  # overlapped another request: not isolated
        mine = sorted((s for s in steps if lo <= float(s["t_run"]) <= hi), key=lambda s: float(s["t_run"]))
        prefill = [s for s in mine if s.get("prefill_tokens")]
        if not mine or not prefill:
            continue
        first_end = float(prefill[-1]["t_run"]) + float(prefill[-1]["duration"])
        last_end = float(mine[-1]["t_run"]) + float(mine[-1]["duration"])
        out["prompt"].append(float(r.prompt_tokens or r.input_len))
        out["arrival"].append(float(mine[0]["t_run"]) - lo)
        out["first_token"].append(lo + r.ttft_s - first_end)
        out["finish"].append(hi - last_end)
    return out


def in_service_samples(steps: list[dict[str, Any]], moe: MoeRouting | None = None) -> list[dict[str, Any]]:
    """The server's steps as step-model samples (features and runner seconds), as `Profile.samples`
    holds the grid's: steps taken in service, with the HTTP front end and the client on the same
    cores, which the grid's isolated repeats of one shape do not see. `moe`: an MoE model's routing
    (a server does not count its experts: the expectation for each step's tokens stands in)."""
    out = []
    for s in steps:
        f = record_features(s, moe)
        if f is not None and float(s["duration"]) > 0:
            out.append({**dataclasses.asdict(f), "seconds": float(s["duration"])})
    return out


def measure_server_overhead(model: str, engine_flags: list[str], tokenizer: Any, max_seqs: int,
                            max_prompt: int | None = None, max_output: int | None = None, isolated: int = 12,
                            burst_output: int = 32,
                            log_path: str | Path | None = None,
                            moe: MoeRouting | None = None) -> tuple[ServerOverhead, list[dict[str, Any]]]:
    """(the overhead terms, the server's steps as step-model samples: `in_service_samples`).
    max_prompt / max_output: the server's --max-input-len / --max-output-len where it has them
    (the requests are cut to fit); moe: an MoE model's routing (the grid's profile's)."""
    burst_output = min(burst_output, max_output or burst_output)
    lens = [min(n, max_prompt or n) for n in ISOLATED_PROMPTS]
    iso = [RequestSpec(i, 0.0, lens[i % len(lens)], ISOLATED_OUTPUT) for i in range(isolated)]
    build_prompts(iso, tokenizer)
    bursts = []
    for n in sorted({2, min(8, max_seqs), max_seqs}):
        specs = [RequestSpec(i, 0.0, min(64, max_prompt or 64), burst_output) for i in range(n)]
        build_prompts(specs, tokenizer)
        bursts.append(specs)
    steps: list[dict[str, Any]] = []
    with ServerProcess([model, *engine_flags], log_path=log_path) as srv:
        alone: dict[str, list[float]] = {}
        for k, spec in enumerate(iso):  # closed loop: the next is sent when this one has ended
            result, timeline = asyncio.run(replay(srv.base_url, [spec], progress=False, warmup=k == 0))
            steps += timeline.steps
            for key, vals in isolated_terms(result.records, timeline.steps).items():
                alone.setdefault(key, []).extend(vals)
        for specs in bursts:
            _, tl = asyncio.run(replay(srv.base_url, specs, progress=False, warmup=False))
            steps += tl.steps
    if len(alone.get("prompt", [])) < 2:
        raise ValueError(f"only {len(alone.get('prompt', []))} of {isolated} isolated requests completed with "
                         "their steps recorded: the server failed (see its log)")
    gap, admit, info = fit_gaps(steps)
    x = np.array([[1.0, p] for p in alone["prompt"]])
    a0, a_tok = nonnegative_lstsq(x, np.array(alone["arrival"]))
    # the admission is charged at the admitting step: not twice at an idle server's first step
    a0 = max(float(a0) - admit, 0.0)
    info.update({"isolated_requests": len(alone["prompt"]), "arrival_median_s": float(np.median(alone["arrival"])),
                 "first_token_median_s": float(np.median(alone["first_token"])),
                 "finish_median_s": float(np.median(alone["finish"])), "engine_flags": list(engine_flags),
                 "clock_error_s": timeline.clock_error_s})
    overhead = ServerOverhead(gap_s=gap, admit_s=admit, arrival_s=[a0, float(a_tok)],
                              first_token_s=max(float(np.median(alone["first_token"])), 0.0),
                              finish_s=max(float(np.median(alone["finish"])), 0.0), fit=info)
    return overhead, in_service_samples(steps, moe)
