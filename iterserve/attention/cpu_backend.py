"""Decode attention by iterserve's C++ CPU kernel (iterserve/csrc/cpu_kernels.cpp), which reads
each sequence's K/V rows straight from the paged cache instead of gathering a padded copy first.

The kernels module is handed in by the platform that loaded it (platform/cpu_kernels.py), so this
file neither builds nor finds it.
"""
from __future__ import annotations

from types import ModuleType

import torch

from iterserve.attention.backend import AttentionBackend
from iterserve.attention.metadata import AttentionMetadata, DecodeMetadata
from iterserve.attention.torch_attention import write_kv


class CpuKernelAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMetadata,
               scale: float) -> torch.Tensor:
        return self.kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                   scale)


class BatchInvariantCpuAttentionBackend(CpuKernelAttentionBackend):
    """Batch-invariant mode (EngineConfig.batch_invariant): every query of a step, prefill ones
    included, goes through the decode kernel, which computes each (sequence, head) alone in one
    fixed order. So a token's attention output is the same bits whether it was computed in a
    prefill, a chunk, a decode, or a recompute after preemption, and whatever else shares the step
    (SDPA's prefill path blocks its reduction by the query count)."""

    name = "cpu_batch_invariant"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        tables, lens = meta.per_query_tables()
        return self.kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
