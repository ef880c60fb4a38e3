"""KV block pool: which cache blocks are free, and which blocks each request holds.

It knows nothing about models or tensors: a block id indexes the first dimension of every layer's
cache tensor (see runner.KVCache). Blocks are taken on demand as a request's tokens grow and
returned the moment it finishes, is aborted or is preempted.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class BlockUsage:
    total_blocks: int
    used_blocks: int
    free_blocks: int
    tokens_stored: int
    allocated_slots: int

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def internal_fragmentation(self) -> float:
        """Share of allocated slots that hold no token (the price of a large block size)."""
        return 1.0 - self.tokens_stored / self.allocated_slots if self.allocated_slots else 0.0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self._tokens: dict[str, int] = {}  # tokens each request has written (for usage figures)

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks a request needs so that its table covers num_tokens tokens."""
        have = len(self.tables.get(request_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= len(self._free)

    # ---- changes ----------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grows the request's table to cover num_tokens; False (and no change) when short."""
        need = self.blocks_needed(request_id, num_tokens)
        if need > len(self._free):
            return False
        table = self.tables.setdefault(request_id, [])
        for _ in range(need):
            table.append(self._free.popleft())
        self._tokens[request_id] = max(self._tokens.get(request_id, 0), num_tokens)
        return True

    def allocate_contiguous(self, request_id: str, num_tokens: int) -> bool:
        """Reserves one contiguous run of block ids for the whole sequence up front (static
        batching's contiguous per-sequence KV). False when no such run is free."""
        if request_id in self.tables:
            raise ValueError(f"request {request_id} already holds blocks")
        need = self.blocks_for(num_tokens)
        free = sorted(self._free)
        run_start, run_len = None, 0
        for i, b in enumerate(free):
            run_len = run_len + 1 if i and b == free[i - 1] + 1 else 1
            if run_len == need:
                run_start = b - need + 1
                break
        if run_start is None:
            return False
        taken = set(range(run_start, run_start + need))
        self._free = deque(b for b in self._free if b not in taken)
        self.tables[request_id] = list(range(run_start, run_start + need))
        self._tokens[request_id] = 0
        return True

    def note_tokens(self, request_id: str, num_tokens: int) -> None:
        """Records how many slots of the request's blocks hold a token (usage figures only)."""
        if request_id in self.tables:
            self._tokens[request_id] = num_tokens

    def free(self, request_id: str) -> int:
        """Returns the request's blocks to the pool; returns how many. Freeing twice is a no-op."""
        table = self.tables.pop(request_id, None)
        self._tokens.pop(request_id, None)
        if not table:
            return 0
        self._free.extend(table)
        return len(table)

    def usage(self) -> BlockUsage:
        used = self.num_blocks - len(self._free)
        return BlockUsage(
            total_blocks=self.num_blocks,
            used_blocks=used,
            free_blocks=len(self._free),
            tokens_stored=sum(min(t, len(self.tables[r]) * self.block_size) for r, t in self._tokens.items()),
            allocated_slots=used * self.block_size,
        )

    def check_invariants(self) -> None:
        """used + free = total; no block twice. Cheap enough for tests, not for the hot path."""
        held = [b for t in self.tables.values() for b in t]
        assert len(held) == len(set(held)), "a block is in two tables"
        assert not set(held) & set(self._free), "a held block is also free"
        assert len(held) + len(self._free) == self.num_blocks, "blocks leaked"
        assert len(set(self._free)) == len(self._free), "a block is free twice"
