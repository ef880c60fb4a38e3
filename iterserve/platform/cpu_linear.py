"""Faster CPU matmuls for the projections: bf16 weights laid out once at load for a GEMM kernel,
and a quantised twin for steps of few tokens (4-bit for the decoder's projections, Q8_0 for the LM
head). The CPU platform (platform/cpu.py) decides which of these a model gets; the figures behind
each threshold are in docs/profile.md, with the commands that measured them
(`benchmarks/kernel_options.py`).

- Layouts. A plain `F.linear` in bf16 lets oneDNN re-lay the weight out for its kernel on every
  call; packing it once at load (`mkldnn._reorder_linear_weight`, what inductor's freezing pass
  does) gives bit-identical results without that cost: the "onednn" layout. Where AVX512-BF16
  exists, our own bf16 GEMM (iterserve/csrc/gemm_bf16.cpp, the "tiled" layout) is faster still at
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

- GGUF twins. A GGUF checkpoint in other block types (the K-quants of a Q4_K_M / Q5_K_M / Q6_K
  file: Q4_K, Q5_K, Q6_K, with Q8_0 / Q5_0 / Q5_1 where a row is not a multiple of 256) keeps the
  file's own blocks as the twin (`twin="gguf"`, csrc/gemm_gguf.cpp's gguf_gemm): the loader hands them
  over per module (`model.gguf_sources`: QuantShard row ranges, several block types per fused
  projection), K-quant blocks as stored, 32-input blocks repacked four to a group
  (`pack_gguf_x4`, a permutation). `dequantize_gguf_twin` reads any twin back: it equals gguf-py's
  dequantisation of the file bit for bit (tests/test_kquant.py).

- GGUF blocks as the weight. Where the kernels built and quantization is auto, the loader keeps a
  GGUF's quantised modules as their blocks only (model.block_modules, their float weights never
  allocated); `use_gguf_blocks` gives each a CpuLinear whose `blocks` are its only copy: gguf_gemm
  for steps of few rows, `blocks_gemm` for many (a panel of rows dequantised at a time by
  csrc/gguf_dequant.cpp into the layout's form, then its GEMM: the float copy's numbers), and the
  embedding a BlockEmbedding. The GGUF twins beside a float copy (`shards=`) are what a model gets
  that carries gguf_sources without block_modules (a loader that dequantised them); the GGUF loader
  now keeps blocks instead wherever the kernels read them.

The 4-bit grid (`min_max_4bit`, shared by both 4-bit twins) is rebuilt from the float weights by
min-max per group of 32 along the input dimension. For a checkpoint that was 4-bit already (GGUF
Q4_0/Q4_1: the same groups), that recovers the checkpoint's own levels; the only new error is the
rounding of the scales (bf16 for torch's kernel, float16 for ours). Q8_0 is rebuilt the same way
(absmax per 32 / 127): from a Q8_0 embedding (the GGUF's) it recovers the stored levels.
"""
from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import nn

from iterserve.config import parse_size
from iterserve.cpu_info import cpu_flags
from iterserve.custom_ops import call_directly
from iterserve.memory import empty_in_large_pages, file_mapped_pages, in_large_pages, release_mapped_pages, unmap_pages
from iterserve.model.gguf_file import unpermute_qk
from iterserve.platform.base import replace_module
from iterserve.platform.cpu_kernels import load_cpu_kernels

GROUP_SIZE = 32
# torch's int4 kernel; ours (csrc/gemm_quant.cpp) for 4 and 8 bits, and from a GGUF's own blocks
TWINS = ("int4", "q4_1", "q8_0", "gguf")
GGUF_INT8 = "gguf_int8"  # the op's name for a "gguf" twin on int8 activations (use_int8_activations)
# ... and with its K-quant shards of 16+ rows on AMX-INT8 tiles (gguf_gemm amx=True), where AMX is lent
GGUF_INT8_AMX = "gguf_int8_amx"
# a "gguf" twin on int16 activations with its K-quant shards of 16+ rows on AMX-INT8 tiles (use_amx_tiles)
GGUF_AMX = "gguf_amx"

# ---- GGUF blocks (llama.cpp's layouts; gguf-py's gguf/quants.py dequantises them) -------------------
# name -> (ggml type id, inputs a block, bytes a block)
GGUF_BLOCKS = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
               "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")  # read by the kernel as stored; the others repacked by pack_gguf_x4
