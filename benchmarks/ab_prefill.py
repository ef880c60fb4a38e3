"""Prompt-carrying steps with the C++ prefill-attention kernel against torch's SDPA for the chunks,
in one process and interleaved (A, B, A, B, ...), so a shared host's noise hits both alike; the best
step of the rounds is kept. Each step: D running decodes (context 64) plus one fresh C-token prompt
(no prefix-cache hit). The decodes run on the C++ decode kernel in both.

    python benchmarks/ab_prefill.py --kinds 0:1024 8:256 8:512 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from decode_speed import drain, start_decode_batch  # noqa: E402  (sibling scripts)
from profile_step import time_prompt_step  # noqa: E402

from iterserve.attention.backend import AttentionBackend  # noqa: E402
from iterserve.attention.cpu_backend import CpuKernelAttentionBackend  # noqa: E402
from iterserve.llm import LLM  # noqa: E402


class TorchPrefillBackend(CpuKernelAttentionBackend):
    """The C++ decode kernel with the torch path (SDPA per chunk) for the prefill chunks: the engine
    before the prefill kernel."""
    prefill = AttentionBackend.prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kinds", nargs="+", default=["0:1024", "8:256", "8:512"], metavar="D:C",
                    help="D decodes plus one C-token prompt per step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--extra", default="{}", help="JSON of EngineConfig fields")
    args = ap.parse_args()
    kinds = [tuple(int(x) for x in k.split(":")) for k in args.kinds]
    extra = json.loads(args.extra)
    extra.setdefault("max_num_batched_tokens", max(2048, max(d + c for d, c in kinds)))
    llm = LLM(args.model, kv_cache_memory="1GiB", **extra)
    eng = llm.engine
    ours = eng.runner.attention
    if not isinstance(ours, CpuKernelAttentionBackend) or not ours.kernels.bf16_gemm_is_vectorised():
        raise SystemExit(f"needs the C++ attention backend with AVX512-BF16 (got {ours.name})")
    backends = {"torch SDPA": TorchPrefillBackend(ours.kernels), "kernel": ours}

    rows = []
    for d, c in kinds:
        if d:
            start_decode_batch(llm, d, 64, 4 + 2 * args.rounds * len(backends))
        best = dict.fromkeys(backends, float("inf"))
        for _ in range(args.rounds):
            for name, backend in backends.items():
                eng.runner.attention = backend
                best[name] = min(best[name], time_prompt_step(llm, c, d))
        eng.runner.attention = ours
        drain(llm)
        row = {"decodes": d, "chunk": c} | {k: round(v * 1e3, 1) for k, v in best.items()}
        row["speedup"] = round(best["torch SDPA"] / best["kernel"], 2)
        rows.append(row)
        print(f"{d:3d} decodes + {c:4d}-token prompt: torch SDPA {row['torch SDPA']:7.1f} ms, kernel "
              f"{row['kernel']:7.1f} ms ({row['speedup']:.2f}x)", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
