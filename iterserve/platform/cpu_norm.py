"""RMSNorm through iterserve's C++ kernel in eager bf16 and float32 runs (csrc/norm.cpp, `rms_norm`).

Eager torch runs the model's RMSNorm as eight ops (cast to float32, pow, mean, add, rsqrt, mul,
cast back, weight mul), each with its own dispatch and pass over memory, 61 times a step (28.6 us a
576-wide float32 row on a Zen 3 core, against 1.9 us in the kernel); the kernel does one pass per
row in the same order of rounding. A decoder layer's residual add and
the norm after it (`add_and_norm`) are one kernel too: one pass over the row instead of the add's
own. Under torch.compile the torch forms stay, so inductor fuses them with their neighbours as before.
"""
from __future__ import annotations

import torch
from torch import nn

from iterserve.model.layers import RMSNorm
from iterserve.platform.base import replace_module
from iterserve.platform.cpu_kernels import load_cpu_kernels


KERNEL_DTYPES = (torch.bfloat16, torch.float32)


class CpuRMSNorm(RMSNorm):
    """An RMSNorm whose eager bf16 or float32 forward is one kernel call (same parameter, same numbers up to
    the order of the sum of squares). Holds no reference to the kernels' module (found through
    load_cpu_kernels' cache per call, as CpuLinear does), so the model stays copyable."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__(norm.weight.shape[0], norm.eps, norm.unit_offset)
        self.weight = norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or x.dtype != self.weight.dtype or x.dim() != 2:
            return super().forward(x)
        return load_cpu_kernels().rms_norm(x, self.weight, self.eps, self.unit_offset)

    def add_and_norm(self, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if (torch.compiler.is_compiling() or x.dtype != self.weight.dtype or a.dtype != x.dtype or x.dim() != 2
                or a.shape != x.shape):
            return super().add_and_norm(x, a)
        s, h = load_cpu_kernels().add_rms_norm(x, a, self.weight, self.eps, self.unit_offset)
        return s, h


def use_cpu_rms_norm(model: nn.Module) -> int:
    """Swaps every bf16 or float32 RMSNorm of the model for CpuRMSNorm (the kernels must have loaded);
    returns how many."""
    changed = 0
    for name, mod in list(model.named_modules()):
        if type(mod) is RMSNorm and mod.weight.dtype in KERNEL_DTYPES and mod.weight.device.type == "cpu":
            replace_module(model, name, CpuRMSNorm(mod))
            changed += 1
    return changed
