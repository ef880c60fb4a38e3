"""Decode and prefill attention by iterserve's C++ CPU kernels (iterserve/csrc/attention_decode.cpp, attention_prefill.cpp),
which read each sequence's K/V rows straight from the paged cache instead of gathering a padded
copy first. The prefill kernel (flash-attention style on AVX512-BF16) replaces torch's SDPA for bf16
chunks: torch's CPU flash kernel was a third of a 1024-token prefill step (docs/profile.md).

The kernels module is handed in by the platform that loaded it (platform/cpu_kernels.py), so this
file neither builds nor finds it.
"""
from __future__ import annotations

from types import ModuleType

import torch

from iterserve.attention.backend import AttentionBackend
from iterserve.attention.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata


KERNEL_KV_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)  # kv_write's caches (uint8: q8_0)


class CpuKernelAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """A float32, bf16 or q8_0 cache is written by the kernel (the torch form's bytes, in one pass
        instead of a cast and an index_copy_, or ~15 ops for q8_0); fp8 by the torch form."""
        if k_cache.dtype not in KERNEL_KV_DTYPES or k.dtype not in (torch.float32, torch.bfloat16):
            return super().write_kv(k_cache, v_cache, k, v, slot_mapping)
        self.kernels.kv_write(k, k_cache, slot_mapping)
        self.kernels.kv_write(v, v_cache, slot_mapping)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMetadata,
               scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        return self.kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                   scale, window, softcap)

    def prefill_kernel_fits(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """The prefill kernel's domain: bf16 queries, a bf16 or 8-bit cache, a build with AVX512-BF16,
        head_dim a multiple of 32 and at most 24 query heads per KV head; elsewhere the torch path runs."""
        return (q.dtype == torch.bfloat16 and k_cache.dtype != torch.float32 and q.shape[-1] % 32 == 0
                and q.shape[1] // k_cache.shape[2] <= 24 and self.kernels.bf16_gemm_is_vectorised())

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: PrefillMetadata, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        if not self.prefill_kernel_fits(q, k_cache):
            return super().prefill(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
        outs, start = [], 0
        for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            outs.append(self.kernels.paged_prefill_attention(q[start:start + n], k_cache, v_cache,
                                                             meta.block_tables[i], ctx, scale, window, softcap))
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class BatchInvariantCpuAttentionBackend(CpuKernelAttentionBackend):
    """Batch-invariant mode (EngineConfig.batch_invariant): every query of a step, prefill ones
    included, goes through the decode kernel, which computes each (sequence, head) alone in one
    fixed order. So a token's attention output is the same bits whether it was computed in a
    prefill, a chunk, a decode, or a recompute after preemption, and whatever else shares the step
    (SDPA's prefill path blocks its reduction by the query count)."""

    name = "cpu_batch_invariant"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        self.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        # each query as a decode ending at its own position: the kernel's window is then that query's own
        tables, lens = meta.per_query_tables()
        return self.kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window, softcap)
