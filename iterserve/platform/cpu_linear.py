"""Faster CPU matmuls for the projections: bf16 weights laid out once at load for a GEMM kernel,
and a quantised twin for steps of few tokens (4-bit for the decoder's projections, Q8_0 for the LM
head). The CPU platform (platform/cpu.py) decides which of these a model gets; the figures behind
each threshold are in docs/profile.md, with the commands that measured them
(`benchmarks/kernel_options.py`).

- Layouts. A plain `F.linear` in bf16 lets oneDNN re-lay the weight out for its kernel on every
  call; packing it once at load (`mkldnn._reorder_linear_weight`, what inductor's freezing pass
  does) gives bit-identical results without that cost: the "onednn" layout. Where AVX512-BF16
  exists, our own bf16 GEMM (iterserve/csrc/cpu_kernels.cpp, the "tiled" layout) is faster still at
  decode sizes; it runs on the kernels' work pool, whose worker stays awake between the calls of a
  step. Numbers: float32 accumulation and one rounding to bf16, as oneDNN, but in another order, so
  not bit-identical to it. On a CPU with AMX the same weight tiles also feed AMX's tile products for
  steps of many rows (`amx_min_rows`, measured), where oneDNN's AMX GEMM used to beat ours 3x: one
  copy of the weights, the faster kernel at each step size.
- 4-bit twin. A decode step of one or two sequences is bound by reading the weights. torch's CPU
  int4 kernel (`_weight_int4pack_mm_for_cpu`, the one gpt-fast uses) reads a quarter of the bf16
  bytes, but loses to bf16 past a few rows; so such a layer keeps both and picks per step
  (`four_bit_max_tokens`). Where AVX512-VNNI (or AVX2 + FMA) exists, our own Q4_1 kernel takes the
  int4 twin's place; it is also the only 4-bit twin of a float32 run (quantization=int4 there).
- Q8_0 head. The LM head is the largest single matrix of a small model's step. Its twin is GGUF's
  Q8_0 (int8 with a float scale per 32 inputs), used for steps that sample few rows.

The 4-bit grid (`min_max_4bit`, shared by both 4-bit twins) is rebuilt from the float weights by
min-max per group of 32 along the input dimension. For a checkpoint that was 4-bit already (GGUF
Q4_0/Q4_1: the same groups), that recovers the checkpoint's own levels; the only new error is the
rounding of the scales (bf16 for torch's kernel, float16 for ours). Q8_0 is rebuilt the same way
(absmax per 32 / 127): from a Q8_0 embedding (the GGUF's) it recovers the stored levels.
"""
from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

import torch
from torch import nn

from iterserve.cpu_info import cpu_flags
from iterserve.platform.base import replace_module
from iterserve.platform.cpu_kernels import load_cpu_kernels

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


