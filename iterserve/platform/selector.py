"""The platform's one entry point: `get_platform(config)` resolves the device ("auto": CUDA when
available) and dtype, and returns the Platform that owns everything device-specific."""
from __future__ import annotations

import torch

from iterserve.config import EngineConfig
from iterserve.platform.base import Platform
from iterserve.platform.cpu import CpuPlatform, cpu_dtype
from iterserve.platform.cuda import CudaPlatform, cuda_dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def get_platform(config: EngineConfig, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> Platform:
    """The platform for config.device and config.dtype; `device` and `dtype` override both (a model
    loaded elsewhere and shared between engines decides its own). Validates the dtype either way."""
    resolved = resolve_device(config.device)
    device = device or resolved
    if device.type == "cuda":
        want = cuda_dtype(config.dtype)
        return CudaPlatform(config, device, dtype or want)
    if device.type == "cpu":
        want = cpu_dtype(config.dtype)
        # float32 only because this CPU lacks fast bf16 (not asked for, nor a loaded model's own): the
        # KV cache stays bf16 under --kv-cache-dtype auto
        auto_float32 = dtype is None and config.dtype == "auto" and want == torch.float32
        return CpuPlatform(config, device, dtype or want, kv_bf16_for_float32=auto_float32)
    raise ValueError(f"device {device} is not supported: use auto, cpu or cuda[:N]")
