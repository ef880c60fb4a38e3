"""The step's attention state (metadata and KV caches), visible to every layer without being an
argument of the model's tensor code.

Why: `torch.compile` specialises a graph on every Python value it sees. The attention metadata
changes every step (block tables, context lengths, how many decodes), so the compiled decoder
never sees it: each layer calls the opaque `iterserve::paged_attention` op with its layer index,
and the op reads the metadata and the cache from here (vLLM's forward context does the same).
The context belongs to the thread that runs the step, so engines stepping in different threads of
one process never read each other's metadata.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
import threading
from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    meta: object  # attention.AttentionMetadata (not imported: attention imports this module)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]


_local = threading.local()  # .current: the running step's ForwardContext, per thread


@contextmanager
def forward_context(meta, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    prev = getattr(_local, "current", None)
    _local.current = ForwardContext(meta, kv_caches)
    try:
        yield
    finally:
        _local.current = prev


def get_forward_context() -> ForwardContext:
    current = getattr(_local, "current", None)
    if current is None:
        raise RuntimeError("paged attention called outside forward_context(): the model must run "
                           "through LlamaForCausalLM.forward, which sets the step's metadata")
    return current
