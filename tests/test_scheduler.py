"""Continuous batching scheduler: limits, chunked prefill, release at completion, order, preemption.

Most tests drive `Scheduler` directly with requests that no model computes: `Sim` plays the
engine's part (computed tokens catch up by what was scheduled; a request that caught up gets one
new token; stop checks; finished requests go back to the scheduler). A few run the same checks
through the real engine on the tiny model, reading its StepRecords.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.config import EngineConfig
from iterserve.core.block_pool import BlockPool
from iterserve.core.scheduler import Scheduler, SchedulerOutput
from iterserve.request import Request, RequestStatus
from iterserve.sampling import SamplingParams

MAX_MODEL_LEN = 4096


def fake_request(rid: str, prompt_len: int, max_tokens: int, arrival: float, priority: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, [5 + i % 100 for i in range(prompt_len)], params, eos_token_ids=(2,),
                   priority=priority, arrival_time=arrival)


@dataclass
class Sim:
    """The engine's bookkeeping around Scheduler.schedule(), with the invariants checked each step."""

    sched: Scheduler
    step: int = 0
    finished_at: dict[str, int] = field(default_factory=dict)
    first_step: dict[str, int] = field(default_factory=dict)
    history: list[SchedulerOutput] = field(default_factory=list)

    @classmethod
    def make(cls, num_blocks: int = 64, block_size: int = 16, **cfg) -> "Sim":
        cfg.setdefault("max_num_batched_tokens", 2048)  # the budget these cases were written for
        config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **cfg)
        return cls(Scheduler(config, BlockPool(num_blocks, block_size), MAX_MODEL_LEN))

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.sched.add_request(r)

    def run_step(self) -> tuple[SchedulerOutput, list[tuple[str, int]]]:
        s, cfg, pool = self.sched, self.sched.config, self.sched.pool
        self.step += 1
        out = s.schedule(now=float(self.step))
        self.history.append(out)
        # limits
        assert len(s.running) <= cfg.max_num_seqs
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert out.num_tokens <= cfg.max_num_batched_tokens
        ids = [x.request.request_id for x in out.scheduled]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        pool.check_invariants()
        assert pool.usage().used_blocks <= pool.num_blocks
        for p in out.preempted:
            assert p.request_id not in pool.tables and p.num_computed_tokens == 0
            assert p.status is RequestStatus.PREEMPTED and p in list(s.waiting)
            assert p.request_id not in ids
        # the engine's part
        finished: list[tuple[str, int]] = []
        for x in out.scheduled:
            req, n = x.request, x.num_tokens
            assert n >= 1 and req in s.running
            assert len(pool.tables[req.request_id]) * pool.block_size >= req.num_computed_tokens + n
            self.first_step.setdefault(req.request_id, self.step)
            req.num_computed_tokens += n
            assert req.num_computed_tokens <= req.num_tokens
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            req.append_token(7, float(self.step))
            status = req.check_stop_token(MAX_MODEL_LEN)
            if status is not None:
                req.status = status
                for r, freed in s.finish(req):
                    finished.append((r.request_id, freed))
                    self.finished_at[r.request_id] = self.step
                    assert r.request_id not in pool.tables, "a finished request still holds blocks"
        pool.check_invariants()
        return out, finished

    def run_all(self, max_steps: int = 5000) -> None:
        while self.sched.has_unfinished():
            self.run_step()
            assert self.step < max_steps, "scheduler stopped making progress"


# ---- limits under random workloads ----------------------------------------------------------------
workloads = st.lists(st.tuples(st.integers(1, 200), st.integers(1, 40), st.integers(0, 3)),
                     min_size=1, max_size=14)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads, max_num_seqs=st.integers(1, 6), budget=st.integers(1, 300),
       block_size=st.sampled_from([1, 8, 16, 32]), spare_blocks=st.integers(0, 20),
       policy=st.sampled_from(["fcfs", "priority"]), late=st.integers(0, 10))
