"""The step's state that layers read without it being an argument of the model's tensor code: the
attention metadata, KV caches and backend, and the per-step extras of features that act on the
projections (the LoRA rows by adapter slot). The runner sets it around each forward pass
(`forward_context(...)`); every layer reads it through the one accessor, `get_forward_context()`.

Why: `torch.compile` specialises a graph on every Python value it sees. The attention metadata
changes every step (block tables, context lengths, how many decodes), so the compiled decoder
never sees it: each layer calls the opaque `iterserve::paged_attention` op with its layer index,
and the op reads the metadata, the cache and the backend from here (vLLM's forward context does
the same). The LoRA deltas are added by forward hooks on the projections (lora/layers.py says why
hooks), which read the step's batch from here too: None in a step with no adapter rows.

It lives in attention/ because attention's op is what needs it most and its fields are attention's
types; a feature's extra is typed here by what the layers call on it (`ProjectionDeltas`), so
attention/ imports nothing of lora/. The context belongs to the thread that runs the step, so
engines stepping in different threads of one process never read each other's.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from iterserve.attention.backend import AttentionBackend
from iterserve.attention.metadata import AttentionMetadata


class ProjectionDeltas(Protocol):
    """One step's additions to the projections' outputs (lora/layers.py's LoRABatch)."""

    def apply(self, key: tuple[int, str], x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Adds the delta of projection `key` (layer, module) for input rows `x` to `out`; returns it."""
        ...


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: AttentionBackend
    lora: ProjectionDeltas | None = None  # the step's LoRA rows; None: no row carries an adapter
    # per layer, its KV cache group's metadata (core/kv_groups.py: each group has its own block
    # tables and slots); None: every layer reads `meta` (one group)
    layer_meta: list[AttentionMetadata] | None = None

    def meta_for(self, layer: int) -> AttentionMetadata:
        return self.meta if self.layer_meta is None else self.layer_meta[layer]


_local = threading.local()  # .current: the running step's ForwardContext, per thread


@contextmanager
def forward_context(meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    backend: AttentionBackend, lora: ProjectionDeltas | None = None,
                    layer_meta: list[AttentionMetadata] | None = None) -> Iterator[None]:
    prev = getattr(_local, "current", None)
    _local.current = ForwardContext(meta, kv_caches, backend, lora, layer_meta)
    try:
        yield
    finally:
        _local.current = prev


def get_forward_context() -> ForwardContext:
    """The running step's context on this thread; RuntimeError outside a step."""
    current = getattr(_local, "current", None)
    if current is None:
        raise RuntimeError("a layer read the step's state outside forward_context(): run the model through "
                           "ModelRunner, which sets the step's metadata, caches, attention backend and LoRA rows")
    return current
