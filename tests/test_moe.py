"""Mixture-of-experts families (Mixtral, Qwen3-MoE, OLMoE, GraniteMoE) against transformers.

For each family a random-weight model is built offline by transformers (8 experts, top-2 or top-3,
at least two layers, tiny widths), saved as a Hugging Face folder with SmolLM2's tokenizer; then:
- the router alone, fed the same hidden states, picks the same experts with bit-equal weights as
  transformers' router module, in float32 and in bf16 (where its casts show);
- float32 greedy tokens equal transformers' `generate`: each prompt alone, in one batch of 8, and in
  a KV cache so small that requests are preempted; logprobs within LOGPROB_TOL; bf16 through the CPU
  platform's loading: top-1 agreement as tests/test_model_families.py asks;
- a one-token step reads only the k experts the router picked.
Engine features on a tiny MoE: prefix caching with n > 1, n-gram speculative decoding, LoRA on the
attention projections (and expert LoRA refused), embeddings. Refusals of the MoE architectures the
decoder lacks a piece for (gpt-oss, DeepSeek, Qwen2-MoE, ...), by name.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_model_families import (BASE, NEW_TOKENS, WINDOW, _greedy, check_float32_engine, engine_top1_agreement,
                                 hf_bf16_agreement)
from test_model_families import hf_reference, prompts, saved_families  # noqa: F401 (prompts: a shared fixture)

from iterserve.llm import LLM
from iterserve.model.loader import load_model
from iterserve.model.moe import SparseMoeBlock
from iterserve.model.registry import UnsupportedArchitecture, family_for
from iterserve.pooling import PoolingParams
from iterserve.sampling import SamplingParams

# family -> (model_type, config overrides): 8 experts, each family's own router options turned on
MOE_FAMILIES = {
    "mixtral": ("mixtral", dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                                sliding_window=WINDOW)),
    # layer 1 keeps a dense MLP (mlp_only_layers); norm_topk_prob renormalises the top-k
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1])),
    # (its q/k norms are hidden_size wide: head_dim must be hidden / heads)
    "olmoe": ("olmoe", dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                            head_dim=16, pad_token_id=0)),
    "granitemoe": ("granitemoe", dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                                      embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.05,
                                      logits_scaling=2.0)),
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    return saved_families(tmp_path_factory, MOE_FAMILIES)


def _hf_moe_block(hf_layer):
    return getattr(hf_layer, "mlp", None) or hf_layer.block_sparse_moe


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_router_matches_transformers(family, dtype, moe_dirs):
    """Same experts, bit-equal weights, as transformers' router module on the same hidden states
    (top-k ties are measure-zero with random inputs; the casts show in bf16)."""
    from transformers import AutoModelForCausalLM

    folder = moe_dirs(family)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model, cfg, _, _ = load_model(str(folder), dtype)
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    block = _hf_moe_block(hf.model.layers[0])
    router = getattr(block, "gate", None) or block.router
    _, ref_w, ref_ids = router(x)
    w, ids = model.layers[0].mlp.gate(x)
    assert torch.equal(ids, ref_ids)
    assert w.dtype == ref_w.dtype and torch.equal(w, ref_w)
    # the whole block (the experts' sum in transformers' order): float32 to its rounding, bf16 within an
    # ulp (transformers' default experts kernel may block its GEMMs otherwise)
    ours, ref = model.layers[0].mlp(x), block(x[None])[0]
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    else:
        torch.testing.assert_close(ours, ref, rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_moe_family_matches_transformers(family, moe_dirs, prompts):
    folder = moe_dirs(family)
    ref_ids, ref_logits = hf_reference(folder, prompts)
    model, cfg, tok, _ = load_model(str(folder), torch.float32)
    loaded = (model, cfg, tok)
    assert cfg.architecture == family and cfg.num_experts == 8
    if family == "mixtral":
        assert cfg.has_windows and all(len(p) > cfg.sliding_window for p in prompts)
    if family == "qwen3_moe":  # the dense layer is built as one
        assert cfg.dense_mlp_layers == (1,) and not hasattr(model.layers[1].mlp, "gate")

    check_float32_engine(loaded, prompts, ref_ids, ref_logits)

    # bf16 through the engine's own loading (the CPU platform's layouts and kernels, the experts on its
    # tiled GEMM where it is vectorised): top-1 agreement with the float32 tokens
    eng = LLM(model=str(folder), dtype="bfloat16", kv_cache_memory="32MiB").engine
    assert isinstance(eng.model.layers[0].mlp, SparseMoeBlock)
    agree, total = engine_top1_agreement(eng, prompts, ref_ids)
    # a random MoE is more fragile in bf16 than a dense model: one rounding that flips a top-k choice
    # swaps a whole expert's output (transformers' own bf16 agreed with its float32 on 110 of Mixtral's
    # 120 steps, ours on 105, the two bf16 runs on 115): within 8 steps of transformers' own bf16
    hf16 = hf_bf16_agreement(folder, prompts, ref_ids)
    assert agree >= min(math.ceil(0.99 * total), hf16) - 8, \
        f"bf16 top-1 agreement {agree}/{total} (transformers' bf16: {hf16})"


@torch.inference_mode()
def test_one_token_reads_only_its_experts(moe_dirs, monkeypatch):
    """A decode row runs k experts' GEMMs (two each) and the router's, never the other experts'."""
    model, cfg, _, _ = load_model(str(moe_dirs("olmoe")), torch.float32)
    block = model.layers[0].mlp
    touched = []
    real_linear = F.linear

    def counting(x, w, b=None):
        touched.append(w.data_ptr())
        return real_linear(x, w, b)

    monkeypatch.setattr(F, "linear", counting)
    x = torch.randn(1, cfg.hidden_size)
    _, ids = block.gate(x)
    touched.clear()
    block(x)
    w13, w2 = block.experts.w13_weight, block.experts.w2_weight
    expected = {block.gate.weight.data_ptr()} | {w13[e].data_ptr() for e in ids[0].tolist()} | \
               {w2[e].data_ptr() for e in ids[0].tolist()}
    assert len(touched) == 1 + 2 * cfg.num_experts_per_tok and set(touched) == expected


