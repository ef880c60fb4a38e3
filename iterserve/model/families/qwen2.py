"""Qwen2 / Qwen2.5: biases on q, k and v (none on o); a window on the layers from
`max_window_layers` when `use_sliding_window` is on (transformers' layer_types say which)."""
from __future__ import annotations

from typing import Any

from iterserve.config import ModelConfig
from iterserve.model.families.base import Family


def configure(hf: Any, cfg: ModelConfig) -> None:
    cfg.attention_bias, cfg.o_proj_bias = True, False


FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), configure,
                features="q/k/v biases; optional window on upper layers")
