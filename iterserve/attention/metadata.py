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
    # gather plans by attention window: the torch path's key mask depends on it, and a model whose
    # layers alternate windowed and global attention (Gemma 2, 3) asks for two every step
    _plans: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    def gather_plan(self, block_size: int, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids to gather [B * n], key mask [B, 1, 1, n * block_size]) for the torch path: the
        same for every layer of a step with the same window (0: none; W: only each sequence's last W
        keys), so built once per window, at the first layer that asks."""
        if window >= self.max_context_len:
            window = 0  # a window no sequence fills masks nothing
        plan = self._plans.get(window)
        if plan is None:
            flat = (next(iter(self._plans.values()))[0] if self._plans
                    else block_ids(self.block_tables, self.max_context_len, block_size))
            key_pos = torch.arange(flat.numel() // self.num_seqs * block_size, device=self.context_lens.device)
            lens = self.context_lens.unsqueeze(1)
            mask = key_pos.unsqueeze(0) < lens
            if window > 0:
                mask &= key_pos.unsqueeze(0) >= lens - window
            plan = self._plans[window] = (flat, mask.view(self.num_seqs, 1, 1, -1))
        return plan


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
    _per_query: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def per_query_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block table [T, width], context length [T]) of every query of the step, each prefill
        query as if it were a decode at its own position: what lets one decode kernel compute every
        token alike, wherever it falls in a step (batch-invariant mode). Built once per step."""
        if self._per_query is None:
            tables, lens = [], []
            if self.decode is not None:
                tables.append(self.decode.block_tables)
                lens.append(self.decode.context_lens)
            if self.prefill is not None:
                p = self.prefill
                device = p.block_tables.device
                n = torch.tensor(p.query_lens, device=device)
                tables.append(p.block_tables.repeat_interleave(n, dim=0))
                lens.append(torch.cat([torch.arange(ctx - q + 1, ctx + 1, device=device)
                                       for q, ctx in zip(p.query_lens, p.context_lens)]))
            width = max(t.shape[1] for t in tables)
            tables = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables]
            self._per_query = (torch.cat(tables), torch.cat(lens))
        return self._per_query
