"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm; a window on every layer with
`use_sliding_window`) with a mixture-of-experts MLP of `moe_intermediate_size`-wide experts:
softmax over the experts in float32, top-k, renormalised when `norm_topk_prob`, rounded to the
model's dtype (transformers' Qwen3MoeTopKRouter). Layers listed in `mlp_only_layers`, or off the
`decoder_sparse_step` period, keep a dense MLP of `intermediate_size`, as transformers builds them."""
from __future__ import annotations

from typing import Any

from iterserve.config import ModelConfig
from iterserve.model.families.base import Family, refuse_expert_options, set_experts


def configure(hf: Any, cfg: ModelConfig) -> None:
    refuse_expert_options(hf, "qwen3_moe")
    cfg.qk_norm = "head"
    cfg.layer_types = ()  # the window, when use_sliding_window sets one, is every layer's
    set_experts(cfg, hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size)
    cfg.router_renormalize = bool(hf.norm_topk_prob)
    step, dense = int(getattr(hf, "decoder_sparse_step", 1) or 1), set(getattr(hf, "mlp_only_layers", None) or ())
    cfg.dense_mlp_layers = tuple(i for i in range(cfg.num_layers) if i in dense or (i + 1) % step != 0)


FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), configure,
                features="mixture of experts (softmax, top-k, norm_topk_prob); per-head q/k RMSNorm; "
                         "dense layers by mlp_only_layers / decoder_sparse_step")
