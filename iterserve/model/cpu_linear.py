"""Faster CPU matmuls for the projections: bf16 weights laid out once at load for a GEMM kernel,
and a quantised twin for steps of few tokens (4-bit for the decoder's projections, Q8_0 for the LM
head).

Measured on the 2-core machines of this project (Zen 4 and Intel AMX hosts):
- A plain `F.linear` in bf16 lets oneDNN re-lay the weight out for its kernel on every call; with
  the weight packed once at load (`mkldnn._reorder_linear_weight`, what inductor's freezing pass
  does), the same GEMMs ran 1.3-1.8x faster at 4-64 rows, with bit-identical results. That is the
  "onednn" layout, used where our own kernel is not vectorised.
- Our bf16 GEMM (iterserve/csrc/cpu_kernels.cpp, the "tiled" layout, where AVX512-BF16 exists)
  beats it at every decode size: the 120 projections at 16 rows in 5.9-6.2 vs 13.5-14.5 ms, at 8
  rows 5.4 vs 13.2, within 3% at 512 (124 vs 120; Zen 4, `kernel_options.py linears`). At 16 rows
  that is 34 GB/s of weights, about this machine's memory bandwidth. It runs on the kernels' work
  pool, whose worker then stays awake between the calls of a step (oneDNN's OpenMP threads sleep
  between calls under OMP_WAIT_POLICY=PASSIVE). Numbers: float32 accumulation and one rounding to
  bf16, as oneDNN, but in another order, so not bit-identical to it.
- A decode step of one or two sequences is bound by reading the weights (~270 MB per token in
  bf16). torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, the one gpt-fast uses) reads a
  quarter of that, but loses to bf16 past a few rows; so such a layer keeps both and picks per step
  (`four_bit_max_tokens`).
- Where AVX512-VNNI exists, our own Q4_1 kernel (iterserve/csrc/cpu_kernels.cpp) takes the
  int4 twin's place: the 120 projections of one row in 3.1-3.5 vs 6.7 ms (torch int4) and 4.8-5.2
  (our bf16); level with our bf16 at 4 rows (5.4 vs 5.5), slower at 8 (8.8 vs 5.5; Zen 4,
  `kernel_options.py linears`).
- The LM head (49152 x 576 here) is the largest single matrix of a small model's step. Its twin
  is GGUF's Q8_0 (int8 with a float scale per 32 inputs; iterserve/csrc/cpu_kernels.cpp): 0.56 vs
  1.21 ms at 1 row, 0.96 vs 1.2 (our bf16) at 4, slower from 8 (Zen 4, `kernel_options.py lm-head`).

The 4-bit grid (`min_max_4bit`, shared by both 4-bit twins) is rebuilt from the float weights by
min-max per group of 32 along the input dimension. For a checkpoint that was 4-bit already (GGUF
Q4_0/Q4_1: the same groups), that recovers the checkpoint's own levels; the only new error is the
rounding of the scales (bf16 for torch's kernel, float16 for ours). Q8_0 is
rebuilt the same way (absmax per 32 / 127): from a Q8_0 embedding (the GGUF's) it recovers the
stored levels, and its logits stay as close to float32 as bf16's (max error 0.0155 vs 0.0166).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from iterserve.cpu_info import cpu_flags
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


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> [ceil(N/16), K/2, 16, 2] bf16 (zero-padded outputs), laid out for
    cpu_kernels.cpp's bf16_gemm: a tile of 16 outputs, an input pair at a time."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"bf16 packing needs an even in_features, got {k}")
    tiles = -(-n // 16)
    w = torch.zeros(tiles * 16, k, dtype=torch.bfloat16)
    w[:n] = weight
    return w.reshape(tiles, 16, k // 2, 2).transpose(1, 2).contiguous()


def pack_q8_0(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (int8 [N, K], float32 scales [N, K/group]), w ~= q * scale (GGUF Q8_0)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    scales = groups.abs().amax(-1).clamp(min=1e-12) / 127
    q = groups.div(scales.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), scales.contiguous()


LAYOUTS = ("tiled", "onednn")  # our bf16 kernel's weight tiles (pack_bf16); oneDNN's opaque prepacked weight


def tiled_bf16_available() -> bool:
    """Whether the projections take our bf16 GEMM: it built with AVX512-BF16 (else oneDNN's is
    faster), and ITERSERVE_BF16_GEMM (read when a model's linears are laid out, at load) is `tiled`,
    or `auto` (default) on a CPU without AMX: oneDNN runs bf16 on AMX tiles, and ours was measured
    only against oneDNN's AVX-512 path (Zen 4), so AMX hosts keep oneDNN unless told otherwise."""
    choice = os.environ.get("ITERSERVE_BF16_GEMM", "auto")
    if choice not in ("auto", "tiled", "onednn"):
        raise ValueError(f"ITERSERVE_BF16_GEMM={choice!r}: use auto, tiled or onednn")
    if choice == "onednn" or (choice == "auto" and "amx_bf16" in cpu_flags()):
        return False
    kernels = load_cpu_kernels()
    return kernels is not None and kernels.bf16_gemm_is_vectorised()


def bf16_linears_available() -> bool:
    return tiled_bf16_available() or prepack_available()


def four_bit_max_tokens() -> int:
    """Rows up to which the 4-bit twin beats the bf16 weight: 4 against our tiled bf16 GEMM (5.4 vs
    5.5 ms for the 120 projections at 4 rows, 8.8 vs 5.5 at 8), 8 against oneDNN's (8.9 vs 12.8 at 8
    rows, 16.5 vs 14.4 at 16; Zen 4, `kernel_options.py linears`)."""
    return 4 if tiled_bf16_available() else 8


class CpuLinear(nn.Module):
    """A bf16 Linear with its weight laid out once for a fast kernel (`layout`: our tiled GEMM where
    it is vectorised, else oneDNN's prepacked weight), and optionally a quantised twin (`twin`: one
    of TWINS) used when the step has at most `twin_max_tokens` rows. Keeps no plain copy of a weight
    it owns alone."""

    def __init__(self, linear: nn.Linear, twin: str | None = None, twin_max_tokens: int = 0,
                 keep_weight: bool = False, layout: str | None = None) -> None:
        super().__init__()
        if twin not in (None, *TWINS):
            raise ValueError(f"twin must be one of {TWINS} or None, got {twin!r}")
        layout = layout or ("tiled" if tiled_bf16_available() and linear.in_features % 2 == 0 else "onednn")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
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
        self.layout = layout
        self.packed_weight = pack_bf16(w) if layout == "tiled" else torch.ops.mkldnn._reorder_linear_weight(w, 16)
        self.weight = linear.weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.iterserve.cpu_linear(x, self.packed_weight, self.layout, self.out_features,
                                              getattr(self, "twin_weight", None), getattr(self, "twin_scales", None),
                                              getattr(self, "twin_mins", None), self.bias, self.twin_max_tokens,
                                              self.twin)


# One op, opaque to torch.compile: inductor cannot lower either packed weight, and the per-step
# choice between the kernels must not become a guard (one compiled graph per choice).
_lib = torch.library.Library("iterserve", "FRAGMENT")
_lib.define("cpu_linear(Tensor x, Tensor packed_weight, str layout, int out_features, Tensor? twin_weight, "
            "Tensor? twin_scales, Tensor? twin_mins, Tensor? bias, int twin_max_tokens, str twin) -> Tensor")


def _cpu_linear(x: torch.Tensor, packed_weight: torch.Tensor, layout: str, out_features: int,
                twin_weight: torch.Tensor | None, twin_scales: torch.Tensor | None, twin_mins: torch.Tensor | None,
                bias: torch.Tensor | None, twin_max_tokens: int, twin: str) -> torch.Tensor:
    if x.shape[0] <= twin_max_tokens:
        if twin == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), twin_weight, GROUP_SIZE, twin_scales)
        elif twin == "q4_1":
            y = load_cpu_kernels().q4_gemm(x, twin_weight, twin_scales, twin_mins)
        else:
            y = load_cpu_kernels().q8_0_gemm(x, twin_weight, twin_scales)
    elif layout == "tiled":
        y = load_cpu_kernels().bf16_gemm(x, packed_weight, out_features)
    else:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return y if bias is None else y + bias


_lib.impl("cpu_linear", _cpu_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("iterserve::cpu_linear")
def _cpu_linear_fake(x, packed_weight, layout, out_features, twin_weight, twin_scales, twin_mins, bias,
                     twin_max_tokens, twin):
    return x.new_empty(x.shape[0], out_features)


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
    if not bf16_linears_available():
        raise RuntimeError("this torch/CPU has no oneDNN bf16 support, and our bf16 kernel did not build")
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
