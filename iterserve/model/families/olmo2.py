"""OLMo 2: norms after attention and after the MLP only (none before), and RMSNorm over all heads'
q and over all heads' k, before RoPE. (transformers' OLMo 2 norm rounds once, after the weight; in
bf16 this decoder keeps Llama's order, one rounding apart, so the CPU norm kernel applies.)"""
from __future__ import annotations

from typing import Any

from iterserve.config import ModelConfig
from iterserve.model.families.base import Family


def configure(hf: Any, cfg: ModelConfig) -> None:
    cfg.norm_placement = "post"
    cfg.qk_norm = "all"


FAMILY = Family("olmo2", ("Olmo2ForCausalLM",), ("olmo2",), configure,
                features="post-norms only, q/k RMSNorm over all heads")
