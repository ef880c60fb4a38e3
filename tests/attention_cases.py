"""Random paged-attention cases shared by the attention tests (torch path, Triton and C++ kernels),
and a dense reference with an explicit mask (sliding window, soft-cap) to check them against."""
from __future__ import annotations

import torch

from iterserve.attention.metadata import DecodeMetadata

CONTEXT_LENS = [1, 15, 16, 17, 100]  # inside, exactly at and just past a block boundary
HEAD_DIM = 64
KV_HEADS = 2


def random_case(context_lens: list[int], block_size: int, group: int, seed: int = 0, head_dim: int = HEAD_DIM):
    """q, caches and metadata for sequences whose blocks are a random permutation of the pool."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(need) + 3  # spare blocks hold noise that must never be read
    k_cache = torch.randn(num_blocks, block_size, KV_HEADS, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, KV_HEADS, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need) + 1  # padded wider than any sequence needs, as the runner may
    tables = torch.zeros(len(context_lens), width, dtype=torch.long)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    meta = DecodeMetadata(block_tables=tables, context_lens=torch.tensor(context_lens),
                          max_context_len=max(context_lens))
    q = torch.randn(len(context_lens), KV_HEADS * group, head_dim, generator=g)
    return q, k_cache, v_cache, meta


def poison_unread_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMetadata, window: int = 0) -> None:
    """Fills every cache slot a decode kernel must not read with 1e4: the rest of each sequence's
    last block, every block no sequence uses, and with a window W the slots before each sequence's
    last W. Asserts that some unused block exists."""
    bs = k_cache.shape[1]
    lens = meta.context_lens.tolist()
    for i, n in enumerate(lens):
        last = meta.block_tables[i, (n - 1) // bs]
        k_cache[last, n % bs or bs:] = 1e4
        v_cache[last, n % bs or bs:] = 1e4
        before = torch.arange(max(0, n - window) if window > 0 else 0)
        slots = meta.block_tables[i, before // bs] * bs + before % bs
        k_cache.view(-1, *k_cache.shape[2:])[slots] = 1e4
        v_cache.view(-1, *v_cache.shape[2:])[slots] = 1e4
    used = {int(b) for i, n in enumerate(lens) for b in meta.block_tables[i, :-(-n // bs)]}
    unused = sorted(set(range(k_cache.shape[0])) - used)
    assert unused
    k_cache[unused] = 1e4
    v_cache[unused] = 1e4


def sequence_kv(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens' rows [length, kv_heads, D] of one sequence (block table `table`)."""
    bs = cache.shape[1]
    pos = torch.arange(length)
    return cache.view(-1, *cache.shape[2:])[table[pos // bs] * bs + pos % bs]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor | list[int],
                        scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Dense attention in float64 with the mask written out: q [n, H, D] at absolute positions q_pos,
    against k, v [L, kv_heads, D] at positions 0 .. L - 1 -> [n, H, D] float64. A query at p sees keys
    max(0, p - window + 1) .. p (window 0: 0 .. p); softcap c > 0: scores c * tanh(s / c)."""
    H, kvh = q.shape[1], k.shape[1]
    qd = q.double().transpose(0, 1)  # [H, n, D]
    kd = k.double().transpose(0, 1).repeat_interleave(H // kvh, 0)  # [H, L, D]
    vd = v.double().transpose(0, 1).repeat_interleave(H // kvh, 0)
    s = qd @ kd.transpose(1, 2) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    qp = torch.as_tensor(q_pos).view(-1, 1)
    kp = torch.arange(k.shape[0]).view(1, -1)
    mask = kp <= qp
    if window > 0:
        mask &= kp > qp - window
    return (s.masked_fill(~mask, float("-inf")).softmax(-1) @ vd).transpose(0, 1)


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMetadata,
                     scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """`reference_attention` for a decode batch: each sequence's one query at its last position."""
    outs = []
    for b, n in enumerate(meta.context_lens.tolist()):
        k, v = (sequence_kv(c, meta.block_tables[b], n) for c in (k_cache, v_cache))
        outs.append(reference_attention(q[b:b + 1], k, v, [n - 1], scale, window, softcap))
    return torch.cat(outs)
