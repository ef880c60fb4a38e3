"""--batch-invariant: the same request gives the same greedy tokens (and logprobs) alone, in a step
of 16, chunked and under KV pressure with preemption (recomputed after losing its blocks).

- bf16 (CPUs with AVX512-BF16), on the real model: our tiled bf16 GEMM everywhere.
- float32 (what a CPU without fast bf16 runs: AVX2-only Zen 3), on the tiny models, on the native
  build and on the AVX2 one (ITERSERVE_CPU_KERNELS_VARIANT, so that an AVX-512 host runs Zen 3's
  code too): each projection on f32_gemm, and a GGUF's blocks on gguf_gemm at every step size (or,
  with --dtype float32, dequantised onto f32_gemm); both kernels' rows checked here not to depend
  on the step's other rows, bit for bit, and the engine's tokens and logprobs alike.

Without it the texts differ: with the default kernels the issue (#16) found 8 of 12 texts changed
between --max-num-seqs 16 and --max-num-seqs 8 --num-kv-blocks 24 (the 4-bit twin and the Q8_0 head
run only for steps of few rows, oneDNN blocks its reduction by the row count, and a prefill's
attention (SDPA) sums in another order than the decode kernel); `benchmarks/batch_invariance.py`
counts them on any host (docs/benchmarks/batch-invariant.md). That is a property of kernels, not a contract, so no
test asserts that the default mode differs.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from gguf_convert import convert, mixed_quant
from test_model_families import random_model

import iterserve.platform.cpu as cpu_platform
from iterserve.config import EngineConfig
from iterserve.llm import LLM
from iterserve.platform.cpu_kernels import VARIANT_ENV, load_cpu_kernels
from iterserve.platform.cpu_linear import (EVERY_ROW, INVARIANT_FLOAT32, CpuLinear, pack_gguf_twin, random_shards,
                                           tiled_gemm_vectorised)
from iterserve.sampling import SamplingParams
from iterserve.testing import BATCH_INVARIANCE_FILLERS as FILLERS
from iterserve.testing import BATCH_INVARIANCE_PROMPTS as PROMPTS

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def texts(llm: LLM, prompts: list[str]) -> list[str]:
    return [r.text for r in llm.generate(prompts, PARAMS, use_tqdm=False)]


def test_batch_invariant_refuses_what_would_break_it():
    for bad in (dict(compile=True), dict(quantization="int4"), dict(bf16_gemm="onednn"),
                dict(decode_attention="torch"), dict(cpu_kernels=False)):
        with pytest.raises(ValueError, match="batch_invariant"):
            EngineConfig(batch_invariant=True, **bad)


@pytest.mark.real_model
@pytest.mark.skipif(not tiled_gemm_vectorised(load_cpu_kernels()),
                    reason="batch_invariant in bf16 needs the C++ kernels' AVX512-BF16 GEMM")
def test_same_greedy_text_alone_in_a_batch_of_16_and_under_preemption():
    llm = LLM("smollm2-135m", batch_invariant=True, max_num_seqs=16, kv_cache_memory="256MiB")
    resolved = llm.engine.resolved_config()
    assert resolved["batch_invariant"] and resolved["bf16_gemm"] == "tiled" and resolved["quantization"] == "none"
    assert resolved["decode_attention"] == "cpu_batch_invariant"
    alone = [texts(llm, [p])[0] for p in PROMPTS]
    batched = texts(llm, PROMPTS + FILLERS)[:len(PROMPTS)]
    assert max(r.batch_size for r in llm.engine.records) == 16  # all of them shared steps
    assert batched == alone

    tight = LLM("smollm2-135m", batch_invariant=True, max_num_seqs=8, num_kv_blocks=24)
    pressed = texts(tight, PROMPTS)
    assert any(r.preempted for r in tight.engine.records)  # some were preempted and recomputed
    assert pressed == alone
    assert len(set(alone)) == len(PROMPTS) and all(len(t) > 40 for t in alone)  # real, distinct texts


# ---- float32 (a CPU without AVX512-BF16): the kernels, then the engine, on the native and AVX2 builds ----------
def rows_alone(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.cat([gemm(x[i:i + 1]) for i in range(x.shape[0])])


def assert_rows_independent(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """Each row of gemm(x) is the same bits computed alone and in steps of every size below 10."""
    full = gemm(x)
    for m in range(1, 10):
        assert torch.equal(gemm(x[:m]), full[:m]), f"the first {m} rows differ from the same rows in {len(x)}"
    assert torch.equal(rows_alone(gemm, x), full)


@pytest.mark.parametrize("n,k", [(45, 64), (100, 1003), (37, 2048)])
def test_f32_gemm_sums_each_row_alike_at_every_row_count(n, k, kernel_variant, variant_kernels):
    """f32_bf16w_gemm does not (its 1-3 row tiles split k in two chains): the float32 projections of
    a batch-invariant run take this one."""
    assert kernel_variant != "avx2" or variant_kernels.f32_gemm_is_vectorised()
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(23, k, generator=g), torch.randn(n, k, generator=g)
    torch.testing.assert_close(variant_kernels.f32_gemm(x, w), x @ w.T, rtol=1e-4, atol=1e-4)
    assert_rows_independent(lambda rows: variant_kernels.f32_gemm(rows, w), x)


@pytest.mark.parametrize("spec", ["q4_k:48", "q5_k:40", "q6_k:33", "q8_0:20", "q4_0:17", "q4_1:16", "q5_0:9",
                                  "q5_1:31", "q4_k:32+q6_k:16+q8_0:8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_gemm_rows_do_not_depend_on_the_step(spec, dtype, kernel_variant, variant_kernels):
    """Each activation row is quantised alone and summed in exact int32 per block: gguf_gemm can run a
    GGUF's blocks at every step size of a batch-invariant run."""
    k = 512
    buf, meta = pack_gguf_twin(random_shards(spec, k), k)
    n = int(meta[:, 1].sum())
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    assert_rows_independent(lambda rows: variant_kernels.gguf_gemm(rows, buf, meta, n), x)


