"""KV block pool: which cache blocks are free, which each request holds, and which hold a cached
prefix that a later request may share.

It knows nothing about models or tensors: a block id indexes the first dimension of every layer's
cache tensor (ModelRunner.kv_caches). Blocks are taken on demand as a request's tokens grow and
released the moment it finishes, is aborted or is preempted.

Prefix caching (vLLM v1's design): a full block whose KV has been computed is registered under its
content hash (core/block_hash.py). Blocks carry reference counts, so several requests can hold one
block. A block whose count drops to zero keeps its KV and its hash and joins an evictable queue
(least recently released first) instead of the free list; a new request whose prefix hashes match
takes it back by reference. Evictable blocks are reclaimed only when no plain free block is left.
A request releases its blocks last first, so a sequence's tail is evicted before its head (the
head is what other requests share). Only full blocks are ever shared, and nobody writes into a
full block, so sharing needs no copy-on-write.

With caching disabled (static batching) the pool is the plain free list it always was.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from iterserve.core.block_hash import BlockHash


@dataclass
class BlockUsage:
    total_blocks: int
    used_blocks: int  # held by at least one request
    free_blocks: int  # not held: plain free + evictable cached
    tokens_stored: int
    allocated_slots: int
    cached_free_blocks: int = 0  # of free_blocks: evictable, still holding a cached prefix

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def internal_fragmentation(self) -> float:
        """Share of allocated slots that hold no token (the price of a large block size)."""
        return 1.0 - self.tokens_stored / self.allocated_slots if self.allocated_slots else 0.0


@dataclass(frozen=True)
class BlockMap:
    """Which request holds each block, copied in one go on the engine thread so that a monitor
    (the dashboard) can draw it on another thread. A block in no table and not cached is free."""

    num_blocks: int
    held: tuple[tuple[str, tuple[int, ...]], ...]  # (request id, its block table); a shared block is in several
    cached: tuple[int, ...] = ()  # free blocks still holding a reusable prefix (prefix caching)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))  # no request, no cached content
        self._evictable: OrderedDict[int, None] = OrderedDict()  # no request, cached; LRU first
        self.ref_count = [0] * num_blocks
        self._block_hash: dict[int, BlockHash] = {}  # cached block -> its hash
        self._cached: dict[BlockHash, int] = {}  # hash -> the one block registered under it
        self.tables: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of each table already registered
        self._tokens: dict[str, int] = {}  # tokens each request has written (for usage figures)
        self._shared_refs = 0  # sum over blocks of (ref_count - 1): slots counted twice in _tokens

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: plain free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks a request needs so that its table covers num_tokens tokens."""
        have = len(self.tables.get(request_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        return self._shortfall(request_id, num_tokens, cached_blocks) <= 0

    def find_cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Blocks holding the longest cached prefix of a sequence whose full blocks hash to
        block_hashes (a chain: the first miss ends the prefix)."""
        blocks: list[int] = []
        if not self.enable_caching:
            return blocks
        for h in block_hashes:
            b = self._cached.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    # ---- changes ----------------------------------------------------------------------------
    def _shortfall(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int]) -> int:
        if cached_blocks and self.tables.get(request_id):
            raise ValueError(f"request {request_id} already holds blocks: a cached prefix is taken at admission")
        need = max(0, self.blocks_for(num_tokens) - len(self.tables.get(request_id, ())) - len(cached_blocks))
        # taking an evictable cached block by reference removes it from what new blocks can use
        revived = sum(1 for b in cached_blocks if self.ref_count[b] == 0)
        return need - (self.num_free - revived)

    def allocate(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Grows the request's table to cover num_tokens; False (and no change) when short.

        cached_blocks (from find_cached_prefix, at admission only) become the table's first blocks,
        shared by reference; only the blocks after them are taken new.
        """
        if self._shortfall(request_id, num_tokens, cached_blocks) > 0:
            return False
        table = self.tables.setdefault(request_id, [])
        for b in cached_blocks:
            self._ref(b)
            table.append(b)
        self._num_cached[request_id] = max(self._num_cached.get(request_id, 0), len(cached_blocks))
        for _ in range(self.blocks_for(num_tokens) - len(table)):
            b = self._take_new()
            self._ref(b)
            table.append(b)
        self._tokens[request_id] = max(self._tokens.get(request_id, 0), num_tokens)
        return True

    def _ref(self, b: int) -> None:
        if self.ref_count[b] == 0:
            self._evictable.pop(b, None)
        else:
            self._shared_refs += 1
        self.ref_count[b] += 1

    def _take_new(self) -> int:
        """A block with no content: a plain free one, else the least recently released cached one
        (its hash is dropped: its KV will be overwritten)."""
        if self._free:
            return self._free.popleft()
        b, _ = self._evictable.popitem(last=False)
        del self._cached[self._block_hash.pop(b)]
        return b

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int) -> None:
        """Registers the request's blocks whose KV is now fully computed under their hashes, so
        later requests can share them. A block whose hash is already registered (the same prefix
        computed twice at once) stays private and goes back to the free list when released."""
        if not self.enable_caching:
            return
        table = self.tables.get(request_id)
        if table is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(block_hashes), len(table))
        for i in range(self._num_cached.get(request_id, 0), num_full):
            b, h = table[i], block_hashes[i]
            if h not in self._cached and b not in self._block_hash:
                self._cached[h] = b
                self._block_hash[b] = h
        self._num_cached[request_id] = max(self._num_cached.get(request_id, 0), num_full)

    def allocate_contiguous(self, request_id: str, num_tokens: int) -> bool:
        """Reserves one contiguous run of block ids for the whole sequence up front (static
        batching's contiguous per-sequence KV). False when no such run is free."""
        if self.enable_caching:
            raise ValueError("contiguous reservations are static batching's, which keeps unshared KV: "
                             "use a pool with enable_caching=False")
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
        for b in taken:
            self.ref_count[b] = 1
        self.tables[request_id] = list(range(run_start, run_start + need))
        self._tokens[request_id] = 0
        return True

    def note_tokens(self, request_id: str, num_tokens: int) -> None:
        """Records how many slots of the request's blocks hold a token (usage figures only)."""
        if request_id in self.tables:
            self._tokens[request_id] = num_tokens

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Gives back the blocks at the end of the request's table beyond what num_tokens need
        (speculative decoding's rejected drafts); returns how many. Those blocks were never
        registered in the prefix cache (only blocks of computed tokens are), and are private."""
        table = self.tables.get(request_id)
        keep = self.blocks_for(num_tokens)
        if not table or len(table) <= keep:
            return 0
        dropped = table[keep:]
        del table[keep:]
        for b in reversed(dropped):
            self.ref_count[b] -= 1
            if self.ref_count[b] > 0:
                self._shared_refs -= 1
            elif b in self._block_hash:
                self._evictable[b] = None
            else:
                self._free.append(b)
        self._num_cached[request_id] = min(self._num_cached.get(request_id, 0), keep)
        self._tokens[request_id] = min(self._tokens.get(request_id, 0), num_tokens)
        return len(dropped)

    def free(self, request_id: str) -> int:
        """Releases the request's blocks, last first; returns how many it held. A block still held
        by another request stays; a cached one becomes evictable; any other one free. Freeing
        twice is a no-op."""
        table = self.tables.pop(request_id, None)
        self._tokens.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if not table:
            return 0
        for b in reversed(table):
            self.ref_count[b] -= 1
            if self.ref_count[b] > 0:
                self._shared_refs -= 1
            elif b in self._block_hash:
                self._evictable[b] = None  # most recently released: evicted last
            else:
                self._free.append(b)
        return len(table)

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block no request holds (they become plain free); returns how many."""
        n = len(self._evictable)
        for b in self._evictable:
            del self._cached[self._block_hash.pop(b)]
            self._free.append(b)
        self._evictable.clear()
        return n

    def usage(self) -> BlockUsage:
        free = self.num_free
        used = self.num_blocks - free
        written = sum(min(t, len(self.tables[r]) * self.block_size) for r, t in self._tokens.items())
        return BlockUsage(
            total_blocks=self.num_blocks,
            used_blocks=used,
            free_blocks=free,
            tokens_stored=written - self._shared_refs * self.block_size,  # a shared block is full
            allocated_slots=used * self.block_size,
            cached_free_blocks=len(self._evictable),
        )

    def block_map(self) -> BlockMap:
        """A copy of the tables: O(held blocks), a few microseconds for a thousand."""
        return BlockMap(self.num_blocks, tuple((rid, tuple(t)) for rid, t in self.tables.items()),
                        cached=tuple(self._evictable))

    def check_invariants(self) -> None:
        """Reference counts match the tables; used + evictable + free = total; no block in two
        places; the cache map is one-to-one and only names cached blocks. Cheap enough for tests,
        not for the hot path."""
        refs = [0] * self.num_blocks
        for t in self.tables.values():
            assert len(t) == len(set(t)), "a block twice in one table"
            for b in t:
                refs[b] += 1
        assert refs == self.ref_count, "reference counts do not match the tables"
        held = {b for b in range(self.num_blocks) if refs[b]}
        free, evictable = list(self._free), list(self._evictable)
        assert len(set(free)) == len(free), "a block is free twice"
        assert not held & set(free), "a held block is also free"
        assert not held & set(evictable), "a held block is also evictable"
        assert not set(free) & set(evictable), "a block is both free and evictable"
        assert len(held) + len(evictable) + len(free) == self.num_blocks, "blocks leaked"
        assert all(b in self._block_hash for b in evictable), "an evictable block holds no cached prefix"
        assert not any(b in self._block_hash for b in free), "a plain free block is still registered"
        assert {b: h for h, b in self._cached.items()} == self._block_hash, "cache map not one-to-one"
        assert self._shared_refs == sum(max(0, r - 1) for r in refs), "shared reference count drifted"
