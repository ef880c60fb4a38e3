"""Faster CPU matmuls for the projections: prepacked oneDNN bf16 weights, and a 4-bit twin for
steps of few tokens.

Measured on this 2-core AVX512-BF16/AMX machine:
- A plain `F.linear` in bf16 lets oneDNN re-lay the weight out for its kernel on every call; with
  the weight packed once at load (`mkldnn._reorder_linear_weight`, what inductor's freezing pass
  does), the same GEMMs ran 1.3-1.8x faster at 4-64 rows, with bit-identical results.
- A decode step of one or two sequences is bound by reading the weights (~270 MB per token in
  bf16). torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, the one gpt-fast uses) reads a
  quarter of that, but loses to bf16 once a step carries more than about 8 rows; so such a layer
  keeps both and picks per step.

The 4-bit grid is rebuilt from the float weights by min-max per group of 32 along the input
dimension. For a checkpoint that was 4-bit already (GGUF Q4_0/Q4_1: the same groups), that
recovers the checkpoint's own levels; the only new error is bf16 rounding of the scales.
"""
from __future__ import annotations

import torch
from torch import nn

GROUP_SIZE = 32


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def prepack_available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (packed uint8, scales_and_zeros [K/group, N, 2] bf16), with
    w ~= (q - 8) * scale + zero, q in 0..15 (the layout torch's CPU int4 kernel takes)."""
    n, k = weight.shape
    groups = weight.float().reshape(-1, group_size)
    lo, hi = groups.amin(1, keepdim=True), groups.amax(1, keepdim=True)
    scales = (hi - lo).clamp(min=1e-8) / 15
    q = groups.sub(lo).div(scales).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zeros = lo + 8 * scales
    sz = torch.cat([scales.reshape(n, k // group_size, 1), zeros.reshape(n, k // group_size, 1)], 2)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz.transpose(0, 1).contiguous().bfloat16()


class CpuLinear(nn.Module):
    """A bf16 Linear with its weight prepacked for oneDNN, and optionally a 4-bit twin used when
    the step has at most `int4_max_tokens` rows. Keeps no plain copy of a weight it owns alone."""

    def __init__(self, linear: nn.Linear, int4_max_tokens: int = 0, keep_weight: bool = False) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.int4_max_tokens = int4_max_tokens
        if int4_max_tokens:
            packed, sz = pack_int4(w)
            self.register_buffer("int4_weight", packed, persistent=False)
            self.register_buffer("int4_scales_and_zeros", sz, persistent=False)
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        self.weight = linear.weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.iterserve.cpu_linear(x, self.packed_weight, getattr(self, "int4_weight", None),
                                              getattr(self, "int4_scales_and_zeros", None), self.bias,
                                              self.int4_max_tokens)


# One op, opaque to torch.compile: inductor cannot lower oneDNN's prepacked weight, and the
# per-step choice between the two kernels must not become a guard (one compiled graph per choice).
_lib = torch.library.Library("iterserve", "FRAGMENT")
_lib.define("cpu_linear(Tensor x, Tensor packed_weight, Tensor? int4_weight, Tensor? int4_scales_and_zeros, "
            "Tensor? bias, int int4_max_tokens) -> Tensor")


def _cpu_linear(x: torch.Tensor, packed_weight: torch.Tensor, int4_weight: torch.Tensor | None,
                int4_scales_and_zeros: torch.Tensor | None, bias: torch.Tensor | None,
                int4_max_tokens: int) -> torch.Tensor:
    if x.shape[0] <= int4_max_tokens:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), int4_weight, GROUP_SIZE,
                                                       int4_scales_and_zeros)
        return y if bias is None else y + bias
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


_lib.impl("cpu_linear", _cpu_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("iterserve::cpu_linear")
def _cpu_linear_fake(x, packed_weight, int4_weight, int4_scales_and_zeros, bias, int4_max_tokens):
    return x.new_empty(x.shape[0], packed_weight.shape[0])


def optimize_cpu_linears(model: nn.Module, int4_max_tokens: int = 0) -> int:
    """Swaps the decoder projections (4-bit twin if int4_max_tokens > 0) and the LM head (prepack
    only: it shares its weight with the embedding, and 4 bits would round the logits) for
    CpuLinear. The model must be bf16 on CPU. Returns the number of layers changed."""
    if not prepack_available():
        raise RuntimeError("this torch/CPU has no oneDNN bf16 support")
    if int4_max_tokens and not int4_kernel_available():
        raise RuntimeError("this torch has no CPU int4 kernel (_weight_int4pack_mm_for_cpu)")
    changed = 0
    for name, mod in list(model.named_modules()):
        if not (isinstance(mod, nn.Linear) and mod.weight.dtype == torch.bfloat16
                and mod.weight.device.type == "cpu"):
            continue
        if name.startswith("layers."):
            new = CpuLinear(mod, int4_max_tokens if mod.in_features % GROUP_SIZE == 0 else 0)
        elif name == "lm_head":
            new = CpuLinear(mod, keep_weight=True)
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        changed += 1
    return changed
