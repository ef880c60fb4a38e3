"""float32 engines with bf16 weights (platform/cpu_linear.py layout "bf16w", csrc/gemm_f32_bf16w.cpp's
f32_bf16w_gemm, AVX2 + FMA): the kernel is the float32 product with the weights rounded to bf16, at
every row count and ragged shape; a float32 engine measures it against plain F.linear per shape
(platform/kernel_choice.py), but only for shapes whose weights are bf16-exact (float32 means float32's
numbers: a bf16 checkpoint may take it, a float32 or GGUF one keeps F.linear unless bf16w is forced,
with a warning), and lays its projections out as measured; on SmolLM2 (a Q4_1 GGUF) the measured
float32 engine equals transformers' float32, and forced bf16w keeps plain float32's greedy tokens.
The kernels' tests run on the native build and, on an AVX-512 host, the AVX2 one too (conftest's
kernel_variant). Runs with the scalar fallback too (a CPU without AVX2)."""
from __future__ import annotations

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
from test_kernel_choice import _slowed  # a layout made slow on purpose, shared with the bf16 chooser tests

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="iterserve's CPU kernels did not build")


@pytest.mark.parametrize("n,k", [(96, 64), (100, 576), (7, 30), (49, 1537)])
def test_kernel_is_the_float32_product_with_bf16_weights(n, k, kernel_variant, variant_kernels):
    """Row blocks of 1-6 (65 rows: 11 blocks of 6 or 5), a ragged last output tile (odd N), K a
    multiple of the vector width and not."""
    kernels = variant_kernels
    assert kernel_variant != "avx2" or kernels.f32_bf16w_gemm_is_vectorised()
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


def _bf16w_offered(monkeypatch) -> None:
    """The float32 candidates as an AVX2 host has them (on any host: the scalar fallback is timed too
    where AVX2 is missing)."""
    monkeypatch.setattr(kc, "layout_candidates", lambda in_features, kernels, dtype=None: ["float32", "bf16w"])


@pytest.mark.parametrize("slow,expected", [("float32", "bf16w"), ("bf16w", "float32")])
def test_float32_chooser_follows_the_clock(monkeypatch, tmp_path, slow, expected):
    """A float32 request times plain float32 against bf16w for a shape whose weights are bf16-exact
    and keeps the faster; a shape whose weights are not keeps float32, bf16w not even timed."""
    _bf16w_offered(monkeypatch)
    monkeypatch.setattr(kc, "linear_candidates", _slowed(slow, 0.005))
    req = kc.ChoiceRequest(shapes=[("proj", 64, 128), ("head", 100, 128)], buckets=[1, 2], dtype=torch.float32,
                           bf16_exact=[("head", 100, 128)])
    choice = kc.choose_kernels(req, kernels, remeasure=True, folder=tmp_path)
    assert choice.plan("head", 100, 128).layout == expected and expected in choice.brief()
    rounding = choice.plan("proj", 64, 128)
    assert rounding.layout == "float32" and set(rounding.ms) == {"float32"}


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
    assert eng.platform.int4_max_tokens == 0  # no Q4_1 twin in float32 unless quantization=int4
    if kernels.q4_gemm_is_vectorised():
        q4 = LLMEngine(EngineConfig(**cfg, quantization="int4", measure_kernels=True))
        assert {m.twin for m in q4.model.modules() if isinstance(m, CpuLinear)} <= {"q4_1", ""}
    else:
        with pytest.raises(ValueError, match="int4"):
            LLMEngine(EngineConfig(**cfg, quantization="int4"))
    with pytest.raises(ValueError, match="float32"):
        LLMEngine(EngineConfig(**cfg, bf16_gemm="tiled"))


