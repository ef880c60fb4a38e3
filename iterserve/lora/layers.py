"""The adapters' deltas, added to the base projections' outputs for the rows that carry an adapter.

Each targeted projection y = x W^T (whatever kernel computes it: oneDNN, our tiled GEMM, a 4-bit
twin) gets scaling * (x A^T) B^T added for the rows of each slot in use: the rows are gathered per
slot, go through two small matmuls, and are added back in place (index_add_); a decode-sized step
takes one masked matmul pair over all slots instead (LoRABatch). A step where every row carries
one slot skips the gather. Where the platform has a LoRA kernel (the CPU platform with iterserve's
C++ kernels loaded: their lora_sgmv), every step takes one kernel call per projection instead:
each row through its own slot's A and B's diagonal blocks only, with none of the masked path's
wasted arithmetic or the gather's per-slot ops. Rows without an adapter cost nothing, and a step
with no adapter rows takes the exact same path as an engine without LoRA: the runner then sets no
LoRA batch, and the hook returns at once.

The step's batch comes to the hooks in the forward context the runner sets around the forward pass
(attention/forward_context.py), beside attention's metadata; the kernel comes from the platform
through the manager (LoRAManager.sgmv), so nothing here is device-specific.

Why forward hooks on the projection modules rather than a wrapper class or edits to the layers:
the CPU platform replaces each nn.Linear by its own module (platform/cpu_linear.py) after loading,
and the model's own code stays the plain code every family runs; a hook sees whatever module is
there at install time, and the base output it returns, and is installed only with --enable-lora.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from iterserve.attention.forward_context import get_forward_context
from iterserve.lora.adapter import FUSED
from iterserve.lora.manager import LoRAKernel, LoRAManager, SlotWeights


DENSE_MAX_ROWS = 32  # steps of at most this many rows take the masked path (decode steps); more: gathered


@dataclass
class LoRABatch:
    """One step's adapter rows, in the form `apply` takes.

    With the platform's LoRA kernel (manager.sgmv), one way for every step: each row's slot as an
    int32 tensor (row_slot), built here once per step, and one kernel call per projection, which
    reads only each row's own slot and B's diagonal blocks. On a 16-row SmolLM2-135M decode step
    over 4 adapters it replaced ~12 ms of masked matmuls (docs/server.md), and it beats the gather on
    long steps too (the per-slot B there is the whole block-diagonal matrix).

    Otherwise (no LoRA kernel: CUDA, or no C++ kernels), two torch ways to add the deltas, chosen per step by its row count. Gathered (prefill-sized steps):
    per slot in use, gather its rows, two small matmuls, index_add_ back: no wasted arithmetic,
    ~4 ops per slot per projection. Masked (decode-sized steps, <= DENSE_MAX_ROWS rows): every row
    through every slot's A at once ([T, slots * S * R]), a 0/1 mask keeps each row's own slot
    (none for base rows), one matmul with the stacked B: 4 ops per projection whatever the number
    of slots. A decode step is bound by reading the adapters' weights, which both read once; the
    masked path's extra arithmetic is rank-sized, and it saves the per-slot op overheads that
    dominate a small step (measured: benchmarks/lora_throughput.py)."""

    groups: list[tuple[int, torch.Tensor | None]]  # gathered: (slot, flat rows, or None for all rows)
    masks: dict[int, torch.Tensor]  # masked: S (projections of a fused module) -> [T, slots * S * R] 0/1
    modules: dict[tuple[int, str], SlotWeights]
    row_slot: torch.Tensor | None = None  # kernel path: [T] int32, each flat row's slot or -1
    sgmv: LoRAKernel | None = None  # kernel path: the platform's kernel

    @classmethod
    def build(cls, row_slots: Sequence[int], manager: LoRAManager, device: torch.device) -> "LoRABatch | None":
        """row_slots: each flat row's slot, -1 for none. None when no row has one."""
        by_slot: dict[int, list[int]] = {}
        for i, s in enumerate(row_slots):
            if s >= 0:
                by_slot.setdefault(s, []).append(i)
        if not by_slot:
            return None
        if manager.sgmv is not None:
            return cls([], {}, manager.modules, torch.tensor(row_slots, dtype=torch.int32), manager.sgmv)
        if len(by_slot) == 1 and len(next(iter(by_slot.values()))) == len(row_slots):
            return cls([(next(iter(by_slot)), None)], {}, manager.modules)
        if len(row_slots) <= DENSE_MAX_ROWS:
            slots = torch.tensor(row_slots, device=device)
            masks = {}
            for width in {len(p) for p in FUSED.values()}:  # S: projections per fused module
                col_slot = torch.arange(manager.max_loras, device=device).repeat_interleave(width * manager.max_rank)
                masks[width] = (slots[:, None] == col_slot[None, :]).to(manager.dtype)
            return cls([], masks, manager.modules)
        groups = [(s, torch.tensor(rows, dtype=torch.long, device=device)) for s, rows in sorted(by_slot.items())]
        return cls(groups, {}, manager.modules)

    def apply(self, key: tuple[int, str], x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        w = self.modules[key]
        if self.row_slot is not None:
            dst = out if out.is_contiguous() else out.contiguous()  # the kernel writes in place: a copy of a view
            self.sgmv(x, w.a, w.b, self.row_slot, w.bounds, dst)
            return out if dst is out else out.copy_(dst)
        if self.masks:
            h = x.to(w.a.dtype) @ w.a.flatten(0, 1).t()  # [T, slots * S * R]
            h.mul_(self.masks[len(w.out_slices)])  # each row keeps its own slot's columns
            out.add_((h @ w.b.flatten(0, 1)).to(out.dtype))
            return out
        for slot, rows in self.groups:
            if not w.active[slot]:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            d = ((xs.to(w.a.dtype) @ w.a[slot].t()) @ w.b[slot]).to(out.dtype)
            if rows is None:
                out.add_(d)
            else:
                out.index_add_(0, rows, d)
        return out


def _hook(key: tuple[int, str]):
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        batch = get_forward_context().lora
        if batch is None:
            return None
        return batch.apply(key, args[0], out)
    return hook


def install_lora_hooks(model: nn.Module) -> list:
    """Hooks every layer's fused projections (qkv, o, gate_up, down); returns the handles (their
    .remove() takes a hook off). Call it after the platform has laid out the model's weights."""
    handles = []
    for layer, block in enumerate(model.layers):
        for fused in FUSED:
            if fused.startswith("mlp.") and model.cfg.is_moe_layer(layer):
                continue  # the experts take no adapter (lora/adapter.py refuses one)
            mod = block.get_submodule(fused)
            handles.append(mod.register_forward_hook(_hook((layer, fused))))
    return handles
