"""What one step's attention needs to know besides q, k and v: where each new token's K/V goes in
the paged cache, and which blocks each sequence's context lives in.

The runner builds one `AttentionMetadata` per step for the step's flat token batch, laid out as
vLLM does: first the decodes (one new token per sequence), then the prefill chunks (several new
tokens per sequence, possibly after an already-cached prefix). Every layer and every backend reads
the same object. This module imports nothing from iterserve: the backends, the forward context, the
runner and the model all depend on it, and it depends on none of them.

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size
+ offset.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def block_ids(tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The ids of the blocks holding each sequence's first `length` tokens, flattened [B * n]."""
    return tables[:, :-(-length // block_size)].reshape(-1)


@dataclass
class DecodeMetadata:
    """The first `num_seqs` tokens of the batch: one new token per sequence."""
    block_tables: torch.Tensor  # [B, max_blocks] (padded with 0)
    context_lens: torch.Tensor  # [B] tokens in cache after this step's write
    max_context_len: int
    _plan: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    def gather_plan(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids to gather [B * n], key mask [B, 1, 1, n * block_size]) for the torch path: the
        same for every layer of a step, so built once, at the first layer."""
        if self._plan is None:
            flat = block_ids(self.block_tables, self.max_context_len, block_size)
            key_pos = torch.arange(flat.numel() // self.num_seqs * block_size, device=self.context_lens.device)
            mask = (key_pos.unsqueeze(0) < self.context_lens.unsqueeze(1)).view(self.num_seqs, 1, 1, -1)
            self._plan = (flat, mask)
        return self._plan


@dataclass
class PrefillMetadata:
    """The rest of the batch: chunks of `query_lens[i]` tokens, in order."""
    block_tables: torch.Tensor  # [P, max_blocks]
    query_lens: list[int]
    context_lens: list[int]  # cached prefix + this chunk

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_decode_tokens: int
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None
