"""Gemma 2: Gemma's (1 + w) RMSNorm before and after attention and MLP, GELU-tanh, the embedding
scaled by sqrt(hidden), the query scale from `query_pre_attn_scalar`, attention-logit and
final-logit soft-capping, and a window on every other layer (layer_types)."""
from __future__ import annotations

from typing import Any

from iterserve.config import ModelConfig
from iterserve.model.families.base import Family


def configure_gemma(hf: Any, cfg: ModelConfig) -> None:
    """What Gemma 2 and Gemma 3 share."""
    cfg.norm_unit_offset = True
    cfg.norm_placement = "sandwich"
    cfg.embedding_multiplier = cfg.hidden_size ** 0.5
    cfg.attention_scale = hf.query_pre_attn_scalar ** -0.5
    cfg.attn_logit_softcap = getattr(hf, "attn_logit_softcapping", None)
    cfg.final_logit_softcap = getattr(hf, "final_logit_softcapping", None)


FAMILY = Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), configure_gemma,
                features="(1+w) sandwich norms, GELU-tanh, embedding scale, attention + final logit soft-cap, "
                         "window on alternate layers")
