"""What a family is (`Family`), and the ModelConfig fields every family reads the same way from a
Hugging Face config (transformers' config classes, which fill each family's defaults and, from
transformers 5, standardise RoPE into `rope_parameters`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from iterserve.config import ModelConfig


def keep_name(name: str) -> str | None:
    return name


def no_changes(hf: Any, cfg: ModelConfig) -> None:
    return None


@dataclass(frozen=True)
class Family:
    """A registry entry. `configure` sets the family's options on the common ModelConfig;
    `rename` maps a checkpoint tensor name to the decoder's (None: not part of the text model)."""

    name: str
    architectures: tuple[str, ...]  # config.json `architectures`
    model_types: tuple[str, ...]  # config.json `model_type`
    configure: Callable[[Any, ModelConfig], None] = no_changes
    rename: Callable[[str], str | None] = keep_name
    features: str = ""  # what it adds to Llama, for the docs' table and the start-up log


def _rope(hf: Any) -> tuple[float, dict | None, float | None, float]:
    """(theta, scaling or None, Gemma 3's local theta or None, partial rotary factor)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if not params:  # transformers < 5: rope_theta + rope_scaling
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    local = None
    if "full_attention" in params:  # per layer type (Gemma 3)
        local = params.get("sliding_attention", {}).get("rope_theta")
        params = dict(params["full_attention"])
    theta = params.pop("rope_theta", getattr(hf, "rope_theta", 10000.0))
    partial = params.pop("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0) or 1.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None, local, partial
    if kind in ("yarn", "longrope"):
        original = params.get("original_max_position_embeddings") or getattr(hf, "original_max_position_embeddings")
        params["original_max_position_embeddings"] = original
        if not params.get("factor"):
            params["factor"] = hf.max_position_embeddings / original
    return theta, params, local, partial


def common_config(hf: Any, family: str) -> ModelConfig:
    """The fields all families share, read from a transformers config object (the text part)."""
    heads = hf.num_attention_heads
    theta, scaling, local_theta, partial = _rope(hf)
    eos = getattr(hf, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return ModelConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        rms_norm_eps=getattr(hf, "rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=eos_ids,
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        o_proj_bias=bool(getattr(hf, "attention_bias", False)),
        architecture=family,
        hidden_act=getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu"),
        sliding_window=getattr(hf, "sliding_window", None) or None,
        layer_types=tuple(getattr(hf, "layer_types", None) or ()),
        local_rope_theta=local_theta,
        partial_rotary_factor=partial,
    )


def refuse_mlp_bias(hf: Any, family: str) -> None:
    if getattr(hf, "mlp_bias", False):
        raise ValueError(f"{family}: mlp_bias=true is not supported")


def set_experts(cfg: ModelConfig, num_experts: int, per_token: int, inter: int) -> None:
    """The mixture-of-experts sizes every MoE family sets (model/moe.py); the router's variant is the family's."""
    cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size = int(num_experts), int(per_token), int(inter)


def refuse_expert_options(hf: Any, family: str) -> None:
    """Options of transformers' MoE configs this decoder does not compute: refused by name, never ignored."""
    if getattr(hf, "shared_expert_intermediate_size", 0) or getattr(hf, "shared_intermediate_size", 0):
        raise ValueError(f"{family}: a shared expert (shared_expert_intermediate_size) is not supported")
    if getattr(hf, "clip_qkv", None) is not None:
        raise ValueError(f"{family}: clip_qkv (q, k, v clamped) is not supported")
