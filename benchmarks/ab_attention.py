"""The decode attention kernel (paged_decode_attention) of this checkout against another checkout's
build, in one process and interleaved (A, B, A, B, ...): a 16-sequence decode step's shapes by
default (Llama 3.2 1B: 32 query heads on 8 KV heads of 64, bf16 cache, 16-token blocks). Both builds
must give the same bits. Three cache states per context length, because the kernel's time is half
arithmetic and half waiting on the cache's rows:

- `l2`: every sequence reads the same blocks (the rows stay in L1 / L2: the arithmetic alone);
- `l3`: each sequence its own blocks, read again call after call (from L3);
- `cold`: the same, with 64 MB written between calls (from memory, as in a model's step, where a
  layer's weights pass between two attention calls).

    python benchmarks/ab_attention.py --baseline-src OLD_CHECKOUT --context 128 512 --rounds 5

Prints the median microseconds of each build per state and old / new.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from iterserve.platform.cpu_kernels import load_cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_gguf_gemm import baseline_kernels  # noqa: E402  (sibling scripts)
from machine import figures_line, machine_figures  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-src", required=True, help="an iterserve checkout to compare against")
    ap.add_argument("--context", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", default="32:8", help="query heads:KV heads (default 32:8)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of 20 interleaved calls per state")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(figures_line(machine_figures()))
    old, new = baseline_kernels(args.baseline_src), load_cpu_kernels()
    H, KVH = map(int, args.heads.split(":"))
    B, D, BS = args.batch, args.head_dim, args.block_size
    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    print("| context | state | old us | new us | old / new |")
    print("|---:|---|---:|---:|---:|")
    for ctx in args.context:
        per = -(-ctx // BS)
        blocks = B * per + 1
        k = torch.randn(blocks, BS, KVH, D, generator=gen).to(torch.bfloat16)
        v = torch.randn(blocks, BS, KVH, D, generator=gen).to(torch.bfloat16)
        own = torch.randperm(blocks - 1, generator=gen)[:B * per].view(B, per).contiguous()
        shared = own[:1].expand(B, per).contiguous()
        lens = torch.full((B,), ctx, dtype=torch.long)
        q = torch.randn(B, H, D, generator=gen).to(torch.bfloat16)
        for state, table in (("l2", shared), ("l3", own), ("cold", own)):
            def call(mod):
                return mod.paged_decode_attention(q, k, v, table, lens, D ** -0.5, 0, 0.0)
            a, b = call(old), call(new)
            if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                print(f"the builds differ at context {ctx}: max |diff| {(a.float() - b.float()).abs().max():.3g}")
                return 1
            times = {"old": [], "new": []}
            for _ in range(args.rounds * 20):
                for name, mod in (("old", old), ("new", new)):
                    if state == "cold":
                        flush.add_(1)
                    t = time.perf_counter()
                    call(mod)
                    times[name].append(time.perf_counter() - t)
            o, n = (statistics.median(times[x]) * 1e6 for x in ("old", "new"))
            print(f"| {ctx} | {state} | {o:.0f} | {n:.0f} | {o / n:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
