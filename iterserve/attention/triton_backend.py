"""A Triton paged-attention decode kernel: one query token per sequence, K/V read in place.

The torch path (`torch_attention.decode_attention`) copies every sequence's blocks into a padded
[B, kv_heads, L, D] tensor before attending; on a GPU that copy costs as much as the attention
itself. This kernel reads each key and value row straight from the paged cache through the block
table, once, and keeps a running (online) softmax, so nothing of size B x L is ever materialised.

Grid: one program per (sequence, kv head). A program holds the GROUP query heads that share its
kv head (GQA) as the rows of one tile, so each K/V row is loaded once for all of them; tiles of
BLOCK_N context tokens are gathered through the block table token by token, which makes the tile
independent of the cache's block size (1 to 128 all work). Scores and the softmax run in float32.
A sliding window (window W > 0) starts the loop at the tile holding the window's first key and
masks the keys before it (never loaded: their blocks may be gone); a soft-cap (softcap c > 0) maps
each score s to c * tanh(s / c) before the softmax.

Triton is an optional dependency, imported when the kernel is first defined: this module imports
on machines without it (`triton_available` says whether the backend can run). With
TRITON_INTERPRET=1 set before the first call, the same kernel runs on CPU tensors (the tests).
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from iterserve.attention.backend import AttentionBackend
from iterserve.attention.metadata import DecodeMetadata

BLOCK_N = 32  # context tokens per tile
MIN_DOT = 16  # tl.dot needs every tile dimension >= 16


@functools.cache
def _kernel():
    """Compiles nothing yet: defines the @triton.jit kernel on first use (needs triton)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["stride_tb"])
    def paged_decode_kernel(
        Q, K, V, O, Tables, Lens, scale, window, softcap,
        stride_qb, stride_qh, stride_ob, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_tb,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, SOFTCAP: tl.constexpr,  # SOFTCAP: softcap > 0
    ):
        LOG2E: tl.constexpr = 1.4426950408889634  # scores go to exp2
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        ctx = tl.load(Lens + seq)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        n = tl.arange(0, TILE_N)
        heads = kvh * GROUP + g
        qmask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
        q = tl.load(Q + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        lo = tl.maximum(ctx - window, 0)  # the first key the query sees
        for start in range((lo // TILE_N) * TILE_N, ctx, TILE_N):
            pos = start + n
            valid = (pos >= lo) & (pos < ctx)
            blk = tl.load(Tables + seq * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            off = pos % BLOCK_SIZE
            kvmask = valid[:, None] & (d[None, :] < HEAD_DIM)
            k = tl.load(K + blk[:, None] * stride_kb + off[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                        mask=kvmask, other=0.0)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")  # [GROUP_PAD, TILE_N]
            if SOFTCAP:  # tanh(x) = 2 sigmoid(2x) - 1, which saturates at +-1 (exp overflows to inf, not NaN)
                s = softcap * LOG2E * (2.0 / (1.0 + tl.exp(s * (-2.0 * scale / softcap))) - 1.0)
            else:
                s = s * (scale * LOG2E)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + blk[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                        mask=kvmask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + seq * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty),
                 mask=qmask)

    return paged_decode_kernel


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _pow2_at_least(x: int, floor: int) -> int:
    return max(floor, 1 << (x - 1).bit_length())


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: DecodeMetadata, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Same contract as `torch_attention.decode_attention`: q [B, heads, D], one query per sequence at
    its last position (already written to the cache) -> [B, heads, D]."""
    B, H, D = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    tables = meta.block_tables
    out = torch.empty_like(q)
    group = H // kv_heads
    # no window (0) goes in as the widest one, whose first key is 0 for any context
    _kernel()[(B, kv_heads)](
        q, k_cache, v_cache, out, tables, meta.context_lens, scale, window or 2 ** 31 - 1, float(softcap),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0),
        GROUP=group, GROUP_PAD=_pow2_at_least(group, MIN_DOT), HEAD_DIM=D, D_PAD=_pow2_at_least(D, MIN_DOT),
        BLOCK_SIZE=block_size, TILE_N=BLOCK_N, SOFTCAP=softcap > 0,
    )
    return out


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    reads_8bit_kv = False  # its kernel reads float caches only

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMetadata,
               scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        return decode_attention_triton(q, k_cache, v_cache, meta, scale, window, softcap)
