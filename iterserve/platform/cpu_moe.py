"""The experts of a mixture-of-experts layer (model/moe.py) on iterserve's tiled bf16 GEMM in CPU bf16 runs.

torch's bf16 F.linear on a CPU without oneDNN's prepacked weight runs a one-row step at a fraction
of memory speed: 8 experts of a [1024 x 2048 + 512 x 1024] shape took 120 ms a decode row on the
Zen 5 host, the tiled GEMM 1.9 ms from the same numbers (bit-equal outputs: it rounds once per
output, as torch's does). So each expert's w13 and w2 are packed once (pack_bf16) into one stacked
buffer each, the plain weights dropped (no second copy), and the SiLU-and-multiply runs as one kernel
(csrc/elementwise.cpp) as CpuMLP's. The router stays torch's F.linear: its numerics decide which
experts run, and transformers computes it so.
"""
from __future__ import annotations

import torch
from torch import nn

from iterserve.model.moe import SparseMoeBlock
from iterserve.platform.base import replace_module
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_linear import pack_bf16


class CpuSparseMoeBlock(SparseMoeBlock):
    """A SparseMoeBlock whose experts run on the tiled bf16 GEMM from packed weights; shares the
    router and settings of the block it replaces."""

    def __init__(self, block: SparseMoeBlock) -> None:
        nn.Module.__init__(self)
        self.__dict__.update(block.__dict__)
        self._modules = {"gate": block.gate}  # the plain expert weights are not kept
        w13, w2 = block.experts.w13_weight.detach(), block.experts.w2_weight.detach()
        self.hidden_size = w2.shape[1]
        self.register_buffer("w13_tiles", torch.stack([pack_bf16(w) for w in w13]), persistent=False)
        self.register_buffer("w2_tiles", torch.stack([pack_bf16(w) for w in w2]), persistent=False)
        self.silu = block.act is torch.nn.functional.silu

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        kernels = load_cpu_kernels()
        gate_up = kernels.bf16_gemm(x, self.w13_tiles[e], 2 * self.inter, 0)
        if self.silu:
            h = kernels.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.inter, dim=-1)
            h = self.act(gate) * up
        return kernels.bf16_gemm(h, self.w2_tiles[e], self.hidden_size, 0)


def use_cpu_moe(model: nn.Module) -> int:
    """Swaps every bf16 SparseMoeBlock whose widths the packing takes (even) for CpuSparseMoeBlock
    (the kernels must have loaded, with the tiled GEMM vectorised); returns how many changed."""
    changed = 0
    for name, mod in list(model.named_modules()):
        if type(mod) is not SparseMoeBlock or mod.experts.w13_weight.dtype != torch.bfloat16:
            continue
        if mod.experts.w13_weight.shape[2] % 2 or mod.inter % 2:
            continue
        replace_module(model, name, CpuSparseMoeBlock(mod))
        changed += 1
    return changed
