"""The model registry: which families iterserve runs, found by a checkpoint's Hugging Face
`architectures` / `model_type` (and, for GGUF files, by `general.architecture`: family_for_gguf).

Each family lives in model/families/, over the shared layers of model/layers.py; they all run as
model/decoder.py's DecoderForCausalLM. Adding one: a module with a FAMILY, listed below.
"""
from __future__ import annotations

from collections.abc import Sequence

from iterserve.model.families import (gemma2, gemma3, granite, granitemoe, llama, mistral, mixtral, olmo2, olmoe,
                                      phi3, qwen2, qwen3, qwen3_moe, smollm3)
from iterserve.model.families.base import Family
from iterserve.model.gguf_arch import GGUF_ARCHS

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma2.FAMILY, gemma3.FAMILY, phi3.FAMILY,
    granite.FAMILY, olmo2.FAMILY, smollm3.FAMILY, mixtral.FAMILY, qwen3_moe.FAMILY, olmoe.FAMILY, granitemoe.FAMILY)}
_BY_ARCHITECTURE = {a: f for f in FAMILIES.values() for a in f.architectures}
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}


# mixture-of-experts architectures refused by name, with the piece the decoder lacks (docs/models.md):
# Hugging Face `architectures` / `model_type`, and GGUF `general.architecture`
MISSING_PIECE = {
    "GptOssForCausalLM": "gpt-oss needs attention sinks, its clamped SwiGLU experts with biases and MXFP4 weights",
    "DeepseekV2ForCausalLM": "DeepSeek-V2 needs multi-head latent attention (MLA) and shared experts",
    "DeepseekV3ForCausalLM": "DeepSeek-V3 needs multi-head latent attention (MLA), shared experts and "
                             "grouped top-k routing with a bias",
    "Qwen2MoeForCausalLM": "Qwen2-MoE needs its shared expert (with a sigmoid gate)",
    "Qwen3NextForCausalLM": "Qwen3-Next needs gated delta-net (linear attention) layers and a shared expert",
    "GraniteMoeSharedForCausalLM": "GraniteMoE-Shared needs its shared expert",
    "GraniteMoeHybridForCausalLM": "GraniteMoE-Hybrid needs Mamba 2 layers and a shared expert",
}
_MISSING_BY_MODEL_TYPE = {"gpt_oss": "GptOssForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                          "deepseek_v3": "DeepseekV3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                          "qwen3_next": "Qwen3NextForCausalLM", "granitemoeshared": "GraniteMoeSharedForCausalLM",
                          "granitemoehybrid": "GraniteMoeHybridForCausalLM"}
MISSING_PIECE_GGUF = {
    "gpt-oss": MISSING_PIECE["GptOssForCausalLM"], "deepseek2": MISSING_PIECE["DeepseekV3ForCausalLM"],
    "qwen2moe": MISSING_PIECE["Qwen2MoeForCausalLM"], "qwen3next": MISSING_PIECE["Qwen3NextForCausalLM"],
    "granitehybrid": MISSING_PIECE["GraniteMoeHybridForCausalLM"],
}


class UnsupportedArchitecture(ValueError):
    pass


def supported_architectures() -> str:
    return ", ".join(a for f in FAMILIES.values() for a in f.architectures)


def supported_gguf_architectures() -> str:
    return ", ".join(GGUF_ARCHS)


def family_for_gguf(arch: str | None) -> Family:
    """The family of a GGUF file by its `general.architecture` (model/gguf_arch.py has each one's
    table; a llama-arch file with a sliding window runs as Mistral); an unknown one gets an error
    that names what is supported."""
    if arch in MISSING_PIECE_GGUF:
        raise UnsupportedArchitecture(f"GGUF architecture {arch!r} is not supported: {MISSING_PIECE_GGUF[arch]}, "
                                      "which iterserve does not have (docs/models.md)")
    if arch not in GGUF_ARCHS:
        raise UnsupportedArchitecture(f"GGUF architecture {arch!r} is not supported: iterserve reads GGUF files "
                                      f"of these architectures: {supported_gguf_architectures()} (docs/models.md)")
    return FAMILIES[GGUF_ARCHS[arch].family]


def family_for(architectures: Sequence[str] | None, model_type: str | None) -> Family:
    """The family of a Hugging Face config: its first known `architectures` entry, else its
    `model_type`; an unknown one gets an error that names what is supported."""
    refused = [a for a in architectures or () if a in MISSING_PIECE] or \
        ([_MISSING_BY_MODEL_TYPE[model_type]] if model_type in _MISSING_BY_MODEL_TYPE else [])
    for arch in architectures or ():
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    if refused:
        raise UnsupportedArchitecture(f"{refused[0]} is not supported: {MISSING_PIECE[refused[0]]}, which iterserve "
                                      "does not have (docs/models.md)")
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    what = ", ".join(architectures or ()) or f"model_type {model_type!r}"
    raise UnsupportedArchitecture(f"{what} is not supported: iterserve runs these architectures: "
                                  f"{supported_architectures()} (docs/models.md)")
