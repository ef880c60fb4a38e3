"""Granite 3.x: Llama with four multipliers: the embedding's, each block's output before the
residual add, the attention's softmax scale (`attention_multiplier`, replacing head_dim ** -0.5),
and the logits' divisor (`logits_scaling`)."""
from __future__ import annotations

from typing import Any

from iterserve.config import ModelConfig
from iterserve.model.families.base import Family, refuse_mlp_bias


def configure(hf: Any, cfg: ModelConfig) -> None:
    refuse_mlp_bias(hf, "granite")
    cfg.embedding_multiplier = hf.embedding_multiplier
    cfg.residual_multiplier = hf.residual_multiplier
    cfg.attention_scale = hf.attention_multiplier
    cfg.logits_divisor = hf.logits_scaling


FAMILY = Family("granite", ("GraniteForCausalLM",), ("granite",), configure,
                features="embedding, residual, attention and logit multipliers")
