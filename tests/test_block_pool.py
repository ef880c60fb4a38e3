"""BlockPool: never leaks, never double-frees, and reports usage exactly.

A hypothesis state machine drives random sequences of allocate (with growing token counts, as a
request's sequence grows step by step), allocate_contiguous, note_tokens, free and abort (a free
in the middle of growth) against a plain Python model of what each request should hold, for every
supported block size.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from iterserve.core.block_pool import BlockPool

BLOCK_SIZES = [1, 8, 16, 32, 64, 128]
REQ_IDS = st.sampled_from([f"r{i}" for i in range(6)])


def make_machine(block_size: int, num_blocks: int):
    class PoolMachine(RuleBasedStateMachine):
        """Model: request id -> tokens it has written; blocks it holds follow from that."""

        def __init__(self) -> None:
            super().__init__()
            self.pool = BlockPool(num_blocks, block_size)
            self.tokens: dict[str, int] = {}  # tokens stored per request
            self.blocks: dict[str, int] = {}  # blocks held per request
            self.contiguous_tokens: dict[str, int] = {}  # tokens noted in contiguous reservations

        def _blocks_for(self, n: int) -> int:
            return -(-n // block_size)

        @property
        def used(self) -> int:
            return sum(self.blocks.values())

        @rule(rid=REQ_IDS, grow=st.integers(0, 3 * block_size + 5))
        def allocate(self, rid: str, grow: int) -> None:
            """A request's sequence grows by `grow` tokens (0: a no-op request for its table)."""
            if rid in self.blocks and rid not in self.tokens:
                return  # contiguous reservation: the static scheduler never grows it
            target = self.tokens.get(rid, 0) + grow
            need = max(0, self._blocks_for(target) - self.blocks.get(rid, 0))
            before = dict(self.pool.tables)
            free_before = self.pool.num_free
            assert self.pool.blocks_needed(rid, target) == need
            assert self.pool.can_allocate(rid, target) == (need <= free_before)
            ok = self.pool.allocate(rid, target)
            assert ok == (need <= free_before)
            if ok:
                self.tokens[rid] = target
                self.blocks[rid] = self.blocks.get(rid, 0) + need
                assert len(self.pool.tables[rid]) == self.blocks[rid]
                assert self.pool.num_free == free_before - need
            else:  # refusal changes nothing
                assert self.pool.num_free == free_before
                assert {k: list(v) for k, v in self.pool.tables.items()} == before

        @rule(rid=REQ_IDS, n=st.integers(1, 4 * block_size))
        def allocate_contiguous(self, rid: str, n: int) -> None:
            if rid in self.pool.tables:
                with pytest.raises(ValueError, match="already holds"):
                    self.pool.allocate_contiguous(rid, n)
                return
            free = sorted(self.pool._free)
            need = self._blocks_for(n)
            has_run = any(free[i + need - 1] - free[i] == need - 1 for i in range(len(free) - need + 1))
            ok = self.pool.allocate_contiguous(rid, n)
            assert ok == has_run
            if ok:
                table = self.pool.tables[rid]
                assert table == list(range(table[0], table[0] + need)), "reservation is not contiguous"
                self.blocks[rid] = need
                self.contiguous_tokens[rid] = 0

        @precondition(lambda self: any(r not in self.tokens for r in self.blocks))
        @rule(data=st.data())
        def fill_contiguous(self, data) -> None:
            """The static path reports how many reserved slots hold a token."""
            rid = data.draw(st.sampled_from(sorted(r for r in self.blocks if r not in self.tokens)))
            n = data.draw(st.integers(0, self.blocks[rid] * block_size))
            self.pool.note_tokens(rid, n)
            self.contiguous_tokens[rid] = n

        @rule(rid=REQ_IDS)
        def free(self, rid: str) -> None:
            """Finish or abort: everything the request holds goes back, and a second free is a no-op."""
            expected = self.blocks.pop(rid, 0)
            self.tokens.pop(rid, None)
            self.contiguous_tokens.pop(rid, None)
            free_before = self.pool.num_free
            assert self.pool.free(rid) == expected
            assert self.pool.num_free == free_before + expected
            assert rid not in self.pool.tables, "a freed request still holds blocks"
            assert self.pool.free(rid) == 0, "double free returned blocks"
            self.pool.check_invariants()

        @precondition(lambda self: bool(self.tokens))
        @rule(data=st.data())
        def abort_mid_growth(self, data) -> None:
            """Abort a request that is still growing: grow it once more, then free it."""
            rid = data.draw(st.sampled_from(sorted(self.tokens)))
            self.allocate(rid, data.draw(st.integers(1, block_size)))
            self.free(rid)

        @invariant()
        def pool_matches_model(self) -> None:
            pool = self.pool
            pool.check_invariants()
            u = pool.usage()
            assert u.used_blocks + u.free_blocks == u.total_blocks == num_blocks
            assert u.used_blocks == self.used
            for rid, n in self.blocks.items():
                assert len(pool.tables[rid]) == n
            stored = sum(self.tokens.values()) + sum(self.contiguous_tokens.values())
            assert u.tokens_stored == stored
            assert u.allocated_slots == self.used * block_size
            if self.used:
                assert u.internal_fragmentation == pytest.approx(1 - stored / (self.used * block_size))
                assert u.usage == pytest.approx(self.used / num_blocks)
            else:
                assert u.internal_fragmentation == 0.0 and u.usage == 0.0
            # paged allocation wastes less than one block per request
            for rid, n in self.tokens.items():
                assert len(pool.tables[rid]) * block_size - n < block_size or n == 0

    return PoolMachine


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_block_pool_state_machine(block_size: int) -> None:
    machine = make_machine(block_size, num_blocks=12)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=40, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


def test_usage_example() -> None:
    """A worked example: 2 requests, block size 16, 20 and 33 tokens -> 2 + 3 blocks, 80 slots."""
    pool = BlockPool(10, 16)
    assert pool.allocate("a", 20) and pool.allocate("b", 33)
    u = pool.usage()
    assert (u.used_blocks, u.free_blocks, u.tokens_stored, u.allocated_slots) == (5, 5, 53, 80)
    assert u.internal_fragmentation == pytest.approx(27 / 80)
    assert u.usage == pytest.approx(0.5)
    assert pool.free("a") == 2 and pool.free("a") == 0
    assert pool.usage().tokens_stored == 33


def test_allocate_refuses_without_partial_change() -> None:
    pool = BlockPool(4, 8)
    assert pool.allocate("a", 24)  # 3 blocks
    assert not pool.allocate("b", 9)  # needs 2, 1 free
    assert "b" not in pool.tables or pool.tables["b"] == []
    assert pool.num_free == 1
    pool.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    """The invariant checker itself must be able to fail."""
    pool = BlockPool(4, 8)
    pool.allocate("a", 8)
    pool._free.append(pool.tables["a"][0])  # a held block also free
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool = BlockPool(4, 8)
    pool.allocate("a", 8)
    pool._free.popleft()  # a block vanished
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_invariants()


def test_bad_sizes_rejected() -> None:
    with pytest.raises(ValueError):
        BlockPool(0, 16)
    with pytest.raises(ValueError):
        BlockPool(4, 0)
