"""Which adapters the server knows, which are loaded in CPU memory, and which sit in the few resident
slots that a step's rows can use.

Three tiers, as in vLLM: registered (a name and a folder, checked when registered), CPU-loaded (a
bounded LRU of float32 weights, --max-cpu-loras; an adapter that falls out is read again from its
folder when next needed) and resident (--max-loras slots of stacked, padded tensors on the model's
device, in its dtype). A slot holds its adapter's A and B for every layer and targeted module, B
already multiplied by the adapter's scaling and both padded with zeros to --max-lora-rank, so one
step can use any mix of slots with the same tensors.

The scheduler asks `ensure_resident(name, busy)` when it admits a request: the adapter's slot, a
free one, or the least recently used slot whose adapter no running request uses (`busy`); when none
is left the request waits, as it waits for KV blocks. Adapters are only ever loaded into slots on
the engine thread, between steps.
"""
from __future__ import annotations

import itertools
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from iterserve.config import ModelConfig
from iterserve.lora.adapter import FUSED, TARGETS, LoRAAdapter, LoRAError, load_adapter, projection_shapes
from iterserve.lora.slots import SlotTable

log = logging.getLogger("iterserve.lora")


# a platform's LoRA kernel: (x [T, in], a [slots, S * R, in], b [slots, S * R, out], row_slot [T] int32
# (-1: no adapter), bounds [S + 1], out [T, out] contiguous) adds each row's own slot's delta to out
# in place (the CPU platform's: csrc/lora.cpp's lora_sgmv)
LoRAKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int], torch.Tensor], None]


class LoRAInUse(LoRAError):
    """An unload refused because requests still run under the adapter (the server answers 409)."""


@dataclass
class SlotWeights:
    """One fused module of one layer, for every slot: A [slots, S * R, in] (the S projections' A
    stacked), B [slots, S * R, out] (transposed, scaled, block-diagonal: projection s's R rows feed
    only its own output columns), and which slots' adapters target this module at all."""

    a: torch.Tensor
    b: torch.Tensor
    active: list[bool]
    out_slices: list[tuple[int, int]]  # output columns of each of the S projections
    bounds: list[int] = field(default_factory=list)  # the same as S+1 offsets, 0 .. out (lora_sgmv's form)

    def __post_init__(self) -> None:
        self.bounds = [lo for lo, _ in self.out_slices] + [self.out_slices[-1][1]]


@dataclass
class LoRAStats:
    """Counters for metrics and records, per adapter name."""

    loads: int = 0  # adapters copied into a slot
    cpu_loads: int = 0  # adapters read from their folder (registration and re-reads)
    requests: Counter = field(default_factory=Counter)
    prompt_tokens: Counter = field(default_factory=Counter)
    generation_tokens: Counter = field(default_factory=Counter)


