"""The scheduler with prefix caching: admission shares the longest cached prefix, the last token is
always computed, hits are counted, and memory pressure neither thrashes nor loses a request.

Driven by test_scheduler's `Sim` (the engine's bookkeeping without a model) over a caching pool;
the issue's thrash reproduction also runs through the engine on the tiny model.
"""
from __future__ import annotations

import argparse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import MAX_MODEL_LEN, Sim

from iterserve.config import EngineConfig
from iterserve.core.block_pool import BlockPool
from iterserve.core.scheduler import Scheduler
from iterserve.engine_args import add_engine_args
from iterserve.request import Request, RequestStatus
from iterserve.sampling import SamplingParams


def caching_sim(num_blocks: int = 64, block_size: int = 4, caching: bool = True, **cfg) -> Sim:
    cfg.setdefault("max_num_batched_tokens", 2048)  # the budget these cases were written for
    config = EngineConfig(block_size=block_size if block_size in (8, 16, 32) else 8,
                          num_kv_blocks=num_blocks, **cfg)
    return Sim(Scheduler(config, BlockPool(num_blocks, block_size, enable_caching=caching), MAX_MODEL_LEN))


def req(rid: str, tokens: list[int], max_tokens: int = 2, arrival: float = 0.0) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                   eos_token_ids=(2,), arrival_time=arrival)


PROMPT = list(range(100, 110))  # 2 full blocks of 4 + 2 tokens


def run_until_admitted(sim: Sim, r: Request):
    while True:
        out, _ = sim.run_step()
        for x in out.scheduled:
            if x.request is r and (r.request_id, r.num_cached_tokens) in out.admitted:
                return out, x
        assert sim.step < 100


def test_admission_starts_after_the_cached_prefix_and_counts_hits() -> None:
    sim = caching_sim()
    a = req("a", PROMPT)
    sim.add(a)
    sim.run_all()
    assert sim.sched.prefix_cache_queries == 10 and sim.sched.prefix_cache_hits == 0
    b = req("b", PROMPT[:8] + [7, 7, 7], arrival=1.0)
    sim.add(b)
    out, x = run_until_admitted(sim, b)
    assert out.admitted == [("b", 8)] and x.num_tokens == 3, "only the tokens after the cached prefix"
    assert sim.sched.prefix_cache_queries == 10 + 11 and sim.sched.prefix_cache_hits == 8
    sim.run_all()
    assert b.num_output_tokens == 2


def test_the_last_prompt_token_is_always_computed() -> None:
    sim = caching_sim()
    sim.add(req("a", PROMPT))
    sim.run_all()
    c = req("c", PROMPT[:8], arrival=1.0)  # exactly the 2 cached blocks: the last one is computed again
    sim.add(c)
    out, x = run_until_admitted(sim, c)
    assert out.admitted == [("c", 4)] and x.num_tokens == 4


def test_a_running_request_shares_its_computed_blocks() -> None:
    sim = caching_sim()
    a = req("a", PROMPT, max_tokens=20)
    sim.add(a)
    sim.run_step()  # a's prompt computed; its full blocks are registered at the next schedule
    b = req("b", PROMPT + [1, 2, 3], arrival=1.0)
    sim.add(b)
    out, _ = run_until_admitted(sim, b)
    assert out.admitted == [("b", 8)]
    pool = sim.sched.pool
    assert pool.tables["a"][:2] == pool.tables["b"][:2]
    assert all(pool.ref_count[blk] == 2 for blk in pool.tables["a"][:2])
    sim.run_all()


def test_no_caching_means_no_hits() -> None:
    config = EngineConfig(block_size=8, num_kv_blocks=64, max_num_batched_tokens=2048)
    sim = Sim(Scheduler(config, BlockPool(64, 4), MAX_MODEL_LEN))
    sim.add(req("a", PROMPT))
    sim.run_all()
    sim.add(req("b", PROMPT, arrival=1.0))
    sim.run_all()
    assert sim.sched.prefix_cache_hits == 0 and sim.sched.prefix_cache_queries == 0


# ---- no preemption thrash ---------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
def test_thrash_reproduction_preempts_at_most_a_few_times(caching: bool) -> None:
    """Without the two rules (shrink the chunk; re-admit only with all its blocks) the long prompt
    was preempted 27 times here without caching (the cache hid most of it: each re-admission
    found its earlier chunks)."""
    sim = caching_sim(num_blocks=160, block_size=16, caching=caching, max_num_batched_tokens=512)
    streams = [req(f"s{i}", [10 + i, 11, 12, 13], max_tokens=256, arrival=i * 0.01) for i in range(8)]
    sim.add(*streams)
    while min(s.num_output_tokens for s in streams) < 200:
        sim.run_step()
    long = req("long", [20 + i % 300 for i in range(1500)], max_tokens=16, arrival=10.0)
    sim.add(long)
    steps_before = sim.step
    sim.run_all()
    assert all(s.status is RequestStatus.FINISHED_LENGTH for s in streams + [long])
    assert long.num_output_tokens == 16
    preemptions = sim.sched.num_preemptions_total
    assert preemptions <= 3, f"{preemptions} preemptions in {sim.step - steps_before} steps"
    # a re-admitted request held all the blocks it needed from its first step back
    for out in sim.history:
        for x in out.scheduled:
            r = x.request
            if (r.request_id, r.num_cached_tokens) in out.admitted and r.num_preemptions:
                assert r.num_output_tokens >= 1
    assert sim.sched.num_recomputed_tokens <= preemptions * 1500


