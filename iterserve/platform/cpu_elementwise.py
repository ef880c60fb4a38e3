"""The gated MLP's SiLU-and-multiply and RoPE through iterserve's C++ kernels in eager CPU runs
(csrc/elementwise.cpp, `silu_and_mul` and `rope`).

Eager torch runs `silu(gate) * up` as three ops (split, silu, mul: two [T, F] temporaries) and RoPE
as seven (slices, neg, cat, two muls, add: five temporaries), 30 times each per SmolLM2 step; each
kernel is one pass over memory, with torch's bits (the same formulas and order of rounding: the tests
compare them bit for bit). Under torch.compile the torch forms stay, so inductor fuses them with
their neighbours as before. GELU-tanh (Gemma) keeps torch's form: matching its bits would mean
re-deriving SLEEF's tanh.

A prompt chunk's MLP runs in slices of MLP_SLICE_ROWS rows (llama.cpp's default micro-batch): its
[T, 2F] and [T, F] activations are the largest buffers of a step (a 1B's 2048-token chunk: 96 MiB,
most of what a served 1B's resident memory rose by under load, docs/profile.md), and every op of an
MLP works row by row, so slicing changes no row's arithmetic on the bf16 kernels (tested).
"""
from __future__ import annotations

import torch
from torch import nn

from iterserve.attention.forward_context import get_forward_context
from iterserve.model.layers import MLP, Attention
from iterserve.platform.base import replace_module
from iterserve.platform.cpu_kernels import load_cpu_kernels

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
MLP_SLICE_ROWS = 512  # rows of a prompt chunk's MLP at a time (module docstring)


def _eager(x: torch.Tensor) -> bool:
    return x.dtype in KERNEL_DTYPES and not torch.compiler.is_compiling()


class CpuMLP(MLP):
    """A dense MLP that runs a prompt chunk's rows in slices of MLP_SLICE_ROWS and, for SiLU, its
    act_and_mul as one kernel call. It shares the module's projections and settings, and holds no
    reference to the kernels' module (found through load_cpu_kernels' cache per call, as CpuLinear
    does), so the model stays copyable."""

    def __init__(self, mlp: MLP) -> None:
        nn.Module.__init__(self)
        self.__dict__.update(mlp.__dict__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= MLP_SLICE_ROWS or x.dim() != 2 or not _eager(x) or _step_has_lora_rows():
            return super().forward(x)
        out = None
        for r0 in range(0, rows, MLP_SLICE_ROWS):
            y = super().forward(x[r0:r0 + MLP_SLICE_ROWS])
            if out is None:
                out = y.new_empty((rows, y.shape[1]))
            out[r0:r0 + y.shape[0]] = y
        return out

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.hidden_act != "silu" or not _eager(gate_up) or gate_up.dim() != 2:
            return super().act_and_mul(gate_up)
        return load_cpu_kernels().silu_and_mul(gate_up)


def _step_has_lora_rows() -> bool:
    """The LoRA hooks add each row's adapter by the row's index in the whole step, so a step with
    adapter rows keeps its MLP in one piece."""
    try:
        return get_forward_context().lora is not None
    except RuntimeError:  # no step context (a module called on its own)
        return False


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
    """Swaps the model's dense MLPs for CpuMLP and its attention modules for CpuAttention (the
    kernels must have loaded); returns how many modules changed."""
    changed = 0
    for name, mod in list(model.named_modules()):
        # (a weight on the meta device is one the loader kept as GGUF blocks, for the platform to replace)
        if type(mod) not in (MLP, Attention) or next(mod.parameters()).device.type not in ("cpu", "meta"):
            continue
        if type(mod) is MLP:
            replace_module(model, name, CpuMLP(mod))
            changed += 1
        elif type(mod) is Attention:
            replace_module(model, name, CpuAttention(mod))
            changed += 1
    return changed
