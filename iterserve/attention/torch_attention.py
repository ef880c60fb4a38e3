"""The reference attention over the paged KV cache, in plain torch: runs on any device.

The decode and prefill halves of a step take different paths because they have different shapes:
decodes are one query row per sequence, batched in one masked SDPA over the gathered blocks;
prefills are long and few, so each runs alone at its exact length (no padding to the step's longest
query: a step that mixes a 500-token prompt with 15 decodes must not compute 16 x 500 query rows).
Nothing here loops in Python over decoding sequences.

Every backend (attention/backend.py) writes K/V and runs prefills with these functions; the
kernel backends replace only `decode_attention`, whose contract they share.

Every function takes the layer's sliding window (`window` W > 0: a query at position p sees keys
max(0, p - W + 1) .. p; Mistral, Gemma 2 and 3) and logit soft-cap (`softcap` c > 0: each score
becomes c * tanh(score / c); Gemma 2), as Hugging Face transformers define them; 0 turns either off.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from iterserve.attention.kv_cache_dtype import dequantise, write_rows
from iterserve.attention.metadata import DecodeMetadata, PrefillMetadata


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Stores this step's keys and values [T, kv_heads, head_dim] into their cache slots, in the
    cache's format (8-bit ones quantised on the way in: kv_cache_dtype.py)."""
    write_rows(k_cache, k, slot_mapping)
    write_rows(v_cache, v, slot_mapping)


def gather_blocks(cache: torch.Tensor, flat: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[B, kv_heads, L, W] copy of the blocks `flat` names (L = whole blocks per sequence; W: the
    cache's row width, head_dim but for q8_0).
    index_select copies whole blocks, which is cheaper than advanced indexing (cache[tables])."""
    _, bs, kvh, d = cache.shape
    return cache.index_select(0, flat).view(num_seqs, -1, kvh, d).transpose(1, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float = 0.0) -> torch.Tensor:
    """q [B, H, n, D] against k, v [B, kv_heads, L, D] (GQA by broadcast) -> [B, H, n, D] in q's dtype;
    mask: bool (True = attend), broadcast to [B, H, n, L], or None for causal (n == L).

    softcap c > 0 (Gemma 2) makes each score c * tanh(q.k * scale / c) before the softmax. SDPA has
    no such hook, so then the scores are computed here, in float32, with the mask applied by hand."""
    H, kvh = q.shape[1], k.shape[1]
    if softcap <= 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=(H != kvh))
    n, L = q.shape[2], k.shape[2]
    if mask is None:
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril()
    # [B, kvh, group, n, L]: each KV head's group of query heads against its keys, no copy of k or v
    s = q.float().unflatten(1, (kvh, H // kvh)) @ k.float().unsqueeze(2).transpose(-1, -2)
    s = torch.tanh(s.flatten(1, 2) * (scale / softcap)) * softcap
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return (p.unflatten(1, (kvh, H // kvh)) @ v.float().unsqueeze(2)).flatten(1, 2).to(q.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: DecodeMetadata, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q: [B, heads, D], one query per sequence at its last position -> [B, heads, D]. window W > 0:
    each query sees only its sequence's last W keys (itself included); softcap: see `attend`."""
    B, H, D = q.shape
    flat, mask = meta.gather_plan(k_cache.shape[1], window)
    k, v = gather_blocks(k_cache, flat, B), gather_blocks(v_cache, flat, B)  # [B, kvh, L, D]
    out = attend(q.unsqueeze(2), dequantise(k, q.dtype), dequantise(v, q.dtype), mask, scale, softcap)
    return out.view(B, H, D)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: PrefillMetadata, scale: float, window: int = 0,
                      softcap: float = 0.0) -> torch.Tensor:
    """q, k, v: [T, heads, D] of the prefill chunks, concatenated -> [T, heads, D], causal; query j of
    a chunk sits at absolute position ctx - q_len + j and, with a window W > 0, sees keys from that
    position - W + 1 on. softcap: see `attend`.

    A chunk with no cached prefix attends to its own fresh K/V (no cache read), unless the cache is
    8-bit: then every query reads the quantised rows, as its later decodes and the C++ kernel do. A
    later chunk reads its context from the cache, from the first block its first query's window
    reaches (the blocks before it may have been freed)."""
    out = q.new_empty(q.shape)
    bs = k_cache.shape[1]
    start = 0
    for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
        lo = max(0, ctx - n - window + 1) if window > 0 else 0  # the first key any query of the chunk sees
        qi = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if ctx == n and k_cache.element_size() > 1:  # then lo == 0
            ki = k[start:start + n].transpose(0, 1).unsqueeze(0)
            vi = v[start:start + n].transpose(0, 1).unsqueeze(0)
        else:
            flat = meta.block_tables[i, lo // bs:-(-ctx // bs)]
            skip = lo % bs
            ki = dequantise(gather_blocks(k_cache, flat, 1)[:, :, skip:skip + ctx - lo], q.dtype)
            vi = dequantise(gather_blocks(v_cache, flat, 1)[:, :, skip:skip + ctx - lo], q.dtype)
        mask = None  # causal, when the chunk is the whole context and no window cuts into it
        if ctx != n or 0 < window < n:
            qpos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
            kpos = torch.arange(lo, ctx, device=q.device).unsqueeze(0)
            mask = kpos <= qpos  # [n, ctx - lo]
            if window > 0:
                mask &= kpos > qpos - window
        o = attend(qi, ki, vi, mask, scale, softcap)
        out[start:start + n] = o[0].transpose(0, 1)
        start += n
    return out