def test_a_prefill_chunk_shrinks_to_the_free_blocks_instead_of_preempting() -> None:
    sim = caching_sim(num_blocks=10, block_size=8, max_num_batched_tokens=64)
    old = req("old", list(range(1, 9)), max_tokens=30)
    sim.add(old)
    sim.run_step()
    new = req("new", list(range(200, 264)), max_tokens=2, arrival=1.0)  # 64 tokens: 8 blocks
    sim.add(new)
    out, x = run_until_admitted(sim, new)
    assert x.num_tokens < 64 or not out.preempted
    sizes = []
    while new.num_output_tokens == 0 and new.status is RequestStatus.RUNNING:
        out, _ = sim.run_step()
        sizes += [y.num_tokens for y in out.scheduled if y.request is new]
        assert old not in out.preempted, "an older decode is never preempted for a newer prefill"
    sim.run_all()
    assert old.num_preemptions == 0


# ---- random workloads with shared prefixes ------------------------------------------------------------

BASES = [list(range(300, 340)), list(range(300, 316)) + list(range(500, 524)), [9] * 40]
workloads = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40), st.lists(st.integers(3, 6), max_size=8),
                               st.integers(1, 30)), min_size=1, max_size=10)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads, max_num_seqs=st.integers(1, 6), budget=st.integers(1, 200),
       block_size=st.sampled_from([1, 4, 8, 16]), spare_blocks=st.integers(0, 12), late=st.integers(0, 10))
def test_shared_prefixes_limits_hold_and_everything_finishes(reqs, max_num_seqs, budget, block_size,
                                                              spare_blocks, late) -> None:
    prompts = [BASES[b][:cut] + tail for b, cut, tail, _ in reqs]
    biggest = max(-(-(len(p) + m) // block_size) for p, (_, _, _, m) in zip(prompts, reqs))
    sim = caching_sim(num_blocks=biggest + spare_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=budget)
    requests = [req(f"r{i}", p, max_tokens=m, arrival=i * 0.1) for i, (p, (_, _, _, m)) in enumerate(zip(prompts, reqs))]
    half = len(requests) // 2
    sim.add(*requests[:half])
    for _ in range(late):
        if sim.sched.has_unfinished():
            sim.run_step()
    sim.add(*requests[half:])
    sim.run_all()
    for r in requests:
        assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.params.max_tokens
    pool = sim.sched.pool
    assert pool.num_free == pool.num_blocks and not pool.tables
    assert sim.sched.prefix_cache_hits <= sim.sched.prefix_cache_queries


# ---- through the engine on the tiny model -------------------------------------------------------------

def test_engine_thrash_reproduction(make_engine) -> None:
    """Caching off: the case where the thrash was worst (see the Sim test)."""
    eng = make_engine(num_kv_blocks=160, block_size=16, max_num_batched_tokens=512, log_scheduler=True,
                      enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    for i in range(8):
        eng.add_request(prompt_token_ids=[100 + i, 101, 102, 103], params=sp, request_id=f"s{i}")
    while min(r.num_output_tokens for r in eng.requests.values()) < 200:
        eng.step()
    eng.add_request(prompt_token_ids=[500 + i % 700 for i in range(1500)], request_id="long",
                    params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.num_output_tokens
    assert done == {**{f"s{i}": 256 for i in range(8)}, "long": 8}
    preempted = [rid for r in eng.records for rid in r.preempted]
    assert len(preempted) <= 3, preempted
    assert eng.scheduler.num_preemptions_total == len(preempted)
    eng.pool.check_invariants()
    assert ("long", 0) in [a for r in eng.records for a in r.admitted]
    line = next(r.log_line() for r in eng.records if r.admitted)
    assert "admitted s0 cached 0 tok" in line


# ---- the switch ---------------------------------------------------------------------------------------

def test_prefix_caching_default_and_static_refusal() -> None:
    assert EngineConfig().prefix_caching and not EngineConfig(enable_prefix_caching=False).prefix_caching
    assert not EngineConfig(batching="static").prefix_caching
    with pytest.raises(ValueError, match="static batching keeps contiguous, unshared KV"):
        EngineConfig(batching="static", enable_prefix_caching=True)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).enable_prefix_caching is None
    assert p.parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert "unshared" in p.format_help()


def test_engine_pool_follows_the_switch(make_engine) -> None:
    assert make_engine().pool.enable_caching
    assert not make_engine(enable_prefix_caching=False).pool.enable_caching
    assert not make_engine(batching="static").pool.enable_caching
