"""Decode attention by iterserve's C++ CPU kernel (iterserve/csrc/cpu_kernels.cpp), which reads
each sequence's K/V rows straight from the paged cache instead of gathering a padded copy first.

The kernels module is handed in by the platform that loaded it (platform/cpu_kernels.py), so this
file neither builds nor finds it.
"""
from __future__ import annotations

from types import ModuleType

import torch

from iterserve.attention.backend import AttentionBackend
from iterserve.attention.metadata import DecodeMetadata


class CpuKernelAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMetadata,
               scale: float) -> torch.Tensor:
        return self.kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                   scale)
