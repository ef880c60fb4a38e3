"""The CUDA platform: bfloat16 by default, Triton decode attention when installed, and a KV cache
sized by profiling (vLLM's recipe: run a forward pass at the token budget, measure the peak, give
what --gpu-memory-utilization leaves to KV blocks)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from iterserve.attention.selector import select_attention_backend
from iterserve.config import EngineConfig, ModelConfig
from iterserve.platform.base import Platform, kv_bytes_per_block, parse_dtype


def cuda_dtype(name: str) -> torch.dtype:
    return torch.bfloat16 if name == "auto" else parse_dtype(name)


class CudaPlatform(Platform):
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        if config.quantization == "int4":
            raise ValueError("quantization=int4 needs a CPU bfloat16 run (oneDNN bf16 and torch's CPU int4 kernel)")
        super().__init__(config, device, dtype, select_attention_backend(config.decode_attention, device))

    def num_kv_blocks(self, model_config: ModelConfig, profile_run: Callable[[], None]) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = kv_bytes_per_block(model_config, cfg.block_size, self.kv_cache)
        torch.cuda.reset_peak_memory_stats()
        profile_run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        avail = total * cfg.gpu_memory_utilization - peak
        if avail < per_block:
            raise RuntimeError(f"no GPU memory left for the KV cache at gpu_memory_utilization="
                               f"{cfg.gpu_memory_utilization} (peak {peak / 2**30:.1f} GiB)")
        return int(avail // per_block)

    def resolved(self) -> dict[str, Any]:
        return {**super().resolved(), "cpu_kernels": False, "bf16_gemm": None, "quantization": "none"}
