"""SmolLM3: Llama with no RoPE on every fourth layer (config.json's `no_rope_layers`: 1 = RoPE,
0 = none), tied embeddings."""
from __future__ import annotations

from typing import Any

from iterserve.config import ModelConfig
from iterserve.model.families.base import Family, refuse_mlp_bias


def configure(hf: Any, cfg: ModelConfig) -> None:
    refuse_mlp_bias(hf, "smollm3")
    flags = getattr(hf, "no_rope_layers", None) or [1] * cfg.num_layers
    cfg.no_rope_layers = tuple(i for i, use in enumerate(flags) if not use)
    if not getattr(hf, "use_sliding_window", False):
        cfg.sliding_window = None


FAMILY = Family("smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), configure,
                features="no RoPE on every fourth layer")
