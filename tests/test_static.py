"""Static batching: fill-or-timeout, no joins, contiguous KV for the longest possible sequence,
padding work until the slowest member ends, and the whole batch released at once.

Scheduler-level tests drive `schedule(now)` with explicit times; engine-level tests run the tiny
model and check what a client would see (outputs, timings, step records).
"""
from __future__ import annotations

import time

import pytest

from iterserve.config import EngineConfig
from iterserve.core.block_pool import BlockPool
from iterserve.core.static import StaticScheduler
from iterserve.request import Request, RequestStatus
from iterserve.sampling import SamplingParams

T0 = 1000.0  # a fixed clock for scheduler-level tests


def _sched(max_batch_size: int = 4, timeout_ms: float = 100.0, num_blocks: int = 256,
           block_size: int = 16) -> StaticScheduler:
    cfg = EngineConfig(batching="static", max_batch_size=max_batch_size, batch_timeout_ms=timeout_ms,
                       block_size=block_size)
    return StaticScheduler(cfg, BlockPool(num_blocks, block_size), max_model_len=2048)


def _req(i: int, prompt_len: int = 10, max_tokens: int = 5, arrival: float = T0) -> Request:
    return Request(f"r{i}", list(range(3, 3 + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                   arrival_time=arrival)


def _ids(out) -> list[str]:
    return [s.request.request_id for s in out.scheduled]


def _run_batch_to_end(s: StaticScheduler, now: float) -> None:
    """Finishes every running member the way the engine would."""
    for r in list(s.running):
        r.status = RequestStatus.FINISHED_LENGTH
        s.finish(r)
    assert not s.running


# ---------------------------------------------------------------- forming a batch

def test_partial_batch_waits_for_the_timeout_then_starts():
    s = _sched(max_batch_size=4, timeout_ms=100)
    for i in range(3):
        s.add_request(_req(i, arrival=T0 + 0.01 * i))
    assert s.schedule(T0 + 0.050).is_empty
    assert s.schedule(T0 + 0.0999).is_empty  # the oldest has waited 99.9 ms
    assert s.next_deadline() == pytest.approx(T0 + 0.100)
    out = s.schedule(T0 + 0.100)
    assert _ids(out) == ["r0", "r1", "r2"]
    assert all(r.times.first_scheduled == T0 + 0.100 for r in s.running)
    assert s.next_deadline() is None  # a batch is running: nothing to wake up for


def test_full_batch_starts_at_once_and_the_rest_waits():
    s = _sched(max_batch_size=4, timeout_ms=10_000)
    for i in range(6):
        s.add_request(_req(i))
    out = s.schedule(T0)
    assert _ids(out) == ["r0", "r1", "r2", "r3"]
    assert s.num_waiting == 2


def test_no_request_joins_a_running_batch():
    s = _sched(max_batch_size=4, timeout_ms=100)
    s.add_request(_req(0))
    s.schedule(T0 + 0.2)  # partial batch of one starts at the timeout
    for i in range(1, 6):  # enough to fill a batch, long past any timeout
        s.add_request(_req(i, arrival=T0 + 0.3))
    for k in range(5):
        assert _ids(s.schedule(T0 + 10 + k)) == ["r0"]
    assert s.num_waiting == 5
    _run_batch_to_end(s, T0 + 20)
    assert _ids(s.schedule(T0 + 20)) == ["r1", "r2", "r3", "r4"]


# ---------------------------------------------------------------- KV reservation

def test_contiguous_reservation_for_the_longest_possible_sequence():
    s = _sched(max_batch_size=3, block_size=16)
    lens = [(10, 5), (40, 3), (7, 30)]  # longest possible: prompt 40 + max_tokens 30 = 70 tokens
    for i, (p, m) in enumerate(lens):
        s.add_request(_req(i, prompt_len=p, max_tokens=m))
    s.schedule(T0)
    tables = [s.pool.tables[f"r{i}"] for i in range(3)]
    for t in tables:
        assert len(t) == s.pool.blocks_for(70) == 5
        assert t == list(range(t[0], t[0] + len(t)))  # one contiguous run of block ids
    held = [b for t in tables for b in t]
    assert len(set(held)) == len(held)
    assert s.pool.num_free == s.pool.num_blocks - 15
    s.pool.check_invariants()


def test_batch_shrinks_to_what_the_pool_can_reserve():
    s = _sched(max_batch_size=4, num_blocks=10, block_size=16)  # 4 blocks each: only 2 fit
    for i in range(4):
        s.add_request(_req(i, prompt_len=40, max_tokens=20))
    assert _ids(s.schedule(T0)) == ["r0", "r1"]
    assert s.num_waiting == 2
    _run_batch_to_end(s, T0 + 1)
    assert s.pool.num_free == 10
    assert _ids(s.schedule(T0 + 1)) == ["r2", "r3"]


def test_kv_usage_counts_the_tokens_written_not_just_the_reservation():
    s = _sched(max_batch_size=2)
    s.add_request(_req(0, prompt_len=20, max_tokens=50))
    s.add_request(_req(1, prompt_len=5, max_tokens=50))
    s.schedule(T0)
    u = s.pool.usage()
    assert u.used_blocks == 2 * s.pool.blocks_for(70)
    assert u.tokens_stored == 25
    assert 0 < u.internal_fragmentation < 1


# ---------------------------------------------------------------- holding until the slowest ends

def test_finished_members_are_padded_and_released_together():
    s = _sched(max_batch_size=3)
    reqs = [_req(i) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    s.schedule(T0)
    reqs[1].status = RequestStatus.FINISHED_LENGTH
    assert s.finish(reqs[1]) == []  # held: nothing released yet
    out = s.schedule(T0 + 1)
    assert [(x.request.request_id, x.padding, x.num_tokens) for x in out.scheduled] == [
        ("r0", False, out.scheduled[0].num_tokens), ("r1", True, 1), ("r2", False, out.scheduled[2].num_tokens)]
    reqs[0].status = RequestStatus.FINISHED_LENGTH
    assert s.finish(reqs[0]) == []
    assert s.pool.num_free < s.pool.num_blocks  # still reserved while held
    reqs[2].status = RequestStatus.FINISHED_LENGTH
    released = s.finish(reqs[2])
    assert sorted(r.request_id for r, _ in released) == ["r0", "r1", "r2"]
    assert all(freed == s.pool.blocks_for(15) for _, freed in released)
    assert s.pool.num_free == s.pool.num_blocks and not s.running


def test_abort_of_a_member_is_held_like_a_finish():
    s = _sched(max_batch_size=2)
    a, b = _req(0), _req(1)
    s.add_request(a)
    s.add_request(b)
    s.schedule(T0)
    assert s.abort_request("r0") == []
    assert [x.padding for x in s.schedule(T0 + 1).scheduled] == [True, False]
    b.status = RequestStatus.FINISHED_LENGTH
    assert {r.request_id for r, _ in s.finish(b)} == {"r0", "r1"}


# ---------------------------------------------------------------- the engine, tiny model

def _add(engine, max_tokens_list, prompt_len=8, arrival=None):
    return [engine.add_request(prompt_token_ids=list(range(5 + i, 5 + i + prompt_len)),
                               params=SamplingParams(max_tokens=m, temperature=0, ignore_eos=True),
                               arrival_time=arrival)
            for i, m in enumerate(max_tokens_list)]


def _drain(engine) -> list:
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return steps


def test_engine_holds_every_member_until_the_slowest_finishes(make_engine):
    eng = make_engine(batching="static", max_batch_size=4, batch_timeout_ms=10_000)
    max_tokens = [3, 7, 12, 5]
    reqs = _add(eng, max_tokens)
    steps = _drain(eng)
    finished_at = {o.request_id: k for k, outs in enumerate(steps) for o in outs if o.finished}
    assert len(finished_at) == 4 and len(set(finished_at.values())) == 1  # all in one step
    assert len({r.times.finished for r in reqs}) == 1
    assert [r.num_output_tokens for r in reqs] == max_tokens
    # the short ones streamed their tokens before the batch ended, without the finish flag
    streamed = {rid: sum(len(o.new_token_ids) for outs in steps for o in outs if o.request_id == rid)
                for rid in finished_at}
    assert streamed == {r.request_id: m for r, m in zip(reqs, max_tokens)}
    recs = list(eng.records)
    assert len(recs) == max(max_tokens)
    assert all(rec.batch_size == 4 for rec in recs)
    # step s pads every member that finished before it: sum over members of (12 - m)
    assert [rec.num_padding for rec in recs] == [sum(m < s for m in max_tokens) for s in range(1, 13)]
    assert sum(rec.num_padding for rec in recs) == sum(max(max_tokens) - m for m in max_tokens)
    assert all(rec.kv_used_blocks == 4 * eng.pool.blocks_for(8 + 12) for rec in recs[:-1])
    assert recs[-1].kv_used_blocks == 0 and eng.pool.num_free == eng.pool.num_blocks
    assert recs[0].kv_tokens == 4 * 8 and recs[5].kv_tokens > recs[0].kv_tokens


def test_engine_never_admits_into_a_running_batch(make_engine):
    eng = make_engine(batching="static", max_batch_size=4, batch_timeout_ms=0)
    first = _add(eng, [6, 6])
    eng.step()  # a partial batch of two starts (timeout 0)
    late = [eng.add_request(prompt_token_ids=[7, 8, 9], request_id=f"late{i}",
                            params=SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
            for i in range(4)]
    _drain(eng)
    batch_end = max(r.times.finished for r in first)
    assert all(r.times.first_scheduled >= batch_end for r in late)
    assert [rec.batch_size for rec in eng.records] == [2] * 6 + [4] * 2


def test_engine_starts_a_partial_batch_only_after_the_timeout(make_engine):
    eng = make_engine(batching="static", max_batch_size=4, batch_timeout_ms=200)
    reqs = _add(eng, [2, 2])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.15:
        assert eng.step() == [] and eng.step_count == 0
        time.sleep(0.02)
    time.sleep(max(0.0, reqs[0].times.arrival + 0.2 - time.monotonic()) + 0.01)
    eng.step()
    assert eng.step_count == 1
    assert reqs[0].times.queue_time >= 0.2


def test_greedy_output_matches_continuous_batching(make_engine):
    prompts = [list(range(10 + 7 * i, 10 + 7 * i + n)) for i, n in enumerate([5, 17, 9, 30, 3, 12])]
    max_tokens = [4, 9, 15, 6, 11, 2]

    def run(**kw) -> list[list[int]]:
        eng = make_engine(**kw)
        reqs = [eng.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=m, temperature=0,
                                                                          ignore_eos=True))
                for p, m in zip(prompts, max_tokens)]
        _drain(eng)
        return [list(r.output_token_ids) for r in reqs]

    static = run(batching="static", max_batch_size=4, batch_timeout_ms=0)
    continuous = run(batching="continuous", max_num_seqs=16)
    assert static == continuous
    assert [len(o) for o in static] == max_tokens
