"""Mixtral: Mistral's attention (a window on every layer when config.json sets `sliding_window`) with
a mixture-of-experts MLP: softmax over the experts in float32, top-k, the k weights renormalised and
kept in float32 when they scale the experts' outputs (transformers' MixtralTopKRouter). Checkpoint
names `block_sparse_moe.gate` (router) and `block_sparse_moe.experts.N.w1/w3/w2` (gate/up/down)."""
from __future__ import annotations

from typing import Any

from iterserve.config import ModelConfig
from iterserve.model.families.base import Family, refuse_expert_options, set_experts

_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def configure(hf: Any, cfg: ModelConfig) -> None:
    refuse_expert_options(hf, "mixtral")
    cfg.o_proj_bias = cfg.attention_bias = False
    cfg.layer_types = ()  # the window, when set, is every layer's
    set_experts(cfg, hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size)
    cfg.router_renormalize = True
    cfg.router_weights_float32 = True


def rename(name: str) -> str | None:
    """block_sparse_moe.gate -> mlp.gate; block_sparse_moe.experts.N.w1 -> mlp.experts.N.gate_proj (w3 up, w2 down)."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    parts = name.split(".")
    if len(parts) > 2 and parts[-2] in _EXPERT_PROJ and parts[-4] == "experts":
        parts[-2] = _EXPERT_PROJ[parts[-2]]
    return ".".join(parts)


FAMILY = Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), configure, rename,
                features="mixture of experts (softmax, top-k, renormalised); sliding window (when set)")
