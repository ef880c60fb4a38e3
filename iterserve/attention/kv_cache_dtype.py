"""The KV cache's storage formats (--kv-cache-dtype, vLLM's flag and names) and the two things every
attention path does with them: quantise a step's K/V rows on their write into the cache, and widen
rows read back (the torch path; the C++ kernels widen in registers: csrc/kv_formats.h).

- bfloat16, float32 (and float16 on CUDA): the values as computed, rounded to that dtype.
- fp8 (= fp8_e4m3), fp8_e5m2: one byte a value, torch's float8_e4m3fn / float8_e5m2, scale 1.0
  (vLLM's default when a checkpoint brings no KV scales), saturated at the format's largest finite
  value instead of turning into NaN.
- q8_0: llama.cpp's block_q8_0 (its `-ctk q8_0 -ctv q8_0`): each 32 values of a token's head row
  share one float16 scale d = max|x| / 127 and are stored as round(x / d) in int8: 34 bytes per 32
  values (8.5 bits a value). A cache of this format is uint8 [blocks, block_size, kv_heads,
  head_dim / 32 * 34]; the kernels tell it from the others by that dtype.

Half of bf16's bytes (a little more for q8_0) per cached token: twice the tokens in the same
--kv-cache-memory, and half the bytes a decode step streams (docs/benchmarks/kv-cache-dtype.md has
the measured accuracy and speed of each).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "q8_0")
Q8_VALUES = 32  # values per q8_0 block
Q8_BYTES = 34  # one float16 scale + 32 int8
_FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # each format's largest finite value


@dataclass(frozen=True)
class KVCacheFormat:
    """A resolved --kv-cache-dtype: its name (as /v1/scheduler reports it) and the cache tensors' dtype."""

    name: str
    storage: torch.dtype

    @property
    def is_8bit(self) -> bool:
        return self.name in ("fp8_e4m3", "fp8_e5m2", "q8_0")

    def row_width(self, head_dim: int) -> int:
        """Elements of `storage` holding one token's row of one KV head."""
        if self.name != "q8_0":
            return head_dim
        if head_dim % Q8_VALUES:
            raise ValueError(f"--kv-cache-dtype q8_0 needs head_dim a multiple of {Q8_VALUES}; this model's is {head_dim}")
        return head_dim // Q8_VALUES * Q8_BYTES

    def cache_shape(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return num_blocks, block_size, kv_heads, self.row_width(head_dim)

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes of one token's K (or V) row for one KV head, scales included."""
        return self.row_width(head_dim) * torch.empty((), dtype=self.storage).element_size()


FORMATS = {f.name: f for f in (KVCacheFormat("bfloat16", torch.bfloat16), KVCacheFormat("float32", torch.float32),
                                KVCacheFormat("float16", torch.float16),
                                KVCacheFormat("fp8_e4m3", torch.float8_e4m3fn),
                                KVCacheFormat("fp8_e5m2", torch.float8_e5m2), KVCacheFormat("q8_0", torch.uint8))}


def format_of_dtype(dtype: torch.dtype) -> KVCacheFormat:
    """The format that stores values in the model's own dtype (what auto means by default)."""
    return next(f for f in FORMATS.values() if f.storage == dtype and f.name != "q8_0")


def resolve_kv_cache_dtype(choice: str, model_dtype: torch.dtype, bf16_for_float32: bool = False) -> KVCacheFormat:
    """The format `choice` names. auto: the model's dtype, except bfloat16 when bf16_for_float32 (a CPU
    run in float32 only because the CPU lacks fast bf16 GEMMs: the cache is read by our kernels, not
    by a GEMM, so bf16 halves its bytes at no cost in speed). Unknown names fail with the list."""
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown --kv-cache-dtype {choice!r}: use one of {', '.join(KV_CACHE_DTYPES)}")
    if choice == "auto":
        return FORMATS["bfloat16"] if bf16_for_float32 and model_dtype == torch.float32 else format_of_dtype(model_dtype)
    return FORMATS["fp8_e4m3" if choice == "fp8" else choice]


# ---- on the cache tensors: the format is known from their dtype --------------------------------
def quantise(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """Rows x [..., head_dim] as a cache of dtype `storage` stores them: [..., row_width] of that dtype."""
    if storage in _FP8:
        top = _FP8[storage]
        return x.float().clamp(-top, top).to(storage)
    if storage == torch.uint8:  # q8_0, as llama.cpp's quantize_row_q8_0
        blocks = x.float().unflatten(-1, (-1, Q8_VALUES))
        d = blocks.abs().amax(-1, keepdim=True) / 127
        q = (blocks * torch.where(d > 0, 1 / d, 0)).round().to(torch.int8)
        packed = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], -1)
        return packed.flatten(-2)
    return x.to(storage)


def dequantise(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row_width] (any view of a cache) as values [..., head_dim] of `dtype`."""
    if rows.dtype in _FP8:
        return rows.to(dtype)
    if rows.dtype == torch.uint8:
        blocks = rows.contiguous().unflatten(-1, (-1, Q8_BYTES))
        d = blocks[..., :2].contiguous().view(torch.float16).float()
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).flatten(-2).to(dtype)
    return rows.to(dtype)


def write_rows(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores x [T, kv_heads, head_dim] into `cache`'s slots (one write of the step's rows, quantised
    on the way in). fp8 rows are copied as bytes: torch has no float8 index_copy on CPU."""
    nb, bs, h, w = cache.shape
    flat, rows = cache.view(nb * bs, h, w), quantise(x, cache.dtype)
    if cache.dtype in _FP8:
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slot_mapping, rows)
