"""Llama 1-3.x (Llama 3's RoPE scaling included): the base every other family varies."""
from __future__ import annotations

from typing import Any

from iterserve.config import ModelConfig
from iterserve.model.families.base import Family, refuse_mlp_bias


def configure(hf: Any, cfg: ModelConfig) -> None:
    refuse_mlp_bias(hf, "llama")  # attention_bias puts biases on q, k, v and o (common_config)


FAMILY = Family("llama", ("LlamaForCausalLM",), ("llama",), configure,
                features="RoPE default / linear / llama3 / yarn scaling")