@torch.inference_mode()
def test_cpu_experts_on_the_tiled_gemm_bit_equal(moe_dirs):
    """The CPU platform's bf16 experts (packed for the tiled GEMM, SiLU-and-mul kernel) give the plain
    block's bits, on steps of one row and of many."""
    from iterserve.platform.cpu_kernels import load_cpu_kernels
    from iterserve.platform.cpu_linear import tiled_gemm_vectorised
    from iterserve.platform.cpu_moe import CpuSparseMoeBlock, use_cpu_moe

    if not tiled_gemm_vectorised(load_cpu_kernels()):
        pytest.skip("the tiled bf16 GEMM needs the C++ kernels with AVX512-BF16")
    model, cfg, _, _ = load_model(str(moe_dirs("qwen3_moe")), torch.bfloat16)
    plain = model.layers[0].mlp
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(n, cfg.hidden_size, generator=g).bfloat16() for n in (1, 3, 40)]
    ref = [plain(x) for x in xs]
    assert use_cpu_moe(model) == 2  # the two MoE layers; the dense layer is not one
    fast = model.layers[0].mlp
    assert type(fast) is CpuSparseMoeBlock and not any(n.startswith("experts") for n, _ in fast.named_parameters())
    for x, r in zip(xs, ref):
        assert torch.equal(fast(x), r)


