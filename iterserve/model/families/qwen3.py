"""Qwen3 (dense): RMSNorm of each head's q and k before RoPE, no q/k/v biases by default."""
from __future__ import annotations

from typing import Any

from iterserve.config import ModelConfig
from iterserve.model.families.base import Family


def configure(hf: Any, cfg: ModelConfig) -> None:
    cfg.qk_norm = "head"


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), configure,
                features="per-head q/k RMSNorm; optional window on upper layers")
