"""Faster CPU matmuls for the projections: prepacked oneDNN bf16 weights, and a quantised twin for
steps of few tokens (4-bit for the decoder's projections, Q8_0 for the LM head).

Measured on this 2-core AVX512-BF16/AMX machine:
- A plain `F.linear` in bf16 lets oneDNN re-lay the weight out for its kernel on every call; with
  the weight packed once at load (`mkldnn._reorder_linear_weight`, what inductor's freezing pass
  does), the same GEMMs ran 1.3-1.8x faster at 4-64 rows, with bit-identical results.
- A decode step of one or two sequences is bound by reading the weights (~270 MB per token in
  bf16). torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, the one gpt-fast uses) reads a
  quarter of that, but loses to bf16 once a step carries more than about 8 rows; so such a layer
  keeps both and picks per step.
- Where AVX512-VNNI exists, our own Q4_1 kernel (iterserve/csrc/cpu_kernels.cpp) takes the
  int4 twin's place: the 120 projections of one row in 3.1 vs 6.7 ms, 8.9 vs 12.7 at 8 rows (Zen 4,
  `kernel_options.py linears`).
- The LM head (49152 x 576 here) is the largest single matrix of a small model's step. Its twin
  is GGUF's Q8_0 (int8 with a float scale per 32 inputs; iterserve/csrc/cpu_kernels.cpp): 0.56 vs
  1.21 ms at 1 row, 0.89 vs 1.27 at 4, slower from 8 (Zen 4, `kernel_options.py lm-head`).

The 4-bit grid (`min_max_4bit`, shared by both 4-bit twins) is rebuilt from the float weights by
min-max per group of 32 along the input dimension. For a checkpoint that was 4-bit already (GGUF
Q4_0/Q4_1: the same groups), that recovers the checkpoint's own levels; the only new error is the
rounding of the scales (bf16 for torch's kernel, float16 for ours). Q8_0 is
rebuilt the same way (absmax per 32 / 127): from a Q8_0 embedding (the GGUF's) it recovers the
stored levels, and its logits stay as close to float32 as bf16's (max error 0.0155 vs 0.0166).
"""
from __future__ import annotations

import torch
from torch import nn

from iterserve.model.cpu_kernels import load_cpu_kernels

GROUP_SIZE = 32
TWINS = ("int4", "q4_1", "q8_0")  # torch's int4 kernel; ours (cpu_kernels.cpp) for 4 and 8 bits


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def prepack_available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def min_max_4bit(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 4-bit grid both twins use, by min-max per group of the input dimension: (levels 0..15
    [N, K/group, group] float, scales and mins [N, K/group, 1] float32), w ~= q * scale + min."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scales = (hi - lo).clamp(min=1e-8) / 15
    return groups.sub(lo).div(scales).round().clamp(0, 15), scales, lo


def pack_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (packed uint8, scales_and_zeros [K/group, N, 2] bf16), with
    w ~= (q - 8) * scale + zero, q in 0..15 (the layout torch's CPU int4 kernel takes)."""
    n, k = weight.shape
    q, scales, lo = min_max_4bit(weight, group_size)
    zeros = lo + 8 * scales
    sz = torch.cat([scales, zeros], 2)  # [N, K/group, 2]
    return (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).reshape(n, k), 1),
            sz.transpose(0, 1).contiguous().bfloat16())


