"""The reference attention over the paged KV cache, in plain torch: runs on any device.

The decode and prefill halves of a step take different paths because they have different shapes:
decodes are one query row per sequence, batched in one masked SDPA over the gathered blocks;
prefills are long and few, so each runs alone at its exact length (no padding to the step's longest
query: a step that mixes a 500-token prompt with 15 decodes must not compute 16 x 500 query rows).
Nothing here loops in Python over decoding sequences.

Every backend (attention/backend.py) writes K/V and runs prefills with these functions; the
kernel backends replace only `decode_attention`, whose contract they share.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from iterserve.attention.metadata import DecodeMetadata, PrefillMetadata, block_ids


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Stores this step's keys and values [T, kv_heads, head_dim] into their cache slots."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_blocks(cache: torch.Tensor, flat: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[B, kv_heads, L, D] copy of the blocks `flat` names (L = whole blocks per sequence).
    index_select copies whole blocks, which is cheaper than advanced indexing (cache[tables])."""
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
