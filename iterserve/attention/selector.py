"""Which attention backend a run gets: the registry of backends and the one choice among them.

`decode_attention` (EngineConfig; default from ITERSERVE_DECODE_ATTENTION, else auto) names one of
BACKENDS, or auto: CUDA takes Triton when it is installed, CPU takes the C++ kernel when the
platform loaded it, anything else the torch path. Forcing one is for comparing them or for stepping
around a broken install. The platform calls this once, at engine start (platform/selector.py).
(flash-attn's paged KV would need 256-token pages; --block-size stops at 128, so it is not wired in.)
"""
from __future__ import annotations

import logging
from types import ModuleType

import torch

from iterserve.attention.backend import AttentionBackend, TorchAttentionBackend
from iterserve.attention.cpu_backend import CpuKernelAttentionBackend
from iterserve.attention.triton_backend import TritonAttentionBackend, triton_available

log = logging.getLogger("iterserve.attention")

BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "cpu": CpuKernelAttentionBackend,
    "triton": TritonAttentionBackend,
}
CHOICES = ("auto", *BACKENDS)


def resolve_backend_name(choice: str, device: torch.device, cpu_kernels: ModuleType | None) -> str:
    """The backend `choice` means on this device ("auto" resolved); raises when it cannot run."""
    if choice not in CHOICES:
        raise ValueError(f"decode_attention={choice!r} (--decode-attention / ITERSERVE_DECODE_ATTENTION): "
                         f"use one of {', '.join(CHOICES)}")
    if choice == "cpu" and cpu_kernels is None:
        raise RuntimeError("decode_attention=cpu, but the CPU kernels are off or did not load (see the log)")
    if choice != "auto":
        return choice
    if device.type == "cpu" and cpu_kernels is not None:
        return "cpu"
    if device.type == "cuda" and triton_available():
        return "triton"
    return "torch"


def select_attention_backend(choice: str, device: torch.device,
                             cpu_kernels: ModuleType | None = None) -> AttentionBackend:
    """A backend instance for `choice` on `device`; `cpu_kernels` is the loaded C++ module or None."""
    name = resolve_backend_name(choice, device, cpu_kernels)
    log.info("decode attention on %s: %s", device, name)
    if name == "cpu":
        return CpuKernelAttentionBackend(cpu_kernels)
    return BACKENDS[name]()
