"""OLMoE: Llama's pre-norms, RMSNorm over all heads' q and over all heads' k (before RoPE), and a
mixture-of-experts MLP: softmax over the experts in float32, top-k, renormalised when
`norm_topk_prob` (OLMoE-1B-7B: not), rounded to the model's dtype (transformers' OlmoeTopKRouter)."""
from __future__ import annotations

from typing import Any

from iterserve.config import ModelConfig
from iterserve.model.families.base import Family, refuse_expert_options, set_experts


def configure(hf: Any, cfg: ModelConfig) -> None:
    refuse_expert_options(hf, "olmoe")
    cfg.qk_norm = "all"
    set_experts(cfg, hf.num_experts, hf.num_experts_per_tok, hf.intermediate_size)
    cfg.router_renormalize = bool(hf.norm_topk_prob)


FAMILY = Family("olmoe", ("OlmoeForCausalLM",), ("olmoe",), configure,
                features="mixture of experts (softmax, top-k); q/k RMSNorm over all heads")
