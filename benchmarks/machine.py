"""Two figures that say what kind of machine a benchmark ran on, printed beside its results: memory
bandwidth (a large tensor copy in 2 MiB pages: decoding small batches is bound by reading weights) and bf16 and
float32 GEMM throughput through torch (prefill and large batches are bound by it; on AMX hosts oneDNN uses the
tiles). Hosts of one "kind" differ 2x in both, so a result without them cannot be compared.
"""
from __future__ import annotations

from typing import Any

import torch

from iterserve.bench.common import best_time
from iterserve.bench.summary import host_info
from iterserve.memory import empty_in_large_pages


def copy_bandwidth_gbs(mib: int = 256, reps: int = 5) -> float:
    """GB/s of a `mib` MiB tensor copy, counting the bytes read and written (as STREAM's copy). Both
    tensors in 2 MiB pages, as the engine's weights (the GGUF's map) and KV cache are: in 4 KiB pages
    the same copy ran at 25.6-25.8 GB/s against 27.9-28.2 on the 2-core AMX Xeon (2026-12-06), and a
    bound taken from the slower figure flattered every ratio to it."""
    src = empty_in_large_pages((mib * 2**20 // 4,), torch.float32).fill_(1.0)
    dst = empty_in_large_pages((src.numel(),), torch.float32).fill_(0.0)
    return 2 * src.numel() * 4 / best_time(lambda: dst.copy_(src), reps) / 1e9


def read_bandwidth_gbs(gib: int = 1, reps: int = 5) -> float:
    """GB/s of summing a `gib` GiB float32 tensor: reads only, as a decode step reads its weights
    (the bound of a single stream: bytes read a token over this). In 2 MiB pages, as the weights are
    mapped: on the 2-core AMX Xeon (2026-12-06) 33.7 GB/s against 23.6 in 4 KiB pages, and 27.5-28.5
    for the same sum over the 1B GGUF's own map."""
    x = empty_in_large_pages((gib * 2**28,), torch.float32).fill_(1.0)
    return x.numel() * 4 / best_time(x.sum, reps) / 1e9


def gemm_gflops(dtype: torch.dtype = torch.bfloat16, n: int = 1024, reps: int = 5) -> float:
    """GFLOP/s of an n x n x n matmul through torch in `dtype` (bf16: oneDNN, AMX tiles where present;
    float32: MKL, the rate an AVX2-only CPU's float32 engine can reach, where bf16 crawls)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / best_time(lambda: torch.mm(a, b), reps) / 1e9


def best_gemm_gflops(fig: dict[str, Any]) -> float:
    """The faster of the host's bf16 and float32 GEMM figures: the compute bound of a step counts the
    best dense rate the host has (bf16 crawls without AVX512-BF16, where the engine runs float32)."""
    return max(fig["bf16_gemm_1024_gflop_s"], fig.get("f32_gemm_1024_gflop_s", 0.0))


def machine_figures() -> dict[str, Any]:
    """host_info() plus the bandwidth and GEMM figures, and torch's thread count for them."""
    return {**host_info(), "copy_gb_s": round(copy_bandwidth_gbs(), 1),
            "bf16_gemm_1024_gflop_s": round(gemm_gflops(torch.bfloat16), 1),
            "f32_gemm_1024_gflop_s": round(gemm_gflops(torch.float32), 1), "torch_threads": torch.get_num_threads()}


def figures_line(fig: dict[str, Any]) -> str:
    return (f"host: {fig['cpu']}, {fig['cores']} cores, {' '.join(fig['isa'])}; copy {fig['copy_gb_s']} GB/s, "
            f"bf16 GEMM 1024^3 {fig['bf16_gemm_1024_gflop_s']} GFLOP/s, float32 {fig.get('f32_gemm_1024_gflop_s', '-')} "
            f"({fig['torch_threads']} threads)")
