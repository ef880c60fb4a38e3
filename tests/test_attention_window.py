"""Sliding-window attention and attention-logit soft-capping on the torch path (torch_attention.py)
and through the `iterserve::paged_attention` op, against a dense float64 reference with the mask
written out (attention_cases.reference_attention: transformers' semantics).

Windows smaller than, equal to and larger than the context, W = 1, windows that start inside a
block and cross block boundaries, block sizes 1 and 16; a soft-cap of 5 on scores scaled up so that
it changes the result; float32 to float rounding, bfloat16 within bf16's. The kernels' own tests
(test_cpu_kernels.py, test_cpu_prefill_attention.py, test_triton_attention.py) check them the same way.
"""
from __future__ import annotations

import pytest
import torch

from iterserve.attention.backend import TorchAttentionBackend
from iterserve.attention.forward_context import forward_context
from iterserve.attention.metadata import AttentionMetadata, PrefillMetadata
from iterserve.attention.paged_attention import paged_attention
from iterserve.attention.torch_attention import decode_attention, prefill_attention

from attention_cases import HEAD_DIM, decode_reference, random_case, reference_attention, sequence_kv

LENS = [1, 15, 16, 17, 40, 100]
WINDOWS = [1, 5, 16, 17, 40, 100, 1000]  # inside a block, a block, across blocks, the whole context, more
SOFTCAP = 5.0
QSCALE = 4.0  # scores ~ N(0, 16): a cap of 5 bends most of them


def tolerance(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_window_and_softcap_match_dense_reference(block_size, dtype):
    q, k_cache, v_cache, meta = random_case(LENS, block_size, group=3)
    q = q * QSCALE
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    scale = HEAD_DIM ** -0.5
    for window in [0] + WINDOWS:
        for softcap in (0.0, SOFTCAP):
            want = decode_reference(q, k_cache, v_cache, meta, scale, window, softcap)
            got = decode_attention(q, k_cache, v_cache, meta, scale, window, softcap)
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), want, **tolerance(dtype), msg=f"window {window} softcap {softcap}")


def test_softcap_and_window_change_the_result():
    """The cases above are not vacuous: the cap and the window each move the output."""
    q, k_cache, v_cache, meta = random_case([100], 16, group=3)
    q = q * QSCALE
    base = decode_attention(q, k_cache, v_cache, meta, 0.125)
    assert (decode_attention(q, k_cache, v_cache, meta, 0.125, 0, SOFTCAP) - base).abs().max() > 0.1
    assert (decode_attention(q, k_cache, v_cache, meta, 0.125, 17, 0.0) - base).abs().max() > 0.1
    assert torch.equal(decode_attention(q, k_cache, v_cache, meta, 0.125, 100, 0.0), base)  # W = context


def test_gather_plan_is_cached_per_window():
    """Layers alternating windowed and global attention (Gemma 2) share one plan per window."""
    _, _, _, meta = random_case([5, 40], 16, group=1)
    flat, full = meta.gather_plan(16)
    assert meta.gather_plan(16) == (flat, full) and meta.gather_plan(16, 1000)[1] is full
    flat8, win = meta.gather_plan(16, 8)
    assert flat8 is flat and meta.gather_plan(16, 8)[1] is win
    assert win.sum().item() == 5 + 8 and full.sum().item() == 5 + 40


