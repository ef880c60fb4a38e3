"""The C++ CPU decode-attention kernel (iterserve/csrc/attention_decode.cpp) against the torch path.

Same random cases as the Triton kernel's tests: shuffled block tables, contexts ending inside, at
and just past a block boundary, several block sizes, head dims and GQA ratios; float32 must agree
to float rounding, bfloat16 to bf16 rounding; the parallel and single-thread paths must agree; and
the engine's greedy output must not change when the kernel replaces the torch path. Sliding windows
and soft-capping against a dense float64 reference, with the slots before the window poisoned (and
their blocks' ids out of the cache) to show they are never read; the batch-invariant backend
(every query through this kernel) honours the window. And the rms_norm kernel's Gemma form.
The numeric tests run on the native build and, on an AVX-512 host, the AVX2 one too (conftest's
kernel_variant), as do the Q8_0 GEMM (its portable loop on AVX2: no AVX2 intrinsics path) and the prefill
kernel's refusal where AVX512-BF16 is missing.
"""
from __future__ import annotations

import pytest
import torch

from iterserve.attention.cpu_backend import BatchInvariantCpuAttentionBackend, CpuKernelAttentionBackend
from iterserve.attention.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata
from iterserve.attention.selector import select_attention_backend
from iterserve.attention.torch_attention import decode_attention
from iterserve.config import EngineConfig
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.selector import get_platform

from attention_cases import (CONTEXT_LENS, HEAD_DIM, decode_reference, poison_unread_slots, random_case,
                             reference_attention, sequence_kv)

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU kernels did not build here (see the log)")


def decode_attention_cpu(q, k_cache, v_cache, meta, scale, window=0, softcap=0.0, build=kernels):
    """The decode kernel through its backend; `build`: the kernels module (a variant's)."""
    return CpuKernelAttentionBackend(build).decode(q, k_cache, v_cache, meta, scale, window, softcap)


@pytest.mark.parametrize("head_dim, block_size, group", [(64, 16, 1), (64, 16, 3), (64, 32, 3), (80, 8, 4),
                                                         (128, 64, 8), (32, 1, 2), (72, 16, 3), (36, 8, 1)])
def test_float32_matches_torch(head_dim, block_size, group, variant_kernels):
    q, k_cache, v_cache, meta = random_case(CONTEXT_LENS + [33, 2, 300], block_size, group, head_dim=head_dim)
    scale = head_dim ** -0.5
    want = decode_attention(q, k_cache, v_cache, meta, scale)
    got = decode_attention_cpu(q, k_cache, v_cache, meta, scale, build=variant_kernels)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                  (torch.bfloat16, torch.float32)])
def test_bfloat16_within_rounding_of_float32(q_dtype, cache_dtype, variant_kernels):
    """bf16 inputs are widened exactly and accumulated in float32, so the only error left is the
    rounding of the output to bf16 (half an ulp: 2**-8 relative)."""
    q, k_cache, v_cache, meta = random_case(CONTEXT_LENS, block_size=16, group=3)
    q, k_cache, v_cache = q.to(q_dtype), k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    scale = HEAD_DIM ** -0.5
    want = decode_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    got = decode_attention_cpu(q, k_cache, v_cache, meta, scale, build=variant_kernels)
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


WINDOWS = [1, 5, 16, 17, 40, 100, 1000]  # inside a block, a block, across blocks, the whole context, more


@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("block_size, group", [(16, 3), (1, 2), (8, 1)])
def test_window_and_softcap_match_dense_reference(block_size, group, q_dtype, cache_dtype, variant_kernels):
    """A window W: only each sequence's last W keys (W = 1: the query's own); a soft-cap of 5 on
    scores scaled up to ~N(0, 16), where it bends most of them. float32 to float rounding, bf16 to
    the output's rounding."""
    q, k_cache, v_cache, meta = random_case(CONTEXT_LENS + [33, 2, 300], block_size, group)
    q, k_cache, v_cache = (q * 4).to(q_dtype), k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    scale = HEAD_DIM ** -0.5
    tol = dict(rtol=1e-5, atol=1e-5) if q_dtype == torch.float32 else dict(rtol=2 ** -8, atol=1e-5)
    for window in [0] + WINDOWS:
        for softcap in (0.0, 5.0):
            want = decode_reference(q, k_cache, v_cache, meta, scale, window, softcap)
            got = decode_attention_cpu(q, k_cache, v_cache, meta, scale, window, softcap, build=variant_kernels)
            assert got.dtype == q_dtype
            torch.testing.assert_close(got.double(), want, **tol, msg=f"window {window} softcap {softcap}")


