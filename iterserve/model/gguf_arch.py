"""How llama.cpp writes each family of the model registry as GGUF, read back into a ModelConfig and
the decoder's (Hugging Face) tensor names: one `GGUFArch` per `general.architecture`.

What the tables follow is llama.cpp's converter (convert_hf_to_gguf.py) and its loader
(src/llama-model.cpp), with gguf-py's constants and tensor_mapping for the names:

- Q/K rows: the converter permutes q_proj / k_proj rows (biases too) of the architectures llama.cpp
  runs with its "normal" (interleaved-pair) RoPE, the converter classes derived from its LlamaModel:
  llama (Llama, Mistral, Mixtral), granite, granitemoe, smollm3. The others (qwen2, qwen3, gemma2, gemma3, phi3, olmo2)
  run NEOX RoPE, Hugging Face's rotate-half, and are stored as they are.
- Gemma: the converter adds 1 to every tensor whose HF name ends in "norm.weight" (Gemma's RMSNorm
  scales by 1 + w; llama.cpp's by w): the four sandwich norms, the final norm and Gemma 3's q/k norms.
  The loader subtracts 1 in float32 (as transformers' GGUF loader does), for the decoder's (1 + w).
- Phi-3: q, k and v stay fused as attn_qkv, and gate and up as ffn_up, [gate; up] in that order (its
  SwiGLU takes the first half as the gate): both are the decoder's fused parameters as they are.
- Mixture of experts (Mixtral as llama with `expert_count` > 0, qwen3moe, olmoe, granitemoe): the
  router `ffn_gate_inp` and the experts stacked as `ffn_{gate,up,down}_exps` [experts, rows, cols];
  how the router renormalises is llama.cpp's per architecture (no key but `expert_weights_norm`).
  Quantised expert tensors are dequantised to floats at load (the block kernels take 2-d weights).
- Tied embeddings: no output.weight (Gemma's converter drops lm_head even when present).
- Hyper-parameters GGUF has no key for come from llama.cpp's loader: Gemma 2/3's query scale
  (head_dim ** -0.5, or (hidden / heads) ** -0.5 for the 27B, told by the layer count), Gemma 2's
  alternate windows (4096 when the key is absent), Gemma 3's 5 local : 1 global layers and local RoPE
  base 10000, SmolLM3's no-RoPE layers (every fourth).
- Windows GGUF cannot say per layer (Qwen2/3's `max_window_layers`) are not read, as llama.cpp does
  not; a window on a llama-arch file (a Mistral with `llama.attention.sliding_window`) is every
  layer's; Phi-3's is applied as transformers applies it (llama.cpp turns it off). An olmo2 file with
  a window is OLMo 3, which the registry does not have: refused.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from iterserve.config import ModelConfig
from iterserve.model.gguf_file import GGUFError, GGUFIndex


class GGUFMeta:
    """A file's metadata seen through its architecture's key prefix; missing required keys are
    refused with the key's full name."""

    def __init__(self, index: GGUFIndex, path: Path | None) -> None:
        self.index, self.path = index, path
        self.arch = index.get("general.architecture")

    def get(self, key: str, default=None):
        return self.index.get(f"{self.arch}.{key}", default)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.where}missing required key '{self.arch}.{key}'")
        return value

    def scalar(self, key: str, default=None, required: bool = False):
        """A key llama.cpp also allows per layer (head counts, feed-forward length): one value."""
        value = self.require(key) if required else self.get(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise GGUFError(f"{self.where}'{self.arch}.{key}' differs between layers ({value}): "
                                "not supported")
            value = value[0]
        return value

    @property
    def where(self) -> str:
        return f"{self.path}: " if self.path else ""

    def has_tensor(self, name: str) -> bool:
        return self.index.tensor(name) is not None


# ---- tensor names: per block, GGUF name -> the decoder's (HF) module under model.layers.N ----------
PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
PRE_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}  # ffn_norm: the MLP's pre-norm
SANDWICH_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                  "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
POST_NORMS = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
PHI3_FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# mixture of experts (model/moe.py): the router and every expert's projection stacked in one 3-d tensor
# (experts x rows x cols, as llama.cpp's converter stacks the per-expert checkpoint tensors)
EXPERTS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
           "ffn_down_exps": "mlp.experts.down_proj"}
ROUTER_TENSOR = "ffn_gate_inp"  # always read as floats: the router computes in float (llama-quantize keeps it so)
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# read elsewhere (RoPE tables) or unused by llama.cpp itself
SKIPPED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
SKIPPED_BLOCK_TENSORS = ("attn_rot_embd",)


