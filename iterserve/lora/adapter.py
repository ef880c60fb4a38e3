"""Reading a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) and checking it
against the base model before anything else changes.

Why so strict: an adapter that does not fit would either fail in the middle of a step (every other
request of that step with it) or, worse, compute something plausible and wrong. So everything we do
not implement is refused by name (DoRA, biases, modules_to_save, per-module ranks, embedding or LM
head targets), and every tensor's layer and shape is checked against the base model's. The
config is PEFT's JSON format, read as PEFT writes it; the tensors are read with safetensors.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from iterserve.config import ModelConfig

# the projections an adapter may target, by Hugging Face's names -> (our module, slice index): q/k/v
# and gate/up land in their slice of our fused qkv_proj and gate_up_proj (model/decoder.py)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
# our fused module -> the HF projections it holds, in output order
FUSED: dict[str, tuple[str, ...]] = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                     "self_attn.o_proj": ("o_proj",),
                                     "mlp.gate_up_proj": ("gate_proj", "up_proj"),
                                     "mlp.down_proj": ("down_proj",)}
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# a LoRA tensor on an expert or a router (model/moe.py; Mixtral's and GraniteMoE's checkpoint names too)
_EXPERT_TENSOR = re.compile(r"\.(?:experts|block_sparse_moe|gate|router)\.")


# PEFT LoRA options that change what the adapter computes and that we do not implement
_UNSUPPORTED = {"lora_bias": "a bias on lora_B", "fan_in_fan_out": "transposed Conv1D weights",
                "layer_replication": "replicated layers", "alora_invocation_tokens": "activated LoRA",
                "trainable_token_indices": "trained token embeddings", "target_parameters": "parameter targets",
                "use_qalora": "QALoRA"}


class LoRAError(ValueError):
    """An adapter that cannot be served on this base model, with the reason."""


@dataclass
class LoRAAdapter:
    """One adapter's weights, float32 on the CPU: (layer, HF projection) -> (A [r, in], B [out, r])."""

    name: str
    path: str
    rank: int
    scaling: float  # alpha / r, or alpha / sqrt(r) with rsLoRA
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def targets(self) -> set[str]:
        return {proj for _, proj in self.weights}

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF projection -> (out_features, in_features) of the base model's layers."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def _read_config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not folder.is_dir():
        raise LoRAError("the adapter folder does not exist")
    if not path.is_file():
        raise LoRAError("the adapter folder has no adapter_config.json (a PEFT LoRA adapter folder is expected)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAError(f"adapter_config.json is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError("adapter_config.json is not a JSON object")
    return cfg


def _check_config(cfg: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a config we implement; LoRAError for anything else."""
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoRAError(f"peft_type {kind!r}: only LoRA adapters are supported")
    if cfg.get("use_dora"):
        raise LoRAError("DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"bias={cfg.get('bias')!r}: only adapters without biases (bias 'none') are supported")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"modules_to_save {cfg['modules_to_save']} is not supported (fully trained modules)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoRAError(f"{key} (per-module ranks or alphas) is not supported")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise LoRAError(f"{key} ({what}) is not supported")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoRAError(f"adapter_config.json needs a positive integer r and a number lora_alpha (r={rank!r})")
    if rank > max_rank:
        raise LoRAError(f"rank {rank} is above --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def load_adapter(name: str, path: str | Path, model_cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Reads and checks the adapter at `path`; LoRAError says why one cannot be served."""
    folder = Path(path)
    rank, scaling = _check_config(_read_config(folder), max_rank)
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise LoRAError("the adapter folder has no adapter_model.safetensors")
    try:
        tensors = load_file(str(file))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a corrupt file
        raise LoRAError(f"adapter_model.safetensors cannot be read: {e}") from None
    shapes = projection_shapes(model_cfg)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if _EXPERT_TENSOR.search(key):
            raise LoRAError(f"tensor {key!r} targets a mixture-of-experts layer's expert or router: expert "
                            "LoRA is not supported (attention projections only on this model)")
        m = _TENSOR.search(key)
        if m is None:
            raise LoRAError(f"tensor {key!r} is not a LoRA A/B weight of a decoder layer's projection "
                            "(embedding, LM head and other targets are not supported)")
        layer, proj, half = int(m.group(1)), m.group(2), m.group(3)
        if proj not in TARGETS:
            raise LoRAError(f"target module {proj!r} (tensor {key!r}) is not one the base model has; "
                            f"supported: {', '.join(TARGETS)}")
        if layer >= model_cfg.num_layers:
            raise LoRAError(f"tensor {key!r} is for layer {layer}, but the base model has {model_cfg.num_layers}")
        if TARGETS[proj][0].startswith("mlp.") and model_cfg.is_moe_layer(layer):
            raise LoRAError(f"tensor {key!r} targets the dense MLP's {proj}, but layer {layer} is a "
                            "mixture-of-experts layer: expert LoRA is not supported")
        halves.setdefault((layer, proj), {})[half] = t
    if not halves:
        raise LoRAError("adapter_model.safetensors holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, proj), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"layer {layer} {proj}: lora_A and lora_B must both be present")
        a, b = ab["A"].float(), ab["B"].float()
        out_f, in_f = shapes[proj]
        if a.shape != (rank, in_f) or b.shape != (out_f, rank):
            raise LoRAError(f"layer {layer} {proj}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                            f"the base model (expected ({rank}, {in_f}) and ({out_f}, {rank})): an adapter for "
                            "another base model?")
        weights[(layer, proj)] = (a.contiguous(), b.contiguous())
    return LoRAAdapter(name, str(folder), rank, scaling, weights)