@pytest.mark.parametrize("block_size", [1, 16])
def test_keys_before_the_window_are_never_read(block_size):
    """The slots before each sequence's window hold 1e4 and the ids of the blocks wholly before it
    point outside the cache (they may be freed): the kernel neither reads nor checks them."""
    lens, window = [17, 5, 40, 100], 7
    q, k_cache, v_cache, meta = random_case(lens, block_size, group=3)
    scale = HEAD_DIM ** -0.5
    before = decode_attention_cpu(q, k_cache, v_cache, meta, scale, window, 5.0)
    poison_unread_slots(k_cache, v_cache, meta, window)
    for b, n in enumerate(lens):
        meta.block_tables[b, :max(0, n - window) // block_size] = k_cache.shape[0]
    assert torch.equal(decode_attention_cpu(q, k_cache, v_cache, meta, scale, window, 5.0), before)


def test_batch_invariant_backend_honours_the_window():
    """Every query of a step (two decodes, a fresh prompt chunk and a chunk after a cached prefix)
    through the decode kernel, each as a decode at its own position: each sees its own window."""
    g = torch.Generator().manual_seed(3)
    bs, kvh, group, D, window = 16, 2, 3, HEAD_DIM, 6
    lens = {"d0": 30, "d1": 9, "p0": 20, "p1": 45}  # tokens in cache after the step
    new = {"d0": 1, "d1": 1, "p0": 20, "p1": 11}  # of which this step's
    need = {s: -(-n // bs) for s, n in lens.items()}
    num_blocks = sum(need.values()) + 2
    k_cache, v_cache = (torch.randn(num_blocks, bs, kvh, D, generator=g).bfloat16() for _ in range(2))
    perm, tables = torch.randperm(num_blocks, generator=g).tolist(), {}
    for s in lens:
        tables[s], perm = torch.tensor(perm[:need[s]] + [0] * (4 - need[s])), perm[need[s]:]
    T = sum(new.values())
    q = (torch.randn(T, kvh * group, D, generator=g) * 4).bfloat16()
    k, v = (torch.randn(T, kvh, D, generator=g).bfloat16() for _ in range(2))
    slots = torch.cat([tables[s][torch.arange(lens[s] - new[s], lens[s]) // bs] * bs
                       + torch.arange(lens[s] - new[s], lens[s]) % bs for s in lens])
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=2,
        decode=DecodeMetadata(block_tables=torch.stack([tables["d0"], tables["d1"]]),
                              context_lens=torch.tensor([30, 9]), max_context_len=30),
        prefill=PrefillMetadata(block_tables=torch.stack([tables["p0"], tables["p1"]]), query_lens=[20, 11],
                                context_lens=[20, 45]))
    got = BatchInvariantCpuAttentionBackend(kernels).forward(q, k, v, (k_cache, v_cache), meta, 0.125, window, 5.0)
    want, start = [], 0
    for s, n in lens.items():
        ks, vs = (sequence_kv(c, tables[s], n) for c in (k_cache, v_cache))
        want.append(reference_attention(q[start:start + new[s]], ks, vs, torch.arange(n - new[s], n), 0.125,
                                        window, 5.0))
        start += new[s]
    torch.testing.assert_close(got.double(), torch.cat(want), rtol=2 ** -8, atol=1e-5)


def test_rms_norm_unit_offset_is_gemmas():
    """unit_offset: transformers' GemmaRMSNorm, out = bf16(x * r * (1 + w)) in float32 (one
    rounding, after the weight); only the sum of squares' order may move a value by a bf16 ulp.
    Without it, the Llama form (x * r rounded to bf16 first, then times w)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    g = torch.Generator().manual_seed(0)
    for dim in (640, 100):
        ref = GemmaRMSNorm(dim, eps=1e-6)
        ref.weight.data = (torch.randn(dim, generator=g) * 0.5).bfloat16()
        for rows in (1, 7, 100):
            x = (torch.randn(rows, dim, generator=g) * 3).bfloat16()
            with torch.no_grad():
                want = ref(x)
            got = kernels.rms_norm(x, ref.weight.data, 1e-6, True)
            assert got.dtype == torch.bfloat16
            differ = got != want
            assert differ.float().mean().item() <= 1e-3, f"{rows} x {dim}: {differ.sum().item()} differ"
            assert ((got.float() - want.float()).abs() <= want.float().abs() / 128).all()
    x = torch.randn(5, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    xf = x.float()
    llama = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert ((kernels.rms_norm(x, w, 1e-6, False).float() - llama.float()).abs() <= llama.float().abs() / 64).all()


def test_bad_inputs_get_clear_errors():
    q, k_cache, v_cache, meta = random_case([17, 5], block_size=16, group=3)
    with pytest.raises(RuntimeError, match=">= 0"):
        kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.1, -1, 0.0)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_are_read_in_place(dtype, variant_kernels):
    """q, k and v as the layer hands them over, views of the fused QKV output whose rows are strided:
    the decode kernel and kv_write read them in place, with the numbers of contiguous copies (and a
    view whose heads are not contiguous is copied first, as before)."""
    q, k_cache, v_cache, meta = random_case(CONTEXT_LENS, block_size=16, group=3)
    B, H, D = q.shape
    KVH = k_cache.shape[2]
    fused = torch.randn(B, H + 2 * KVH, D).to(dtype)  # [q | k | v] rows, as Attention.forward views them
    fused[:, :H] = q.to(dtype)
    qv, kv, vv = fused[:, :H], fused[:, H:H + KVH], fused[:, H + KVH:]
    assert not qv.is_contiguous() and not kv.is_contiguous()
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    want = decode_attention_cpu(qv.contiguous(), k_cache, v_cache, meta, 0.125, build=variant_kernels)
    assert torch.equal(decode_attention_cpu(qv, k_cache, v_cache, meta, 0.125, build=variant_kernels), want)
    heads_apart = qv.transpose(0, 1).contiguous().transpose(0, 1)  # [B, H, D], a row's heads B * D apart
    assert heads_apart.stride(1) != D
    assert torch.equal(decode_attention_cpu(heads_apart, k_cache, v_cache, meta, 0.125, build=variant_kernels), want)
    slots = torch.randperm(k_cache.shape[0] * k_cache.shape[1])[:B]
    for x in (kv, vv):
        got, ref = k_cache.clone(), k_cache.clone()
        variant_kernels.kv_write(x, got, slots)
        variant_kernels.kv_write(x.contiguous(), ref, slots)
        assert torch.equal(got, ref) and not torch.equal(got, k_cache)


def test_widen_bf16_is_torchs_float(variant_kernels):
    """The LM head's logits widened by the kernels: torch's .float() values (bf16 widens exactly),
    rows strided or not, a row's scalar tail, NaN and infinities kept."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1003, generator=g).to(torch.bfloat16)
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for v in (x, x[:, 1:], x[:1]):
        got = variant_kernels.widen_bf16(v)
        assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), v.float().view(torch.int32))
    with pytest.raises(RuntimeError, match="bf16"):
        variant_kernels.widen_bf16(x.float())


def test_a_bf16_engines_head_gives_float32_logits():
    """On the CPU platform the LM head returns float32 (the model's .float() copies nothing), the values
    of its bf16 output widened."""
    from iterserve.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype="bfloat16", kv_cache_memory="64MiB"))
    head = eng.model.lm_head
    assert head.float_out
    h = torch.randn(16, head.in_features).to(torch.bfloat16)
    with torch.inference_mode():
        got = head(h)
        head.float_out = False
        try:
            want = head(h)
        finally:
            head.float_out = True
    assert got.dtype == torch.float32 and want.dtype == torch.bfloat16 and torch.equal(got, want.float())


