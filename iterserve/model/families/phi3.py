"""Phi-3 / Phi-3.5 / Phi-4-mini: q, k and v (and gate and up) stored fused in the checkpoint, which
the decoder's fused projections take as they are; long-rope scaling (short or long factors, chosen
once per run by the engine's max_model_len); partial rotary (Phi-4-mini); a window on every layer
when config.json sets `sliding_window` (Phi-3-mini: 2047)."""
from __future__ import annotations

from typing import Any

from iterserve.config import ModelConfig
from iterserve.model.families.base import Family


def configure(hf: Any, cfg: ModelConfig) -> None:
    cfg.attention_bias = cfg.o_proj_bias = False
    cfg.layer_types = ()


FAMILY = Family("phi3", ("Phi3ForCausalLM",), ("phi3",), configure,
                features="fused qkv / gate_up in the checkpoint, long-rope, partial rotary, window on every layer "
                         "(when set)")