X4_HEADER = {"Q4_0": 8, "Q4_1": 16, "Q5_0": 24, "Q5_1": 32, "Q8_0": 8}  # bytes before a group's levels
X4_BYTES = {"Q4_0": 72, "Q4_1": 80, "Q5_0": 88, "Q5_1": 96, "Q8_0": 136}  # bytes per group of 4 blocks


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@functools.cache
def prepack_available() -> bool:
    """Whether oneDNN prepacks and runs a bf16 linear here. Asked of oneDNN itself, once: torch's
    `_is_mkldnn_bf16_supported` has said yes on AVX2-only CPUs (Zen 3), where the prepack then
    refuses ("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq")."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 32, dtype=torch.bfloat16), 1)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 32, dtype=torch.bfloat16), w, None, "none", [], "")
    except RuntimeError:
        return False
    return True


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
    w ~= q * scale + min, q in 0..15 (GGUF Q4_1), laid out for csrc/gemm_quant.cpp's q4_gemm: in each
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
    csrc/gemm_bf16.cpp's bf16_gemm: a tile of 16 outputs, an input pair at a time."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"bf16 packing needs an even in_features, got {k}")
    tiles = -(-n // 16)
    w = torch.zeros(tiles * 16, k, dtype=torch.bfloat16)
    w[:n] = weight
    return in_large_pages(w.reshape(tiles, 16, k // 2, 2).transpose(1, 2))  # read every step: 2 MiB pages


def pack_bf16_f32(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> [ceil(N/16), K, 16] bf16 (zero-padded outputs), laid out for csrc/gemm_f32_bf16w.cpp's
    f32_bf16w_gemm: a tile of 16 outputs, one input at a time, outputs in the order 0, 8, 1, 9, ...
    (so the kernel widens a tile's row into outputs 0-7 and 8-15 without shuffling lanes). Rounds
    the weight to bf16: exact only for a bf16_exact one."""
    n, k = weight.shape
    tiles = -(-n // 16)
    w = torch.zeros(tiles * 16, k, dtype=torch.bfloat16)
    w[:n] = weight
    order = torch.arange(16).reshape(2, 8).t().reshape(16)  # 0, 8, 1, 9, ..., 7, 15
    return in_large_pages(w.reshape(tiles, 16, k)[:, order].transpose(1, 2))  # read every step: 2 MiB pages


def float32_weight(weight: torch.Tensor) -> torch.Tensor:
    """The float32 layout's weight: a float32 contiguous weight as it is (the checkpoint's own tensor,
    maybe its file's map: a copy would hold it twice); any other widened into 2 MiB pages, as the
    other layouts' copies are (read every step)."""
    if weight.dtype == torch.float32 and weight.is_contiguous():
        return weight
    return in_large_pages(weight, torch.float32)


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether rounding `weight` to bf16 leaves every element as it is (a bf16 checkpoint run in
    float32): only then does the bf16w layout give a float32 run float32's numbers. Checked once per
    module at start-up (a float32 run's layouts, platform/cpu.py)."""
    return torch.equal(weight.detach().bfloat16().float(), weight.detach())


def pack_q8_0(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (int8 [N, K], float32 scales [N, K/group]), w ~= q * scale (GGUF Q8_0)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    scales = groups.abs().amax(-1).clamp(min=1e-12) / 127
    q = groups.div(scales.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), scales.contiguous()


def _x4_positions() -> torch.Tensor:
    """Position p of a group of 4 blocks -> index b * 32 + e in the group's 4 x 32 levels (block b,
    input e): p holds input 8 * (p // 32) + p % 8 of block (p % 32) // 8 (csrc/gemm_quant.cpp)."""
    p = torch.arange(128)
    return (p % 32) // 8 * 32 + 8 * (p // 32) + p % 8


def _block_levels(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """[..., block bytes] uint8 blocks of a 32-input type -> [..., 32] levels as stored (uint8: 0..15 /
    0..31, or Q8_0's int8 bits)."""
    if qtype == "Q8_0":
        return blocks[..., 2:34]
    qs = blocks[..., -16:]
    levels = torch.cat([qs & 0x0F, qs >> 4], -1)  # inputs 0-15 in the low nibbles, 16-31 in the high
    if qtype in ("Q5_0", "Q5_1"):
        at = 2 if qtype == "Q5_0" else 4
        qh = blocks[..., at:at + 4].to(torch.int64)
        word = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
        bits = (word.unsqueeze(-1) >> torch.arange(32)) & 1
        levels = levels | (bits.to(torch.uint8) << 4)
    return levels


def pack_gguf_x4(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """[rows, K/32 blocks] of a 32-input GGUF type (uint8 as stored) -> [rows, ceil(K/128) groups]
    laid out for csrc/gemm_gguf.cpp's gguf_gemm: per group of 4 blocks, their d (and m) float16 bits as
    stored, the Q5 types' high bits as 4 x u32 (word j bit i: bit 4 of position 32j + i), then the
    levels in position order (`_x4_positions`): Q8_0's int8 as they are, the 4/5-bit types' low
    nibbles paired as byte 32c + i = p[64c + i] | p[64c + 32 + i] << 4. Zero blocks pad the last
    group. A permutation of the stored bytes: `unpack_gguf_x4` inverts it."""
    _, block, size = GGUF_BLOCKS[qtype]
    rows = data.shape[0]
    if rows > 8192:  # a large LM head: in slices of rows, so its temporaries stay small (written in
        # place: a torch.cat of the slices held the head twice, Gemma 3's 170 MiB, at start-up's peak)
        out = empty_in_large_pages((rows, -(-(data.shape[1] // size) // 4) * X4_BYTES[qtype]), torch.uint8)
        for r in range(0, rows, 8192):
            out[r:r + 8192] = pack_gguf_x4(data[r:r + 8192], qtype)
        return out
    nb = data.shape[1] // size
    groups = -(-nb // 4)
    blocks = torch.zeros(rows, groups * 4, size, dtype=torch.uint8)
    blocks[:, :nb] = data.reshape(rows, nb, size)
    blocks = blocks.reshape(rows, groups, 4, size)
    head = blocks[..., 0:2].reshape(rows, groups, 8)
    parts = [head] + ([blocks[..., 2:4].reshape(rows, groups, 8)] if qtype in ("Q4_1", "Q5_1") else [])
    pos = _block_levels(blocks, qtype).reshape(rows, groups, 128)[..., _x4_positions()]
    if qtype != "Q8_0":
        if qtype in ("Q5_0", "Q5_1"):
            bits = ((pos >> 4) & 1).reshape(rows, groups, 16, 8).to(torch.int32)
            parts.append((bits << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8))
        pos = pos & 0x0F
        pos = pos.reshape(rows, groups, 2, 2, 32)
        pos = pos[:, :, :, 0] | (pos[:, :, :, 1] << 4)
    parts.append(pos.reshape(rows, groups, -1))
    out = empty_in_large_pages((rows, groups, X4_BYTES[qtype]), torch.uint8)  # read every step: 2 MiB pages
    return torch.cat(parts, -1, out=out).reshape(rows, groups * X4_BYTES[qtype])


def _x4_levels(packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """[rows, groups, group bytes] -> [rows, groups, 4, 32] levels (uint8) in block order."""
    rows, groups, _ = packed.shape
    lv = packed[..., X4_HEADER[qtype]:]
    if qtype == "Q8_0":
        pos = lv
    else:
        lv = lv.reshape(rows, groups, 2, 1, 32)
        pos = torch.cat([lv & 0x0F, lv >> 4], 3).reshape(rows, groups, 128)
        if qtype in ("Q5_0", "Q5_1"):
            at = 8 if qtype == "Q5_0" else 16
            hb = packed[..., at:at + 16].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)
            pos = pos | ((hb & 1).reshape(rows, groups, 128) << 4)
    levels = torch.empty_like(pos)
    levels[..., _x4_positions()] = pos
    return levels.reshape(rows, groups, 4, 32)


def unpack_gguf_x4(packed: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """pack_gguf_x4's inverse: the blocks as the file stores them, [rows, K/32 * block bytes] uint8."""
    _, block, size = GGUF_BLOCKS[qtype]
    rows = packed.shape[0]
    g = packed.reshape(rows, -1, X4_BYTES[qtype])
    groups = g.shape[1]
    levels = _x4_levels(g, qtype)
    parts = [g[..., 0:8].reshape(rows, groups, 4, 2)]
    if qtype in ("Q4_1", "Q5_1"):
        parts.append(g[..., 8:16].reshape(rows, groups, 4, 2))
    if qtype == "Q8_0":
        parts.append(levels)
    else:
        if qtype in ("Q5_0", "Q5_1"):
            bits = ((levels >> 4) & 1).reshape(rows, groups, 4, 4, 8).to(torch.int32)
            parts.append((bits << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8))
        lo = levels & 0x0F
        parts.append(lo[..., :16] | (lo[..., 16:] << 4))
    blocks = torch.cat(parts, -1).reshape(rows, groups * 4, size)
    return blocks[:, :in_features // block].reshape(rows, -1).contiguous()


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian float16 bits) -> [...] float32, exactly."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _kquant_dequantize(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """[rows, K/256 * bytes] K-quant blocks -> [rows, K] float32, as gguf-py's dequantize computes
    them (the same float32 operations: D = d * sc and M = dmin * m exact, then D * q - M)."""
    size = GGUF_BLOCKS[qtype][2]
    rows = data.shape[0]
    b = data.reshape(rows, -1, size)
    n = b.shape[1]
    if qtype == "Q6_K":
        ql, qh = b[..., :128].reshape(rows, n, 2, 1, 64), b[..., 128:192].reshape(rows, n, 2, 1, 32)
        sc = b[..., 192:208].contiguous().view(torch.int8).float()
        d = _f16(b[..., 208:210].unsqueeze(-2)).reshape(rows, n, 1)
        lo = torch.cat([ql & 0x0F, ql >> 4], 3).reshape(rows, n, 8, 32)
        hi = ((qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)) & 3).reshape(rows, n, 8, 32)
        q = (lo | (hi << 4)).to(torch.int8) - 32
        return ((d * sc).reshape(rows, n, 16, 1) * q.reshape(rows, n, 16, 16).float()).reshape(rows, -1)
    d, dmin = _f16(b[..., 0:2].unsqueeze(-2)), _f16(b[..., 2:4].unsqueeze(-2))
    s = b[..., 4:16].reshape(rows, n, 3, 4)
    sc = torch.cat([s[..., 0, :] & 0x3F, (s[..., 2, :] & 0x0F) | ((s[..., 0, :] >> 2) & 0x30)], -1).float()
    mn = torch.cat([s[..., 1, :] & 0x3F, (s[..., 2, :] >> 4) | ((s[..., 1, :] >> 2) & 0x30)], -1).float()
    qs = b[..., -128:].reshape(rows, n, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], 3).reshape(rows, n, 8, 32)
    if qtype == "Q5_K":
        qh = b[..., 16:48].reshape(rows, n, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(8, 1)
        q = q | ((qh & 1) << 4)
    big_d = (d.reshape(rows, n, 1) * sc).unsqueeze(-1)
    big_m = (dmin.reshape(rows, n, 1) * mn).unsqueeze(-1)
    return (big_d * q.float() - big_m).reshape(rows, -1)


def _x4_dequantize(packed: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """A pack_gguf_x4 shard -> [rows, K] float32, as gguf-py computes its blocks (d * (q - offset),
    or d * q + m)."""
    rows = packed.shape[0]
    g = packed.reshape(rows, -1, X4_BYTES[qtype])
    levels = _x4_levels(g, qtype)
    d = _f16(g[..., 0:8].reshape(*g.shape[:2], 4, 1, 2))
    if qtype == "Q8_0":
        w = levels.contiguous().view(torch.int8).float() * d
    elif qtype in ("Q4_1", "Q5_1"):
        w = d * levels.float() + _f16(g[..., 8:16].reshape(*g.shape[:2], 4, 1, 2))
    else:
        w = d * (levels.to(torch.int16) - (8 if qtype == "Q4_0" else 16)).float()
    return w.reshape(rows, -1)[:, :in_features]


def shard_fields(shard: Any) -> tuple[int, int, int, str, Any]:
    """(row_start, rows, cols, qtype, data) of a QuantShard (model/gguf_file.py; any object with
    those fields: data [rows, bytes a row] uint8, a tensor or numpy array, as the file stores it)."""
    return int(shard.row_start), int(shard.rows), int(shard.cols), str(shard.qtype), shard.data


def _shard_bytes(data: Any) -> torch.Tensor:
    """A shard's data as a uint8 tensor (a numpy array, maybe a read-only memory map, is copied)."""
    if isinstance(data, torch.Tensor):
        return data.view(torch.uint8)
    import numpy as np
    return torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))


def gguf_row_bytes(qtype: str, in_features: int) -> int:
    """Bytes a row of a twin's shard takes in gguf_gemm's layout (K-quants as stored, else pack_gguf_x4)."""
    _, block, size = GGUF_BLOCKS[qtype]
    return in_features // block * size if qtype in KQUANTS else -(-in_features // 128) * X4_BYTES[qtype]


def gguf_twin_supported(shards: Sequence[Any] | None, out_features: int, in_features: int) -> bool:
    """Whether gguf_gemm can run these shards as a (out_features x in_features) projection's twin:
    every shard of a block type it reads, with this many inputs, and the shards' rows covering the
    outputs in order, once."""
    if not shards:
        return False
    row = 0
    for s in sorted(shards, key=lambda s: int(s.row_start)):
        start, rows, cols, qtype, data = shard_fields(s)
        if qtype not in GGUF_BLOCKS or start != row or cols != in_features or in_features % GGUF_BLOCKS[qtype][1]:
            return False
        if tuple(data.shape) != (rows, in_features // GGUF_BLOCKS[qtype][1] * GGUF_BLOCKS[qtype][2]):
            return False
        row += rows
    return row == out_features


def _one_map(shards: Sequence[Any]) -> bool:
    """Whether the shards are K-quant rows that all view one storage (the file's map, GGUFTensor.mapped):
    gguf_gemm then reads them in place, at their offsets in it."""
    data = [shard_fields(s)[4] for s in shards]
    return (all(shard_fields(s)[3] in KQUANTS for s in shards) and all(isinstance(d, torch.Tensor) for d in data)
            and len({d.untyped_storage().data_ptr() for d in data}) == 1)


def pack_gguf_twin(shards: Sequence[Any], in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shards of one projection -> (buf uint8, meta [S, 4] int64: ggml type, rows, bytes a row,
    offset), what gguf_gemm takes: K-quant rows as stored, 32-input blocks by pack_gguf_x4. K-quant
    shards that view one storage (a file's map) are used in place: buf is that whole storage, the
    offsets are where each shard lies in it, and nothing is copied (their rows stay in the file's
    order: output_order). Otherwise the shards are copied into one buffer, a permuted shard's rows
    put back in order (QuantShard.permuted_heads) as they go."""
    ordered = sorted(shards, key=lambda s: int(s.row_start))
    if _one_map(ordered):
        base = shard_fields(ordered[0])[4].untyped_storage()
        buf = torch.empty(0, dtype=torch.uint8).set_(base)
        meta = [[GGUF_BLOCKS[shard_fields(s)[3]][0], shard_fields(s)[1], gguf_row_bytes(shard_fields(s)[3], in_features),
                 shard_fields(s)[4].data_ptr() - base.data_ptr()] for s in ordered]
        return buf, torch.tensor(meta, dtype=torch.int64)
    parts, meta, offset, read = [], [], 0, []
    for s in ordered:
        _, rows, _, qtype, data = shard_fields(s)
        data = stored = _shard_bytes(data)
        heads = int(getattr(s, "permuted_heads", 0))
        if heads:
            data = unpermute_qk(data, heads)
        packed = data.contiguous() if qtype in KQUANTS else pack_gguf_x4(data, qtype)
        if packed.data_ptr() != stored.data_ptr():
            read.append(stored)
        parts.append(packed.reshape(-1))
        meta.append([GGUF_BLOCKS[qtype][0], rows, gguf_row_bytes(qtype, in_features), offset])
        offset += packed.numel()
    if len(parts) == 1:
        buf = parts[0]
    else:  # the model's own copy, read every step: in 2 MiB pages (memory.empty_in_large_pages)
        buf = torch.cat(parts, out=empty_in_large_pages((offset,), torch.uint8))
    release_mapped_pages(read)  # the file's copy of what is now in buf (memory.release_mapped_pages)
    return buf, torch.tensor(meta, dtype=torch.int64)


def output_order(shards: Sequence[Any]) -> torch.Tensor | None:
    """Where each output of a projection packed in place (pack_gguf_twin) comes from, when one of its
    shards still has llama.cpp's Q/K permutation (QuantShard.permuted_heads): y[:, order] puts the
    outputs back in Hugging Face's order, a gather of a row of outputs where a copy of the weight
    would cost its bytes in every process. None: already in order."""
    ordered = sorted(shards, key=lambda s: int(s.row_start))
    if not _one_map(ordered) or not any(getattr(s, "permuted_heads", 0) for s in ordered):
        return None
    parts = []
    for s in ordered:
        start, rows = shard_fields(s)[:2]
        heads = int(getattr(s, "permuted_heads", 0))
        idx = torch.arange(start, start + rows)
        parts.append(unpermute_qk(idx, heads) if heads else idx)
    return torch.cat(parts)


_GGUF_NAMES = {v[0]: k for k, v in GGUF_BLOCKS.items()}


def dequantize_gguf_twin(buf: torch.Tensor, meta: torch.Tensor, in_features: int) -> torch.Tensor:
    """A GGUF twin's storage read back: [N, K] float32 equal to gguf-py's dequantisation of the
    file's blocks, bit for bit (tests/test_kquant.py)."""
    out = []
    for t, rows, row_bytes, offset in meta.tolist():
        qtype = _GGUF_NAMES[t]
        data = buf[offset:offset + rows * row_bytes].reshape(rows, row_bytes)
        out.append(_kquant_dequantize(data, qtype) if qtype in KQUANTS else _x4_dequantize(data, qtype, in_features))
    return torch.cat(out)


def gguf_twin_blocks(buf: torch.Tensor, meta: torch.Tensor, in_features: int) -> list[tuple[str, torch.Tensor]]:
    """A GGUF twin's storage as the file's blocks again: (qtype, [rows, bytes a row] uint8) per shard."""
    out = []
    for t, rows, row_bytes, offset in meta.tolist():
        qtype = _GGUF_NAMES[t]
        data = buf[offset:offset + rows * row_bytes].reshape(rows, row_bytes)
        out.append((qtype, data.clone() if qtype in KQUANTS else unpack_gguf_x4(data, qtype, in_features)))
    return out


def _spec(types_and_rows: Iterable[tuple[str, int]]) -> str:
    """(block type, rows) in row order -> 'q4_k:1024+q6_k:256', neighbours of one type merged."""
    merged: list[list] = []
    for qtype, rows in types_and_rows:
        if merged and merged[-1][0] == qtype:
            merged[-1][1] += rows
        else:
            merged.append([qtype, rows])
    return "+".join(f"{q.lower()}:{r}" for q, r in merged)


def gguf_twin_spec(shards: Sequence[Any]) -> str:
    """A twin's block types and rows, what its speed depends on: 'q4_k:1024+q6_k:256' (neighbouring
    shards of one type merged). The kernel chooser times one twin per distinct (shape, spec)."""
    return _spec((shard_fields(s)[3], shard_fields(s)[1]) for s in sorted(shards, key=lambda s: int(s.row_start)))


def gguf_meta_spec(meta: torch.Tensor) -> str:
    """gguf_twin_spec of a packed twin (pack_gguf_twin's meta)."""
    return _spec((_GGUF_NAMES[t], rows) for t, rows, _, _ in meta.tolist())


def gguf_twin_name(spec: str) -> str:
    """'q4_k:1024+q6_k:256' -> 'q4_k+q6_k': the block types, as the chooser's table names the twin."""
    return "+".join(dict.fromkeys(part.split(":")[0] for part in spec.split("+")))


class RandomShard:
    """A QuantShard of random blocks (sane float16 scales): for timing a spec (kernel_choice.py)."""

    def __init__(self, row_start: int, rows: int, cols: int, qtype: str, generator: torch.Generator | None = None):
        _, block, size = GGUF_BLOCKS[qtype]
        self.row_start, self.rows, self.cols, self.qtype = row_start, rows, cols, qtype
        # in 2 MiB pages, as the model's blocks lie (a GGUF's map, or repacked copies: empty_in_large_pages)
        data = empty_in_large_pages((rows, cols // block, size), torch.uint8)
        torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=generator, out=data)
        scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
        for at in ((208,) if qtype == "Q6_K" else (0, 2) if qtype in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else (0,)):
            data[..., at:at + 2] = scale
        self.data = data.reshape(rows, -1)


def random_shards(spec: str, in_features: int) -> list[RandomShard]:
    """Random shards of a spec (gguf_twin_spec) for a projection of in_features inputs."""
    out, row = [], 0
    for part in spec.split("+"):
        qtype, rows = part.split(":")
        out.append(RandomShard(row, int(rows), in_features, qtype.upper()))
        row += int(rows)
    return out


# our bf16 kernel's weight tiles (pack_bf16); oneDNN's opaque prepacked weight (on AMX tiles where the
# CPU has them); a float32 copy of the weight (bf16 activations widened per call), for CPUs where bf16 is
# slow; bf16 weight tiles (pack_bf16_f32) for our AVX2 float32 GEMM, for float32 engines (on CPUs
# without fast bf16 the engine runs float32: reading half the bytes of a float32 weight is what counts),
# but only where the weights are bf16-exact (bf16_exact) unless the user forces it: elsewhere it rounds
# them, and a float32 run must give float32's numbers
LAYOUTS = ("tiled", "onednn", "float32", "bf16w")
# the tiled layout where its AMX cut-over is not measured (forced tiled, or AMX never timed where it
# leads): steps from this many rows on AMX tiles, where it led AVX-512 at every shape by 1.9-2.7x (level
# at 4; 2-core AMX Xeon, docs/profile.md)
AMX_MIN_ROWS = 16
BF16_GEMM_CHOICES = ("auto", *LAYOUTS)
# float32 weights on csrc/gemm_f32.cpp's f32_gemm, one sum order per output at every row count: a
# batch-invariant float32 run's layout (MKL's F.linear, the float32 layout, blocks its sums by M)
INVARIANT_FLOAT32 = "float32_fixed"
FLOAT32_LAYOUTS = ("float32", "bf16w")  # what a float32 engine's projections can take (bf16_gemm's choices)
FLOAT32_FORMS = (*FLOAT32_LAYOUTS, INVARIANT_FLOAT32)  # ... and under batch_invariant
EVERY_ROW = 1 << 62  # a twin's max tokens that no step exceeds: the twin runs every step


def tiled_gemm_vectorised(kernels: ModuleType | None) -> bool:
    """Whether our bf16 GEMM built with AVX512-BF16 (elsewhere oneDNN's is faster)."""
    return kernels is not None and kernels.bf16_gemm_is_vectorised()


def tiled_gemm_amx(kernels: ModuleType | None) -> bool:
    """Whether our bf16 GEMM can run steps of many rows on AMX tiles here (from the tiled layout)."""
    return tiled_gemm_vectorised(kernels) and kernels.bf16_gemm_amx_available()


def gguf_int8_amx(kernels: ModuleType | None) -> bool:
    """Whether gguf_gemm can run int8 K-quant shards of 16+ rows on AMX-INT8 tiles here (build and OS)."""
    return kernels is not None and kernels.gguf_gemm_amx_available()


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
    its weight stored as bf16 for our AVX2 GEMM (`bf16w`: the output is float32, of the weight rounded
    to bf16) or as float32 for our fixed-order GEMM (`float32_fixed`, batch_invariant's), and optionally a
    quantised twin (`twin`: one of TWINS; "gguf" is built from `shards`, the checkpoint's own blocks)
    used when the step has at most `twin_max_tokens` rows.
    `amx_min_rows` (tiled only): steps of at least that many rows run our GEMM on AMX tiles, from
    the same weight tiles, where bf16_gemm_amx_available; 0: never. Keeps no plain copy of a weight
    it owns alone.
    `blocks` (buf, meta from pack_gguf_twin): the GGUF's blocks are the weight, its only copy (the
    linear's weight is on the meta device), maybe the file's map in place; `out_order` (output_order)
    then puts outputs computed in the file's row order back in the model's. Steps of at most `twin_max_tokens` rows run gguf_gemm on
    them; larger ones dequantise a panel of output rows at a time into `layout`'s form and run its
    GEMM (blocks_gemm): the numbers of a float copy in that layout, without keeping one."""

    def __init__(self, linear: nn.Linear, twin: str | None = None, twin_max_tokens: int = 0,
                 keep_weight: bool = False, layout: str = "onednn", amx_min_rows: int = 0,
                 shards: Sequence[Any] | None = None, blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
                 out_order: torch.Tensor | None = None) -> None:
        super().__init__()
        # blocks packed in place in the file's row order (output_order): outputs gathered back after the GEMM
        self.register_buffer("out_order", out_order if blocks is not None else None, persistent=False)
        if blocks is not None:
            twin = "gguf"
        if twin not in (None, *TWINS):
            raise ValueError(f"twin must be one of {TWINS} or None, got {twin!r}")
        if (twin == "gguf") != (shards is not None or blocks is not None):
            raise ValueError("twin='gguf' takes the GGUF's blocks (shards), and shards only that twin")
        if layout not in (*LAYOUTS, INVARIANT_FLOAT32):
            raise ValueError(f"layout must be one of {(*LAYOUTS, INVARIANT_FLOAT32)}, got {layout!r}")
        w = linear.weight.detach()
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.twin = twin or ""
        self.op_twin = self.twin  # what the op is told: the twin, GGUF_INT8(_AMX) (use_int8_activations) or GGUF_AMX
        self.twin_max_tokens = twin_max_tokens if twin else 0
        self.twin_spec = ""  # gguf: the shards' block types and rows (gguf_twin_spec)
        self.from_blocks = blocks is not None
        # chain_read_ahead: the next projection's weight bytes, how many of them to read ahead, and the
        # kernels' read_ahead that asks for it (none: no read-ahead)
        self.read_next: torch.Tensor | None = None
        self.read_bytes = 0
        self.read_ahead: Callable[[torch.Tensor, int], None] | None = None
        # the LM head (CpuPlatform.prepare_model): bf16 outputs widened to float32 by the kernels, the
        # logits' dtype, so that the model's .float() copies nothing
        self.float_out = False
        if blocks is not None:
            self.twin_spec = gguf_meta_spec(blocks[1])
            self.register_buffer("twin_weight", blocks[0], persistent=False)
            self.register_buffer("twin_scales", blocks[1], persistent=False)
        elif twin == "gguf":
            if not gguf_twin_supported(shards, self.out_features, self.in_features):
                raise ValueError(f"these GGUF shards cannot be the twin of a {self.out_features} x {self.in_features} "
                                 f"projection: {[(*shard_fields(s)[:4], tuple(s.data.shape)) for s in shards]}")
            self.twin_spec = gguf_twin_spec(shards)
            buf, meta = pack_gguf_twin(shards, self.in_features)
            self.register_buffer("twin_weight", buf, persistent=False)
            self.register_buffer("twin_scales", meta, persistent=False)
        elif twin:
            packed = {"int4": pack_int4, "q4_1": pack_q4_1, "q8_0": pack_q8_0}[twin](w)
            self.register_buffer("twin_weight", packed[0], persistent=False)
            self.register_buffer("twin_scales", packed[1], persistent=False)
            if twin == "q4_1":
                self.register_buffer("twin_mins", packed[2], persistent=False)
        self.layout = layout
        self.amx_min_rows = amx_min_rows if layout == "tiled" else 0
        self.packed_weight = (torch.empty(0) if self.from_blocks else pack_bf16(w) if layout == "tiled"
                              else float32_weight(w) if layout in ("float32", INVARIANT_FLOAT32)
                              else pack_bf16_f32(w) if layout == "bf16w"
                              else torch.ops.mkldnn._reorder_linear_weight(w, 16))
        self.weight = linear.weight if keep_weight and not self.from_blocks else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # buffers read from their dict: nn.Module.__getattr__ costs ~1 us a name (~1.7 for an absent one)
        # on a Zen 3 core, and a small model's step makes ~120 of these calls around ~20 us kernels (the
        # four names are only ever set by register_buffer in __init__; a plain attribute would go unseen)
        buffers = self._buffers
        out_order = buffers["out_order"]
        in_order = out_order is None  # else the bias (in the model's order) is added after the gather
        op = _cpu_linear if call_directly() else torch.ops.iterserve.cpu_linear
        y = op(x, self.packed_weight, self.layout, self.out_features, buffers.get("twin_weight"),
               buffers.get("twin_scales"), buffers.get("twin_mins"),
               self.bias if in_order else None, self.twin_max_tokens, self.op_twin, self.amx_min_rows, self.from_blocks)
        compiling = torch.compiler.is_compiling()
        if self.float_out and not compiling and y.dtype == torch.bfloat16 and y.dim() == 2:
            y = load_cpu_kernels().widen_bf16(y)
        # not in a compiled graph: dynamo took read_next (another module's buffer) for an input of
        # this one's and handed the kernel the wrong blocks
        if not compiling and self.read_next is not None and x.shape[0] <= self.twin_max_tokens:
            self.read_ahead(self.read_next, self.read_bytes)
        if in_order:
            return y
        # the kernels' permute_columns, torch.gather's values: the 1B's q/k/v at 1 / 16 / 512 rows in 2.8 /
        # 11.5 / 285 us against gather's 7.6 / 225 / 1173 (its index expanded into a copy, its OpenMP
        # thread woken from 32,768 elements; 2-core AMX Xeon). A compiled graph keeps the torch op
        if compiling:
            y = torch.gather(y, -1, out_order.expand(y.shape))
        else:
            y = load_cpu_kernels().permute_columns(y, out_order)
        return y if self.bias is None else y + self.bias


READ_AHEAD_BYTES = 8 << 20  # of the next projection's blocks (chain_read_ahead); ITERSERVE_READ_AHEAD_BYTES sets it


def read_ahead_bytes() -> int:
    """READ_AHEAD_BYTES, or ITERSERVE_READ_AHEAD_BYTES where set (a size: 8MiB, 0 for none)."""
    raw = os.environ.get("ITERSERVE_READ_AHEAD_BYTES")
    if raw is None:
        return READ_AHEAD_BYTES
    try:
        return parse_size(raw)
    except ValueError as e:
        raise ValueError(f"ITERSERVE_READ_AHEAD_BYTES: {e} (0: no read-ahead)") from None


def twin_modules(model: nn.Module) -> list[CpuLinear]:
    """The projections (and head) whose steps of few rows read a twin's blocks, in the model's order."""
    return [m for m in model.modules() if isinstance(m, CpuLinear) and m.twin_max_tokens
            and m._buffers.get("twin_weight") is not None]


def chain_read_ahead(model: nn.Module, kernels: Any) -> int:
    """Gives each CpuLinear with a twin the next one's twin weight, in the model's module order (a
    decoder's order of execution: q/k/v, o, gate/up, down, the next layer's, ..., the head, then the
    first layer's for the next step): after a step of few rows it asks the kernels' pool to read that
    many bytes of it into cache while the Python between the two runs (work_pool.h's read-ahead), so
    the next one-row kernel, bound by reading its weights, finds them there. A wrong next (a family
    whose forward runs in another order) costs bandwidth nobody else is using, not numbers. Returns how
    many are chained; none without the kernels' pool (`kernels` None) or with read_ahead_bytes() 0."""
    nbytes = read_ahead_bytes()
    chain = twin_modules(model)
    if kernels is None or nbytes <= 0 or len(chain) < 2:
        return 0
    for mod, nxt in zip(chain, chain[1:] + chain[:1]):
        mod.read_next, mod.read_bytes, mod.read_ahead = twin_bytes(nxt), nbytes, kernels.read_ahead
    return len(chain)


def twin_bytes(mod: CpuLinear) -> torch.Tensor:
    """The bytes mod's twin reads, as a view: a GGUF twin's shards where they lie in its buffer (which
    may be the whole file's map, each module's blocks at their offsets in it), another twin's whole
    weight. The read-ahead once took twin_weight itself, so with the file's map it read the file's
    first bytes (its header and embedding) before every kernel, not the next one's blocks."""
    weight = mod._buffers["twin_weight"]
    return shard_span(weight, mod._buffers["twin_scales"]) if mod.twin == "gguf" else weight


KQUANT_NAMES = ("q4_k", "q5_k", "q6_k")  # gguf_twin_spec's names of the block types int8 activations apply to


def is_down_projection(name: str) -> bool:
    """The MLP's down projection (gguf_activations=int8-except-down keeps it on int16): its input, the
    gated activation, carries the outliers that one int8 scale per 256 inputs loses most on."""
    return name.endswith("mlp.down_proj")


def use_amx_tiles(model: nn.Module) -> int:
    """Puts each CpuLinear whose GGUF twin holds K-quant blocks and stays on int16 activations (every one
    with gguf_activations=int16, the down projections with int8-except-down) on gguf_gemm's AMX-INT8
    path for its steps of 16+ rows (gguf_gemm_amx_available): each int16 level as two bytes, four tile
    products a line, within the int16 path's bound of float64 (not its bits: the super-block's sum is
    rounded twice, where the vector loop rounds one sum per lane); 2.2-4x the int16 loop at 16-64 rows on a
    2-core AMX Xeon (docs/profile.md). Not under batch_invariant: a row would round by its step's size.
    Returns how many."""
    n = 0
    for mod in model.modules():
        if (isinstance(mod, CpuLinear) and mod.op_twin == "gguf" and mod.twin_max_tokens
                and any(t in mod.twin_spec for t in KQUANT_NAMES)):
            mod.op_twin = GGUF_AMX
            n += 1
    return n


def use_int8_activations(model: nn.Module, except_down: bool = False, amx: bool = False) -> int:
    """Puts each CpuLinear whose GGUF twin holds K-quant blocks on gguf_gemm's int8 activations (a scale
    per 256 inputs, llama.cpp's Q8_K) for its steps of few rows (gguf_activations=int8): about half the
    instructions a weight of the int16 path, at llama.cpp's accuracy; except_down: not the MLP's down
    projections (int8-except-down); amx: their steps of 16+ rows on AMX-INT8 tiles (gguf_gemm_amx_available:
    the interleaved kernel's numbers, 1.8-2.5x its speed on a 2-core AMX Xeon). Returns how many."""
    n = 0
    for name, mod in model.named_modules():
        if (isinstance(mod, CpuLinear) and mod.twin == "gguf" and mod.twin_max_tokens
                and any(t in mod.twin_spec for t in KQUANT_NAMES) and not (except_down and is_down_projection(name))):
            mod.op_twin = GGUF_INT8_AMX if amx else GGUF_INT8
            n += 1
    return n


PANEL_BYTES = 4 << 20  # a dequantised panel of output rows (blocks_gemm): about an L2's worth or two
_panels = threading.local()  # this thread's panel scratch, by dtype: reused, so its pages fault in once


def _panel_scratch(dtype: torch.dtype, numel: int) -> torch.Tensor:
    held = getattr(_panels, "by_dtype", None)
    if held is None:
        held = _panels.by_dtype = {}
    if held.get(dtype) is None or held[dtype].numel() < numel:
        held[dtype] = torch.empty(numel, dtype=dtype)
    return held[dtype]


def release_panel_scratch() -> None:
    """Drops this thread's panel scratch (_panel_scratch). The kernel choice calls it once it has timed
    its candidates: it measures in the thread that starts the engine, which a server never steps in, so
    its panels (PANEL_BYTES a dtype: bf16 and float32 both timed) would stay resident for nothing."""
    _panels.by_dtype = {}


def blocks_gemm(x: torch.Tensor, buf: torch.Tensor, meta: torch.Tensor, out_features: int, layout: str,
                amx_min_rows: int = 0) -> torch.Tensor:
    """x @ w.T for a step of many rows with the weight only in its GGUF blocks: a panel of output rows
    at a time is dequantised (csrc/gguf_dequant.cpp, gguf-py's numbers) into the layout's form, tiled
    bf16 tiles, oneDNN's bf16 rows or float32 rows, and run on that layout's GEMM (float32_fixed:
    f32_gemm, whose sums do not depend on the step's rows, where F.linear's do). A prefill chunk is
    bound by arithmetic, so the dequantisation (a read of the blocks and a write of the panel) costs
    little next to the GEMM, and the panel stays in cache for it. The panel is written into one
    scratch buffer per thread (PANEL_BYTES: 4 MiB in bf16, 8 in float32) kept between calls."""
    kernels = load_cpu_kernels()
    m, k = x.shape
    wide = 4 if layout in FLOAT32_FORMS else 2
    step = max(16, PANEL_BYTES // (k * wide) // 16 * 16)
    scratch = _panel_scratch(torch.float32 if wide == 4 else torch.bfloat16, step * k)

    def panel(r0: int, r1: int) -> torch.Tensor:
        rows = torch.arange(r0, r1)
        if layout == "tiled":
            tiles = kernels.gguf_dequant(buf, meta, k, rows, True, True, scratch)
            return kernels.bf16_gemm(x, tiles, r1 - r0, amx_min_rows)
        if layout == "onednn":
            return torch.nn.functional.linear(x, kernels.gguf_dequant(buf, meta, k, rows, True, False, scratch))
        rows_f32 = kernels.gguf_dequant(buf, meta, k, rows, False, False, scratch)
        if layout == INVARIANT_FLOAT32:
            return kernels.f32_gemm(x.float(), rows_f32)
        return torch.nn.functional.linear(x.float(), rows_f32)

    if out_features <= step:  # one panel: its GEMM's output is the output
        return panel(0, out_features)
    out = x.new_empty(m, out_features, dtype=torch.float32 if wide == 4 else x.dtype)
    for r0 in range(0, out_features, step):
        out[:, r0:r0 + step] = panel(r0, min(out_features, r0 + step))
    return out


# One op, opaque to torch.compile: inductor cannot lower either packed weight, and the per-step
# choice between the kernels must not become a guard (one compiled graph per choice).
_lib = torch.library.Library("iterserve", "FRAGMENT")
_lib.define("cpu_linear(Tensor x, Tensor packed_weight, str layout, int out_features, Tensor? twin_weight, "
            "Tensor? twin_scales, Tensor? twin_mins, Tensor? bias, int twin_max_tokens, str twin, "
            "int amx_min_rows=0, bool from_blocks=False) -> Tensor")


def _cpu_linear(x: torch.Tensor, packed_weight: torch.Tensor, layout: str, out_features: int,
                twin_weight: torch.Tensor | None, twin_scales: torch.Tensor | None, twin_mins: torch.Tensor | None,
                bias: torch.Tensor | None, twin_max_tokens: int, twin: str, amx_min_rows: int = 0,
                from_blocks: bool = False) -> torch.Tensor:
    if x.shape[0] <= twin_max_tokens:
        if twin == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), twin_weight, GROUP_SIZE, twin_scales)
        elif twin == "q4_1":
            y = load_cpu_kernels().q4_gemm(x, twin_weight, twin_scales, twin_mins)
        elif twin in ("gguf", GGUF_AMX, GGUF_INT8, GGUF_INT8_AMX):
            y = load_cpu_kernels().gguf_gemm(x, twin_weight, twin_scales, out_features,
                                             twin in (GGUF_INT8, GGUF_INT8_AMX), twin in (GGUF_AMX, GGUF_INT8_AMX))
        else:
            y = load_cpu_kernels().q8_0_gemm(x, twin_weight, twin_scales)
    elif from_blocks:
        y = blocks_gemm(x, twin_weight, twin_scales, out_features, layout, amx_min_rows).to(x.dtype)
    elif layout == "tiled":
        y = load_cpu_kernels().bf16_gemm(x, packed_weight, out_features, amx_min_rows)
    elif layout == "float32":
        y = torch.nn.functional.linear(x.float(), packed_weight).to(x.dtype)
    elif layout == "bf16w":
        y = load_cpu_kernels().f32_bf16w_gemm(x.float(), packed_weight, out_features).to(x.dtype)
    elif layout == INVARIANT_FLOAT32:
        y = load_cpu_kernels().f32_gemm(x.float(), packed_weight).to(x.dtype)
    else:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return y if bias is None else y + bias


_lib.impl("cpu_linear", _cpu_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("iterserve::cpu_linear")
def _cpu_linear_fake(x, packed_weight, layout, out_features, twin_weight, twin_scales, twin_mins, bias,
                     twin_max_tokens, twin, amx_min_rows=0, from_blocks=False):
    return x.new_empty(x.shape[0], out_features)


def four_bit_twin(in_features: int, kernels: ModuleType | None, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Our Q4 kernel where it is vectorised (AVX512-VNNI, or AVX2 + FMA) and the shape fits, else
    torch's int4 (bf16 only: it takes bf16 activations)."""
    if kernels is not None and kernels.q4_gemm_is_vectorised() and in_features % 64 == 0:
        return "q4_1"
    return "int4" if in_features % GROUP_SIZE == 0 and dtype == torch.bfloat16 else None


FOUR_BIT_BLOCKS = {"Q4_0", "Q4_1"}  # a GGUF of these keeps the min-max twins (pack_q4_1 recovers their levels)


def gguf_twins_of(model: nn.Module) -> dict[str, tuple[str, list]]:
    """Module name -> (spec, shards) of each projection and of the LM head whose GGUF blocks
    gguf_gemm reads, from `model.gguf_sources` (module path -> QuantShard list, set by the loader for
    a GGUF; a tied head takes the embedding's blocks). Empty when there are none, or when the
    projections are all Q4_0 / Q4_1 and a float copy was loaded (those keep the min-max Q4_1 and Q8_0
    twins, as before); the modules whose only copy is their blocks (`model.block_modules`) are
    always named."""
    sources = getattr(model, "gguf_sources", None) or {}
    blocks = getattr(model, "block_modules", set())
    proj_types = {str(s.qtype) for name, shards in sources.items() if name.startswith("layers.") for s in shards}
    four_bit_only = not proj_types or proj_types <= FOUR_BIT_BLOCKS
    embed = getattr(model, "embed_tokens", None)
    out = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or (four_bit_only and name not in blocks):
            continue
        if name.startswith("layers."):
            shards = sources.get(name)
        elif name == "lm_head":
            tied = embed is not None and mod.weight is getattr(embed, "weight", None)
            shards = sources.get("lm_head") or (sources.get("embed_tokens") if tied else None)
        else:
            continue
        if gguf_twin_supported(shards, mod.out_features, mod.in_features):
            out[name] = (gguf_twin_spec(shards), list(shards))
    return out


def shard_span(buf: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """The bytes of buf that meta's shards span ([S, 4]: type, rows, bytes per row, offset), as a view:
    buf may be the whole file's map, the shards at their offsets in it (pack_gguf_twin)."""
    start = int(meta[:, 3].min())
    end = int((meta[:, 3] + meta[:, 1] * meta[:, 2]).max())
    return buf[start:end]


class BlockEmbedding(nn.Module):
    """The token embedding read from its GGUF blocks, its only copy (shared with a tied LM head's
    CpuLinear): a step dequantises the rows of its tokens alone (csrc/gguf_dequant.cpp), gguf-py's
    numbers in the model's dtype, as a float copy of the table would hold them.

    `unmap_after`: the table is the file's map and nothing else reads it (no tied head). A row's read
    maps its whole folio of the page cache (2 MiB where the file is cached in large pages), and the
    process kept each one mapped: after a few prompts a 1B's 54 MiB table (the 8B's 295 MiB) was
    mostly in its RSS, for the few rows a step reads. So after each lookup the table's pages are
    unmapped again (madvise DONTNEED; the page cache keeps them, and the next step maps the folios of
    its rows again): a lookup of 1 / 16 / 512 random rows of the 1B's took 17 / 69-104 / 363-679 us
    against 8-10 / 15 / 200-216 kept mapped, 0.05-0.15 % of those steps (2-core AMX Xeon,
    docs/profile.md)."""

    def __init__(self, blocks: tuple[torch.Tensor, torch.Tensor], num_embeddings: int, embedding_dim: int,
                 dtype: torch.dtype, unmap_after: bool = False) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.register_buffer("buf", blocks[0], persistent=False)
        self.register_buffer("meta", blocks[1], persistent=False)
        self.mapped = file_mapped_pages(shard_span(*blocks)) if unmap_after else None  # (address, bytes) to unmap

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = load_cpu_kernels().gguf_dequant(self.buf, self.meta, self.embedding_dim, ids.reshape(-1).long(),
                                               self.dtype == torch.bfloat16)
        if self.mapped is not None:
            unmap_pages(*self.mapped)
        return rows.view(*ids.shape, self.embedding_dim)


def use_gguf_blocks(model: nn.Module, plan_of: Callable[[str, nn.Linear, str], tuple[str, int, int]]) -> int:
    """Replaces each module whose only copy is its GGUF blocks (`model.block_modules`, weights on
    the meta device) with one that computes from them: CpuLinear(blocks=...) for the projections and
    the LM head, BlockEmbedding for the embedding, a tied head and the embedding sharing one buffer.
    `plan_of(name, linear, spec)` -> (layout, twin's max tokens, AMX min rows) for a linear. Then
    drops the loader's shards of those modules. Returns the number replaced. (A MoE layer's experts
    kept as blocks are cpu_moe.use_moe_blocks' to replace.)"""
    blocks = getattr(model, "block_modules", set())
    sources = model.gguf_sources
    packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(shard list) -> (buf, meta)
    changed = 0
    modules = {name: model.get_submodule(name) for name in sorted(blocks)}
    shards_of = {name: sources.get(name) or sources.get("embed_tokens") for name in modules}
    # shard lists a linear reads too (a tied head reads the embedding's): BlockEmbedding keeps those mapped
    read_by_linears = {id(shards_of[n]) for n, m in modules.items() if isinstance(m, nn.Linear)}
    for name, mod in modules.items():
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            continue  # a MoE layer's experts: cpu_moe.use_moe_blocks
        shards = shards_of[name]
        dim = mod.embedding_dim if isinstance(mod, nn.Embedding) else mod.in_features
        if id(shards) not in packed:
            packed[id(shards)] = pack_gguf_twin(shards, dim)
        pair = packed[id(shards)]
        if isinstance(mod, nn.Embedding):
            new: nn.Module = BlockEmbedding(pair, mod.num_embeddings, dim, mod.weight.dtype,
                                            unmap_after=id(shards) not in read_by_linears)
        else:
            layout, most, amx = plan_of(name, mod, gguf_meta_spec(pair[1]))
            new = CpuLinear(mod, twin_max_tokens=most, layout=layout, amx_min_rows=amx, blocks=pair,
                            out_order=output_order(shards))
        replace_module(model, name, new)
        changed += 1
    model.gguf_sources = {k: v for k, v in sources.items() if k not in blocks}
    return changed


def optimize_cpu_linears(model: nn.Module, layout: str = "onednn", int4_max_tokens: int = 0,
                         q8_head_max_tokens: int = 0, kernels: ModuleType | None = None,
                         plans: Mapping[tuple, tuple[str, int, int]] | None = None,
                         dtype: torch.dtype = torch.bfloat16, amx_min_rows: int = 0,
                         gguf_twins: Mapping[str, Sequence[Any]] | None = None) -> int:
    """Swaps the decoder projections (4-bit twin if int4_max_tokens > 0) and the LM head (Q8_0 twin
    if q8_head_max_tokens > 0: 4 bits would round the logits; it keeps its weight, which it shares
    with the embedding) for CpuLinear in `layout` (a linear with an odd in_features takes oneDNN's).
    `kernels`: the loaded CPU kernels, or None. `amx_min_rows`: the tiled layout's AMX cut-over
    (CpuLinear). `plans`: (role "proj"/"head", out, in) -> (layout, twin's max tokens, AMX min rows),
    a measured choice per shape (platform/kernel_choice.py) that replaces `layout`, the twin
    thresholds and the AMX cut-over for the shapes it names (a twin stays off where its figure is 0;
    a GGUF twin's shape is keyed (role, out, in, spec)). `gguf_twins`: module name -> the GGUF
    shards its twin is built from (gguf_twins_of); when given, these twins replace the 4-bit and
    Q8_0 ones (int4_max_tokens / q8_head_max_tokens: their cut-overs where not measured) and a
    module it does not name gets none. Only CPU linears of `dtype` are swapped: bf16, or float32
    with a FLOAT32_LAYOUTS layout and no twin but our Q4_1 one. Returns the number changed."""
    if dtype == torch.float32 and (layout not in FLOAT32_FORMS or q8_head_max_tokens
                                   or any(p[0] not in FLOAT32_FORMS for p in (plans or {}).values())):
        raise ValueError(f"a float32 model takes the layouts {', '.join(FLOAT32_FORMS)} and no head twin")
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
    if gguf_twins and kernels is None:
        raise RuntimeError("twins from GGUF blocks need iterserve's CPU kernels, which did not build (see the log)")
    changed = 0
    for name, mod in list(model.named_modules()):
        if not (isinstance(mod, nn.Linear) and mod.weight.dtype == dtype and mod.weight.device.type == "cpu"):
            continue
        role = "proj" if name.startswith("layers.") else "head" if name == "lm_head" else None
        if role is None:
            continue
        lay, proj_max, head_max, amx = layout, int4_max_tokens, q8_head_max_tokens, amx_min_rows
        shards = (gguf_twins or {}).get(name)
        spec = gguf_twin_spec(shards) if shards else ""
        plan = (plans or {}).get((role, mod.out_features, mod.in_features, spec))
        if plan is None and not spec:
            plan = (plans or {}).get((role, mod.out_features, mod.in_features))
        if plan is not None:
            lay, amx = plan[0], plan[2]
            proj_max, head_max = plan[1] if int4_max_tokens else 0, plan[1] if q8_head_max_tokens else 0
        if lay == "tiled" and mod.in_features % 2:
            lay = "onednn"
        if gguf_twins:  # the file's own blocks, or no twin
            most = plan[1] if plan is not None else proj_max if role == "proj" else head_max
            new = CpuLinear(mod, "gguf" if shards and most else None, most, keep_weight=role == "head", layout=lay,
                            amx_min_rows=amx, shards=shards if shards and most else None)
        elif role == "proj":
            twin = four_bit_twin(mod.in_features, kernels, dtype) if proj_max else None
            new = CpuLinear(mod, twin, proj_max, layout=lay, amx_min_rows=amx)
        else:
            fits = head_max and mod.in_features % GROUP_SIZE == 0
            new = CpuLinear(mod, "q8_0" if fits else None, head_max, keep_weight=True, layout=lay, amx_min_rows=amx)
        replace_module(model, name, new)
        changed += 1
    return changed
