"""The C++ CPU decode-attention kernel (iterserve/csrc/cpu_kernels.cpp) against the torch path.

Same random cases as the Triton kernel's tests: shuffled block tables, contexts ending inside, at
and just past a block boundary, several block sizes, head dims and GQA ratios; float32 must agree
to float rounding, bfloat16 to bf16 rounding; the parallel and single-thread paths must agree; and
the engine's greedy output must not change when the kernel replaces the torch path.
"""
from __future__ import annotations

import pytest
import torch

from iterserve.attention.cpu_backend import CpuKernelAttentionBackend
from iterserve.attention.selector import select_attention_backend
from iterserve.attention.torch_attention import decode_attention
from iterserve.config import EngineConfig
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.selector import get_platform

from attention_cases import CONTEXT_LENS, HEAD_DIM, poison_unread_slots, random_case

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU kernels did not build here (see the log)")


def decode_attention_cpu(q, k_cache, v_cache, meta, scale):
    return CpuKernelAttentionBackend(kernels).decode(q, k_cache, v_cache, meta, scale)


@pytest.mark.parametrize("head_dim, block_size, group", [(64, 16, 1), (64, 16, 3), (64, 32, 3), (80, 8, 4),
                                                         (128, 64, 8), (32, 1, 2), (72, 16, 3), (36, 8, 1)])
def test_float32_matches_torch(head_dim, block_size, group):
    q, k_cache, v_cache, meta = random_case(CONTEXT_LENS + [33, 2, 300], block_size, group, head_dim=head_dim)
    scale = head_dim ** -0.5
    want = decode_attention(q, k_cache, v_cache, meta, scale)
    got = decode_attention_cpu(q, k_cache, v_cache, meta, scale)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                  (torch.bfloat16, torch.float32)])
def test_bfloat16_within_rounding_of_float32(q_dtype, cache_dtype):
    """bf16 inputs are widened exactly and accumulated in float32, so the only error left is the
    rounding of the output to bf16 (half an ulp: 2**-8 relative)."""
    q, k_cache, v_cache, meta = random_case(CONTEXT_LENS, block_size=16, group=3)
    q, k_cache, v_cache = q.to(q_dtype), k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    scale = HEAD_DIM ** -0.5
    want = decode_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    got = decode_attention_cpu(q, k_cache, v_cache, meta, scale)
    assert got.dtype == q_dtype
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-6)


def test_kernels_called_from_several_threads_at_once():
    """The kernels share one work pool: jobs from two Python threads (two engines) take turns, and
    every result is the one a lone call gives (each output row is computed by one chunk, so the
    split never changes a number)."""
    from concurrent.futures import ThreadPoolExecutor

    from iterserve.platform.cpu_linear import pack_q4_1, pack_q8_0

    q, k_cache, v_cache, meta = random_case(CONTEXT_LENS * 4, block_size=16, group=3)
    w = torch.randn(300, 128)
    x = torch.randn(3, 128).bfloat16()
    calls = {
        "attention": lambda: decode_attention_cpu(q, k_cache, v_cache, meta, 0.125),
        "q4": lambda: kernels.q4_gemm(x, *pack_q4_1(w)),
        "q8": lambda: kernels.q8_0_gemm(x, *pack_q8_0(w)),
    }
    want = {name: f() for name, f in calls.items()}
    with ThreadPoolExecutor(4) as ex:
        futures = [(name, ex.submit(f)) for _ in range(20) for name, f in calls.items()]
        for name, fut in futures:
            assert torch.equal(fut.result(), want[name]), name
    assert kernels.pool_threads() == torch.get_num_threads()


def test_unread_slots_do_not_leak():
    """Slots past a sequence's context and blocks in no table are never read."""
    q, k_cache, v_cache, meta = random_case([17, 5, 32], block_size=16, group=3)
    scale = HEAD_DIM ** -0.5
    before = decode_attention_cpu(q, k_cache, v_cache, meta, scale)
    poison_unread_slots(k_cache, v_cache, meta)
    assert torch.equal(decode_attention_cpu(q, k_cache, v_cache, meta, scale), before)