def test_limits_hold_and_everything_finishes(reqs, max_num_seqs, budget, block_size, spare_blocks,
                                             policy, late):
    """Never more than max_num_seqs running, the token budget scheduled, or the blocks that exist;
    every request ends with all its tokens even when the cache forces preemptions."""
    biggest = max(-(-(p + m) // block_size) for p, m, _ in reqs)
    sim = Sim.make(num_blocks=biggest + spare_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=budget, scheduling_policy=policy)
    requests = [fake_request(f"r{i}", p, m, arrival=i * 0.1, priority=prio)
                for i, (p, m, prio) in enumerate(reqs)]
    half = len(requests) // 2
    sim.add(*requests[:half])
    for _ in range(late):  # the rest arrive while the first ones run
        if sim.sched.has_unfinished():
            sim.run_step()
    sim.add(*requests[half:])
    sim.run_all()
    for r in requests:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == r.params.max_tokens
    assert sim.sched.pool.num_free == sim.sched.pool.num_blocks


# ---- chunked prefill ----------------------------------------------------------------------------------
def test_chunked_prefill_splits_long_prompt_and_decodes_still_run():
    sim = Sim.make(num_blocks=64, block_size=16, max_num_batched_tokens=32, max_num_seqs=4)
    short = fake_request("short", 8, 20, arrival=0.0)
    sim.add(short)
    sim.run_step()  # short's prefill
    long = fake_request("long", 100, 4, arrival=1.0)
    sim.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        out, _ = sim.run_step()
        sizes = {x.request.request_id: x.num_tokens for x in out.scheduled}
        assert sizes.get("short") == 1, "the decode must run in every step of the long prefill"
        chunks.append(sizes["long"])
    assert chunks == [31, 31, 31, 7], "a prompt of 100 split over the budget the decode leaves"
    assert sum(chunks) == 100


# ---- release at completion ------------------------------------------------------------------------------
def test_finish_frees_blocks_in_same_step_and_waiting_runs_next_step():
    # room for one request at a time: a waiting request is blocked by KV blocks, not by max_num_seqs
    sim = Sim.make(num_blocks=3, block_size=8, max_num_seqs=8)
    a, b = fake_request("a", 10, 3, 0.0), fake_request("b", 12, 3, 0.1)
    sim.add(a, b)
    steps_with_b = []
    while sim.sched.has_unfinished():
        out, finished = sim.run_step()
        if any(x.request is b for x in out.scheduled):
            steps_with_b.append(sim.step)
        if ("a", 2) in finished:
            assert sim.sched.pool.num_free == 3, "a's blocks must be free in the step it finished"
            k = sim.step
    assert sim.finished_at["a"] == k == 3
    assert steps_with_b[0] == k + 1, "the waiting request runs in the very next step"


# ---- order ------------------------------------------------------------------------------------------------
def test_fcfs_admits_in_arrival_order():
    sim = Sim.make(max_num_seqs=1)
    arrivals = [0.5, 0.1, 0.9, 0.3, 0.7]
    sim.add(*[fake_request(f"r{i}", 4, 2, arrival=t, priority=-i) for i, t in enumerate(arrivals)])
    sim.run_all()
    order = sorted(sim.first_step, key=sim.first_step.get)
    assert order == ["r1", "r3", "r0", "r4", "r2"], "fcfs follows arrival time and ignores priority"


def test_priority_lower_value_first_arrival_breaks_ties():
    sim = Sim.make(max_num_seqs=1, scheduling_policy="priority")
    spec = {"a": (2, 0.0), "b": (0, 0.3), "c": (1, 0.1), "d": (0, 0.2), "e": (1, 0.05)}
    sim.add(*[fake_request(rid, 4, 2, arrival=t, priority=p) for rid, (p, t) in spec.items()])
    sim.run_all()
    order = sorted(sim.first_step, key=sim.first_step.get)
    assert order == ["d", "b", "e", "c", "a"]


def test_priority_request_arriving_later_jumps_the_queue():
    sim = Sim.make(max_num_seqs=1, scheduling_policy="priority")
    sim.add(fake_request("low1", 4, 3, 0.0, priority=5), fake_request("low2", 4, 3, 0.1, priority=5))
    sim.run_step()  # low1 runs
    sim.add(fake_request("urgent", 4, 3, 0.2, priority=0))
    sim.run_all()
    order = sorted(sim.first_step, key=sim.first_step.get)
    assert order == ["low1", "urgent", "low2"]


# ---- preemption ----------------------------------------------------------------------------------------------
def _preemption_case(policy: str) -> tuple[Sim, list[SchedulerOutput]]:
    """Four requests of one full block each fill a 4-block pool; the next decode needs new blocks."""
    sim = Sim.make(num_blocks=4, block_size=8, max_num_seqs=4, scheduling_policy=policy)
    spec = {"H": (0, 10.0), "L1": (2, 1.0), "L2": (2, 2.0), "M": (1, 3.0)}
    sim.add(*[fake_request(rid, 8, 6, arrival=t, priority=p) for rid, (p, t) in spec.items()])
    out1, _ = sim.run_step()
    assert len(out1.scheduled) == 4 and sim.sched.pool.num_free == 0
    out2, _ = sim.run_step()
    return sim, [out1, out2]


def test_preemption_victim_is_lowest_priority_then_newest():
    sim, (out1, out2) = _preemption_case("priority")
    assert [x.request.request_id for x in out1.scheduled] == ["H", "M", "L1", "L2"]
    # H needs a block: the victim is the lowest priority (2), newest of those (L2); then M needs one: L1
    assert [r.request_id for r in out2.preempted] == ["L2", "L1"]
    assert [x.request.request_id for x in out2.scheduled] == ["H", "M"]
    sim.run_all()


def test_preemption_victim_fcfs_is_newest():
    sim, (out1, out2) = _preemption_case("fcfs")
    assert [x.request.request_id for x in out1.scheduled] == ["L1", "L2", "M", "H"]
    assert [r.request_id for r in out2.preempted] == ["H", "M"]
    sim.run_all()


def test_preempted_request_keeps_tokens_and_resumes():
    sim, (_, out2) = _preemption_case("fcfs")
    victim = out2.preempted[0]
    assert victim.num_output_tokens == 1 and victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1
    # when it comes back it recomputes prompt + the token it already had, then continues
    while not any(x.request is victim for x in sim.history[-1].scheduled):
        sim.run_step()
    resumed = next(x for x in sim.history[-1].scheduled if x.request is victim)
    assert resumed.num_tokens == victim.num_prompt_tokens + 1
    sim.run_all()
    assert victim.num_output_tokens == 6


def test_no_admission_in_a_step_that_preempted():
    sim, (_, out2) = _preemption_case("fcfs")
    assert out2.preempted
    assert all(x.request.status is RequestStatus.RUNNING for x in out2.scheduled)
    assert len(sim.sched.waiting) == 2


# ---- abort ------------------------------------------------------------------------------------------------------
def test_abort_running_and_waiting():
    sim = Sim.make(num_blocks=8, block_size=8, max_num_seqs=1)
    a, b = fake_request("a", 12, 10, 0.0), fake_request("b", 12, 10, 0.1)
    sim.add(a, b)
    sim.run_step()
    assert sim.sched.pool.num_free == 6
    assert sim.sched.abort_request("a") == [(a, 2)]
    assert sim.sched.pool.num_free == 8 and "a" not in sim.sched.pool.tables
    assert sim.sched.abort_request("b") == [(b, 0)]
    assert sim.sched.abort_request("nope") is None
    assert not sim.sched.has_unfinished()


# ---- the same limits through the engine -----------------------------------------------------------------------
def test_engine_step_records_respect_limits(make_engine):
    eng = make_engine(max_num_seqs=3, max_num_batched_tokens=24, block_size=8, num_kv_blocks=10)
    lens = [(5, 12), (30, 6), (17, 9), (3, 20), (40, 4), (11, 11)]
    for i, (p, m) in enumerate(lens):
        eng.add_request(prompt_token_ids=[10 + (7 * i + j) % 500 for j in range(p)],
                        params=SamplingParams(max_tokens=m, temperature=0, ignore_eos=True),
                        request_id=f"e{i}")
    done = {}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.num_output_tokens
        rec = eng.records[-1]
        assert rec.batch_size <= 3 and rec.num_running <= 3
        assert rec.prefill_tokens + rec.decode_tokens <= 24
        assert rec.kv_used_blocks <= rec.kv_total_blocks == 10
        eng.pool.check_invariants()
        steps += 1
        assert steps < 500
    assert done == {f"e{i}": m for i, (_, m) in enumerate(lens)}
    assert any(r.prefill_tokens and r.decode_tokens for r in eng.records), "prefill chunks beside decodes"
    assert len({r.batch_size for r in eng.records}) > 1, "batch size changes step to step"
    assert eng.pool.num_free == 10


def test_engine_finish_at_step_k_frees_and_next_runs_at_k_plus_1(make_engine):
    eng = make_engine(block_size=8, num_kv_blocks=3, max_num_seqs=8)
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    eng.add_request(prompt_token_ids=list(range(100, 110)), params=sp, request_id="a")
    eng.add_request(prompt_token_ids=list(range(200, 212)), params=sp, request_id="b")
    while eng.has_unfinished_requests():
        eng.step()
    recs = list(eng.records)
    k = next(i for i, r in enumerate(recs) if r.finished)
    assert recs[k].finished == [("a", 2)]
    assert recs[k].kv_used_blocks == 0, "a's blocks are free in the step it finished"
    assert recs[k].num_waiting == 1
    assert recs[k + 1].prefill_tokens == 12 and recs[k + 1].num_running == 1, "b runs at step k+1"
    assert "finished a freed 2 blocks" in recs[k].log_line()
    assert [r.step for r in recs] == list(range(1, len(recs) + 1))
