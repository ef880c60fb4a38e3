"""An analytic (roofline) profile for hardware not at hand: published peaks plus the model's shape.

It is an estimate: real steps reach only part of the peak FLOP/s and bandwidth, and the efficiency
and per-step overhead used here are assumptions saved in the profile, not measurements. Use it for
the shape of an answer (which batching wins, roughly how many GPUs), and a measured profile
(`iterserve profile MODEL` on the machine itself) for numbers to rely on.

A mixture-of-experts shape (config.json's num_local_experts / num_experts) holds all its experts in
memory but reads per step only the ones its tokens were routed to: the roofline's bytes are the other
weights plus one expert per distinct expert the step touches, expected under uniform routing
(sim/moe.py: no router to measure here).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from typing import Any
from pathlib import Path

from iterserve.config import ModelConfig
from iterserve.sim.moe import moe_routing
from iterserve.sim.profile import Profile, git_commit, now_iso
from iterserve.sim.step_model import RooflineStepModel


@dataclass(frozen=True)
class GpuSpec:
    name: str
    bf16_flops: float  # dense tensor-core peak, FLOP/s (the vendor's datasheet)
    bandwidth: float  # HBM/GDDR bytes/s (datasheet)
    memory_bytes: float  # what the driver reports as usable, roughly


GIB = 2**30
GPUS = {g.name: g for g in (
    GpuSpec("a100-40gb", 312e12, 1555e9, 39.4 * GIB),
    GpuSpec("a100-80gb", 312e12, 2039e9, 79.2 * GIB),
    GpuSpec("h100-80gb", 989e12, 3350e9, 79.1 * GIB),
    GpuSpec("h200", 989e12, 4800e9, 139.8 * GIB),
    GpuSpec("l4", 121e12, 300e9, 22.0 * GIB),
)}

# config.json fields of well-known checkpoints (their published configurations)
MODEL_SHAPES = {
    "llama-2-7b": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096},
    "llama-2-13b": {"vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                    "num_attention_heads": 40, "num_key_value_heads": 40, "max_position_embeddings": 4096},
    "llama-3-8b": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192},
    "smollm2-135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
                     "tie_word_embeddings": True},
    # mixture of experts: ibm-granite/granite-3.0-3b-a800m (40 experts, top-8: ~800M active of 3.3B)
    "granite-3b-a800m": {"vocab_size": 49155, "hidden_size": 1536, "intermediate_size": 512,
                         "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
                         "num_local_experts": 40, "num_experts_per_tok": 8, "max_position_embeddings": 4096,
                         "tie_word_embeddings": True},
    # allenai/OLMoE-1B-7B-0924 (64 experts, top-8: ~1.3B active of 6.9B)
    "olmoe-1b-7b": {"vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
                    "num_experts_per_tok": 8, "max_position_embeddings": 4096},
}
ACTIVATION_RESERVE_BYTES = 1 * GIB  # peak activations of a 2048-token step, roughly (vLLM profiles it)


def shape_config(hf: dict[str, Any]) -> ModelConfig:
    """A config.json's shape, with its experts: num_local_experts (Mixtral, GraniteMoE) or num_experts
    (Qwen3-MoE, OLMoE), each of moe_intermediate_size (else intermediate_size), and Qwen3-MoE's
    mlp_only_layers kept dense (the families' own reading needs transformers; the roofline needs only sizes)."""
    m = ModelConfig.from_hf_dict(hf)
    experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    if not experts:
        return m
    return dataclasses.replace(m, num_experts=experts, num_experts_per_tok=int(hf["num_experts_per_tok"]),
                               moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
                               dense_mlp_layers=tuple(hf.get("mlp_only_layers") or ()))


def model_shape(name_or_path: str) -> tuple[str, ModelConfig]:
    """A known shape by name, or a Hugging Face config.json (or a folder holding one)."""
    if name_or_path in MODEL_SHAPES:
        return name_or_path, shape_config(MODEL_SHAPES[name_or_path])
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model shape {name_or_path!r}: one of {', '.join(MODEL_SHAPES)}, "
                         "or a config.json")
    return path.parent.name, shape_config(json.loads(path.read_text()))


def analytic_profile(gpu: str, shape: str, bytes_per_param: int = 2, gpu_memory_utilization: float = 0.9,
                     flops_efficiency: float = 0.5, bandwidth_efficiency: float = 0.7,
                     overhead_s: float = 0.002) -> Profile:
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}: one of {', '.join(GPUS)}")
    spec = GPUS[gpu]
    name, m = model_shape(shape)
    body, total = m.param_counts()  # active parameters: an MoE layer counts the k experts a token uses
    moe = moe_routing(m, bytes_per_param)
    # read by every step (all but the experts), and held (all the experts too)
    weight_bytes = total * bytes_per_param - (moe.moe_layers * moe.top_k * moe.expert_bytes if moe else 0)
    held_bytes = weight_bytes + (moe.moe_layers * moe.num_experts * moe.expert_bytes if moe else 0)
    kv_per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * bytes_per_param
    kv_memory = int(spec.memory_bytes * gpu_memory_utilization - held_bytes - ACTIVATION_RESERVE_BYTES)
    if kv_memory < kv_per_token * 16:
        raise ValueError(f"{name} ({held_bytes / GIB:.1f} GiB of weights) leaves no KV cache on {gpu}")
    step = RooflineStepModel(
        peak_flops=spec.bf16_flops, bandwidth=spec.bandwidth, weight_bytes=float(weight_bytes),
        params_per_token=2.0 * body, head_flops_per_seq=2.0 * m.vocab_size * m.hidden_size,
        attn_flops_per_kv=4.0 * m.num_layers * m.num_heads * m.head_dim, kv_bytes_per_token=float(kv_per_token),
        flops_efficiency=flops_efficiency, bandwidth_efficiency=bandwidth_efficiency, overhead_s=overhead_s,
        expert_bytes=moe.expert_bytes if moe else 0.0,
        source={"gpu": asdict(spec), "params": total, "non_embedding_params": body,
                "weight_bytes_held": held_bytes})
    return Profile(
        kind="analytic", model=name, dtype="bfloat16" if bytes_per_param == 2 else f"{bytes_per_param}-byte",
        step_model=step, kv_bytes_per_token=kv_per_token,
        max_model_len=min(m.max_position_embeddings, 4096), kv_memory_bytes=kv_memory, estimate=True,
        model_shape=asdict(m), engine_flags={"gpu_memory_utilization": gpu_memory_utilization},
        machine={"gpu": gpu, "peak_bf16_flops": spec.bf16_flops, "bandwidth_bytes_s": spec.bandwidth,
                 "memory_bytes": spec.memory_bytes},
        commit=git_commit(), created=now_iso(), moe=moe,
        note=(f"ESTIMATE: roofline from {gpu}'s published peaks at {flops_efficiency:.0%} of its FLOP/s and "
              f"{bandwidth_efficiency:.0%} of its bandwidth, plus {overhead_s * 1e3:g} ms per step; "
              "assumptions, not measurements"
              + ("; experts per step expected under uniform routing" if moe else "")))