PROMPT_IDS = [list(range(40 + 97 * i, 40 + 97 * i + n)) for i, n in enumerate((23, 9, 41, 17))]
FILLER_IDS = [list(range(3000 + 31 * i, 3000 + 31 * i + 5 + 3 * i)) for i in range(8)]
LOGPROB_PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1)


def outcomes(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    return [(r.token_ids, r.logprobs, r.prompt_logprobs)
            for r in llm.generate(prompts, LOGPROB_PARAMS, use_tqdm=False)]


def assert_same_alone_batched_chunked(make: Callable[..., LLM]) -> None:
    """Greedy tokens, their logprobs and the prompts' logprobs, bit for bit: each prompt alone, with
    12 in a step, with prefills chunked into a budget of 16 tokens a step, and under KV pressure
    (preempted, then recomputed)."""
    llm = make()
    alone = [outcomes(llm, [p])[0] for p in PROMPT_IDS]
    batched = outcomes(llm, PROMPT_IDS + FILLER_IDS)[:len(PROMPT_IDS)]
    assert max(r.batch_size for r in llm.engine.records) == len(PROMPT_IDS + FILLER_IDS)
    chunked = outcomes(make(max_num_batched_tokens=16), PROMPT_IDS + FILLER_IDS)[:len(PROMPT_IDS)]
    tight = make(max_num_seqs=8, num_kv_blocks=10)
    pressed = outcomes(tight, PROMPT_IDS + FILLER_IDS)[:len(PROMPT_IDS)]
    assert any(r.preempted for r in tight.engine.records)
    assert batched == alone
    assert chunked == alone
    assert pressed == alone
    assert len({tuple(t) for t, _, _ in alone}) > 1  # distinct continuations, not one repeated token


@pytest.fixture
def kernels_of_variant(kernel_variant, variant_kernels, monkeypatch):
    """The engine and every kernel call it makes on `kernel_variant`'s build (the AVX2 one: Zen 3's code)."""
    monkeypatch.setenv(VARIANT_ENV, kernel_variant)
    assert load_cpu_kernels() is variant_kernels
    return variant_kernels


def test_float32_same_tokens_and_logprobs_alone_batched_chunked_and_pressed(tiny_model_dir, kernels_of_variant):
    def make(**kw) -> LLM:
        return LLM(str(tiny_model_dir), dtype="float32", batch_invariant=True,
                   **{"max_num_seqs": 16, "kv_cache_memory": "32MiB", **kw})

    llm = make()
    resolved = llm.engine.resolved_config()
    assert resolved["bf16_gemm"] == INVARIANT_FLOAT32 and resolved["decode_attention"] == "cpu_batch_invariant"
    assert llm.engine.platform.kernels is kernels_of_variant
    linears = [m for m in llm.engine.model.modules() if isinstance(m, CpuLinear)]
    assert linears and all(m.layout == INVARIANT_FLOAT32 and not m.twin for m in linears)
    assert_same_alone_batched_chunked(make)


@pytest.fixture(scope="module")
def q4_k_file(tmp_path_factory):
    """A random llama (tied head) as llama.cpp would quantise it: Q4_K projections, Q8_0 v rows and embedding."""
    hf = random_model("llama", dict(num_hidden_layers=2, hidden_size=256, intermediate_size=256, head_dim=64,
                                    tie_word_embeddings=True))
    return convert(hf, tmp_path_factory.mktemp("invariant") / "llama-q.gguf", quant=mixed_quant)


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_float32_from_gguf_blocks_alone_batched_chunked_and_pressed(q4_k_file, dtype, kernels_of_variant, monkeypatch,
                                                             tmp_path):
    """dtype auto on a CPU without fast bf16 (as on Zen 3: float32, the blocks on gguf_gemm at every
    step), and float32 by name (gguf-py's float32 numbers at every step: panels onto f32_gemm)."""
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_platform, "cpu_has_fast_bf16", lambda: False)

    def make(**kw) -> LLM:
        return LLM(str(q4_k_file), dtype=dtype, batch_invariant=True,
                   **{"max_num_seqs": 16, "kv_cache_memory": "16MiB", **kw})

    llm = make()
    assert llm.engine.platform.dtype == torch.float32
    blocks = [m for m in llm.engine.model.modules() if isinstance(m, CpuLinear) and m.from_blocks]
    assert len(blocks) == 9  # 4 projections a layer and the tied head: every quantised module
    assert all(m.twin_max_tokens == (EVERY_ROW if dtype == "auto" else 0) for m in blocks)
    assert all(m.layout == INVARIANT_FLOAT32 for m in blocks)
    assert llm.engine.resolved_config()["quantization"] == "gguf"
    assert_same_alone_batched_chunked(make)


