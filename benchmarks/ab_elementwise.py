"""SiLU-and-multiply and RoPE through the C++ kernels (platform/cpu_elementwise.py) against the
model's torch forms, in one process and in turns (A, B, A, B, ...), so a shared host's noise hits
both alike: a decode step at --batch and a --prefill-token prompt step alone; min and median of the
rounds.

    python benchmarks/ab_elementwise.py --batch 1 --prefill 2048 --rounds 8
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from decode_speed import decode_step_seconds, drain, start_decode_batch, times_in_turns  # noqa: E402  (sibling scripts)
from profile_step import time_prompt_step  # noqa: E402

from iterserve.llm import LLM  # noqa: E402
from iterserve.model.layers import MLP, Attention  # noqa: E402
from iterserve.platform.cpu_elementwise import CpuAttention, CpuMLP  # noqa: E402

KERNELS = CpuMLP.act_and_mul, CpuAttention.rope


def use_kernels(on: bool) -> None:
    CpuMLP.act_and_mul, CpuAttention.rope = KERNELS if on else (MLP.act_and_mul, Attention.rope)


def report(what: str, times: dict[bool, list[float]]) -> dict:
    row = {"step": what}
    for on, name in ((False, "torch"), (True, "kernels")):
        row[name] = {"min_ms": round(min(times[on]) * 1e3, 2),
                     "median_ms": round(statistics.median(times[on]) * 1e3, 2)}
    row["speedup_min"] = round(row["torch"]["min_ms"] / row["kernels"]["min_ms"], 3)
    print(f"{what}: torch min {row['torch']['min_ms']:.2f} / median {row['torch']['median_ms']:.2f} ms, kernels min "
          f"{row['kernels']['min_ms']:.2f} / median {row['kernels']['median_ms']:.2f} ms ({row['speedup_min']:.3f}x "
          "by min)", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--extra", default="{}", help="JSON of EngineConfig fields (e.g. dtype)")
    args = ap.parse_args()
    extra = json.loads(args.extra)
    extra.setdefault("max_num_batched_tokens", max(2048, args.prefill))
    llm = LLM(args.model, kv_cache_memory="1GiB", **extra)
    eng = llm.engine
    if not any(isinstance(m, (CpuMLP, CpuAttention)) for m in eng.model.modules()):
        raise SystemExit("the platform did not swap in the kernels' modules (no C++ kernels?)")
    rows = []
    start_decode_batch(llm, args.batch, 64, 20 * args.rounds)
    times = times_in_turns(use_kernels, args.rounds, lambda: decode_step_seconds(llm))
    rows.append(report(f"decode batch {args.batch}", times))
    drain(llm)
    times = times_in_turns(use_kernels, args.rounds, lambda: time_prompt_step(llm, args.prefill, 0))
    use_kernels(True)
    rows.append(report(f"{args.prefill}-token prompt", times))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
