"""float32 engines with bf16 weights (platform/cpu_linear.py layout "bf16w", cpu_kernels.cpp's
f32_bf16w_gemm, AVX2 + FMA): the kernel is the float32 product with the weights rounded to bf16, at
every row count and ragged shape; a float32 engine measures it against plain F.linear per shape
(platform/kernel_choice.py) and lays its projections out as measured; on SmolLM2 (a Q4_1 GGUF) the
greedy tokens stay those of plain float32. Runs with the scalar fallback too (a CPU without AVX2)."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from iterserve.config import EngineConfig
from iterserve.engine import LLMEngine
from iterserve.llm import LLM
from iterserve.platform import kernel_choice as kc
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_linear import CpuLinear, optimize_cpu_linears, pack_bf16_f32
from iterserve.sampling import SamplingParams

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="iterserve's CPU kernels did not build")


@pytest.mark.parametrize("n,k", [(96, 64), (100, 576), (7, 30), (49, 1537)])
def test_kernel_is_the_float32_product_with_bf16_weights(n, k):
    """Row blocks of 1-6 (65 rows: 11 blocks of 6 or 5), a ragged last output tile (odd N), K a
    multiple of the vector width and not."""
    torch.manual_seed(n + k)
    w = torch.randn(n, k) * 0.05
    packed = pack_bf16_f32(w)
    assert packed.shape == (-(-n // 16), k, 16) and packed.dtype == torch.bfloat16
    ref_w = w.bfloat16().float()
    for m in (1, 2, 3, 7, 16, 65):
        x = torch.randn(m, k)
        out = kernels.f32_bf16w_gemm(x, packed, n)
        assert out.shape == (m, n) and out.dtype == torch.float32
        # only the summation order differs from the float64 product of the same numbers
        ref = (x.double() @ ref_w.double().t()).float()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * k ** 0.5, msg=f"rows {m}")
    assert kernels.f32_bf16w_gemm(torch.randn(0, k), packed, n).shape == (0, n)


def test_kernel_rejects_a_wrong_weight():
    w = pack_bf16_f32(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="pack_bf16_f32"):
        kernels.f32_bf16w_gemm(torch.randn(2, 62), w, 32)  # K mismatch
    with pytest.raises(RuntimeError, match="pack_bf16_f32"):
        kernels.f32_bf16w_gemm(torch.randn(2, 64), w, 40)  # N needs 3 tiles
    with pytest.raises(RuntimeError, match="float32"):
        kernels.f32_bf16w_gemm(torch.randn(2, 64).bfloat16(), w, 32)


def test_cpu_linear_bf16w_layout_and_float32_swap():
    torch.manual_seed(0)
    lin = nn.Linear(72, 40, bias=True)
    fast = CpuLinear(lin, layout="bf16w")
    x = torch.randn(5, 72)
    ref = x @ lin.weight.detach().bfloat16().float().t() + lin.bias.detach()
    torch.testing.assert_close(fast(x), ref, rtol=1e-5, atol=1e-5)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(64, 32, bias=False), nn.Linear(63, 31, bias=False)])
    model.lm_head = nn.Linear(64, 100, bias=False)
    assert optimize_cpu_linears(model, "bf16w", kernels=kernels, dtype=torch.float32) == 3
    assert [m.layout for m in (*model.layers, model.lm_head)] == ["bf16w"] * 3
    assert model.lm_head.weight is not None  # the head keeps its weight (tied to the embedding)
    with pytest.raises(ValueError, match="float32"):
        optimize_cpu_linears(nn.Module(), "tiled", kernels=kernels, dtype=torch.float32)


def _slowed(layout: str, seconds: float, real=kc.linear_candidates):
    """kc.linear_candidates with `layout` made artificially slow (a sleep before each call)."""
    def candidates(lins, layouts, twin):
        out = real(lins, layouts, twin)
        make = out[layout]
        out[layout] = lambda rows: (lambda f: (lambda: (time.sleep(seconds), f())))(make(rows))
        return out
    return candidates


@pytest.mark.parametrize("slow,expected", [("float32", "bf16w"), ("bf16w", "float32")])
def test_float32_chooser_follows_the_clock(monkeypatch, tmp_path, slow, expected):
    """A float32 request times plain float32 against bf16w (on any host: the candidates are forced
    here, so the scalar fallback is timed too where AVX2 is missing) and keeps the faster."""
    monkeypatch.setattr(kc, "layout_candidates", lambda in_features, kernels, dtype: ["float32", "bf16w"])
    monkeypatch.setattr(kc, "linear_candidates", _slowed(slow, 0.005))
    req = kc.ChoiceRequest(shapes=[("proj", 64, 128), ("head", 100, 128)], buckets=[1, 2], dtype=torch.float32)
    choice = kc.choose_kernels(req, kernels, remeasure=True, folder=tmp_path)
    assert choice.plan("proj", 64, 128).layout == expected and choice.plan("head", 100, 128).layout == expected
    assert expected in choice.brief()


def test_float32_candidates_are_the_float32_layouts():
    assert kc.layout_candidates(576, kernels, torch.float32) == (
        ["float32", "bf16w"] if kernels.f32_bf16w_gemm_is_vectorised() else ["float32"])
    assert "bf16w" not in kc.layout_candidates(576, kernels, torch.bfloat16)


def test_float32_engine_lays_out_as_measured_or_forced(tiny_model_dir, monkeypatch, tmp_path):
    """measure_kernels on: every projection and the head as the table says, the decode attention
    measured too; bf16_gemm=bf16w forces it; measure off and auto: plain float32 as before; a bf16
    layout is refused for a float32 run."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = dict(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="16MiB", max_num_seqs=4)
    eng = LLMEngine(EngineConfig(**cfg, measure_kernels=True))
    choice = eng.platform.kernel_choice
    assert choice is not None and choice.decode_attention in ("cpu", "torch")
    swapped = [(n, m) for n, m in eng.model.named_modules() if isinstance(m, CpuLinear)]
    assert len(swapped) == 2 * 4 + 1
    for name, mod in swapped:
        role = "head" if name == "lm_head" else "proj"
        assert mod.layout == choice.plan(role, mod.out_features, mod.in_features).layout, name
    forced = LLMEngine(EngineConfig(**cfg, bf16_gemm="bf16w", measure_kernels=False))
    assert {m.layout for m in forced.model.modules() if isinstance(m, CpuLinear)} == {"bf16w"}
    off = LLMEngine(EngineConfig(**cfg, measure_kernels=False))
    assert not any(isinstance(m, CpuLinear) for m in off.model.modules())
    with pytest.raises(ValueError, match="float32"):
        LLMEngine(EngineConfig(**cfg, bf16_gemm="tiled"))


@pytest.mark.real_model
def test_smollm2_float32_greedy_tokens_unchanged_with_bf16_weights():
    """The embedded model is a Q4_1 GGUF: rounding its dequantised weights to bf16 changes little,
    and the greedy continuations (3 prompts in one batch, and one alone) stay plain float32's."""
    prompts = ["The history of the printing press begins in", "def fibonacci(n):", "Paris is"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cfg = dict(model="smollm2-135m", dtype="float32", kv_cache_memory="64MiB", measure_kernels=False)
    plain = LLM(**cfg).generate(prompts, params, use_tqdm=False)
    fast_llm = LLM(**cfg, bf16_gemm="bf16w")
    assert all(m.layout == "bf16w" for m in fast_llm.engine.model.modules() if isinstance(m, CpuLinear))
    fast = fast_llm.generate(prompts, params, use_tqdm=False)
    alone = fast_llm.generate(prompts[:1], params, use_tqdm=False)
    assert [r.token_ids for r in fast] == [r.token_ids for r in plain]
    assert alone[0].token_ids == plain[0].token_ids
