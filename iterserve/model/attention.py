"""Attention over the paged KV cache.

The runner hands every layer one `AttentionMetadata` describing the step's flat token batch: a mix
of prefill chunks of different lengths and single-token decodes. Each layer writes its new K/V into
the cache slots named by `slot_mapping`, then attends each query to its own sequence's cached
context through that sequence's block table.

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size
+ offset. The torch path below runs anywhere (no Python loop over sequences); on CUDA a fused
kernel can replace `paged_attention` behind the same signature (see model/cuda_attention.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] block ids of each sequence (padded with 0)
    context_lens: torch.Tensor  # [B] tokens in cache for each sequence after this step's writes
    query_lens: list[int]  # new tokens of each sequence this step
    query_start_loc: torch.Tensor  # [B + 1] offsets of each sequence's tokens in the flat batch
    max_query_len: int
    max_context_len: int
    # gather indices for the padded torch path: flat token t -> (sequence, index within its query)
    token_seq: torch.Tensor | None = None  # [T]
    token_qpos: torch.Tensor | None = None  # [T]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Stores this step's keys and values [T, kv_heads, head_dim] into their cache slots."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim], causal within each sequence.

    Gathers each sequence's context through its block table into a padded [B, L, kv_heads, D]
    tensor (L = blocks * block_size) and runs one masked SDPA over the batch. The query at index
    j of a sequence with q_len new tokens and ctx_len cached tokens sits at position
    ctx_len - q_len + j and may see keys 0..that position.
    """
    T, H, D = q.shape
    B = meta.num_seqs
    bs = k_cache.shape[1]
    kvh = k_cache.shape[2]
    nblk = -(-meta.max_context_len // bs)
    tables = meta.block_tables[:, :nblk]
    L = nblk * bs
    flat = tables.reshape(-1)  # index_select copies whole blocks; ~2x faster than k_cache[tables]
    k = k_cache.index_select(0, flat).view(B, L, kvh, D).transpose(1, 2)  # [B, kvh, L, D]
    v = v_cache.index_select(0, flat).view(B, L, kvh, D).transpose(1, 2)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    key_pos = torch.arange(L, device=q.device)
    ctx = meta.context_lens.unsqueeze(1)  # [B, 1]
    if meta.decode_only:
        qb = q.view(B, 1, H, D).transpose(1, 2)  # [B, H, 1, D]
        mask = (key_pos.unsqueeze(0) < ctx).view(B, 1, 1, L)
    else:
        Q = meta.max_query_len
        qb = q.new_zeros(B, Q, H, D)
        qb[meta.token_seq, meta.token_qpos] = q
        qb = qb.transpose(1, 2)  # [B, H, Q, D]
        qlens = torch.tensor(meta.query_lens, device=q.device).unsqueeze(1)
        qpos = ctx - qlens + torch.arange(Q, device=q.device).unsqueeze(0)  # [B, Q] absolute position
        mask = (key_pos.view(1, 1, L) <= qpos.unsqueeze(2)) & (key_pos.view(1, 1, L) < ctx.unsqueeze(2))
        mask = mask.unsqueeze(1)  # [B, 1, Q, L]
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=(H != kvh))
    out = out.transpose(1, 2)  # [B, Q, H, D]
    if meta.decode_only:
        return out.reshape(T, H, D)
    return out[meta.token_seq, meta.token_qpos]
