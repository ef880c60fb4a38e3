"""Prefix caching in the block pool: the hash chain, lookup, reference counts, eviction order,
reuse after free, and a Hypothesis state machine over requests that share blocks.

The state machine keeps its own model of what KV each block holds (the hash of the prefix whose
last block was computed into it) and checks every cache hit against it: a hit that named a block
holding other content would be wrong KV returned to a request.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from iterserve.core.block_hash import hash_block_chain, hash_block_tokens
from iterserve.core.block_pool import BlockPool

# ---- the hash ------------------------------------------------------------------------------------


def test_hash_chain_depends_on_the_whole_prefix() -> None:
    a = hash_block_chain([1, 2, 3, 4, 5, 6, 7], block_size=2)
    assert len(a) == 3  # the partial last block has no hash
    assert a[0] == hash_block_tokens(None, [1, 2])
    assert a[1] == hash_block_tokens(a[0], [3, 4])
    # same tokens in block 1, different block 0: different hash (its KV differs)
    b = hash_block_chain([9, 2, 3, 4], block_size=2)
    assert b[1] != a[1]
    # an extra key (e.g. an adapter) changes every block's hash
    assert hash_block_chain([1, 2], 2, extra_key="lora-1")[0] != a[0]
    # growing a chain from known hashes hashes only the new blocks, with the same result
    assert hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8], 2, parent_hashes=a) == hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8], 2)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in a)  # sha256


def test_hash_is_stable_across_processes_and_imports_no_torch() -> None:
    """A router in another process must compute the same hashes, without loading torch."""
    code = ("import sys; from iterserve.core.block_hash import hash_block_chain; "
            "print(hash_block_chain(list(range(40)), 16)[1].hex()); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123"}).stdout.split()
    assert out == [hash_block_chain(list(range(40)), 16)[1].hex(), "False"]


# ---- the pool ------------------------------------------------------------------------------------

BS = 4


def admit(pool: BlockPool, rid: str, tokens: list[int]) -> list[int]:
    """What the scheduler does: look up the cached prefix (always leaving the last token to
    compute), allocate, compute everything, register the full blocks. Returns the hit blocks (the
    pool's one group's)."""
    hashes = hash_block_chain(tokens, BS)
    hit = pool.find_cached_prefix(hashes[: (len(tokens) - 1) // BS])
    assert pool.allocate(rid, len(tokens), hit)
    pool.cache_blocks(rid, hashes, len(tokens))
    pool.check_invariants()
    return hit[0]


def test_lookup_shares_the_longest_cached_prefix_by_reference() -> None:
    pool = BlockPool(16, BS, enable_caching=True)
    a = list(range(10))  # 2 full blocks + 2 tokens
    assert admit(pool, "a", a) == []
    table_a = list(pool.tables["a"])
    # same first block, different second: shares only the first
    hit = admit(pool, "b", a[:4] + [99, 98, 97, 96, 95])
    assert hit == table_a[:1] and pool.ref_count[table_a[0]] == 2
    # same prompt: shares both full blocks; its partial third block is its own
    hit = admit(pool, "c", a)
    assert hit == table_a[:2] and pool.tables["c"][2] != table_a[2]
    assert pool.ref_count[table_a[0]] == 3 and pool.ref_count[table_a[1]] == 2
    # a prompt of exactly 2 full blocks reuses only one: its last token must be computed
    assert admit(pool, "d", a[:8]) == table_a[:1]
    # usage counts a shared block once
    u = pool.usage()
    assert u.used_blocks == 3 + 2 + 1 + 1
    assert u.tokens_stored == 10 + 5 + 2 + 4


def test_refcounts_and_release_keep_shared_blocks() -> None:
    pool = BlockPool(8, BS, enable_caching=True)
    admit(pool, "a", list(range(8)))
    admit(pool, "b", list(range(9)))
    shared = pool.tables["a"][0]
    assert pool.ref_count[shared] == 2
    pool.free("a")
    assert pool.ref_count[shared] == 1 and shared not in pool._evictable and shared not in pool._free
    pool.free("b")
    assert pool.ref_count[shared] == 0 and shared in pool._evictable
    pool.check_invariants()


def test_released_cached_blocks_are_reused_after_free() -> None:
    pool = BlockPool(8, BS, enable_caching=True)
    admit(pool, "a", list(range(13)))  # 3 full + 1 partial
    table = list(pool.tables["a"])
    assert pool.free("a") == 4
    assert pool.num_free == 8 and pool.usage().cached_free_blocks == 3  # the partial block is not cached
    hit = admit(pool, "b", list(range(13)) + [50, 51, 52])
    assert hit == table[:3]
    assert pool.usage().cached_free_blocks == 0


def test_eviction_only_when_no_free_block_is_left_least_recent_first_tail_first() -> None:
    pool = BlockPool(6, BS, enable_caching=True)
    admit(pool, "a", list(range(8)) + [0])  # blocks a0 a1 (cached) + partial
    admit(pool, "b", list(range(100, 108)) + [0])
    a, b = list(pool.tables["a"]), list(pool.tables["b"])
    pool.free("a")  # a's blocks released first: least recently used
    pool.free("b")
    # 2 plain free (the partial blocks) + 4 evictable: a new request of 2 blocks takes the plain ones
    assert pool.allocate("c", 8)
    assert set(pool.tables["c"]) == {a[2], b[2]}
    assert pool.num_cached_blocks == 4
    # the next block evicts a's tail block (released first, and a sequence's tail before its head)
    assert pool.allocate("c", 12)
    assert pool.tables["c"][-1] == a[1]
    assert pool.find_cached_prefix(hash_block_chain(list(range(8)), BS)) == [[a[0]]]
    assert pool.allocate("c", 16)
    assert pool.tables["c"][-1] == a[0]
    assert pool.find_cached_prefix(hash_block_chain(list(range(8)), BS)) == [[]]
    # b's prefix is still cached and reusable
    assert pool.find_cached_prefix(hash_block_chain(list(range(100, 108)), BS)) == [b[:2]]
    pool.check_invariants()


def test_allocation_counts_revived_cached_blocks_against_what_is_free() -> None:
    """Taking an evictable block by reference uses up a block that could have been new: the
    check must not count it twice, and a refusal changes nothing."""
    pool = BlockPool(3, BS, enable_caching=True)
    admit(pool, "a", list(range(9)))  # 2 cached + 1 partial; all 3 blocks
    pool.free("a")
    hashes = hash_block_chain(list(range(12)), BS)
    hit = pool.find_cached_prefix(hashes[:2])
    assert len(hit[0]) == 2
    assert pool.can_allocate("b", 12, hit)  # 2 shared + 1 new = 3
    assert not pool.can_allocate("b", 16, hit)  # would need 2 new, only 1 left
    assert not pool.allocate("b", 16, hit)
    assert "b" not in pool.tables and pool.usage().cached_free_blocks == 2
    pool.check_invariants()


def test_duplicate_computation_registers_one_block_and_frees_the_other() -> None:
    """Two requests that computed the same prefix at once: one block is registered, the other
    returns to the plain free list."""
    pool = BlockPool(8, BS, enable_caching=True)
    toks = list(range(5))
    hashes = hash_block_chain(toks, BS)
    assert pool.allocate("a", 5) and pool.allocate("b", 5)  # both admitted before either computed
    pool.cache_blocks("a", hashes, 5)
    pool.cache_blocks("b", hashes, 5)
    assert pool.find_cached_prefix(hashes) == [pool.tables["a"][:1]]
    b0 = pool.tables["b"][0]
    pool.free("b")
    assert b0 in pool._free
    pool.check_invariants()


def test_only_computed_full_blocks_are_registered() -> None:
    pool = BlockPool(8, BS, enable_caching=True)
    toks = list(range(12))
    hashes = hash_block_chain(toks, BS)
    assert pool.allocate("a", 12)
    pool.cache_blocks("a", hashes, 6)  # a prefill chunk of 6 tokens: only block 0 is complete
    assert pool.find_cached_prefix(hashes) == [pool.tables["a"][:1]]
    pool.cache_blocks("a", hashes, 12)
    assert pool.find_cached_prefix(hashes) == [pool.tables["a"]]


def test_caching_disabled_is_a_plain_free_list() -> None:
    pool = BlockPool(4, BS)
    admit(pool, "a", list(range(8)))
    pool.free("a")
    assert pool.num_cached_blocks == 0 and pool.usage().cached_free_blocks == 0
    assert pool.find_cached_prefix(hash_block_chain(list(range(8)), BS)) == [[]]
    assert pool.allocate_contiguous("s", 16)
    with pytest.raises(ValueError, match="unshared"):
        BlockPool(4, BS, enable_caching=True).allocate_contiguous("s", 4)


def test_reset_prefix_cache_frees_only_unheld_blocks() -> None:
    pool = BlockPool(8, BS, enable_caching=True)
    admit(pool, "a", list(range(9)))
    admit(pool, "b", list(range(100, 109)))
    pool.free("a")
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_blocks == 2  # b's, still held
    pool.check_invariants()


def test_check_invariants_catches_a_freed_referenced_block() -> None:
    pool = BlockPool(4, BS, enable_caching=True)
    admit(pool, "a", list(range(8)))
    pool._free.append(pool.tables["a"][0])
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool = BlockPool(4, BS, enable_caching=True)
    admit(pool, "a", list(range(8)))
    pool.ref_count[pool.tables["a"][0]] += 1
    with pytest.raises(AssertionError, match="reference counts"):
        pool.check_invariants()


# ---- the state machine -------------------------------------------------------------------------

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 40, 41, 42, 43], [7] * 12]
REQ_IDS = st.sampled_from([f"r{i}" for i in range(5)])


def make_shared_machine(block_size: int, num_blocks: int):
    class SharedPoolMachine(RuleBasedStateMachine):
        """Requests built from a few common prefixes, so that hits, sharing and eviction happen.
        Model: each request's tokens and computed count; what each block's KV holds."""

        def __init__(self) -> None:
            super().__init__()
            self.pool = BlockPool(num_blocks, block_size, enable_caching=True)
            self.tokens: dict[str, list[int]] = {}
            self.content: dict[int, bytes] = {}  # block -> hash of the prefix computed into it

        def _compute(self, rid: str) -> None:
            """The model computes every token of rid: its full blocks now hold their prefixes."""
            toks, table = self.tokens[rid], self.pool.tables[rid]
            hashes = hash_block_chain(toks, block_size)
            for i, h in enumerate(hashes):
                if self.pool.ref_count[table[i]] > 1:
                    assert self.content.get(table[i]) == h, "a shared block would be overwritten"
                self.content[table[i]] = h
            for i in range(len(hashes), len(table)):
                self.content.pop(table[i], None)  # partially written: holds no full prefix
            self.pool.cache_blocks(rid, hashes, len(toks))

        @rule(rid=REQ_IDS, prefix=st.sampled_from(range(len(PREFIXES))), cut=st.integers(1, 12),
              tail=st.lists(st.integers(0, 3), max_size=6))
        def admit(self, rid: str, prefix: int, cut: int, tail: list[int]) -> None:
            if rid in self.tokens:
                return
            toks = PREFIXES[prefix][:cut] + tail
            hashes = hash_block_chain(toks, block_size)
            hit_groups = self.pool.find_cached_prefix(hashes[: (len(toks) - 1) // block_size])
            hit = hit_groups[0]
            for i, b in enumerate(hit):
                assert self.content.get(b) == hashes[i], "a cache hit names a block holding other KV"
            held_elsewhere = {b for t in self.pool.tables.values() for b in t}
            free_before, refs_before = self.pool.num_free, list(self.pool.ref_count)
            revived = sum(1 for b in hit if self.pool.ref_count[b] == 0)
            need_new = -(-len(toks) // block_size) - len(hit)
            ok = self.pool.allocate(rid, len(toks), hit_groups)
            assert ok == (need_new <= free_before - revived)
            if not ok:
                assert rid not in self.pool.tables and self.pool.ref_count == refs_before
                return
            table = self.pool.tables[rid]
            assert table[: len(hit)] == hit
            for b in table[len(hit):]:
                assert b not in held_elsewhere, "a block handed out while another request holds it"
                assert self.pool.ref_count[b] == 1
            self.tokens[rid] = toks
            self._compute(rid)

        @precondition(lambda self: bool(self.tokens))
        @rule(data=st.data(), more=st.lists(st.integers(0, 3), min_size=1, max_size=2 * block_size + 1))
        def grow(self, data, more: list[int]) -> None:
            """Decode or a later chunk: the sequence grows; new blocks are private."""
            rid = data.draw(st.sampled_from(sorted(self.tokens)))
            held_elsewhere = {b for r, t in self.pool.tables.items() if r != rid for b in t}
            old = list(self.pool.tables[rid])
            toks = self.tokens[rid] + more
            if not self.pool.allocate(rid, len(toks)):
                assert self.pool.tables[rid] == old
                return
            for b in self.pool.tables[rid][len(old):]:
                assert b not in held_elsewhere and self.pool.ref_count[b] == 1
            self.tokens[rid] = toks
            self._compute(rid)

        @precondition(lambda self: bool(self.tokens))
        @rule(data=st.data())
        def free(self, data) -> None:
            rid = data.draw(st.sampled_from(sorted(self.tokens)))
            table = list(self.pool.tables[rid])
            still_held = {b for r, t in self.pool.tables.items() if r != rid for b in t}
            assert self.pool.free(rid) == len(table)
            del self.tokens[rid]
            for b in table:
                if b in still_held:
                    assert self.pool.ref_count[b] > 0, "a block freed while another request holds it"
            assert self.pool.free(rid) == 0

        @rule()
        def reset(self) -> None:
            self.pool.reset_prefix_cache()

        @invariant()
        def consistent(self) -> None:
            pool = self.pool
            pool.check_invariants()
            u = pool.usage()
            held = {b for t in pool.tables.values() for b in t}
            assert u.used_blocks == len(held)
            assert u.used_blocks + u.cached_free_blocks + len(pool._free) == num_blocks
            # a block in two tables is a registered, full, computed prefix block of both
            for r, t in pool.tables.items():
                hashes = hash_block_chain(self.tokens[r], block_size)
                for i, b in enumerate(t):
                    if pool.ref_count[b] > 1:
                        assert i < len(hashes) and pool._block_hash.get(b) == (0, hashes[i])  # (group, hash)
            # stored tokens count each block once
            distinct: dict[int, int] = {}
            for r, t in pool.tables.items():
                n = len(self.tokens[r])
                for i, b in enumerate(t):
                    distinct[b] = max(distinct.get(b, 0), min(block_size, n - i * block_size))
            assert u.tokens_stored == sum(distinct.values())

    return SharedPoolMachine


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_shared_block_pool_state_machine(block_size: int) -> None:
    run_state_machine_as_test(make_shared_machine(block_size, num_blocks=10), settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
