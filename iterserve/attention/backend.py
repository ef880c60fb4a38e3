"""The interface every attention backend implements, and the portable torch backend.

A backend computes one layer's paged attention for a step: it writes the step's new K/V into the
cache, then attends each query to its own sequence's context. Backends differ only in how they run
the decodes (one query per sequence, the part of a step that reads the whole cache) and, where they
have a kernel for it, the prefill chunks (by default the torch path: SDPA per sequence, already
fused on CUDA), so `forward` lives here once and a backend overrides `decode` and `prefill`.

The platform picks one backend when the engine starts (attention/selector.py); the runner hands it
to every layer through the forward context. Nothing here knows which device it runs on.
"""
from __future__ import annotations

import torch

from iterserve.attention.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata
from iterserve.attention.torch_attention import decode_attention, prefill_attention, write_kv


class AttentionBackend:
    """Base class: `forward` for a whole step, `decode` for the decodes (what subclasses supply).
    `name` is what EngineConfig.decode_attention and the logs call the backend."""

    name: str = ""
    reads_8bit_kv: bool = True  # whether it reads fp8 and q8_0 caches (kv_cache_dtype.py); else refused at start

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMetadata,
               scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """q: [B, heads, D], one query per sequence at its last position (already written to the
        cache) -> [B, heads, D]. window, softcap: as in torch_attention's docstring (0 = off)."""
        raise NotImplementedError

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: PrefillMetadata, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """q, k, v: [T, heads, D] of the step's prefill chunks, concatenated (their K/V already written
        to the cache) -> [T, heads, D], causal within each sequence (and within the window)."""
        return prefill_attention(q, k, v, k_cache, v_cache, meta, scale, window, softcap)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Stores the step's k, v [T, kv_heads, D] in their slots, in the cache's format (the torch
        form, torch_attention.write_kv, unless a backend has a kernel for it)."""
        write_kv(k_cache, v_cache, k, v, slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """Writes this step's k, v [T, kv_heads, D] to the cache, then attends q [T, heads, D]. window:
        the layer's sliding window (0: none), softcap: its attention-logit cap (0.0: none)."""
        k_cache, v_cache = kv_cache
        self.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        d = meta.num_decode_tokens
        if meta.prefill is None:
            return self.decode(q, k_cache, v_cache, meta.decode, scale, window, softcap)
        pre = self.prefill(q[d:], k[d:], v[d:], k_cache, v_cache, meta.prefill, scale, window, softcap)
        if meta.decode is None:
            return pre
        return torch.cat([self.decode(q[:d], k_cache, v_cache, meta.decode, scale, window, softcap), pre])


class TorchAttentionBackend(AttentionBackend):
    """The portable path: gathers each sequence's blocks and runs one masked SDPA (any device)."""

    name = "torch"

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMetadata,
               scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        return decode_attention(q, k_cache, v_cache, meta, scale, window, softcap)
