"""Random paged-attention cases shared by the decode kernels' tests (Triton and C++)."""
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


def poison_unread_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMetadata) -> None:
    """Fills every cache slot a decode kernel must not read with 1e4: the rest of each sequence's
    last block, and every block no sequence uses. Asserts that some such block exists."""
    bs = k_cache.shape[1]
    lens = meta.context_lens.tolist()
    for i, n in enumerate(lens):
        last = meta.block_tables[i, (n - 1) // bs]
        k_cache[last, n % bs or bs:] = 1e4
        v_cache[last, n % bs or bs:] = 1e4
    used = {int(b) for i, n in enumerate(lens) for b in meta.block_tables[i, :-(-n // bs)]}
    unused = sorted(set(range(k_cache.shape[0])) - used)
    assert unused
    k_cache[unused] = 1e4
    v_cache[unused] = 1e4