@dataclass(frozen=True)
class GGUFArch:
    """One `general.architecture`: the registry family it runs as, its tensors, and what llama.cpp's
    converter did to them."""

    name: str  # general.architecture
    family: str  # model/registry.py's family name
    tensors: Mapping[str, str]  # per-block GGUF tensor -> HF module path under model.layers.N
    configure: Callable[[GGUFMeta, ModelConfig], None]  # the family's options from the metadata
    permuted_qk: bool = False  # q/k rows permuted for llama.cpp's interleaved RoPE: undone on load
    norm_offset: bool = False  # 1 added to every norm weight (Gemma): subtracted on load
    features: str = ""


# ---- per-architecture options ---------------------------------------------------------------------
def _window_every_layer(m: GGUFMeta, cfg: ModelConfig) -> None:
    window = m.get("attention.sliding_window") or 0
    cfg.sliding_window = int(window) or None
    cfg.layer_types = ()


def configure_experts(m: GGUFMeta, cfg: ModelConfig, renormalize: bool) -> None:
    """The mixture-of-experts sizes (`expert_count`, `expert_used_count`, `expert_feed_forward_length`,
    else `feed_forward_length`). A layer without a router tensor has a dense MLP (Qwen3-MoE's
    mlp_only_layers, which GGUF has no key for: told by the tensors). `renormalize`: whether
    llama.cpp renormalises this architecture's top-k weights (its graph hard-codes it per
    architecture; `expert_weights_norm`, when written, says it)."""
    cfg.num_experts = int(m.require("expert_count"))
    cfg.num_experts_per_tok = int(m.require("expert_used_count"))
    cfg.moe_intermediate_size = int(m.scalar("expert_feed_forward_length") or cfg.intermediate_size)
    cfg.router_renormalize = bool(m.get("expert_weights_norm", renormalize))
    cfg.dense_mlp_layers = tuple(i for i in range(cfg.num_layers)
                                 if not m.has_tensor(f"blk.{i}.{ROUTER_TENSOR}.weight"))
    if any(m.has_tensor(f"blk.{i}.ffn_gate_shexp.weight") for i in range(cfg.num_layers)):
        raise GGUFError(f"{m.where}a shared expert (ffn_*_shexp tensors) is not supported")


def configure_llama(m: GGUFMeta, cfg: ModelConfig) -> None:
    """Llama, and Mistral (written as llama): a window on every layer when the file says so
    (llama.cpp's converter writes none; llama.cpp's llama ignores one). With `expert_count` > 0:
    Mixtral (softmax, top-k, renormalised, the weights kept in float32 as transformers keeps them)."""
    _window_every_layer(m, cfg)
    if cfg.sliding_window:
        cfg.architecture = "mistral"
    if m.get("expert_count"):
        cfg.architecture = "mixtral"
        configure_experts(m, cfg, renormalize=True)
        cfg.router_weights_float32 = True


def no_options(m: GGUFMeta, cfg: ModelConfig) -> None:
    """Qwen2: its q/k/v biases (and none on o) are found from the tensors, as for every architecture."""


def configure_qwen3(m: GGUFMeta, cfg: ModelConfig) -> None:
    cfg.qk_norm = "head"


def _gemma_common(m: GGUFMeta, cfg: ModelConfig, big_model_layers: int) -> None:
    cfg.norm_unit_offset = True
    cfg.norm_placement = "sandwich"
    cfg.hidden_act = "gelu_pytorch_tanh"
    cfg.embedding_multiplier = cfg.hidden_size ** 0.5
    scale = m.get("attention.scale")  # no converter writes it; llama.cpp derives the scale as below
    if scale is None:  # query_pre_attn_scalar: head_dim, but hidden / heads on the 27B
        scale = ((cfg.hidden_size // cfg.num_heads) if cfg.num_layers == big_model_layers else cfg.head_dim) ** -0.5
    cfg.attention_scale = float(scale)


def configure_gemma2(m: GGUFMeta, cfg: ModelConfig) -> None:
    _gemma_common(m, cfg, big_model_layers=46)
    cfg.attn_logit_softcap = m.get("attn_logit_softcapping") or None
    cfg.final_logit_softcap = m.get("final_logit_softcapping") or None
    cfg.sliding_window = int(m.get("attention.sliding_window", 4096))  # llama.cpp's default for Gemma 2
    cfg.layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_layers))


