"""Mistral: Llama with a sliding window on every layer when config.json sets `sliding_window`
(Mistral 7B v0.1: 4096; later versions set it to null)."""
from __future__ import annotations

from typing import Any

from iterserve.config import ModelConfig
from iterserve.model.families.base import Family


def configure(hf: Any, cfg: ModelConfig) -> None:
    cfg.o_proj_bias = cfg.attention_bias = False
    cfg.layer_types = ()  # the window, when set, is every layer's


FAMILY = Family("mistral", ("MistralForCausalLM",), ("mistral",), configure,
                features="sliding window on every layer (when set)")
