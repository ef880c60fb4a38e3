"""The Triton decode kernel against the torch decode path, run by Triton's interpreter on CPU.

Random caches whose block tables are shuffled (a sequence's blocks are scattered and interleaved
with other sequences'), contexts that end inside, exactly at and just past a block boundary, block
sizes 16 and 32, GQA ratios 1 and 3, and a batch mixing all those lengths in one launch. Sliding
windows and soft-capping against a dense float64 reference, the keys before the window never read.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is defined: run it with numpy on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from iterserve.attention.selector import select_attention_backend  # noqa: E402
from iterserve.attention.torch_attention import decode_attention  # noqa: E402
from iterserve.attention.triton_backend import decode_attention_triton  # noqa: E402
from iterserve.config import EngineConfig  # noqa: E402

from attention_cases import (CONTEXT_LENS, HEAD_DIM, decode_reference, poison_unread_slots,  # noqa: E402
                             random_case)


def check(context_lens: list[int], block_size: int, group: int, head_dim: int = HEAD_DIM) -> None:
    q, k_cache, v_cache, meta = random_case(context_lens, block_size, group, head_dim=head_dim)
    scale = head_dim ** -0.5
    want = decode_attention(q, k_cache, v_cache, meta, scale)
    got = decode_attention_triton(q, k_cache, v_cache, meta, scale)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("context_len", CONTEXT_LENS)
def test_single_sequence_matches_torch(context_len, block_size, group):
    check([context_len], block_size, group)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_torch(block_size, group):
    check(CONTEXT_LENS + [33, 2], block_size, group)


@pytest.mark.parametrize("head_dim, block_size, group", [(80, 8, 4), (128, 64, 8), (32, 1, 2)])
def test_other_shapes_match_torch(head_dim, block_size, group):
    """Head dims that are not a power of two, blocks smaller and larger than the kernel's 32-token
    tile (one tile then spans several blocks, or a block several tiles), wider GQA groups."""
    check(CONTEXT_LENS, block_size, group, head_dim=head_dim)


def test_half_precision_within_rounding_of_float32():
    """A 16-bit cache takes the kernel's 16-bit tl.dot path (scores and softmax stay float32).
    float16 stands in for bfloat16 here: Triton 3.9's interpreter multiplies bfloat16 tiles as raw
    bits (its tl.dot on bf16 returns ~1e10), so bf16 is only checked on a GPU (gpu_check.sh)."""
    q, k_cache, v_cache, meta = random_case(CONTEXT_LENS, block_size=16, group=3)
    scale = HEAD_DIM ** -0.5
    want = decode_attention(q, k_cache, v_cache, meta, scale)
    half = [t.half() for t in (q, k_cache, v_cache)]
    got = decode_attention_triton(*half, meta, scale)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=5e-3)


def test_unread_slots_do_not_leak():
    """Slots past a sequence's context (the rest of its last block) and blocks in no table are
    never read: filling them with huge values changes nothing."""
    q, k_cache, v_cache, meta = random_case([17, 5], block_size=16, group=3)
    scale = HEAD_DIM ** -0.5
    before = decode_attention_triton(q, k_cache, v_cache, meta, scale)
    poison_unread_slots(k_cache, v_cache, meta)
    torch.testing.assert_close(decode_attention_triton(q, k_cache, v_cache, meta, scale), before)


@pytest.mark.parametrize("block_size, group", [(16, 3), (1, 2), (32, 1)])
def test_window_and_softcap_match_dense_reference(block_size, group):
    """Windows inside a tile, at a block, across tiles and blocks, W = 1 and wider than the context
    (the loop starts at the window's first tile); a soft-cap of 5 on scores scaled up to ~N(0, 16)."""
    q, k_cache, v_cache, meta = random_case(CONTEXT_LENS + [33, 2, 70], block_size, group)
    q = q * 4
    scale = HEAD_DIM ** -0.5
    for window in (0, 1, 5, 16, 17, 40, 1000):
        for softcap in (0.0, 5.0):
            want = decode_reference(q, k_cache, v_cache, meta, scale, window, softcap)
            got = decode_attention_triton(q, k_cache, v_cache, meta, scale, window, softcap)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5,
                                       msg=f"window {window} softcap {softcap}")


def test_keys_before_the_window_are_never_read():
    """The slots before each sequence's window hold 1e4 and the ids of the blocks wholly before it
    point outside the cache (they may be freed): the result is the same."""
    lens, window, bs = [17, 5, 40, 100], 7, 8
    q, k_cache, v_cache, meta = random_case(lens, bs, group=3)
    scale = HEAD_DIM ** -0.5
    before = decode_attention_triton(q, k_cache, v_cache, meta, scale, window, 5.0)
    poison_unread_slots(k_cache, v_cache, meta, window)
    for b, n in enumerate(lens):
        meta.block_tables[b, :max(0, n - window) // bs] = 10_000
    torch.testing.assert_close(decode_attention_triton(q, k_cache, v_cache, meta, scale, window, 5.0), before)


def test_selection_honours_the_override(monkeypatch):
    """The environment variable is EngineConfig.decode_attention's default; the config picks."""
    cpu = torch.device("cpu")
    monkeypatch.setenv("ITERSERVE_DECODE_ATTENTION", "torch")
    assert select_attention_backend(EngineConfig().decode_attention, cpu).name == "torch"
    monkeypatch.setenv("ITERSERVE_DECODE_ATTENTION", "triton")
    assert select_attention_backend(EngineConfig().decode_attention, cpu).name == "triton"
    assert EngineConfig(decode_attention="torch").decode_attention == "torch"  # a given value wins
    monkeypatch.setenv("ITERSERVE_DECODE_ATTENTION", "cuda-magic")
    with pytest.raises(ValueError, match="ITERSERVE_DECODE_ATTENTION"):
        EngineConfig()
    with pytest.raises(ValueError, match="decode_attention"):
        select_attention_backend("cuda-magic", cpu)


def test_engine_greedy_output_unchanged_with_triton_decode(tiny_loaded, monkeypatch):
    """The tiny model through the whole engine (runner-built tables, q sliced from the step's
    batch, decodes mixed with prefill chunks): same tokens and logprobs with either decode path."""
    from iterserve.llm import LLM
    from iterserve.sampling import SamplingParams

    prompts = [[100 + (37 * i + 11 * j) % 3000 for j in range(5 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)

    def generate():
        llm = LLM(loaded=tiny_loaded, block_size=8, max_num_seqs=4, max_num_batched_tokens=24,
                  kv_cache_memory="8MiB")
        return llm.generate(prompts, params, use_tqdm=False)

    monkeypatch.setenv("ITERSERVE_DECODE_ATTENTION", "torch")
    want = generate()
    monkeypatch.setenv("ITERSERVE_DECODE_ATTENTION", "triton")
    got = generate()
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        diff = max(abs(a[0] - b[0]) for a, b in zip(g.logprobs, w.logprobs))
        assert diff < 1e-4, f"logprobs differ by {diff:.2e}"