def configure_gemma3(m: GGUFMeta, cfg: ModelConfig) -> None:
    _gemma_common(m, cfg, big_model_layers=62)
    cfg.qk_norm = "head"
    cfg.final_logit_softcap = m.get("final_logit_softcapping") or None
    window = int(m.get("attention.sliding_window") or 0)
    if not window:  # llama.cpp: no window key, no local layers
        cfg.sliding_window, cfg.layer_types = None, ()
        return
    cfg.sliding_window = window
    cfg.layer_types = _layer_pattern(m, cfg.num_layers, period=6)
    cfg.local_rope_theta = float(m.get("rope.freq_base_swa", 10000.0))  # scaling is the global layers' only


def _layer_pattern(m: GGUFMeta, n: int, period: int) -> tuple[str, ...]:
    """`attention.sliding_window_pattern` (a period, or one flag per layer, true = windowed), else
    llama.cpp's period for the architecture: the last layer of each period is global."""
    pattern = m.get("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise GGUFError(f"{m.where}'{m.arch}.attention.sliding_window_pattern' has {len(pattern)} entries "
                            f"for {n} layers")
        flags = [bool(p) for p in pattern]
    else:
        flags = [(i + 1) % int(pattern) != 0 for i in range(n)] if int(pattern) > 1 else [True] * n
    return tuple("sliding_attention" if f else "full_attention" for f in flags)


def configure_phi3(m: GGUFMeta, cfg: ModelConfig) -> None:
    """Long-rope from the rope_factors_long/short tensors (gguf_config reads them), a window on
    every layer when sliding_window > 0 (0 marks Phi-4, which has none)."""
    _window_every_layer(m, cfg)


def configure_granite(m: GGUFMeta, cfg: ModelConfig) -> None:
    """Granite's four multipliers: required, as llama.cpp requires them (the logits are divided by
    logit_scale, transformers' logits_scaling)."""
    cfg.embedding_multiplier = float(m.require("embedding_scale"))
    cfg.residual_multiplier = float(m.require("residual_scale"))
    cfg.attention_scale = float(m.require("attention.scale"))
    cfg.logits_divisor = float(m.require("logit_scale"))


def configure_qwen3moe(m: GGUFMeta, cfg: ModelConfig) -> None:
    """Qwen3-MoE: llama.cpp always renormalises its top-k weights (norm_topk_prob, true in every
    released Qwen3-MoE), and reads no window."""
    cfg.qk_norm = "head"
    configure_experts(m, cfg, renormalize=True)


def configure_olmoe(m: GGUFMeta, cfg: ModelConfig) -> None:
    """OLMoE: q/k RMSNorm over all heads; top-k weights not renormalised (llama.cpp's graph, and
    OLMoE-1B-7B's norm_topk_prob)."""
    cfg.qk_norm = "all"
    configure_experts(m, cfg, renormalize=False)


def configure_granitemoe(m: GGUFMeta, cfg: ModelConfig) -> None:
    """GraniteMoE: Granite's multipliers; the router as transformers computes it (top-k of the
    logits, softmax over those k: llama.cpp's renormalised softmax, in other rounding)."""
    configure_granite(m, cfg)
    configure_experts(m, cfg, renormalize=False)  # a softmax over the top k sums to 1 already
    cfg.router_topk_first = True


def configure_olmo2(m: GGUFMeta, cfg: ModelConfig) -> None:
    if m.get("attention.sliding_window"):
        raise GGUFError(f"{m.where}an olmo2 file with a sliding window is OLMo 3, which iterserve does not run")
    cfg.norm_placement = "post"
    cfg.qk_norm = "all"


def configure_smollm3(m: GGUFMeta, cfg: ModelConfig) -> None:
    """No RoPE on every fourth layer (llama.cpp: n_no_rope_layer_step = 4, not in the file)."""
    cfg.no_rope_layers = tuple(i for i in range(cfg.num_layers) if (i + 1) % 4 == 0)


