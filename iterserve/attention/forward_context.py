"""The step's attention state (metadata, KV caches and backend), visible to every layer without
being an argument of the model's tensor code.

Why: `torch.compile` specialises a graph on every Python value it sees. The attention metadata
changes every step (block tables, context lengths, how many decodes), so the compiled decoder
never sees it: each layer calls the opaque `iterserve::paged_attention` op with its layer index,
and the op reads the metadata, the cache and the backend from here (vLLM's forward context does
the same). The runner sets it around each forward pass. It also carries the step's LoRA rows by
adapter slot (lora/layers.py's LoRABatch), which the projections' hooks read; None in a step with
no adapter rows. The context belongs to the thread that
runs the step, so engines stepping in different threads of one process never read each other's.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from iterserve.attention.backend import AttentionBackend
from iterserve.attention.metadata import AttentionMetadata


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: AttentionBackend
    lora: Any = None  # lora.layers.LoRABatch, or None


_local = threading.local()  # .current: the running step's ForwardContext, per thread


@contextmanager
def forward_context(meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    backend: AttentionBackend, lora: Any = None) -> Iterator[None]:
    prev = getattr(_local, "current", None)
    _local.current = ForwardContext(meta, kv_caches, backend, lora)
    try:
        yield
    finally:
        _local.current = prev


def get_forward_context() -> ForwardContext:
    current = getattr(_local, "current", None)
    if current is None:
        raise RuntimeError("paged attention called outside forward_context(): run the model through "
                           "ModelRunner, which sets the step's metadata, caches and attention backend")
    return current


def current_lora() -> Any:
    """The running step's LoRA batch on this thread; None outside a step or with no adapter rows."""
    current = getattr(_local, "current", None)
    return None if current is None else current.lora