def test_engine_features_on_moe(moe_dirs, prompts):
    """Prefix caching with n > 1 and n-gram speculative decoding keep transformers' greedy tokens;
    embeddings come out of the same model."""
    folder = moe_dirs("qwen3_moe")
    longer = prompts[1] + prompts[2][:40]
    ref_ids, _ = hf_reference(folder, [prompts[1], longer])
    model, cfg, tok, _ = load_model(str(folder), torch.float32)
    llm = LLM(loaded=(model, cfg, tok), kv_cache_memory="32MiB")
    first = _greedy(llm, [prompts[1]])[0].token_ids
    eng, params = llm.engine, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    lead = eng.add_request(prompt_token_ids=longer, params=params, request_id="lead")
    eng.add_request(prompt_token_ids=longer, params=params, request_id="follow", prefix_leader="lead")
    both = llm.run_until_done([lead.request_id, "follow"])
    assert eng.scheduler.prefix_cache_hits >= (len(prompts[1]) // 16) * 16
    assert first == ref_ids[0] and [r.token_ids for r in both] == [ref_ids[1], ref_ids[1]]

    spec = LLM(loaded=(model, cfg, tok), kv_cache_memory="32MiB",
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert [r.token_ids for r in _greedy(spec, [prompts[1], longer])] == ref_ids

    pooled = SamplingParams(pooling=PoolingParams())
    vectors = [r.embedding for r in llm.generate([prompts[0], prompts[1]], pooled, use_tqdm=False)]
    assert all(len(v) == cfg.hidden_size and torch.isfinite(torch.tensor(v)).all() for v in vectors)
    assert vectors[0] != vectors[1]


def _write_lora(folder, cfg, targets: dict[str, tuple[int, int]],
                prefix: str = "base_model.model.model.layers.0.") -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": sorted({t.split(".")[-1] for t in targets})}))
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for name, (out_f, in_f) in targets.items():
        tensors[f"{prefix}{name}.lora_A.weight"] = torch.randn(4, in_f, generator=g) * 0.1
        tensors[f"{prefix}{name}.lora_B.weight"] = torch.randn(out_f, 4, generator=g) * 0.1
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def test_lora_on_moe_attention_and_experts_refused(moe_dirs, prompts, tmp_path):
    """An adapter on q/v changes the tokens of its requests only; one on an expert's (or the
    replaced dense MLP's) projections is refused by name."""
    from iterserve.lora.adapter import LoRAError, load_adapter

    folder = moe_dirs("mixtral")
    model, cfg, tok, _ = load_model(str(folder), torch.float32)
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    _write_lora(tmp_path / "attn", cfg, {"self_attn.q_proj": (q, h), "self_attn.v_proj": (kv, h)})
    llm = LLM(loaded=(model, cfg, tok), kv_cache_memory="32MiB", enable_lora=True, max_lora_rank=8,
              lora_modules={"attn": str(tmp_path / "attn")})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    lora = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora_name="attn")
    base, adapted, again = (r.token_ids for r in llm.generate([prompts[0]] * 3, [params, lora, params],
                                                               use_tqdm=False))
    assert adapted != base and again == base

    f = cfg.moe_intermediate_size
    _write_lora(tmp_path / "experts", cfg, {"block_sparse_moe.experts.0.w1": (f, h)})
    with pytest.raises(LoRAError, match="expert"):
        load_adapter("experts", tmp_path / "experts", cfg, 8)
    _write_lora(tmp_path / "dense", cfg, {"mlp.gate_proj": (cfg.intermediate_size, h)})
    with pytest.raises(LoRAError, match="mixture-of-experts"):
        load_adapter("dense", tmp_path / "dense", cfg, 8)


@pytest.mark.parametrize("architecture,model_type,missing", [
    ("GptOssForCausalLM", "gpt_oss", "attention sinks"),
    ("DeepseekV3ForCausalLM", "deepseek_v3", "multi-head latent attention"),
    ("DeepseekV2ForCausalLM", "deepseek_v2", "multi-head latent attention"),
    ("Qwen2MoeForCausalLM", "qwen2_moe", "shared expert"),
])
def test_moe_architectures_refused_by_missing_piece(architecture, model_type, missing, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": model_type}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedArchitecture, match=missing):
        load_model(str(tmp_path))
    with pytest.raises(UnsupportedArchitecture, match=missing):
        family_for([architecture], model_type)
    with pytest.raises(UnsupportedArchitecture, match=missing):  # a config.json with a model_type alone
        family_for(None, model_type)


def test_moe_options_refused(tmp_path):
    """Options of the supported families this decoder does not compute are refused, not ignored."""
    from transformers import AutoConfig

    from iterserve.model.families.base import common_config
    from iterserve.model.registry import FAMILIES

    hf = AutoConfig.for_model("olmoe", **{**BASE, **MOE_FAMILIES["olmoe"][1], "clip_qkv": 8.0})
    with pytest.raises(ValueError, match="clip_qkv"):
        FAMILIES["olmoe"].configure(hf, common_config(hf, "olmoe"))


def test_compile_refused_on_moe(moe_dirs):
    """--compile (see decoder.compile_decoder) on a MoE model is refused by name rather than run wrong
    (--batch-invariant runs: tests/test_batch_invariant.py)."""
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(model=str(moe_dirs("olmoe")), dtype="float32", kv_cache_memory="32MiB", compile=True)