GGUF_ARCHS: dict[str, GGUFArch] = {a.name: a for a in (
    GGUFArch("llama", "llama", {**PRE_NORMS, **PROJECTIONS, **EXPERTS}, configure_llama, permuted_qk=True,
             features="Llama, Mistral (llama arch; a window when the file has one), and Mixtral (expert_count > 0)"),
    GGUFArch("qwen2", "qwen2", {**PRE_NORMS, **PROJECTIONS}, no_options),
    GGUFArch("qwen3", "qwen3", {**PRE_NORMS, **PROJECTIONS, **QK_NORMS}, configure_qwen3),
    GGUFArch("gemma2", "gemma2", {**SANDWICH_NORMS, **PROJECTIONS}, configure_gemma2, norm_offset=True),
    GGUFArch("gemma3", "gemma3", {**SANDWICH_NORMS, **PROJECTIONS, **QK_NORMS}, configure_gemma3,
             norm_offset=True),
    GGUFArch("phi3", "phi3", {**PRE_NORMS, **PROJECTIONS, **PHI3_FUSED}, configure_phi3),
    GGUFArch("granite", "granite", {**PRE_NORMS, **PROJECTIONS}, configure_granite, permuted_qk=True),
    GGUFArch("olmo2", "olmo2", {**POST_NORMS, **PROJECTIONS, **QK_NORMS}, configure_olmo2),
    GGUFArch("smollm3", "smollm3", {**PRE_NORMS, **PROJECTIONS}, configure_smollm3, permuted_qk=True),
    GGUFArch("qwen3moe", "qwen3_moe", {**PRE_NORMS, **PROJECTIONS, **QK_NORMS, **EXPERTS}, configure_qwen3moe),
    GGUFArch("olmoe", "olmoe", {**PRE_NORMS, **PROJECTIONS, **QK_NORMS, **EXPERTS}, configure_olmoe),
    GGUFArch("granitemoe", "granitemoe", {**PRE_NORMS, **PROJECTIONS, **EXPERTS}, configure_granitemoe,
             permuted_qk=True),
)}


# ---- the common keys ---------------------------------------------------------------------------------
def gguf_rope_scaling(m: GGUFMeta, cfg: ModelConfig) -> dict | None:
    """`rope.scaling.*` keys as the decoder's rope_scaling (linear, yarn); long-rope and llama3's
    per-frequency factors come from tensors (gguf_config)."""
    kind = m.get("rope.scaling.type")
    factor = float(m.get("rope.scaling.factor") or m.get("rope.scale_linear") or 1.0)
    if kind is None and factor != 1.0:
        kind = "linear"  # llama.cpp's default type (older files: rope.scale_linear alone)
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor} if factor != 1.0 else None
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings": int(m.get("rope.scaling.original_context_length")
                                                       or cfg.max_position_embeddings / factor)}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):
            if m.get(f"rope.scaling.{key}") is not None:
                out[name] = float(m.get(f"rope.scaling.{key}"))
        return out
    if kind == "longrope":
        return None  # Phi-3's factors are tensors: gguf_config builds it
    raise GGUFError(f"{m.where}'{m.arch}.rope.scaling.type' is {kind!r}: supported are none, linear, yarn, longrope")


def base_config(m: GGUFMeta, spec: GGUFArch) -> ModelConfig:
    """The fields every architecture reads the same way."""
    heads = int(m.scalar("attention.head_count", required=True))
    hidden = int(m.require("embedding_length"))
    head_dim = int(m.get("attention.key_length") or hidden // heads)
    embd = m.index.tensor("token_embd.weight")
    if embd is None:
        raise GGUFError(f"{m.where}the file has no 'token_embd.weight' tensor")
    idx = m.index
    eos = [idx.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos += list(idx.end_of_turn.values())
    cfg = ModelConfig(
        architecture=spec.family,
        vocab_size=embd.shape[0],  # Gemma 3's converter drops the rows beyond the tokenizer's vocabulary
        hidden_size=hidden,
        intermediate_size=int(m.scalar("feed_forward_length", required=True)),
        num_layers=int(m.require("block_count")),
        num_heads=heads,
        num_kv_heads=int(m.scalar("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(m.require("attention.layer_norm_rms_epsilon")),
        rope_theta=float(m.get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(m.require("context_length")),
        tie_word_embeddings=not m.has_tensor("output.weight"),
        bos_token_id=idx.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        attention_bias=m.has_tensor("blk.0.attn_q.bias") or m.has_tensor("blk.0.attn_qkv.bias"),
        o_proj_bias=m.has_tensor("blk.0.attn_output.bias"),
    )
    rope_dim = m.get("rope.dimension_count")
    if rope_dim and int(rope_dim) < head_dim:
        cfg.partial_rotary_factor = int(rope_dim) / head_dim
    cfg.rope_scaling = gguf_rope_scaling(m, cfg)
    return cfg


def longrope_scaling(m: GGUFMeta, cfg: ModelConfig, short: list[float], long: list[float]) -> dict:
    """Phi-3's long-rope from the factor tensors and `rope.scaling.*` (the converter writes the
    original context and the attention factor it computed from max / original positions)."""
    original = int(m.get("rope.scaling.original_context_length") or cfg.max_position_embeddings)
    factor = cfg.max_position_embeddings / original
    attention = m.get("rope.scaling.attn_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long, "factor": factor,
            "original_max_position_embeddings": original, "attention_factor": float(attention)}