class LoRAManager:
    def __init__(self, model_cfg: ModelConfig, max_loras: int, max_rank: int, max_cpu_loras: int | None,
                 device: torch.device | str, dtype: torch.dtype, sgmv: LoRAKernel | None = None) -> None:
        self.model_cfg = model_cfg
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max_cpu_loras
        self.device, self.dtype = torch.device(device), dtype
        # the platform's LoRA kernel (Platform.lora_sgmv): every step's deltas go through it
        # (layers.py); None: the torch paths
        self.sgmv = sgmv
        self._paths: dict[str, str] = {}
        self._uid: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.table = SlotTable(max_loras)  # which adapter is in which slot, least recently used first
        self.stats = LoRAStats()
        shapes = projection_shapes(model_cfg)
        r = max_rank
        self.modules: dict[tuple[int, str], SlotWeights] = {}
        for layer in range(model_cfg.num_layers):
            for fused, projs in FUSED.items():
                in_f = shapes[projs[0]][1]
                outs = [shapes[p][0] for p in projs]
                bounds = [sum(outs[:i]) for i in range(len(outs) + 1)]
                a = torch.zeros(max_loras, len(projs) * r, in_f, dtype=dtype, device=self.device)
                b = torch.zeros(max_loras, len(projs) * r, bounds[-1], dtype=dtype, device=self.device)
                self.modules[(layer, fused)] = SlotWeights(a, b, [False] * max_loras, list(zip(bounds, bounds[1:])))

    # ---- the registry -----------------------------------------------------------------------------
    def load(self, name: str, path: str) -> LoRAAdapter:
        """Reads and checks an adapter (no state changes): safe off the engine thread."""
        return load_adapter(name, path, self.model_cfg, self.max_rank)

    def add(self, adapter: LoRAAdapter) -> None:
        """Registers a checked adapter under its name; LoRAError when the name is taken."""
        if adapter.name in self._paths:
            raise LoRAError(f"an adapter named {adapter.name!r} is already loaded: unload it first")
        self._paths[adapter.name] = adapter.path
        self._uid[adapter.name] = next(self._ids)
        self.stats.cpu_loads += 1
        self._keep_in_cpu(adapter)

    def remove(self, name: str) -> None:
        """Forgets an adapter (the caller made sure no request uses it); frees its slot."""
        self._paths.pop(name)
        self._uid.pop(name)
        self._cpu.pop(name, None)
        slot = self.table.release(name)
        if slot is not None:
            for w in self.modules.values():
                w.active[slot] = False

    def names(self) -> list[str]:
        return list(self._paths)

    def __contains__(self, name: str) -> bool:
        return name in self._paths

    def cache_key(self, name: str) -> tuple[str, str, int]:
        """What the prefix cache's block hashes carry for a request under this adapter: the same
        tokens under another adapter (or the same name loaded again) have other KV."""
        return ("lora", name, self._uid[name])

    def _keep_in_cpu(self, adapter: LoRAAdapter) -> None:
        self._cpu[adapter.name] = adapter
        self._cpu.move_to_end(adapter.name)
        limit = self.max_cpu_loras if self.max_cpu_loras is not None else max(self.max_loras, len(self._paths))
        while len(self._cpu) > limit:
            self._cpu.popitem(last=False)

    def _weights(self, name: str) -> LoRAAdapter:
        adapter = self._cpu.get(name)
        if adapter is None:  # dropped from the CPU cache: read its folder again
            adapter = self.load(name, self._paths[name])
            self.stats.cpu_loads += 1
        self._keep_in_cpu(adapter)
        return adapter

    # ---- resident slots -----------------------------------------------------------------------------
    @property
    def slots(self) -> list[str | None]:
        return self.table.slots

    @property
    def resident(self) -> list[str]:
        return [n for n in self.slots if n is not None]

    def slot(self, name: str) -> int:
        return self.table.slot_of[name]

    def ensure_resident(self, name: str, busy: set[str]) -> bool:
        """Makes `name` resident (loading it into a free slot or the least recently used slot whose
        adapter is not in `busy`) and marks it used now; False when every slot is busy."""
        got = self.table.acquire(name, busy)
        if got is None:
            return False
        if got.loaded:
            if got.evicted is not None:
                log.info("LoRA adapter %s leaves slot %d for %s", got.evicted, got.slot, name)
            try:
                self._fill(got.slot, self._weights(name))
            except BaseException:  # its folder became unreadable: the slot holds no adapter at all
                self.table.release(name)
                for w in self.modules.values():
                    w.active[got.slot] = False
                raise
            self.stats.loads += 1
        return True

    @torch.no_grad()
    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copies an adapter into a slot: every module zeroed, then its A and scaled B padded to R."""
        r, rank = self.max_rank, adapter.rank
        for w in self.modules.values():
            w.a[slot].zero_()
            w.b[slot].zero_()
            w.active[slot] = False
        for (layer, proj), (a, b) in adapter.weights.items():
            fused, s = TARGETS[proj]
            w = self.modules[(layer, fused)]
            lo, hi = w.out_slices[s]
            w.a[slot, s * r:s * r + rank].copy_(a)
            w.b[slot, s * r:s * r + rank, lo:hi].copy_((b * adapter.scaling).t())
            w.active[slot] = True

    def info(self) -> dict:
        """For /v1/scheduler and records."""
        return {"max_loras": self.max_loras, "max_lora_rank": self.max_rank, "max_cpu_loras": self.max_cpu_loras,
                "adapters": self.names(), "resident": [{"slot": i, "name": n} for i, n in enumerate(self.slots)],
                "cpu_loaded": list(self._cpu), "loads_total": self.stats.loads,
                "cpu_loads_total": self.stats.cpu_loads,
                "requests_total": dict(self.stats.requests),
                "prompt_tokens_total": dict(self.stats.prompt_tokens),
                "generation_tokens_total": dict(self.stats.generation_tokens)}
