"""Gemma 3 (text): Gemma 2's layout without soft-capping, plus per-head q/k norm, five windowed
(local) layers to one global, and two RoPE bases: the local layers' `rope_local_base_freq` (10k, no
scaling) and the global layers' `rope_theta` (1M, linear scaling on the 4B and larger).
Gemma3ForConditionalGeneration checkpoints load their language model; the vision tower is skipped
(text only)."""
from __future__ import annotations

from typing import Any

from iterserve.config import ModelConfig
from iterserve.model.families.base import Family
from iterserve.model.families.gemma2 import configure_gemma


def configure(hf: Any, cfg: ModelConfig) -> None:
    configure_gemma(hf, cfg)
    cfg.qk_norm = "head"
    if cfg.local_rope_theta is None:  # transformers < 5
        cfg.local_rope_theta = getattr(hf, "rope_local_base_freq", 10000.0)


def rename(name: str) -> str | None:
    """The multimodal checkpoint's language model (`model.language_model.` in transformers 5,
    `language_model.model.` before) as a text model; the vision tower and projector are dropped."""
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name.startswith(("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                        "model.multi_modal_projector.")):
        return None
    return name.removeprefix("language_model.")


FAMILY = Family("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), ("gemma3_text", "gemma3"),
                configure, rename,
                features="(1+w) sandwich norms, per-head q/k norm, GELU-tanh, embedding scale, 5 local : 1 global "
                         "layers with two RoPE bases")