def prefill_case(n: int, ctx: int, block_size: int, dtype: torch.dtype, seed: int = 0):
    """One sequence's ctx tokens in a shuffled cache (q scaled up, as above); its last n are the chunk."""
    q, k_cache, v_cache, meta = random_case([ctx], block_size, group=3, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(n, q.shape[1], HEAD_DIM, generator=g) * QSCALE
    k, v = (sequence_kv(c, meta.block_tables[0], ctx) for c in (k_cache, v_cache))
    pmeta = PrefillMetadata(block_tables=meta.block_tables, query_lens=[n], context_lens=[ctx])
    cast = (t.to(dtype) for t in (q, k_cache, v_cache, k, v))
    return *cast, pmeta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_window_and_softcap_match_dense_reference(block_size, dtype):
    """Fresh chunks (n == ctx: attends to its own K/V) and chunks after a cached prefix (read from
    the cache, from the block of the first query's window on)."""
    scale = HEAD_DIM ** -0.5
    for n, ctx in [(1, 1), (17, 17), (40, 40), (1, 33), (7, 40), (20, 100)]:
        q, k_cache, v_cache, k, v, meta = prefill_case(n, ctx, block_size, dtype)
        for window in [0] + WINDOWS:
            for softcap in (0.0, SOFTCAP):
                want = reference_attention(q, k, v, torch.arange(ctx - n, ctx), scale, window, softcap)
                got = prefill_attention(q, k[ctx - n:], v[ctx - n:], k_cache, v_cache, meta, scale, window, softcap)
                assert got.dtype == dtype
                torch.testing.assert_close(got.double(), want, **tolerance(dtype),
                                           msg=f"n {n} ctx {ctx} window {window} softcap {softcap}")


def test_prefill_after_a_prefix_never_reads_blocks_before_the_window():
    """The blocks wholly before the first query's window may be freed: point the table there at a
    block that does not exist, and the result is the same."""
    q, k_cache, v_cache, k, v, meta = prefill_case(8, 100, 16, torch.float32)
    before = prefill_attention(q, k[92:], v[92:], k_cache, v_cache, meta, 0.125, 20, 0.0)  # keys 73 .. 99
    meta.block_tables[0, :4] = k_cache.shape[0]  # blocks of positions 0 .. 63
    assert torch.equal(prefill_attention(q, k[92:], v[92:], k_cache, v_cache, meta, 0.125, 20, 0.0), before)


def test_paged_attention_op_passes_window_and_softcap():
    """The op the model calls hands window and softcap to the backend (a step of two decodes and a
    prefill chunk); called without them, it is the plain causal attention it always was."""
    q_dec, k_cache, v_cache, dmeta = random_case([30, 9], 16, group=3)
    g = torch.Generator().manual_seed(5)
    H, kvh = q_dec.shape[1], k_cache.shape[2]
    # a third sequence: a fresh prompt of 12 tokens in two blocks no decode uses
    free = sorted(set(range(k_cache.shape[0])) - set(dmeta.block_tables[:, :2].flatten().tolist()))[:2]
    table = torch.tensor([free + [0] * (dmeta.block_tables.shape[1] - 2)])
    n = 12
    slots_p = table[0, torch.arange(n) // 16] * 16 + torch.arange(n) % 16
    slots_d = torch.stack([dmeta.block_tables[b, (c - 1) // 16] * 16 + (c - 1) % 16
                           for b, c in enumerate(dmeta.context_lens.tolist())])
    T = 2 + n
    q = torch.cat([q_dec, torch.randn(n, H, HEAD_DIM, generator=g)]) * QSCALE
    k, v = torch.randn(T, kvh, HEAD_DIM, generator=g), torch.randn(T, kvh, HEAD_DIM, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.cat([slots_d, slots_p]), num_decode_tokens=2, decode=dmeta,
                             prefill=PrefillMetadata(block_tables=table, query_lens=[n], context_lens=[n]))
    with forward_context(meta, [(k_cache, v_cache)], TorchAttentionBackend()):
        got = paged_attention(q, k, v, 0, 0.125, 4, SOFTCAP)
        plain = paged_attention(q, k, v, 0, 0.125)
    want = []
    for b, c in enumerate(dmeta.context_lens.tolist()):
        kb, vb = (sequence_kv(cache, dmeta.block_tables[b], c) for cache in (k_cache, v_cache))
        want.append(reference_attention(q[b:b + 1], kb, vb, [c - 1], 0.125, 4, SOFTCAP))
    want.append(reference_attention(q[2:], k[2:], v[2:], torch.arange(n), 0.125, 4, SOFTCAP))
    torch.testing.assert_close(got.double(), torch.cat(want), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain.double()[2:], reference_attention(q[2:], k[2:], v[2:], torch.arange(n), 0.125),
                               rtol=1e-5, atol=1e-5)