def test_first_argmax_is_torch_argmax(variant_kernels):
    """The sampler's greedy choice on the CPU platform (csrc/argmax.cpp) gives torch.argmax's index:
    the first of equal maxima (-0 and +0 equal), the first NaN of a row with NaNs, +inf over finite, an
    all -inf row's first; rows shorter than a vector and with a tail, strided rows."""
    from iterserve.platform.cpu import kernel_argmax

    g = torch.Generator().manual_seed(0)
    for vocab in (1, 7, 17, 100, 49152, 49157):
        x = torch.randint(0, 4, (12, vocab), generator=g).float()  # every row full of ties
        x[1, torch.randperm(vocab, generator=g)[:3]] = float("nan")
        x[2] = float("-inf")
        x[3, [vocab // 2, vocab - 1]] = float("inf")
        x[4, -1] = 10.0
        x[5] = 0.0
        x[5, : vocab // 2] = -0.0
        x[6, -1] = float("nan")
        x[7] = torch.randn(vocab, generator=g)
        assert torch.equal(variant_kernels.first_argmax(x), x.argmax(dim=-1)), vocab
        if vocab > 1:  # rows `vocab` apart, each one shorter
            assert torch.equal(variant_kernels.first_argmax(x[:, 1:]), x[:, 1:].argmax(dim=-1)), vocab
    argmax = kernel_argmax(variant_kernels)
    bf16 = torch.randn(3, 50, generator=g).to(torch.bfloat16)  # not the kernel's: torch's path, same index
    assert torch.equal(argmax(bf16), bf16.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        variant_kernels.first_argmax(bf16)
    with pytest.raises(RuntimeError, match="no values"):
        variant_kernels.first_argmax(torch.zeros(2, 0))


def test_the_runners_sample_with_the_platforms_argmax(make_engine):
    """The CPU platform hands its kernel argmax to the engine's runner (Platform.argmax), and greedy
    decoding with it is greedy decoding with torch's (the same tokens)."""
    from iterserve.sampling import SamplingParams

    engine = make_engine()
    assert engine.runner.sampler.argmax is engine.platform.argmax
    assert engine.platform.argmax.__qualname__.startswith("kernel_argmax")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def greedy() -> list[int]:
        engine.add_request(params=params, prompt_token_ids=[5, 9, 13, 2, 7])
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [t for o in engine.step() for t in o.new_token_ids]
        return tokens

    fast = greedy()
    engine.runner.sampler.argmax = lambda x: x.argmax(dim=-1)
    assert fast == greedy() and len(fast) == 8


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_q8_0_gemm_is_the_product_of_its_exact_weights(x_dtype, variant_kernels):
    """Weights on the Q8_0 grid (recovered exactly), float32 accumulation: what is left is the
    summation order and, for bf16 activations, the output's rounding. Every row count of a few, odd N,
    K of one block and of several."""
    from test_cpu_linear import on_q8_grid

    from iterserve.platform.cpu_linear import pack_q8_0

    for n, k in ((37, 32), (200, 96)):
        w = on_q8_grid(n, k, seed=n)
        packed = pack_q8_0(w)
        for rows in (1, 2, 3, 5, 9):
            x = torch.randn(rows, k).to(x_dtype)
            got = variant_kernels.q8_0_gemm(x, *packed)
            assert got.dtype == x_dtype and got.shape == (rows, n)
            tol = dict(rtol=2 ** -8, atol=1e-5) if x_dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.float(), x.float() @ w.t(), **tol, msg=f"{n} x {k}, rows {rows}")


def test_prefill_kernel_refuses_a_build_without_avx512_bf16(kernel_variant, variant_kernels):
    """The prefill kernel has an AVX512-BF16 path only: a build without it (the AVX2 one) refuses it
    by name, and the backend keeps torch's prefill there."""
    if variant_kernels.bf16_gemm_is_vectorised():
        pytest.skip(f"the {kernel_variant} build has AVX512-BF16: tests/test_cpu_prefill_attention.py runs it")
    q, k_cache, v_cache, meta = random_case([20], block_size=16, group=3)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        variant_kernels.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables[0], 20, 0.125)
    assert not CpuKernelAttentionBackend(variant_kernels).prefill_kernel_fits(q, k_cache)


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
