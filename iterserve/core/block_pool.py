"""KV block pool: which cache blocks are free, which each request holds, and which hold a cached
prefix that a later request may share.

It knows nothing about models or tensors: a block id indexes the first dimension of the cache
tensors of the layers of whichever KV cache group's table holds it (ModelRunner.kv_caches). Blocks are taken on demand as a request's tokens grow and
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

KV cache groups (core/kv_groups.py; vLLM v1's hybrid KV cache manager): a model that mixes full and
windowed layers has one block table per group per request, all drawing block ids from this one
pool. A windowed group gives back a block as soon as no query of the sequence can see it again
(`remove_skipped_blocks`), so a long sequence holds its windowed layers' last `window` tokens only;
its table keeps the freed places with the null block. Cached blocks are registered per group, and a
prefix hit needs the full groups' blocks of the whole prefix and the windowed groups' blocks of its
last `window` tokens (`find_cached_prefix`). A model with one kind of layer is one group.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from iterserve.core.block_hash import BlockHash
from iterserve.core.kv_groups import sequence_blocks


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
    """The shared pool of block ids and each request's block table per KV cache group.

    group_windows: one entry per KV cache group (core/kv_groups.py), that group's sliding window in
    tokens, 0 for full attention; the default is one full-attention group (every block kept for the
    whole sequence). A windowed group frees a request's blocks once no query of it can see them
    again (`remove_skipped_blocks`) and its table keeps their places with the null block: block 0,
    reserved when any group is windowed, never handed out, never attended to (the kernels skip positions
    outside the window; the torch path gathers and masks them), as vLLM's null block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 group_windows: Sequence[int] = (0,)) -> None:
        self.group_windows = tuple(int(w) for w in group_windows)
        self.null_block: int | None = 0 if any(self.group_windows) else None
        reserved = 0 if self.null_block is None else 1
        if num_blocks < 1 + reserved or block_size < 1 or not self.group_windows:
            raise ValueError("num_blocks and block_size must be >= 1 (2 blocks with a windowed group: one is "
                             "the null block), and there must be at least one group")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(reserved, num_blocks))  # no request, no cached content
        self._evictable: OrderedDict[int, None] = OrderedDict()  # no request, cached; LRU first
        self.ref_count = [0] * num_blocks
        self._block_hash: dict[int, tuple[int, BlockHash]] = {}  # cached block -> (group, its hash)
        self._cached: dict[tuple[int, BlockHash], int] = {}  # (group, hash) -> the one block registered
        self.group_tables: dict[str, list[list[int]]] = {}  # request -> one table per group
        self.tables: dict[str, list[int]] = {}  # request -> group 0's table (the same list)
        self._skipped: dict[str, list[int]] = {}  # leading null entries of each group's table
        self._num_cached: dict[str, int] = {}  # leading blocks of each table already registered
        self._tokens: dict[str, int] = {}  # tokens each request has written (for usage figures)
        self._shared_refs = 0  # sum over blocks of (ref_count - 1): slots counted twice in _tokens

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: plain free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Table entries (per group) that cover num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_per_sequence(self, num_tokens: int) -> int:
        """Blocks of all groups a sequence of num_tokens holds while decoding its last token: what
        capacity in sequences is counted in (core/kv_groups.py's `sequence_blocks`)."""
        return sum(sequence_blocks(w, num_tokens, self.block_size) for w in self.group_windows)

    def _first_needed(self, window: int, num_computed_tokens: int) -> int:
        """Index of the first block a windowed group still needs when the next token to compute is
        at position num_computed_tokens: the one holding num_computed_tokens - window + 1 (a chunk's
        first query sees the window before it)."""
        return max(0, num_computed_tokens - window + 1) // self.block_size if window > 0 else 0

    def _needs(self, request_id: str, num_tokens: int, cached_blocks: Sequence[Sequence[int]],
               num_computed_tokens: int, reserve_tokens: int) -> list[int]:
        """New blocks each group needs to cover num_tokens (full groups: max(num_tokens, reserve_tokens))."""
        tables = self.group_tables.get(request_id)
        out = []
        for g, w in enumerate(self.group_windows):
            have = len(tables[g]) if tables else (len(cached_blocks[g]) if cached_blocks else 0)
            target = self.blocks_for(num_tokens if w else max(num_tokens, reserve_tokens))
            out.append(max(0, target - max(have, self._first_needed(w, num_computed_tokens))))
        return out

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks (all groups) a request needs so that its tables cover num_tokens tokens."""
        return sum(self._needs(request_id, num_tokens, (), 0, 0))

    def can_allocate(self, request_id: str, num_tokens: int, cached_blocks: Sequence[Sequence[int]] = (),
                     num_computed_tokens: int = 0) -> bool:
        return self._shortfall(request_id, num_tokens, cached_blocks, num_computed_tokens, 0) <= 0

    def fit_tokens(self, request_id: str, num_computed_tokens: int,
                   cached_blocks: Sequence[Sequence[int]] = ()) -> int:
        """Tokens after num_computed_tokens that the request can compute with the free blocks, taking
        none from anyone (may be <= 0); cached_blocks: a new request's prefix hit, as for allocate.
        With one group: (held + free) * block_size - computed."""
        tables = self.group_tables.get(request_id) or cached_blocks
        floors = [max(len(tables[g]) if tables else 0, self._first_needed(w, num_computed_tokens))
                  for g, w in enumerate(self.group_windows)]
        free = self.num_free - sum(1 for c in cached_blocks for b in c
                                   if b != self.null_block and self.ref_count[b] == 0)

        def cost(b: int) -> int:
            return sum(max(0, b - f) for f in floors)

        lo, hi = min(floors), max(floors) + free + 1  # cost(lo) == 0, cost(hi) > free
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if cost(mid) <= free else (lo, mid)
        return lo * self.block_size - num_computed_tokens

    def find_cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[list[int]]:
        """Per group, the blocks of the longest cached prefix of a sequence whose full blocks hash to
        block_hashes (all groups' lists are equally long). vLLM's rule: a hit of k blocks needs the
        full groups' blocks of the whole prefix (a chain: the first miss ends it) and each windowed
        group's blocks of its last `window` tokens (the next query's window); a windowed group's
        entries before those are the null block."""
        empty: list[list[int]] = [[] for _ in self.group_windows]
        if not self.enable_caching or not block_hashes:
            return empty
        k = len(block_hashes)
        for g, w in enumerate(self.group_windows):
            if w == 0:
                k = next((i for i, h in enumerate(block_hashes[:k]) if (g, h) not in self._cached), k)
        runs: dict[int, list[int]] = {}  # windowed group -> length of the cached run ending at each block
        for g, w in enumerate(self.group_windows):
            if w:
                run, n = [], 0
                for h in block_hashes[:k]:
                    n = n + 1 if (g, h) in self._cached else 0
                    run.append(n)
                runs[g] = run
        bs = self.block_size
        while k > 0 and not all(runs[g][k - 1] >= k - self._first_needed(self.group_windows[g], k * bs)
                                for g in runs):
            k -= 1
        if k == 0:
            return empty
        out = []
        for g, w in enumerate(self.group_windows):
            first = self._first_needed(w, k * bs)
            out.append([self.null_block] * first + [self._cached[(g, h)] for h in block_hashes[first:k]])
        return out

    # ---- changes ----------------------------------------------------------------------------
    def _shortfall(self, request_id: str, num_tokens: int, cached_blocks: Sequence[Sequence[int]],
                   num_computed_tokens: int, reserve_tokens: int) -> int:
        if any(cached_blocks) and self.group_tables.get(request_id):
            raise ValueError(f"request {request_id} already holds blocks: a cached prefix is taken at admission")
        need = sum(self._needs(request_id, num_tokens, cached_blocks, num_computed_tokens, reserve_tokens))
        # taking an evictable cached block by reference removes it from what new blocks can use
        revived = sum(1 for c in cached_blocks for b in c if b != self.null_block and self.ref_count[b] == 0)
        return need - (self.num_free - revived)

    def allocate(self, request_id: str, num_tokens: int, cached_blocks: Sequence[Sequence[int]] = (),
                 num_computed_tokens: int = 0, reserve_tokens: int = 0) -> bool:
        """Grows the request's tables to cover num_tokens; False (and no change) when short.

        cached_blocks (from find_cached_prefix, at admission only) become the tables' first
        entries, shared by reference; only the blocks after them are taken new. A new table of a
        windowed group starts with null entries up to the first block the token at
        num_computed_tokens can see. reserve_tokens: the full groups cover that many tokens at least
        (a re-admitted request takes what it needs to reach its next token at once; a windowed
        group's blocks are recycled as it goes, so it takes only this step's).
        """
        if self._shortfall(request_id, num_tokens, cached_blocks, num_computed_tokens, reserve_tokens) > 0:
            return False
        tables = self.group_tables.get(request_id)
        if tables is None:
            tables = self.group_tables[request_id] = [[] for _ in self.group_windows]
            self.tables[request_id] = tables[0]
            self._skipped[request_id] = [0] * self.num_groups
        skipped = self._skipped[request_id]
        for g, blocks in enumerate(cached_blocks):
            for b in blocks:
                if b == self.null_block:
                    skipped[g] += 1
                else:
                    self._ref(b)
                tables[g].append(b)
        if cached_blocks:
            self._num_cached[request_id] = max(self._num_cached.get(request_id, 0), len(cached_blocks[0]))
        for g, w in enumerate(self.group_windows):
            table = tables[g]
            first = self._first_needed(w, num_computed_tokens)
            for _ in range(self.blocks_for(num_tokens if w else max(num_tokens, reserve_tokens)) - len(table)):
                if len(table) < first:
                    table.append(self.null_block)
                    skipped[g] += 1
                else:
                    b = self._take_new()
                    self._ref(b)
                    table.append(b)
        self._tokens[request_id] = max(self._tokens.get(request_id, 0), num_tokens)
        return True

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Frees each windowed group's blocks that no query of the request can see again: those
        entirely before position num_computed_tokens - window + 1, where num_computed_tokens is the
        next token to compute (vLLM's name). Their entries become the null block; a cached one stays
        registered, evictable, for other requests' prefix hits. Returns how many were freed."""
        tables = self.group_tables.get(request_id)
        if tables is None or self.null_block is None:
            return 0
        skipped, freed = self._skipped[request_id], 0
        for g, w in enumerate(self.group_windows):
            if not w:
                continue
            table = tables[g]
            upto = min(self._first_needed(w, num_computed_tokens), len(table))
            for i in range(skipped[g], upto):
                self._release(table[i])
                table[i] = self.null_block
                freed += 1
            skipped[g] = max(skipped[g], upto)
        return freed

    def _ref(self, b: int) -> None:
        if self.ref_count[b] == 0:
            self._evictable.pop(b, None)
        else:
            self._shared_refs += 1
        self.ref_count[b] += 1

    def _release(self, b: int) -> None:
        """Drops one reference: a block still held elsewhere stays; a cached one becomes evictable
        (most recently released: evicted last); any other one free."""
        self.ref_count[b] -= 1
        if self.ref_count[b] > 0:
            self._shared_refs -= 1
        elif b in self._block_hash:
            self._evictable[b] = None
        else:
            self._free.append(b)

    def _take_new(self) -> int:
        """A block with no content: a plain free one, else the least recently released cached one
        (its hash is dropped: its KV will be overwritten)."""
        if self._free:
            return self._free.popleft()
        b, _ = self._evictable.popitem(last=False)
        del self._cached[self._block_hash.pop(b)]
        return b

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int) -> None:
        """Registers the request's blocks whose KV is now fully computed under (group, hash), so
        later requests can share them. A block whose key is already registered (the same prefix
        computed twice at once) stays private and goes back to the free list when released."""
        if not self.enable_caching:
            return
        tables = self.group_tables.get(request_id)
        if tables is None:
            return
        done = self._num_cached.get(request_id, 0)
        num_full = min(num_computed_tokens // self.block_size, len(block_hashes), len(tables[0]))
        for g, table in enumerate(tables):
            for i in range(done, num_full):
                b, key = table[i], (g, block_hashes[i])
                if b != self.null_block and key not in self._cached and b not in self._block_hash:
                    self._cached[key] = b
                    self._block_hash[b] = key
        self._num_cached[request_id] = max(done, num_full)

    def allocate_contiguous(self, request_id: str, num_tokens: int) -> bool:
        """Reserves one contiguous run of block ids for the whole sequence up front, each group's
        table a contiguous part of it (static batching's contiguous per-sequence KV; nothing is
        freed before the sequence ends). False when no such run is free."""
        if self.enable_caching:
            raise ValueError("contiguous reservations are static batching's, which keeps unshared KV: "
                             "use a pool with enable_caching=False")
        if request_id in self.tables:
            raise ValueError(f"request {request_id} already holds blocks")
        per_group = self.blocks_for(num_tokens)
        need = per_group * self.num_groups
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
        tables = [list(range(run_start + g * per_group, run_start + (g + 1) * per_group))
                  for g in range(self.num_groups)]
        self.group_tables[request_id] = tables
        self.tables[request_id] = tables[0]
        self._skipped[request_id] = [0] * self.num_groups
        self._tokens[request_id] = 0
        return True

    def note_tokens(self, request_id: str, num_tokens: int) -> None:
        """Records how many slots of the request's blocks hold a token (usage figures only)."""
        if request_id in self.tables:
            self._tokens[request_id] = num_tokens

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Gives back the blocks at the end of the request's tables beyond what num_tokens need
        (speculative decoding's rejected drafts); returns how many. Those blocks were never
        registered in the prefix cache (only blocks of computed tokens are), and are private."""
        tables = self.group_tables.get(request_id)
        if not tables:
            return 0
        keep = self.blocks_for(num_tokens)
        dropped = 0
        for g, table in enumerate(tables):
            for b in reversed(table[keep:]):
                if b != self.null_block:
                    self._release(b)
                    dropped += 1
            del table[keep:]
            self._skipped[request_id][g] = min(self._skipped[request_id][g], keep)
        self._num_cached[request_id] = min(self._num_cached.get(request_id, 0), keep)
        self._tokens[request_id] = min(self._tokens.get(request_id, 0), num_tokens)
        return dropped

    def free(self, request_id: str) -> int:
        """Releases the request's blocks, each table last first; returns how many it held. A block
        still held by another request stays; a cached one becomes evictable; any other one free.
        Freeing twice is a no-op."""
        tables = self.group_tables.pop(request_id, None)
        self.tables.pop(request_id, None)
        self._skipped.pop(request_id, None)
        self._tokens.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        freed = 0
        for table in tables or ():
            for b in reversed(table):
                if b != self.null_block:
                    self._release(b)
                    freed += 1
        return freed

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
        used = self.num_usable_blocks - free
        bs = self.block_size
        written = sum(max(0, min(t, len(table) * bs) - skipped * bs)
                      for r, t in self._tokens.items()
                      for table, skipped in zip(self.group_tables[r], self._skipped[r]))
        return BlockUsage(
            total_blocks=self.num_usable_blocks,
            used_blocks=used,
            free_blocks=free,
            tokens_stored=written - self._shared_refs * bs,  # a shared block is full
            allocated_slots=used * bs,
            cached_free_blocks=len(self._evictable),
        )

    def held_blocks(self, request_id: str) -> list[int]:
        """The request's blocks of every group, in table order (null entries left out)."""
        return [b for t in self.group_tables.get(request_id, ()) for b in t if b != self.null_block]

    def block_map(self) -> BlockMap:
        """A copy of the tables (every group's held blocks per request): O(held blocks), a few
        microseconds for a thousand."""
        return BlockMap(self.num_blocks, tuple((rid, tuple(self.held_blocks(rid))) for rid in self.group_tables),
                        cached=tuple(self._evictable))

    def check_invariants(self) -> None:
        """Reference counts match the tables; used + evictable + free = usable; no block in two
        places; windowed tables hold null entries only before their blocks; the cache map is
        one-to-one and only names cached blocks. Cheap enough for tests, not for the hot path."""
        refs = [0] * self.num_blocks
        for rid, tables in self.group_tables.items():
            assert self.tables[rid] is tables[0], "group 0's table is not the request's table"
            held_here = self.held_blocks(rid)
            assert len(held_here) == len(set(held_here)), "a block twice in one request's tables"
            for table, skipped in zip(tables, self._skipped[rid]):
                assert all(b == self.null_block for b in table[:skipped]), "a skipped entry holds a block"
                assert self.null_block not in table[skipped:], "a null entry after a held block"
            for b in held_here:
                refs[b] += 1
        assert refs == self.ref_count, "reference counts do not match the tables"
        assert set(self.tables) == set(self.group_tables), "tables and group tables name different requests"
        held = {b for b in range(self.num_blocks) if refs[b]}
        free, evictable = list(self._free), list(self._evictable)
        assert len(set(free)) == len(free), "a block is free twice"
        assert not held & set(free), "a held block is also free"
        assert not held & set(evictable), "a held block is also evictable"
        assert not set(free) & set(evictable), "a block is both free and evictable"
        if self.null_block is not None:
            assert self.null_block not in held | set(free) | set(evictable), "the null block was handed out"
        assert len(held) + len(evictable) + len(free) == self.num_usable_blocks, "blocks leaked"
        assert all(b in self._block_hash for b in evictable), "an evictable block holds no cached prefix"
        assert not any(b in self._block_hash for b in free), "a plain free block is still registered"
        assert {b: key for key, b in self._cached.items()} == self._block_hash, "cache map not one-to-one"
        assert self._shared_refs == sum(max(0, r - 1) for r in refs), "shared reference count drifted"
