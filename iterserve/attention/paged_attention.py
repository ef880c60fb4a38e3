"""The one attention op the model calls: `paged_attention(q, k, v, layer, scale, window=0, softcap=0.0)`
(window: the layer's sliding window in tokens, softcap: its attention-logit cap; 0 turns either off).

It is a custom torch op (`torch.ops.iterserve.paged_attention`), opaque to torch.compile, that
takes the step's metadata, caches and backend from the forward context (forward_context.py says
why), so the compiled decoder never sees them; eager runs call its kernel function straight
(custom_ops.py). Importing this module registers the op.
"""
from __future__ import annotations

import torch

from iterserve.attention.forward_context import get_forward_context
from iterserve.custom_ops import call_directly

_lib = torch.library.Library("iterserve", "FRAGMENT")
_lib.define("paged_attention(Tensor q, Tensor k, Tensor v, int layer, float scale, int window=0, "
            "float softcap=0.0) -> Tensor")


def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                        window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [T, heads, D], this step's k and v [T, kv_heads, D] -> [T, heads, D]."""
    ctx = get_forward_context()
    return ctx.backend.forward(q, k, v, ctx.kv_caches[layer], ctx.meta_for(layer), scale, window, softcap)


_lib.impl("paged_attention", _paged_attention_op, "CompositeExplicitAutograd")


@torch.library.register_fake("iterserve::paged_attention")
def _paged_attention_fake(q, k, v, layer, scale, window=0, softcap=0.0):
    return q.new_empty(q.shape)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                    window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The op under torch.compile and the profiler; its kernel function straight in eager runs
    (custom_ops.call_directly: the dispatcher's round trip costs more than a short decode's attention)."""
    op = _paged_attention_op if call_directly() else torch.ops.iterserve.paged_attention
    return op(q, k, v, layer, scale, window, softcap)
