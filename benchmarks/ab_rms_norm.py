"""RMSNorm through the C++ kernel (platform/cpu_norm.py) against the model's torch RMSNorm, in one
process and in turns, best of the rounds: a decode step at --batch and a --prefill-token prompt
step alone, bf16 eager (the path the kernel serves).

    python benchmarks/ab_rms_norm.py --batch 16 --prefill 1024 --rounds 8
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from decode_speed import decode_step_seconds, drain, start_decode_batch, times_in_turns  # noqa: E402  (sibling scripts)
from profile_step import time_prompt_step  # noqa: E402

from iterserve.llm import LLM  # noqa: E402
from iterserve.model.layers import RMSNorm  # noqa: E402
from iterserve.platform.cpu_norm import CpuRMSNorm  # noqa: E402

KERNEL_FORWARD = CpuRMSNorm.forward


def use_kernel(on: bool) -> None:
    CpuRMSNorm.forward = KERNEL_FORWARD if on else RMSNorm.forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="bfloat16", kv_cache_memory="1GiB", max_num_batched_tokens=max(2048, args.prefill))
    eng = llm.engine
    if not any(type(m) is CpuRMSNorm for m in eng.model.modules()):
        raise SystemExit("the platform did not swap in the kernel's RMSNorm (no C++ kernels or not bf16)")
    start_decode_batch(llm, args.batch, 64, 20 * args.rounds)
    best = {on: min(t) for on, t in times_in_turns(use_kernel, args.rounds, lambda: decode_step_seconds(llm)).items()}
    print(f"decode batch {args.batch}: torch RMSNorm {best[False] * 1e3:.2f} ms/step, kernel {best[True] * 1e3:.2f} "
          f"({best[False] / best[True]:.3f}x)", flush=True)
    drain(llm)
    prompt = times_in_turns(use_kernel, max(3, args.rounds // 2), lambda: time_prompt_step(llm, args.prefill, 0))
    best = {on: min(t) for on, t in prompt.items()}
    use_kernel(True)
    print(f"{args.prefill}-token prompt: torch RMSNorm {best[False] * 1e3:.1f} ms, kernel {best[True] * 1e3:.1f} "
          f"({best[False] / best[True]:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
