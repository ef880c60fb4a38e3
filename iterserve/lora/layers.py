"""The adapters' deltas, added to the base projections' outputs for the rows that carry an adapter.

Each targeted projection y = x W^T (whatever kernel computes it: oneDNN, our tiled GEMM, a 4-bit
twin) gets scaling * (x A^T) B^T added for the rows of each slot in use: the rows are gathered per
slot, go through two small matmuls, and are added back in place (index_add_). A step where every
row carries one slot skips the gather. Rows without an adapter cost nothing, and a step with no
adapter rows takes the exact same path as an engine without LoRA: the runner then sets no LoRA
batch, and the hook returns at once.

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

from iterserve.attention.forward_context import current_lora
from iterserve.lora.adapter import FUSED
from iterserve.lora.manager import LoRAManager, SlotWeights


@dataclass
class LoRABatch:
    """One step's rows by slot: (slot, flat row indices, or None for every row of the step)."""

    groups: list[tuple[int, torch.Tensor | None]]
    modules: dict[tuple[int, str], SlotWeights]
    rank: int

    @classmethod
    def build(cls, row_slots: Sequence[int], manager: LoRAManager, device: torch.device) -> "LoRABatch | None":
        """row_slots: each flat row's slot, -1 for none. None when no row has one."""
        by_slot: dict[int, list[int]] = {}
        for i, s in enumerate(row_slots):
            if s >= 0:
                by_slot.setdefault(s, []).append(i)
        if not by_slot:
            return None
        if len(by_slot) == 1 and len(next(iter(by_slot.values()))) == len(row_slots):
            return cls([(next(iter(by_slot)), None)], manager.modules, manager.max_rank)
        groups = [(s, torch.tensor(rows, dtype=torch.long, device=device)) for s, rows in sorted(by_slot.items())]
        return cls(groups, manager.modules, manager.max_rank)

    def apply(self, key: tuple[int, str], x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        w = self.modules[key]
        r = self.rank
        for slot, rows in self.groups:
            if not w.active[slot]:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            h = xs.to(w.a.dtype) @ w.a[slot].t()  # [n, S * R]
            if len(w.b) == 1:
                d = h @ w.b[0][slot].t()
            else:
                d = torch.cat([h[:, i * r:(i + 1) * r] @ b[slot].t() for i, b in enumerate(w.b)], dim=1)
            d = d.to(out.dtype)
            if rows is None:
                out.add_(d)
            else:
                out.index_add_(0, rows, d)
        return out


def _hook(key: tuple[int, str]):
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        batch = current_lora()
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
            mod = block.get_submodule(fused)
            handles.append(mod.register_forward_hook(_hook((layer, fused))))
    return handles