def pack_bf16_f32(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> [ceil(N/16), K, 16] bf16 (zero-padded outputs), laid out for cpu_kernels.cpp's
    f32_bf16w_gemm: a tile of 16 outputs, one input at a time, outputs in the order 0, 8, 1, 9, ...
    (so the kernel widens a tile's row into outputs 0-7 and 8-15 without shuffling lanes)."""
    n, k = weight.shape
    tiles = -(-n // 16)
    w = torch.zeros(tiles * 16, k, dtype=torch.bfloat16)
    w[:n] = weight
    order = torch.arange(16).reshape(2, 8).t().reshape(16)  # 0, 8, 1, 9, ..., 7, 15
    return w.reshape(tiles, 16, k)[:, order].transpose(1, 2).contiguous()


def pack_q8_0(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (int8 [N, K], float32 scales [N, K/group]), w ~= q * scale (GGUF Q8_0)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    scales = groups.abs().amax(-1).clamp(min=1e-12) / 127
    q = groups.div(scales.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), scales.contiguous()


# our bf16 kernel's weight tiles (pack_bf16); oneDNN's opaque prepacked weight (on AMX tiles where the
# CPU has them); a float32 copy of the weight (bf16 activations widened per call), for CPUs where bf16 is
# slow; bf16 weight tiles (pack_bf16_f32) for our AVX2 float32 GEMM, for float32 engines (on CPUs
# without fast bf16 the engine runs float32: reading half the bytes of a float32 weight is what counts)
LAYOUTS = ("tiled", "onednn", "float32", "bf16w")
BF16_GEMM_CHOICES = ("auto", *LAYOUTS)
FLOAT32_LAYOUTS = ("float32", "bf16w")  # what a float32 engine's projections can take


def tiled_gemm_vectorised(kernels: ModuleType | None) -> bool:
    """Whether our bf16 GEMM built with AVX512-BF16 (elsewhere oneDNN's is faster)."""
    return kernels is not None and kernels.bf16_gemm_is_vectorised()


def tiled_gemm_amx(kernels: ModuleType | None) -> bool:
    """Whether our bf16 GEMM can run steps of many rows on AMX tiles here (from the tiled layout)."""
    return tiled_gemm_vectorised(kernels) and kernels.bf16_gemm_amx_available()


def bf16w_gemm_vectorised(kernels: ModuleType | None) -> bool:
    """Whether our float32 x bf16-weight GEMM built with AVX2 and FMA (the scalar fallback never wins)."""
    return kernels is not None and kernels.f32_bf16w_gemm_is_vectorised()


def bf16_gemm_layout(choice: str, kernels: ModuleType | None) -> str:
    """The layout EngineConfig.bf16_gemm asks for when nothing is measured: `tiled`, `onednn` or
    `float32` as given (tiled only where our GEMM is vectorised), or `auto` by the CPU's flags: ours,
    except on a CPU with AMX, where oneDNN runs bf16 on AMX tiles. (With measure_kernels on, the
    platform times them instead: platform/kernel_choice.py.)"""
    if choice not in BF16_GEMM_CHOICES:
        raise ValueError(f"bf16_gemm={choice!r}: use one of {', '.join(BF16_GEMM_CHOICES)}")
    if choice in ("onednn", "float32", "bf16w"):
        return choice
    if choice == "auto" and "amx_bf16" in cpu_flags():
        return "onednn"
    return "tiled" if tiled_gemm_vectorised(kernels) else "onednn"


def bf16_linears_available(kernels: ModuleType | None) -> bool:
    return tiled_gemm_vectorised(kernels) or prepack_available()


def four_bit_max_tokens(layout: str) -> int:
    """Rows up to which the 4-bit twin beats the bf16 weight: 4 against our tiled bf16 GEMM, 8
    against oneDNN's (docs/profile.md)."""
    return 4 if layout == "tiled" else 8


class CpuLinear(nn.Module):
    """A bf16 Linear with its weight laid out once for a fast kernel (`layout`: our tiled GEMM, which
    needs an even in_features and the CPU kernels, or oneDNN's prepacked weight), or a float32 one with
    its weight stored as bf16 for our AVX2 GEMM (`bf16w`: the output is float32), and optionally a
    quantised twin (`twin`: one of TWINS) used when the step has at most `twin_max_tokens` rows.
    `amx_min_rows` (tiled only): steps of at least that many rows run our GEMM on AMX tiles, from
    the same weight tiles, where bf16_gemm_amx_available; 0: never. Keeps no plain copy of a weight
    it owns alone."""

    def __init__(self, linear: nn.Linear, twin: str | None = None, twin_max_tokens: int = 0,
                 keep_weight: bool = False, layout: str = "onednn", amx_min_rows: int = 0) -> None:
        super().__init__()
        if twin not in (None, *TWINS):
            raise ValueError(f"twin must be one of {TWINS} or None, got {twin!r}")
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
        self.amx_min_rows = amx_min_rows if layout == "tiled" else 0
        self.packed_weight = (pack_bf16(w) if layout == "tiled" else w.float().contiguous() if layout == "float32"
                              else pack_bf16_f32(w) if layout == "bf16w"
                              else torch.ops.mkldnn._reorder_linear_weight(w, 16))
        self.weight = linear.weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.iterserve.cpu_linear(x, self.packed_weight, self.layout, self.out_features,
                                              getattr(self, "twin_weight", None), getattr(self, "twin_scales", None),
                                              getattr(self, "twin_mins", None), self.bias, self.twin_max_tokens,
                                              self.twin, self.amx_min_rows)


# One op, opaque to torch.compile: inductor cannot lower either packed weight, and the per-step
# choice between the kernels must not become a guard (one compiled graph per choice).
_lib = torch.library.Library("iterserve", "FRAGMENT")
_lib.define("cpu_linear(Tensor x, Tensor packed_weight, str layout, int out_features, Tensor? twin_weight, "
            "Tensor? twin_scales, Tensor? twin_mins, Tensor? bias, int twin_max_tokens, str twin, "
            "int amx_min_rows=0) -> Tensor")


def _cpu_linear(x: torch.Tensor, packed_weight: torch.Tensor, layout: str, out_features: int,
                twin_weight: torch.Tensor | None, twin_scales: torch.Tensor | None, twin_mins: torch.Tensor | None,
                bias: torch.Tensor | None, twin_max_tokens: int, twin: str, amx_min_rows: int = 0) -> torch.Tensor:
    if x.shape[0] <= twin_max_tokens:
        if twin == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), twin_weight, GROUP_SIZE, twin_scales)
        elif twin == "q4_1":
            y = load_cpu_kernels().q4_gemm(x, twin_weight, twin_scales, twin_mins)
        else:
            y = load_cpu_kernels().q8_0_gemm(x, twin_weight, twin_scales)
    elif layout == "tiled":
        y = load_cpu_kernels().bf16_gemm(x, packed_weight, out_features, amx_min_rows)
    elif layout == "float32":
        y = torch.nn.functional.linear(x.float(), packed_weight).to(x.dtype)
    elif layout == "bf16w":
        y = load_cpu_kernels().f32_bf16w_gemm(x.float(), packed_weight, out_features).to(x.dtype)
    else:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return y if bias is None else y + bias


_lib.impl("cpu_linear", _cpu_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("iterserve::cpu_linear")
def _cpu_linear_fake(x, packed_weight, layout, out_features, twin_weight, twin_scales, twin_mins, bias,
                     twin_max_tokens, twin, amx_min_rows=0):
    return x.new_empty(x.shape[0], out_features)


def four_bit_twin(in_features: int, kernels: ModuleType | None, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Our Q4 kernel where it is vectorised (AVX512-VNNI, or AVX2 + FMA) and the shape fits, else
    torch's int4 (bf16 only: it takes bf16 activations)."""
    if kernels is not None and kernels.q4_gemm_is_vectorised() and in_features % 64 == 0:
        return "q4_1"
    return "int4" if in_features % GROUP_SIZE == 0 and dtype == torch.bfloat16 else None


def optimize_cpu_linears(model: nn.Module, layout: str = "onednn", int4_max_tokens: int = 0,
                         q8_head_max_tokens: int = 0, kernels: ModuleType | None = None,
                         plans: Mapping[tuple[str, int, int], tuple[str, int, int]] | None = None,
                         dtype: torch.dtype = torch.bfloat16, amx_min_rows: int = 0) -> int:
    """Swaps the decoder projections (4-bit twin if int4_max_tokens > 0) and the LM head (Q8_0 twin
    if q8_head_max_tokens > 0: 4 bits would round the logits; it keeps its weight, which it shares
    with the embedding) for CpuLinear in `layout` (a linear with an odd in_features takes oneDNN's).
    `kernels`: the loaded CPU kernels, or None. `amx_min_rows`: the tiled layout's AMX cut-over
    (CpuLinear). `plans`: (role "proj"/"head", out, in) -> (layout, twin's max tokens, AMX min rows),
    a measured choice per shape (platform/kernel_choice.py) that replaces `layout`, the twin
    thresholds and the AMX cut-over for the shapes it names (a twin stays off where its figure is 0). Only
    CPU linears of `dtype` are swapped: bf16, or float32 with a FLOAT32_LAYOUTS layout and no twin
    but our Q4_1 one. Returns the number changed."""
    if dtype == torch.float32 and (layout not in FLOAT32_LAYOUTS or q8_head_max_tokens
                                   or any(p[0] not in FLOAT32_LAYOUTS for p in (plans or {}).values())):
        raise ValueError(f"a float32 model takes the layouts {', '.join(FLOAT32_LAYOUTS)} and no head twin")
    if (layout == "bf16w" or any(p[0] == "bf16w" for p in (plans or {}).values())) and kernels is None:
        raise RuntimeError("layout bf16w needs iterserve's CPU kernels, which did not build (see the log)")
    if layout == "tiled" and not tiled_gemm_vectorised(kernels):
        raise RuntimeError("layout tiled needs iterserve's CPU kernels built with AVX512-BF16")
    if layout == "onednn" and not prepack_available():
        raise RuntimeError("this torch/CPU has no oneDNN bf16 support")
    if int4_max_tokens and dtype == torch.bfloat16 and not int4_kernel_available():
        raise RuntimeError("this torch has no CPU int4 kernel (_weight_int4pack_mm_for_cpu)")
    if q8_head_max_tokens and kernels is None:
        raise RuntimeError("a Q8_0 LM head needs iterserve's CPU kernels, which did not build (see the log)")
    changed = 0
    for name, mod in list(model.named_modules()):
        if not (isinstance(mod, nn.Linear) and mod.weight.dtype == dtype and mod.weight.device.type == "cpu"):
            continue
        role = "proj" if name.startswith("layers.") else "head" if name == "lm_head" else None
        if role is None:
            continue
        lay, proj_max, head_max, amx = layout, int4_max_tokens, q8_head_max_tokens, amx_min_rows
        plan = (plans or {}).get((role, mod.out_features, mod.in_features))
        if plan is not None:
            lay, amx = plan[0], plan[2]
            proj_max, head_max = plan[1] if int4_max_tokens else 0, plan[1] if q8_head_max_tokens else 0
        if lay == "tiled" and mod.in_features % 2:
            lay = "onednn"
        if role == "proj":
            twin = four_bit_twin(mod.in_features, kernels, dtype) if proj_max else None
            new = CpuLinear(mod, twin, proj_max, layout=lay, amx_min_rows=amx)
        else:
            fits = head_max and mod.in_features % GROUP_SIZE == 0
            new = CpuLinear(mod, "q8_0" if fits else None, head_max, keep_weight=True, layout=lay, amx_min_rows=amx)
        replace_module(model, name, new)
        changed += 1
    return changed