def test_bad_inputs_get_clear_errors():
    q, k_cache, v_cache, meta = random_case([17, 5], block_size=16, group=3)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, torch.tensor([17, 10_000]), 0.1)
    bad = meta.block_tables.clone()
    bad[1, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.paged_decode_attention(q, k_cache, v_cache, bad, meta.context_lens, 0.1)
    with pytest.raises(RuntimeError, match="int64"):
        kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables.int(), meta.context_lens, 0.1)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        decode_attention_cpu(q.half(), k_cache.half(), v_cache.half(), meta, 0.1)
    with pytest.raises(RuntimeError, match="GQA"):
        decode_attention_cpu(q[:, :5], k_cache, v_cache, meta, 0.1)


def _q8_in_child(x, packed):
    return load_cpu_kernels().q8_0_gemm(x, *packed)


def test_a_forked_child_still_runs_the_kernels():
    """fork() copies the work pool but not its worker thread (nor a lock that thread held): the
    child runs each job on its calling thread and gets the parent's numbers."""
    import multiprocessing as mp

    from iterserve.platform.cpu_linear import pack_q8_0

    packed = pack_q8_0(torch.randn(300, 128))
    x = torch.randn(3, 128).bfloat16()
    want = kernels.q8_0_gemm(x, *packed)  # the pool and its worker exist before the fork
    with mp.get_context("fork").Pool(1) as pool:
        got = pool.apply_async(_q8_in_child, (x, packed)).get(timeout=120)
    assert torch.equal(got, want)


def test_cpu_selects_the_kernel_and_can_be_turned_off(monkeypatch):
    """auto takes the kernel on CPU; cpu_kernels=False (ITERSERVE_CPU_KERNELS=0 as its default)
    keeps the platform from loading the kernels, so attention falls back to torch, and forcing the
    kernel then is a clear error."""
    monkeypatch.delenv("ITERSERVE_DECODE_ATTENTION", raising=False)
    monkeypatch.delenv("ITERSERVE_CPU_KERNELS", raising=False)
    cpu = torch.device("cpu")
    on = get_platform(EngineConfig(device="cpu", dtype="float32"))
    assert on.attention.name == "cpu" and on.kernels is kernels
    assert on.resolved()["cpu_kernels"] is True and on.resolved()["decode_attention"] == "cpu"
    monkeypatch.setenv("ITERSERVE_CPU_KERNELS", "0")
    off = get_platform(EngineConfig(device="cpu", dtype="float32"))
    assert off.kernels is None and off.attention.name == "torch"
    assert off.resolved()["cpu_kernels"] is False and off.resolved()["decode_attention"] == "torch"
    with pytest.raises(RuntimeError, match="CPU kernels"):
        select_attention_backend("cpu", cpu, None)


def test_engine_greedy_output_unchanged_with_the_kernel(tiny_loaded, monkeypatch):
    """The tiny model through the whole engine (decodes mixed with prefill chunks, blocks shared
    out by the pool): the same tokens and logprobs with the kernel as with the torch path."""
    from iterserve.llm import LLM
    from iterserve.sampling import SamplingParams

    prompts = [[100 + (37 * i + 11 * j) % 3000 for j in range(5 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)

    def generate(backend: str):
        monkeypatch.setenv("ITERSERVE_DECODE_ATTENTION", backend)
        llm = LLM(loaded=tiny_loaded, block_size=8, max_num_seqs=4, max_num_batched_tokens=24,
                  kv_cache_memory="8MiB")
        return llm.generate(prompts, params, use_tqdm=False)

    want, got = generate("torch"), generate("cpu")
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        diff = max(abs(a[0] - b[0]) for a, b in zip(g.logprobs, w.logprobs))
        assert diff < 1e-4, f"logprobs differ by {diff:.2e}"