def test_refusals_name_what_is_missing(tiny_model_dir, monkeypatch):
    """No C++ kernels at all: refused, naming them; bf16 without AVX512-BF16: refused, pointing at float32."""
    from iterserve.platform.cpu import batch_invariant_refusal

    assert "C++ CPU kernels" in batch_invariant_refusal(None, torch.float32)
    avx2 = load_cpu_kernels("avx2") if "avx2" in cpu_platform.cpu_flags() else None
    if avx2 is not None:
        assert "AVX512-BF16" in batch_invariant_refusal(avx2, torch.bfloat16)
        assert batch_invariant_refusal(avx2, torch.float32) is None
    assert "float16" in batch_invariant_refusal(load_cpu_kernels(), torch.float16)
    monkeypatch.setattr(cpu_platform, "load_cpu_kernels", lambda: None)
    with pytest.raises(ValueError, match="batch_invariant .* C\\+\\+ CPU kernels"):
        LLM(str(tiny_model_dir), dtype="float32", batch_invariant=True, kv_cache_memory="16MiB")


# ---- mixture-of-experts models: the router and the experts on fixed-order GEMMs ---------------------------------
@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    from test_moe import MOE_FAMILIES
    from test_model_families import saved_families

    return saved_families(tmp_path_factory, MOE_FAMILIES)("qwen3_moe")


@pytest.fixture(scope="module")
def q4_k_moe_file(tmp_path_factory):
    """A random Qwen3-MoE whose experts are Q4_K blocks (test_moe_blocks's file)."""
    from test_moe_blocks import write_q4_k_moe

    return write_q4_k_moe(tmp_path_factory.mktemp("invariant-moe"))


def _moe_blocks(llm: LLM) -> list:
    from iterserve.model.moe import SparseMoeBlock

    return [m for m in llm.engine.model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_same_tokens_and_logprobs_alone_batched_chunked_and_pressed(qwen3_moe_dir, dtype):
    """A MoE model from its HF folder: float32 (experts and router on f32_gemm) and bf16 (experts
    packed for the tiled GEMM, the router on it too); a token's expert outputs summed in expert order."""
    from iterserve.platform.cpu_moe import CpuSparseMoeBlock, CpuTopKRouter, FixedF32SparseMoeBlock

    if dtype == "bfloat16" and not tiled_gemm_vectorised(load_cpu_kernels()):
        pytest.skip("bf16 batch_invariant needs the tiled bf16 GEMM (AVX512-BF16)")

    def make(**kw) -> LLM:
        return LLM(str(qwen3_moe_dir), dtype=dtype, batch_invariant=True,
                   **{"max_num_seqs": 16, "kv_cache_memory": "32MiB", **kw})

    blocks = _moe_blocks(make())
    kind = FixedF32SparseMoeBlock if dtype == "float32" else CpuSparseMoeBlock
    assert len(blocks) == 2 and all(type(b) is kind and isinstance(b.gate, CpuTopKRouter) for b in blocks)
    assert_same_alone_batched_chunked(make)


def test_moe_from_gguf_blocks_alone_batched_chunked_and_pressed(q4_k_moe_file, kernels_of_variant, monkeypatch,
                                                                tmp_path):
    """A MoE GGUF where float32 is the default (a CPU without fast bf16): every step's experts in one
    gguf_moe_gemm a layer, whose rows do not depend on the step; native and AVX2 builds."""
    from iterserve.platform.cpu_moe import BlockSparseMoeBlock, CpuTopKRouter

    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_platform, "cpu_has_fast_bf16", lambda: False)

    def make(**kw) -> LLM:
        return LLM(str(q4_k_moe_file), batch_invariant=True, **{"max_num_seqs": 16, "kv_cache_memory": "16MiB", **kw})

    blocks = _moe_blocks(make())
    assert len(blocks) == 2 and all(type(b) is BlockSparseMoeBlock and b.twin_max_tokens == EVERY_ROW
                                    and isinstance(b.gate, CpuTopKRouter) for b in blocks)
    assert_same_alone_batched_chunked(make)