def test_float32_engine_gives_bf16w_to_bf16_exact_weights_only(tiny_model_dir, tiny_loaded, monkeypatch, tmp_path,
                                                               caplog):
    """bf16w offered and made the faster (float32 slowed): the tiny model's float32 checkpoint keeps
    float32 everywhere (its weights are not bf16-exact), the same model saved in bf16 (run in
    float32: bf16-exact) takes bf16w; forced, bf16w warns where it rounds weights and only there."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _bf16w_offered(monkeypatch)
    monkeypatch.setattr(kc, "linear_candidates", _slowed("float32", 0.002))
    bf16_dir = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(bf16_dir)
    tiny_loaded[2].save_pretrained(bf16_dir)
    cfg = dict(dtype="float32", kv_cache_memory="16MiB", max_num_seqs=2)

    def layouts(model_dir, **kw) -> set[str]:
        eng = LLMEngine(EngineConfig(model=str(model_dir), **cfg, **kw))
        return {m.layout for m in eng.model.modules() if isinstance(m, CpuLinear)}

    assert layouts(tiny_model_dir, measure_kernels=True) == {"float32"}
    assert layouts(bf16_dir, measure_kernels=True) == {"bf16w"}
    with caplog.at_level("WARNING", logger="iterserve.platform"):
        assert layouts(bf16_dir, bf16_gemm="bf16w", measure_kernels=False) == {"bf16w"}
        assert "rounded to bf16" not in caplog.text
        assert layouts(tiny_model_dir, bf16_gemm="bf16w", measure_kernels=False) == {"bf16w"}
        assert "5 of 5 projection shapes have weights that are not bf16-exact" in caplog.text


@pytest.mark.real_model
def test_smollm2_float32_equals_transformers_float32(smol_loaded, monkeypatch, tmp_path):
    """float32 means float32: measured, with bf16w offered and made the faster, SmolLM2's projections
    (a Q4_1 GGUF dequantised: not bf16-exact) keep float32, and the greedy tokens and echoed prompt
    logprobs equal transformers' float32 forward pass within 1e-4 (bf16w moved them by up to 0.03)."""
    from model_utils import hf_greedy, hf_llama_from

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _bf16w_offered(monkeypatch)
    monkeypatch.setattr(kc, "linear_candidates", _slowed("float32", 0.002))
    llm = LLM(model="smollm2-135m", dtype="float32", kv_cache_memory="64MiB", max_num_seqs=2, measure_kernels=True)
    assert {m.layout for m in llm.engine.model.modules() if isinstance(m, CpuLinear)} == {"float32"}
    tok = llm.engine.tokenizer
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("The capital of France is", "def add(a, b):")]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    results = llm.generate(prompts, params, use_tqdm=False)
    hf = hf_llama_from(smol_loaded)
    for prompt, res in zip(prompts, results):
        assert res.token_ids == hf_greedy(hf, [prompt], 6, 0)[0][0]
        with torch.inference_mode():
            want = hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
        want = want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        got = torch.tensor([lp[0] for lp in res.prompt_logprobs[1:]])
        assert (got - want).abs().max().item() < 1e-4


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


