"""Attention over the paged KV cache.

The runner hands every layer one `AttentionMetadata` for the step's flat token batch, laid out as
vLLM does: first the decodes (one new token per sequence), then the prefill chunks (several new
tokens per sequence, possibly after an already-cached prefix). Each layer writes its new K/V into
the cache slots named by `slot_mapping`, then attends each query to its own sequence's context.

The two halves take different paths because they have different shapes: decodes are one query
row per sequence, batched in one masked SDPA over the gathered blocks; prefills are long and few,
so each runs alone at its exact length (no padding to the step's longest query: a step that mixes a
500-token prompt with 15 decodes must not compute 16 x 500 query rows).

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size
+ offset. The torch path here runs anywhere and has no Python loop over decoding sequences; on
CUDA, decodes go to a Triton kernel that reads blocks in place (model/decode_backend.py picks).

The model reaches all this through one op, `torch.ops.iterserve.paged_attention(q, k, v, layer,
scale)`, registered at the bottom: it takes the step's metadata and caches from the forward context,
so a compiled decoder never sees them (forward_context.py says why).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from iterserve.model.decode_backend import select_decode_attention
from iterserve.model.forward_context import get_forward_context


@dataclass
class DecodeMetadata:
    """The first `num_seqs` tokens of the batch: one new token per sequence."""
    block_tables: torch.Tensor  # [B, max_blocks] (padded with 0)
    context_lens: torch.Tensor  # [B] tokens in cache after this step's write
    max_context_len: int
    _plan: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    def gather_plan(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids to gather [B * n], key mask [B, 1, 1, n * block_size]): the same for every
        layer of a step, so built once, at the first layer."""
        if self._plan is None:
            flat = block_ids(self.block_tables, self.max_context_len, block_size)
            key_pos = torch.arange(flat.numel() // self.num_seqs * block_size, device=self.context_lens.device)
            mask = (key_pos.unsqueeze(0) < self.context_lens.unsqueeze(1)).view(self.num_seqs, 1, 1, -1)
            self._plan = (flat, mask)
        return self._plan


@dataclass
class PrefillMetadata:
    """The rest of the batch: chunks of `query_lens[i]` tokens, in order."""
    block_tables: torch.Tensor  # [P, max_blocks]
    query_lens: list[int]
    context_lens: list[int]  # cached prefix + this chunk

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_decode_tokens: int
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Stores this step's keys and values [T, kv_heads, head_dim] into their cache slots."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def block_ids(tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The ids of the blocks holding each sequence's first `length` tokens, flattened [B * n]."""
    return tables[:, :-(-length // block_size)].reshape(-1)


def gather_blocks(cache: torch.Tensor, flat: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[B, kv_heads, L, D] copy of the blocks `flat` names (L = whole blocks per sequence).
    index_select copies whole blocks; ~2x faster than cache[tables]."""
    _, bs, kvh, d = cache.shape
    return cache.index_select(0, flat).view(num_seqs, -1, kvh, d).transpose(1, 2)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: DecodeMetadata, scale: float) -> torch.Tensor:
    """q: [B, heads, D], one query per sequence at its last position -> [B, heads, D]."""
    B, H, D = q.shape
    flat, mask = meta.gather_plan(k_cache.shape[1])
    k, v = gather_blocks(k_cache, flat, B), gather_blocks(v_cache, flat, B)  # [B, kvh, L, D]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                         scale=scale, enable_gqa=(H != k.shape[1]))
    return out.view(B, H, D)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: PrefillMetadata, scale: float) -> torch.Tensor:
    """q, k, v: [T, heads, D] of the prefill chunks, concatenated -> [T, heads, D], causal.

    A chunk with no cached prefix attends to its own fresh K/V (no cache read); a later chunk
    reads its whole context from the cache, with query j at absolute position ctx - q_len + j."""
    out = q.new_empty(q.shape)
    H = q.shape[1]
    start = 0
    for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
        qi = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if ctx == n:
            ki = k[start:start + n].transpose(0, 1).unsqueeze(0)
            vi = v[start:start + n].transpose(0, 1).unsqueeze(0)
            mask = None
        else:
            flat = block_ids(meta.block_tables[i:i + 1], ctx, k_cache.shape[1])
            ki = gather_blocks(k_cache, flat, 1)[:, :, :ctx].to(q.dtype)
            vi = gather_blocks(v_cache, flat, 1)[:, :, :ctx].to(q.dtype)
            qpos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos  # [n, ctx]
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=(H != ki.shape[1]))
        out[start:start + n] = o[0].transpose(0, 1)
        start += n
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Writes this step's k, v [T, kv_heads, D] to the cache, then attends q [T, heads, D]."""
    k_cache, v_cache = kv_cache
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    d = meta.num_decode_tokens
    decode = select_decode_attention(q.device)
    if meta.prefill is None:
        return decode(q, k_cache, v_cache, meta.decode, scale)
    pre = prefill_attention(q[d:], k[d:], v[d:], k_cache, v_cache, meta.prefill, scale)
    if meta.decode is None:
        return pre
    return torch.cat([decode(q[:d], k_cache, v_cache, meta.decode, scale), pre])


# ---- the op the model calls: opaque to torch.compile (see forward_context.py) ------------------------
_lib = torch.library.Library("iterserve", "FRAGMENT")
_lib.define("paged_attention(Tensor q, Tensor k, Tensor v, int layer, float scale) -> Tensor")


def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                        scale: float) -> torch.Tensor:
    ctx = get_forward_context()
    return paged_attention(q, k, v, ctx.kv_caches[layer], ctx.meta, scale)


_lib.impl("paged_attention", _paged_attention_op, "CompositeExplicitAutograd")


@torch.library.register_fake("iterserve::paged_attention")
def _paged_attention_fake(q, k, v, layer, scale):
    return q.new_empty(q.shape)
