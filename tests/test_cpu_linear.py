"""CPU bf16 fast paths (platform/cpu_linear.py): prepacked oneDNN weights give the same numbers as
F.linear, our tiled bf16 GEMM the float32 product rounded to bf16; the int4 twin serves only steps of few rows, and on weights that are 4-bit already it
reproduces them up to bf16 rounding of the scales; on the embedded model the whole bf16 path
(prepacked + int4 decode) stays within a stated tolerance of float32."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_utils import make_request, new_runner, run_step, sequence_logits
from torch import nn

from iterserve.config import EngineConfig
from iterserve.engine import LLMEngine
from iterserve.llm import LLM
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_linear import (CpuLinear, bf16_gemm_layout, int4_kernel_available, optimize_cpu_linears,
                                           pack_bf16, pack_q8_0, prepack_available, tiled_gemm_amx,
                                           tiled_gemm_vectorised)
from iterserve.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not (prepack_available() and int4_kernel_available()),
                                reason="needs oneDNN bf16 and torch's CPU int4 kernel")


def on_4bit_grid(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight whose every group of 32 is d * q + m with q in 0..15, 0 and 15 both present
    (what a GGUF Q4_1 block dequantises to)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n * k // 32, 32), generator=g).float()
    q[:, 0], q[:, 1] = 0, 15
    d = torch.rand(n * k // 32, 1, generator=g) * 0.02 + 0.005
    m = -torch.rand(n * k // 32, 1, generator=g) * 0.1
    return (q * d + m).reshape(n, k)


def test_prepacked_equals_f_linear_at_every_row_count():
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True).bfloat16()
    fast = CpuLinear(lin, keep_weight=True, layout="onednn")
    for rows in (1, 2, 7, 16, 33, 300):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(fast(x), F.linear(x, lin.weight, lin.bias)), rows


needs_tiled = pytest.mark.skipif(not tiled_gemm_vectorised(load_cpu_kernels()),
                                 reason="our bf16 GEMM is not vectorised here")


@pytest.mark.parametrize("n,k", [(96, 64), (100, 576), (7, 30), (49, 1536)])
def test_tiled_bf16_gemm_is_the_float32_product_rounded_once(n, k, kernel_variant, variant_kernels):
    """Every row-tile shape (1-24 rows against one output tile, 8-row tiles against three past 24
    rows) and ragged output tiles: float32 accumulation, one rounding to bf16 at the end. The AVX2
    build has no bf16 GEMM path (it needs AVX512-BF16): there, and on any CPU without it, its scalar
    fallback is checked (never laid out by the engine: tiled needs the vectorised one)."""
    assert kernel_variant != "avx2" or not variant_kernels.bf16_gemm_is_vectorised()
    torch.manual_seed(n + k)
    lin = nn.Linear(k, n, bias=False).bfloat16()
    fast = CpuLinear(lin, layout="tiled")
    assert fast.packed_weight.shape == (-(-n // 16), k // 2, 16, 2)
    for rows in (1, 3, 8, 13, 16, 24, 25, 40, 97):
        x = torch.randn(rows, k).bfloat16()
        ref = x.float() @ lin.weight.float().t()
        out = variant_kernels.bf16_gemm(x, fast.packed_weight, n).float()
        # bf16 output rounding (2^-9 relative) plus float32 summation order
        torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=2e-2, msg=f"rows {rows}")
    with pytest.raises(ValueError, match="layout"):
        CpuLinear(lin, layout="mkl")


@needs_tiled
def test_bf16_gemm_switch(monkeypatch):
    """EngineConfig.bf16_gemm (default from ITERSERVE_BF16_GEMM) picks the layout of every
    projection at load; a typo is an error, not a silent default."""
    kernels = load_cpu_kernels()
    monkeypatch.setenv("ITERSERVE_BF16_GEMM", "onednn")
    assert bf16_gemm_layout(EngineConfig().bf16_gemm, kernels) == "onednn"
    monkeypatch.setenv("ITERSERVE_BF16_GEMM", "tiled")
    assert bf16_gemm_layout(EngineConfig().bf16_gemm, kernels) == "tiled"
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(64, 32, bias=False).bfloat16(), nn.Linear(63, 32).bfloat16()])
    assert optimize_cpu_linears(model, "tiled", kernels=kernels) == 2
    assert [m.layout for m in model.layers] == ["tiled", "onednn"]  # odd in_features: no input pairs
    monkeypatch.setenv("ITERSERVE_BF16_GEMM", "fast")
    with pytest.raises(ValueError, match="ITERSERVE_BF16_GEMM"):
        EngineConfig()
    with pytest.raises(ValueError, match="bf16_gemm"):
        bf16_gemm_layout("fast", kernels)


@needs_tiled
def test_tiled_bf16_gemm_rejects_a_wrong_weight():
    kernels = load_cpu_kernels()
    w = pack_bf16(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="pack_bf16"):
        kernels.bf16_gemm(torch.randn(2, 62).bfloat16(), w, 32)  # K mismatch
    with pytest.raises(RuntimeError, match="pack_bf16"):
        kernels.bf16_gemm(torch.randn(2, 64).bfloat16(), w, 40)  # N needs 3 tiles
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.bf16_gemm(torch.randn(2, 64), w, 32)


@pytest.mark.parametrize("twin", ["int4", "q4_1"])
def test_4bit_twin_only_for_small_steps_and_exact_on_a_4bit_grid(twin):
    """Both 4-bit twins: torch's int4 kernel and ours (csrc/gemm_quant.cpp's q4_gemm, int16 activations)."""
    if twin == "q4_1" and load_cpu_kernels() is None:
        pytest.skip("the CPU kernels did not build here")
    w = on_4bit_grid(96, 128)
    lin = nn.Linear(128, 96, bias=False)
    lin.weight.data = w.bfloat16()
    fast = CpuLinear(lin, twin, 4)
    ref_w = w.bfloat16().float()
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, 128).bfloat16()
        out, ref = fast(x).float(), x.float() @ ref_w.t()
        # the grid is recovered; what is left is bf16 rounding of scales/zeros and of the output
        assert (out - ref).abs().max().item() < 0.02 * ref.abs().max().item(), rows
    x = torch.randn(5, 128).bfloat16()  # above the threshold: the bf16 weight, bit for bit
    assert torch.equal(fast(x), CpuLinear(lin, layout=fast.layout)(x))
    # off the grid the twin is visibly a different (rounded) weight: the dispatch is real
    lin2 = nn.Linear(128, 96, bias=False).bfloat16()
    x = torch.randn(4, 128).bfloat16()
    assert not torch.equal(CpuLinear(lin2, twin, 4)(x), CpuLinear(lin2)(x))


def on_q8_grid(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight whose every group of 32 is d * q with q in -127..127 and |q| = 127 present (what a
    GGUF Q8_0 block dequantises to), d a power of two so that bf16 holds every value exactly."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n * k // 32, 32), generator=g).float()
    q[:, 0] = 127
    d = 2.0 ** -torch.randint(8, 12, (n * k // 32, 1), generator=g).float()
    return (q * d).reshape(n, k)


@pytest.mark.skipif(load_cpu_kernels() is None, reason="the CPU kernels did not build here")
def test_q8_0_twin_only_for_small_steps_and_exact_on_a_q8_grid():
    w = on_q8_grid(200, 96)
    q, scales = pack_q8_0(w)
    assert torch.equal(q.float() * scales.repeat_interleave(32, 1), w)  # the grid is recovered exactly
    lin = nn.Linear(96, 200, bias=False)
    lin.weight.data = w.bfloat16()
    fast = CpuLinear(lin, "q8_0", 4, keep_weight=True)
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, 96).bfloat16()
        ref = x.float() @ w.t()
        # exact weights, float32 accumulation: only the output's rounding to bf16 is left
        torch.testing.assert_close(fast(x).float(), ref, rtol=2 ** -8, atol=1e-5)
    x = torch.randn(5, 96).bfloat16()  # above the threshold: the bf16 weight, bit for bit
    assert torch.equal(fast(x), CpuLinear(lin, layout=fast.layout)(x))
    lin2 = nn.Linear(96, 200, bias=False).bfloat16()  # off the grid the twin is a rounded weight
    x = torch.randn(2, 96).bfloat16()
    assert not torch.equal(CpuLinear(lin2, "q8_0", 4)(x), CpuLinear(lin2)(x))
    with pytest.raises(ValueError, match="twin"):
        CpuLinear(lin2, "q3_k", 4)


def test_engine_on_optimized_tiny_model_gives_the_plain_bf16_tokens(tiny_model_dir):
    """Prepacking alone changes no number: greedy tokens equal the plain bf16 model's."""
    from iterserve.model.loader import load_model

    plain = load_model(str(tiny_model_dir), torch.bfloat16)[:3]
    fast = load_model(str(tiny_model_dir), torch.bfloat16)[:3]
    assert optimize_cpu_linears(fast[0], int4_max_tokens=0) == 2 * 4 + 1  # 4 projections a layer + head
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], list(range(100, 140)), [42]]
    a = LLM(loaded=plain, kv_cache_memory="16MiB").generate(prompts, params,
                                                           use_tqdm=False)
    b = LLM(loaded=fast, kv_cache_memory="16MiB").generate(prompts, params,
                                                          use_tqdm=False)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_int4_in_float32_needs_our_q4_kernel(tiny_model_dir):
    """torch's int4 kernel takes bf16 only: a float32 run's 4-bit twin is our Q4_1 kernel or none."""
    cfg = dict(model=str(tiny_model_dir), dtype="float32", quantization="int4", kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="int4"):
        LLMEngine(EngineConfig(**cfg, cpu_kernels=False))
    kernels = load_cpu_kernels()
    if kernels is not None and kernels.q4_gemm_is_vectorised():
        assert LLMEngine(EngineConfig(**cfg)).platform.int4_max_tokens > 0


