"""GraniteMoE: Granite's four multipliers (families/granite.py) with a mixture-of-experts MLP whose
router takes the top-k of the float32 logits, then a softmax over those k, rounded to the model's
dtype (transformers' GraniteMoeTopKRouter). Checkpoint names: `block_sparse_moe.router.layer`
(router), `block_sparse_moe.input_linear` [E, 2F, H] (gate rows, then up) and `output_linear`
[E, H, F]: the decoder's stacked experts as they are."""
from __future__ import annotations

from typing import Any

from iterserve.config import ModelConfig
from iterserve.model.families import granite
from iterserve.model.families.base import Family, refuse_expert_options, set_experts

_NAMES = {".block_sparse_moe.router.layer.": ".mlp.gate.",
          ".block_sparse_moe.input_linear.weight": ".mlp.experts.w13_weight",
          ".block_sparse_moe.output_linear.weight": ".mlp.experts.w2_weight"}


def configure(hf: Any, cfg: ModelConfig) -> None:
    refuse_expert_options(hf, "granitemoe")
    granite.configure(hf, cfg)
    set_experts(cfg, hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size)
    cfg.router_topk_first = True


def rename(name: str) -> str | None:
    for old, new in _NAMES.items():
        if old in name:
            return name.replace(old, new)
    return name


FAMILY = Family("granitemoe", ("GraniteMoeForCausalLM",), ("granitemoe",), configure, rename,
                features="Granite's multipliers; mixture of experts (top-k of the logits, then softmax)")
