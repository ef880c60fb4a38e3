"""The gated MLP's SiLU-and-multiply and RoPE through iterserve's C++ kernels in eager CPU runs
(csrc/elementwise.cpp, `silu_and_mul` and `rope`).

Eager torch runs `silu(gate) * up` as three ops (split, silu, mul: two [T, F] temporaries) and RoPE
as seven (slices, neg, cat, two muls, add: five temporaries), 30 times each per SmolLM2 step; each
kernel is one pass over memory, with torch's bits (the same formulas and order of rounding: the tests
compare them bit for bit). Under torch.compile the torch forms stay, so inductor fuses them with
their neighbours as before. GELU-tanh (Gemma) keeps torch's form: matching its bits would mean
re-deriving SLEEF's tanh.
"""
from __future__ import annotations

import torch
from torch import nn

from iterserve.model.layers import MLP, Attention
from iterserve.platform.base import replace_module
from iterserve.platform.cpu_kernels import load_cpu_kernels

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _eager(x: torch.Tensor) -> bool:
    return x.dtype in KERNEL_DTYPES and not torch.compiler.is_compiling()


class CpuMLP(MLP):
    """A SiLU MLP whose act_and_mul is one kernel call. It shares the module's projections and
    settings, and holds no reference to the kernels' module (found through load_cpu_kernels' cache
    per call, as CpuLinear does), so the model stays copyable."""

    def __init__(self, mlp: MLP) -> None:
        nn.Module.__init__(self)
        self.__dict__.update(mlp.__dict__)

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not _eager(gate_up) or gate_up.dim() != 2:
            return super().act_and_mul(gate_up)
        return load_cpu_kernels().silu_and_mul(gate_up)


class CpuAttention(Attention):
    """An Attention whose RoPE is one kernel call over q and k (the fused QKV output's view), out of
    place as apply_rope; shares the module's projections and settings as CpuMLP does."""

    def __init__(self, attn: Attention) -> None:
        nn.Module.__init__(self)
        self.__dict__.update(attn.__dict__)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not _eager(x) or x.dim() != 3 or cos.dtype != x.dtype or sin.dtype != x.dtype:
            return super().rope(x, cos, sin)
        return load_cpu_kernels().rope(x, cos, sin)


def use_cpu_elementwise(model: nn.Module) -> int:
    """Swaps the model's SiLU MLPs for CpuMLP and its attention modules for CpuAttention (the
    kernels must have loaded); returns how many modules changed."""
    changed = 0
    for name, mod in list(model.named_modules()):
        # (a weight on the meta device is one the loader kept as GGUF blocks, for the platform to replace)
        if type(mod) not in (MLP, Attention) or next(mod.parameters()).device.type not in ("cpu", "meta"):
            continue
        if type(mod) is MLP and mod.hidden_act == "silu":
            replace_module(model, name, CpuMLP(mod))
            changed += 1
        elif type(mod) is Attention:
            replace_module(model, name, CpuAttention(mod))
            changed += 1
    return changed