@pytest.fixture(scope="module")
def smol_float32_reference(smol_loaded):
    """(prompt, the float32 greedy continuation, its float32 log-probabilities [48, vocab]): computed
    once for the three variants below."""
    tok = smol_loaded[2]
    prompt = tok.encode("The history of the printing press begins in", add_special_tokens=False)
    ref = LLM(loaded=smol_loaded, kv_cache_memory="64MiB").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
        use_tqdm=False)[0].token_ids
    full = prompt + ref
    return prompt, ref, sequence_logits(smol_loaded, full)[len(prompt) - 1: -1].log_softmax(-1)


@pytest.mark.real_model
@pytest.mark.parametrize("compiled,copies,amx", [
    (False, 1, False), pytest.param(True, 1, False, marks=pytest.mark.slow), (False, 8, False),
    pytest.param(False, 16, True, marks=pytest.mark.skipif(not tiled_gemm_amx(load_cpu_kernels()),
                                                           reason="no AMX here"))],
    ids=["eager", "compiled", "batch8", "amx16"])
def test_smollm2_bf16_path_within_tolerance_of_float32(smol_float32_reference, compiled, copies, amx):
    """The default CPU path on this kind of machine (bf16, the GGUF's Q4_1 / Q8_0 blocks as the only
    copy of the projections and the head: gguf_gemm for decode steps, panels dequantised to bf16 for
    the prefill; the C++ decode attention) against float32 on one long greedy sequence,
    teacher-forced: the prompt as one prefill (bf16 GEMMs) and then 48 single-token steps
    (gguf_gemm). Compiled (--compile), inductor fuses the
    elementwise ops and rounds to bf16 in other places than eager does: the same bounds hold. batch8:
    8 copies of the sequence share every step, so decoding runs the bf16 GEMMs (ours where
    vectorised) and the bf16 head instead of the twins. amx16: our tiled GEMM forced, unmeasured, so
    every projection of the 16-row decode steps and of the prefill runs on its AMX path."""
    forced = dict(bf16_gemm="tiled", measure_kernels=False) if amx else {}
    eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype="bfloat16", kv_cache_memory="64MiB", **forced))
    if amx:
        from iterserve.platform.cpu import AMX_MIN_ROWS
        assert {m.amx_min_rows for m in eng.model.modules() if isinstance(m, CpuLinear)} == {AMX_MIN_ROWS}
        assert copies >= AMX_MIN_ROWS
    assert eng.platform.int4_max_tokens > 0  # the embedded GGUF is Q4_1: its blocks run the decode steps
    if load_cpu_kernels() is not None:  # and its head's Q8_0 blocks (the embedding's: tied) are its only copy
        assert eng.model.lm_head.twin == "gguf" and eng.model.lm_head.from_blocks
    if compiled:
        eng.model.compile_decoder()
    prompt, ref, want = smol_float32_reference
    full = prompt + ref
    loaded = (eng.model, eng.model_config, eng.tokenizer)
    runner = new_runner(loaded, num_blocks=8 * copies)
    reqs = [make_request(f"bf16-{i}", full) for i in range(copies)]
    got = [run_step(runner, [(r, len(prompt)) for r in reqs])[0]]
    got += [run_step(runner, [(r, 1) for r in reqs])[0] for _ in range(len(ref) - 1)]
    got = torch.stack(got).float().log_softmax(-1)
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    ref_lp_diff = (got[torch.arange(len(ref)), ref] - want[torch.arange(len(ref)), ref]).abs()
    print(f"bf16 + GGUF blocks{' compiled' if compiled else ''} x{copies} vs float32: top-1 agreement {top1:.3f}, |logprob diff| of the fp32 greedy token: "
          f"mean {ref_lp_diff.mean():.3f}, max {ref_lp_diff.max():.3f}")
    assert top1 >= 0.85
    assert ref_lp_diff.mean().item() < 0.1
