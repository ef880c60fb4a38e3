"""Which decode-attention implementation a device gets: a kernel that reads the paged cache in
place (C++ on CPU, Triton on CUDA) or the portable torch path.

Both share `attention.decode_attention`'s contract (q [B, heads, D], K/V already in the paged
cache [num_blocks, block_size, kv_heads, D], `DecodeMetadata`) so the model never knows which ran.
Prefill chunks always take the torch path (SDPA per sequence), which is already fused on CUDA.

ITERSERVE_DECODE_ATTENTION=torch|cpu|triton forces one (to compare them, or to step around a broken
install); otherwise CUDA takes Triton when it is installed, and CPU takes the C++ kernel when it
builds (model/cpu_kernels.py), torch when not. (flash-attn's
paged KV would need 256-token pages; --block-size stops at 128, so it is not wired in.)
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger("iterserve.attention")

DecodeFn = Callable[..., torch.Tensor]
BACKENDS = ("torch", "cpu", "triton")


def _available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@functools.cache
def select_decode_attention(device: torch.device) -> DecodeFn:
    """The decode attention callable for this device (chosen once per device, logged)."""
    from iterserve.model.attention import decode_attention
    from iterserve.model.cpu_kernels import decode_attention_cpu, load_cpu_kernels
    from iterserve.model.triton_attention import decode_attention_triton

    forced = os.environ.get("ITERSERVE_DECODE_ATTENTION") or None
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"ITERSERVE_DECODE_ATTENTION={forced!r}: use one of {', '.join(BACKENDS)}")
    if forced == "cpu" and load_cpu_kernels() is None:
        raise RuntimeError("ITERSERVE_DECODE_ATTENTION=cpu, but the CPU kernels did not load (see the log)")
    if forced:
        name = forced
    elif torch.device(device).type == "cpu":
        name = "cpu" if load_cpu_kernels() is not None else "torch"
    elif torch.device(device).type == "cuda" and _available("triton"):
        name = "triton"
    else:
        name = "torch"
    log.info("decode attention on %s: %s", device, name)
    return {"torch": decode_attention, "cpu": decode_attention_cpu, "triton": decode_attention_triton}[name]
