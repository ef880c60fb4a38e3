"""gguf_gemm of this checkout against another checkout's build, in one process and interleaved (A, B,
A, B, ...), weights cold: each call reads a different copy of the weight, ~300 MB of copies in all,
so the blocks come from memory as in a model's step and not from L3 (one 1B projection is 2-20 MB:
timed warm, a kernel that reorders its reads looks better than it is). Both builds must give the
same bits; prints the best ms of the rounds per row count and old / new.

    python benchmarks/ab_gguf_gemm.py --baseline-src OLD_CHECKOUT \
        --shape Q4_K:2048x8192 --shape Q6_K:4096x14336 --rows 1 4 8 16 32

A shape is TYPE:NxK, TYPE Q4_K, Q5_K or Q6_K (N output rows, K inputs; random_gguf.py's random blocks).
--int8 runs both builds on int8 activations (--gguf-activations int8); with --other-sums where the
new build sums in another order (e.g. the interleaved many-row path against a build without it);
--amx runs the new build's int8 K-quant shards of 16+ rows on AMX-INT8 tiles.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from iterserve.memory import in_large_pages
from iterserve.model.gguf_file import QuantShard
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_linear import pack_gguf_twin

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import figures_line, machine_figures  # noqa: E402  (sibling scripts)
from random_gguf import random_blocks  # noqa: E402


def baseline_kernels(src: str) -> ModuleType:
    """The other checkout's kernels: built by its own loader (in a subprocess, its own build folder),
    then the library loaded here by path under its own name."""
    code = ("import sys; sys.path.insert(0, '.'); from iterserve.platform.cpu_kernels import load_cpu_kernels; "
            "print(load_cpu_kernels().__file__)")
    path = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-src", required=True, help="an iterserve checkout to compare against")
    ap.add_argument("--shape", action="append", help="TYPE:NxK (repeatable; default a 1B's and an 8B's)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold-bytes", type=float, default=300e6, help="bytes of weight copies cycled through")
    ap.add_argument("--other-sums", action="store_true",
                    help="the builds sum in another order: print the largest difference relative to the output's "
                         "scale instead of refusing different bits")
    ap.add_argument("--int8", action="store_true",
                    help="int8 activations for the K-quants (--gguf-activations int8), in both builds")
    ap.add_argument("--amx", action="store_true",
                    help="the new build's int8 K-quant shards of 16+ rows on AMX-INT8 tiles (gguf_gemm amx=True)")
    ap.add_argument("--baseline-amx", action="store_true",
                    help="the baseline build on AMX-INT8 too (a checkout with gguf_gemm's amx argument)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(figures_line(machine_figures()))
    old, new = baseline_kernels(args.baseline_src), load_cpu_kernels()
    shapes = args.shape or ["Q4_K:16384x2048", "Q4_K:2048x8192", "Q6_K:2048x8192", "Q4_K:4096x14336",
                            "Q6_K:4096x14336"]
    print("| shape | " + " | ".join(f"{r} rows: old / new ms" for r in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for spec in shapes:
        qtype, dims = spec.split(":")
        n, k = (int(v) for v in dims.split("x"))
        blocks = torch.from_numpy(random_blocks(n, k, QT[qtype], np.random.default_rng(0)))
        buf, meta = pack_gguf_twin([QuantShard(0, n, k, qtype, blocks)], k)
        # in 2 MiB pages, as a model's blocks are (4 KiB pages read ~30 % slower on the AMX Xeon)
        copies = [in_large_pages(buf) for _ in range(max(2, int(args.cold_bytes // buf.numel())))]
        cells = []
        for rows in args.rows:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
            new_call = (lambda w: new.gguf_gemm(x, w, meta, n, args.int8, True)) if args.amx else (
                lambda w: new.gguf_gemm(x, w, meta, n, args.int8))
            old_call = (lambda w: old.gguf_gemm(x, w, meta, n, args.int8, True)) if args.baseline_amx else (
                lambda w: old.gguf_gemm(x, w, meta, n, args.int8))
            a, b = old_call(buf).float(), new_call(buf).float()
            if args.other_sums:
                print(f"{spec} at {rows} rows: largest difference {((a - b).abs().max() / a.abs().max()).item():.2e}"
                      " of the largest output", file=sys.stderr)
            elif not torch.equal(a, b):
                raise SystemExit(f"{spec} at {rows} rows: the two builds differ")
            best = {"old": float("inf"), "new": float("inf")}
            for _ in range(args.rounds):
                for name, call in (("old", old_call), ("new", new_call)):
                    t0 = time.perf_counter()
                    for b in copies:
                        call(b)
                    best[name] = min(best[name], (time.perf_counter() - t0) / len(copies))
            cells.append(f"{best['old'] * 1e3:.2f} / {best['new'] * 1e3:.2f} (x{best['old'] / best['new']:.2f})")
        print(f"| {spec} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
