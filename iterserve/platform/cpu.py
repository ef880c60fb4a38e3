"""The CPU platform: bf16 where the CPU has native bf16 instructions, iterserve's C++ kernels
(decode attention, bf16 / Q4_1 / Q8_0 GEMMs) where they build, weights re-laid out once at load,
and a KV cache sized by a memory budget.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from iterserve.attention.selector import select_attention_backend
from iterserve.config import EngineConfig, ModelConfig, parse_size
from iterserve.cpu_info import cpu_flags
from iterserve.model.loader import ModelSource, is_four_bit_checkpoint
from iterserve.platform.base import Platform, kv_bytes_per_block, parse_dtype
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_linear import (bf16_gemm_layout, bf16_linears_available, four_bit_max_tokens,
                                           int4_kernel_available, optimize_cpu_linears)

log = logging.getLogger("iterserve.platform")

Q8_HEAD_MAX_TOKENS = 4  # sampled rows; the Q8_0 LM head loses to bf16 from 8 (docs/profile.md)


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """bfloat16 GEMMs beat float32 only with native bf16 instructions (AVX512-BF16 or AMX);
    without them torch emulates bf16 and is slower than float32."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def cpu_dtype(name: str) -> torch.dtype:
    return (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32) if name == "auto" else parse_dtype(name)


class CpuPlatform(Platform):
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.kernels: ModuleType | None = load_cpu_kernels() if config.cpu_kernels else None
        if not config.cpu_kernels:
            log.info("CPU kernels off (cpu_kernels=False): torch and oneDNN paths only")
        super().__init__(config, device, dtype, select_attention_backend(config.decode_attention, device,
                                                                         self.kernels))
        self.layout = bf16_gemm_layout(config.bf16_gemm, self.kernels)  # validates the choice too
        self.int4_max_tokens = 0  # set by prepare_model when the projections get a 4-bit twin
        self.q8_head_max_tokens = 0

    def prepare_model(self, model: nn.Module, source: ModelSource) -> None:
        """In bf16: weights laid out once for a bf16 GEMM (ours, or oneDNN's), and (quantization) a
        4-bit twin of the projections and a Q8_0 twin of the LM head for steps of few tokens, where
        decoding is bound by reading weights (platform/cpu_linear.py). The head's twin needs the
        C++ CPU kernels."""
        q = self.config.quantization
        if self.dtype != torch.bfloat16 or not bf16_linears_available(self.kernels):
            if q == "int4":
                raise ValueError("quantization=int4 needs a CPU bfloat16 run (oneDNN bf16 and torch's CPU int4 kernel)")
            return
        use_int4 = q == "int4" or (q == "auto" and int4_kernel_available() and is_four_bit_checkpoint(source))
        self.int4_max_tokens = four_bit_max_tokens(self.layout) if use_int4 else 0
        self.q8_head_max_tokens = Q8_HEAD_MAX_TOKENS if use_int4 and self.kernels is not None else 0
        n = optimize_cpu_linears(model, self.layout, self.int4_max_tokens, self.q8_head_max_tokens, self.kernels)
        log.info("CPU bf16: %d projections laid out for %s%s%s", n,
                 "our tiled bf16 GEMM" if self.layout == "tiled" else "oneDNN",
                 f", 4-bit twin for steps of <= {self.int4_max_tokens} tokens" if use_int4 else "",
                 f", Q8_0 LM head for <= {self.q8_head_max_tokens} sampled rows" if self.q8_head_max_tokens else "")

    def num_kv_blocks(self, model_config: ModelConfig, profile_run: Callable[[], None]) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        return max(1, parse_size(cfg.kv_cache_memory) // kv_bytes_per_block(model_config, cfg.block_size, self.dtype))

    def resolved(self) -> dict[str, Any]:
        return {**super().resolved(), "cpu_kernels": self.kernels is not None, "bf16_gemm": self.layout,
                "quantization": "int4" if self.int4_max_tokens else "none"}