def on_4bit_grid(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Every group of 32 is d * q + m, q in 0..15 with 0 and 15 present, d and m float16 (a GGUF
    Q4_1 block dequantised): pack_q4_1 recovers it exactly."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n * k // 32, 32), generator=g).float()
    q[:, 0], q[:, 1] = 0, 15
    d = (torch.rand(n * k // 32, 1, generator=g) * 0.02 + 0.005).half().float()
    m = (-torch.rand(n * k // 32, 1, generator=g) * 0.1).half().float()
    return (q * d + m).reshape(n, k)


@pytest.mark.parametrize("n,k", [(96, 128), (33, 576)])
def test_q4_1_twin_in_float32_for_small_steps(n, k, kernel_variant, variant_kernels):
    """Our Q4_1 kernel (AVX2 where AVX-512 VNNI is missing: the AVX2 build's) on float32 rows: every
    row block (8, 4, 2, 1), the weight recovered from the 4-bit grid; what is left is the int16
    rounding of the activations. Above the cut-over the bf16w layout runs."""
    assert kernel_variant != "avx2" or variant_kernels.q4_gemm_is_vectorised()
    w = on_4bit_grid(n, k)
    lin = nn.Linear(k, n, bias=False)
    lin.weight.data = w
    fast = CpuLinear(lin, "q4_1", 9, layout="bf16w")
    for rows in (1, 2, 3, 7, 9):
        x = torch.randn(rows, k)
        out, ref = variant_kernels.q4_gemm(x, fast.twin_weight, fast.twin_scales, fast.twin_mins), x @ w.t()
        assert out.dtype == torch.float32
        assert (out - ref).abs().max().item() < 1e-3 * ref.abs().max().item(), rows
    assert kernel_variant != "native" or torch.equal(fast(x), out)  # CpuLinear runs the twin up to its cut-over
    x = torch.randn(10, k)
    assert torch.equal(fast(x), CpuLinear(lin, layout="bf16w")(x))


def test_float32_chooser_times_the_q4_1_twin(tmp_path):
    req = kc.ChoiceRequest(shapes=[("proj", 256, 576)], buckets=[1, 2], dtype=torch.float32, four_bit=True)
    choice = kc.choose_kernels(req, kernels, remeasure=True, folder=tmp_path)
    plan = choice.plan("proj", 256, 576)
    assert plan.twin == ("q4_1" if kernels.q4_gemm_is_vectorised() else None)
    assert plan.twin is None or set(plan.ms) == {"float32", "q4_1"}  # random weights: not bf16-exact


@pytest.mark.real_model
def test_smollm2_float32_int4_twin_within_tolerance():
    """quantization=int4 in float32 (never under auto): the Q4_1 twin for decode steps of few rows.
    Teacher-forced on one 48-token greedy float32 continuation, one token a step (the twin's rows):
    top-1 agreement with plain float32 >= 0.95 and the mean |log-prob difference| of float32's token
    < 0.02 (measured on Zen 3: 0.979, i.e. one token of 48, and 0.004; free-running, one of three
    32-token greedy continuations parted from float32's at a near-tie after 21 tokens)."""
    from model_utils import make_request, new_runner, run_step

    cfg = dict(model="smollm2-135m", dtype="float32", kv_cache_memory="64MiB", measure_kernels=False)
    plain = LLMEngine(EngineConfig(**cfg))
    twin = LLMEngine(EngineConfig(**cfg, quantization="int4", bf16_gemm="bf16w"))
    if not kernels.q4_gemm_is_vectorised():
        pytest.skip("our Q4 kernel is not vectorised here")
    assert twin.platform.int4_max_tokens > 0 and plain.platform.int4_max_tokens == 0
    assert all(m.twin == "q4_1" for n, m in twin.model.named_modules() if isinstance(m, CpuLinear) and n != "lm_head")
    prompt = plain.tokenizer.encode("The history of the printing press begins in", add_special_tokens=False)
    ref = LLM(loaded=(plain.model, plain.model_config, plain.tokenizer), kv_cache_memory="64MiB").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)[0].token_ids
    full = prompt + ref

    def logprobs(eng: LLMEngine) -> torch.Tensor:
        runner = new_runner((eng.model, eng.model_config, eng.tokenizer), num_blocks=8)
        req = make_request("r", full)
        rows = [run_step(runner, [(req, len(prompt))])[0]]
        rows += [run_step(runner, [(req, 1)])[0] for _ in range(len(ref) - 1)]
        return torch.stack(rows).float().log_softmax(-1)

    want, got = logprobs(plain), logprobs(twin)
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    diff = (got[torch.arange(len(ref)), ref] - want[torch.arange(len(ref)), ref]).abs()
    print(f"float32 + Q4_1 twin vs float32: top-1 agreement {top1:.3f}, |logprob diff| mean {diff.mean():.4f}, "
          f"max {diff.max():.4f}")
    assert top1 >= 0.95 and diff.mean().item() < 0.02
