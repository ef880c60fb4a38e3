"""What the engine asks of the machine it runs on: a device and dtype, an attention backend, a LoRA
kernel where it has one, the model's weights laid out for that machine, and how many KV blocks fit.

One subclass per device kind (platform/cpu.py, platform/cuda.py); platform/selector.py picks one.
Everything CPU- or CUDA-specific lives behind this interface, so the engine and the runner never
ask which device they drive.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from iterserve.attention.backend import AttentionBackend
from iterserve.attention.kv_cache_dtype import KVCacheFormat, resolve_kv_cache_dtype
from iterserve.config import EngineConfig, ModelConfig, parse_size
from iterserve.core.kv_groups import KVCacheGroups, kv_cache_groups
from iterserve.model.loader import ModelSource
from iterserve.sampling import first_argmax

if TYPE_CHECKING:
    from iterserve.lora.manager import LoRAKernel

DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Puts `new` where `model.get_submodule(name)` was: how a platform swaps in its own layers
    (CpuLinear, CpuRMSNorm) for the model's."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def user_cache_dir() -> Path:
    """iterserve's folder in the user's cache ($XDG_CACHE_HOME/iterserve, else ~/.cache/iterserve):
    the measured kernel table (platform/kernel_choice.py) and inductor's compiled graphs."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "iterserve"


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use auto, float32, bfloat16 or float16")
    return DTYPES[name]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_cache: KVCacheFormat,
                       groups: KVCacheGroups | None = None) -> int:
    """Bytes of one KV block: keys and values, block_size tokens each, of one KV cache group's
    layers (core/kv_groups.py: all layers for a model with one kind of attention; 3 of Gemma 3
    270M's 18), in the cache's format (q8_0's scales included). groups: None = the model's own
    grouping (`kv_cache_groups`)."""
    layers = (groups or kv_cache_groups(cfg)).group_size
    return 2 * layers * block_size * cfg.num_kv_heads * kv_cache.bytes_per_token_head(cfg.head_dim)


def kv_blocks_for_budget(config: EngineConfig, model_config: ModelConfig, kv_cache: KVCacheFormat) -> int:
    """KV blocks of --num-kv-blocks, else as many as --kv-cache-memory holds (at least one): the CPU
    platform's cache size, and what the memory plan (iterserve/memory.py) counts before loading."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    return max(1, parse_size(config.kv_cache_memory) // kv_bytes_per_block(model_config, config.block_size, kv_cache))


class Platform:
    """A device, its dtype, attention backend and LoRA kernel, decided once from the EngineConfig."""

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 attention: AttentionBackend, lora_sgmv: LoRAKernel | None = None,
                 kv_bf16_for_float32: bool = False,
                 argmax: Callable[[torch.Tensor], torch.Tensor] = first_argmax) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.attention = attention
        # the KV cache's format (--kv-cache-dtype); kv_bf16_for_float32: auto means bf16 for a float32
        # model (a CPU run in float32 only for lack of fast bf16 GEMMs: kv_cache_dtype.py)
        self.kv_cache = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, kv_bf16_for_float32)
        if self.kv_cache.is_8bit and not attention.reads_8bit_kv:
            raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype}: the {attention.name} attention backend "
                             "cannot read an 8-bit KV cache; use --kv-cache-dtype auto or bfloat16, or "
                             "--decode-attention torch")
        # the LoRA deltas' kernel the engine hands the LoRA manager (lora/layers.py); None: torch's ops
        self.lora_sgmv = lora_sgmv
        # the sampler's greedy choice (sampling.first_argmax's numbers), which the runners get
        self.argmax = argmax

    def gguf_block_types(self) -> frozenset[str]:
        """The GGUF block types this platform computes with as they are stored: the loader keeps a
        module whose weights are all of these as its blocks only, never as floats (model/loader.py),
        and prepare_model must then replace that module. None here."""
        return frozenset()

    def prepare_model(self, model: nn.Module, source: ModelSource) -> None:
        """Lays the loaded weights out for this machine (`source`: where they came from)."""

    def num_kv_blocks(self, model_config: ModelConfig, profile_run: Callable[[], None]) -> int:
        """How many KV blocks of config.block_size the cache gets. `profile_run` runs one forward
        pass at the step's token budget (for platforms that measure their memory)."""
        raise NotImplementedError

    def resolved(self) -> dict[str, Any]:
        """The switches as this platform resolved them ("auto" replaced by what it chose), for
        /v1/scheduler's config and the benchmarks' JSON."""
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "decode_attention": self.attention.name, "kv_cache_dtype": self.kv_cache.name}