def pack_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (nibbles [N, K/2] uint8, scales [N, K/32] f16, mins [N, K/32] f16) with
    w ~= q * scale + min, q in 0..15 (GGUF Q4_1), laid out for cpu_kernels.cpp's q4_gemm: in each
    chunk of 64 inputs, byte i holds input i in its low nibble and input 32 + i in its high one."""
    n, k = weight.shape
    if k % 64:
        raise ValueError(f"q4_1 packing needs in_features divisible by 64, got {k}")
    q, scales, lo = min_max_4bit(weight, GROUP_SIZE)
    q = q.to(torch.uint8).reshape(n, k // 64, 2, GROUP_SIZE)
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2)
    return nibbles.contiguous(), scales.reshape(n, -1).half().contiguous(), lo.reshape(n, -1).half().contiguous()


def pack_q8_0(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (int8 [N, K], float32 scales [N, K/group]), w ~= q * scale (GGUF Q8_0)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    scales = groups.abs().amax(-1).clamp(min=1e-12) / 127
    q = groups.div(scales.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), scales.contiguous()


class CpuLinear(nn.Module):
    """A bf16 Linear with its weight prepacked for oneDNN, and optionally a quantised twin (`twin`:
    one of TWINS) used when the step has at most `twin_max_tokens` rows. Keeps no plain copy
    of a weight it owns alone."""

    def __init__(self, linear: nn.Linear, twin: str | None = None, twin_max_tokens: int = 0,
                 keep_weight: bool = False) -> None:
        super().__init__()
        if twin not in (None, *TWINS):
            raise ValueError(f"twin must be one of {TWINS} or None, got {twin!r}")
        w = linear.weight.detach()
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.twin = twin or ""
        self.twin_max_tokens = twin_max_tokens if twin else 0
        if twin:
            packed = {"int4": pack_int4, "q4_1": pack_q4_1, "q8_0": pack_q8_0}[twin](w)
            self.register_buffer("twin_weight", packed[0], persistent=False)
            self.register_buffer("twin_scales", packed[1], persistent=False)
            if twin == "q4_1":
                self.register_buffer("twin_mins", packed[2], persistent=False)
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        self.weight = linear.weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.iterserve.cpu_linear(x, self.packed_weight, getattr(self, "twin_weight", None),
                                              getattr(self, "twin_scales", None), getattr(self, "twin_mins", None),
                                              self.bias, self.twin_max_tokens, self.twin)


# One op, opaque to torch.compile: inductor cannot lower oneDNN's prepacked weight, and the
# per-step choice between the two kernels must not become a guard (one compiled graph per choice).
_lib = torch.library.Library("iterserve", "FRAGMENT")
_lib.define("cpu_linear(Tensor x, Tensor packed_weight, Tensor? twin_weight, Tensor? twin_scales, "
            "Tensor? twin_mins, Tensor? bias, int twin_max_tokens, str twin) -> Tensor")


def _cpu_linear(x: torch.Tensor, packed_weight: torch.Tensor, twin_weight: torch.Tensor | None,
                twin_scales: torch.Tensor | None, twin_mins: torch.Tensor | None, bias: torch.Tensor | None,
                twin_max_tokens: int, twin: str) -> torch.Tensor:
    if x.shape[0] <= twin_max_tokens:
        if twin == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), twin_weight, GROUP_SIZE, twin_scales)
        elif twin == "q4_1":
            y = load_cpu_kernels().q4_gemm(x, twin_weight, twin_scales, twin_mins)
        else:
            y = load_cpu_kernels().q8_0_gemm(x, twin_weight, twin_scales)
        return y if bias is None else y + bias
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


_lib.impl("cpu_linear", _cpu_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("iterserve::cpu_linear")
def _cpu_linear_fake(x, packed_weight, twin_weight, twin_scales, twin_mins, bias, twin_max_tokens, twin):
    return x.new_empty(x.shape[0], packed_weight.shape[0])


def four_bit_twin(in_features: int) -> str | None:
    """Our Q4 kernel where it is vectorised (AVX512-VNNI) and the shape fits, else torch's int4."""
    kernels = load_cpu_kernels()
    if kernels is not None and kernels.q4_gemm_is_vectorised() and in_features % 64 == 0:
        return "q4_1"
    return "int4" if in_features % GROUP_SIZE == 0 else None


def optimize_cpu_linears(model: nn.Module, int4_max_tokens: int = 0, q8_head_max_tokens: int = 0) -> int:
    """Swaps the decoder projections (4-bit twin if int4_max_tokens > 0) and the LM head (Q8_0 twin
    if q8_head_max_tokens > 0: 4 bits would round the logits; it keeps its weight, which it shares
    with the embedding) for CpuLinear. The model must be bf16 on CPU. Returns the number changed."""
    if not prepack_available():
        raise RuntimeError("this torch/CPU has no oneDNN bf16 support")
    if int4_max_tokens and not int4_kernel_available():
        raise RuntimeError("this torch has no CPU int4 kernel (_weight_int4pack_mm_for_cpu)")
    if q8_head_max_tokens and load_cpu_kernels() is None:
        raise RuntimeError("a Q8_0 LM head needs iterserve's CPU kernels, which did not build (see the log)")
    changed = 0
    for name, mod in list(model.named_modules()):
        if not (isinstance(mod, nn.Linear) and mod.weight.dtype == torch.bfloat16
                and mod.weight.device.type == "cpu"):
            continue
        if name.startswith("layers."):
            new = CpuLinear(mod, four_bit_twin(mod.in_features) if int4_max_tokens else None, int4_max_tokens)
        elif name == "lm_head":
            fits = q8_head_max_tokens and mod.in_features % GROUP_SIZE == 0
            new = CpuLinear(mod, "q8_0" if fits else None, q8_head_max_tokens, keep_weight=True)
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        changed += 1
    return changed
