"""AsyncEngine in-process (no HTTP): commands between steps, aborts, failures, idle sleeping, drain."""
from __future__ import annotations

import asyncio
import time

import pytest

from iterserve.request import RequestRejected
from iterserve.sampling import SamplingParams
from iterserve.server.async_engine import AsyncEngine, BusyWindow

LONG = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_outputs_stream_in_order_and_abort_takes_one_step(make_engine):
    async def main():
        engine = AsyncEngine(make_engine(), warmup=False)
        engine.start()
        short = await engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
        outs = [o async for o in short]
        assert [len(o.new_token_ids) for o in outs] == [1] * 6 and outs[-1].finish_reason == "length"
        assert outs[-1].num_output_tokens == 6

        stream = await engine.add_request("long", [1, 2, 3], LONG)
        it = aiter(stream)
        for _ in range(3):
            await anext(it)
        at_abort = engine.state.step_count
        engine.abort("long")
        rest = [o async for o in it]
        assert rest[-1].finish_reason == "abort"
        await asyncio.sleep(0.05)
        # the step in flight when the abort arrived (plus a publish race) at most; no step after
        assert engine.state.step_count <= at_abort + 2
        assert engine.state.kv.used_blocks == 0 and engine.state.running == 0
        await engine.stop()
        assert not engine.alive

    run(main())


def test_rejections_come_back_before_any_output(make_engine):
    async def main():
        engine = AsyncEngine(make_engine(max_num_seqs=1, max_waiting=1, max_output_len=400), warmup=False)
        engine.start()
        with pytest.raises(RequestRejected, match="max_output_len 400") as e:
            await engine.add_request("big", [1], SamplingParams(max_tokens=401))
        assert e.value.status_code == 400
        await engine.add_request("a", [1, 2], LONG)
        await engine.add_request("b", [1, 2], LONG)  # waits: max_num_seqs 1
        while engine.state.waiting == 0:
            await asyncio.sleep(0.01)
        with pytest.raises(RequestRejected, match="queue is full") as e:
            await engine.add_request("c", [1, 2], LONG)
        assert e.value.status_code == 503
        with pytest.raises(RequestRejected, match="already in use"):
            await engine.add_request("a", [1, 2], LONG)
        await engine.stop()

    run(main())


def test_failed_step_fails_its_requests_and_the_loop_survives(make_engine):
    async def main():
        llm = make_engine()
        engine = AsyncEngine(llm, warmup=False)
        real = llm.runner.execute
        calls = {"n": 0}

        def flaky(sched):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected")
            return real(sched)

        llm.runner.execute = flaky
        engine.start()
        doomed = await engine.add_request("doomed", [1, 2, 3], LONG)
        outs = [o async for o in doomed]
        assert outs[-1].finished and outs[-1].error and outs[-1].finish_reason == "error"
        fine = await engine.add_request("fine", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
        outs = [o async for o in fine]
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 5
        assert engine.state.kv.used_blocks == 0
        await engine.stop()

    run(main())


@pytest.mark.slow  # wall-clock bounds
def test_static_partial_batch_waits_for_its_deadline_without_spinning(make_engine):
    async def main():
        llm = make_engine(batching="static", max_batch_size=4, batch_timeout_ms=200)
        engine = AsyncEngine(llm, warmup=False)
        real = llm.scheduler.schedule
        calls = {"n": 0}

        def counting(now):
            calls["n"] += 1
            return real(now)

        llm.scheduler.schedule = counting
        engine.start()
        t0 = time.monotonic()
        stream = await engine.add_request("alone", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
        outs = [o async for o in stream]
        queue_time = outs[-1].times.queue_time
        assert 0.19 <= queue_time < 0.7 and time.monotonic() - t0 < 3.0  # loose upper bounds: shared CPUs
        assert calls["n"] < 15  # slept until the deadline rather than polling the scheduler
        await engine.stop()

    run(main())


def test_drain_aborts_in_flight_and_refuses_new(make_engine):
    async def main():
        engine = AsyncEngine(make_engine(), warmup=False)
        engine.start()
        stream = await engine.add_request("x", [1, 2, 3], LONG)
        await anext(aiter(stream))
        await engine.drain(timeout=0.2)  # LONG does not finish in 0.2 s: aborted for shutdown
        outs = [o async for o in stream]
        assert outs[-1].finish_reason == "shutdown" and "shut down" in outs[-1].error
        with pytest.raises(RequestRejected, match="shutting down") as e:
            await engine.add_request("y", [1], LONG)
        assert e.value.status_code == 503
        await engine.stop()

    run(main())


def test_busy_window():
    w = BusyWindow(window_s=10.0, since=0.0)
    w.add(0.0, 1.0)
    w.add(5.0, 2.0)
    assert w.fraction(now=10.0) == pytest.approx(0.3)
    assert w.fraction(now=14.0) == pytest.approx(2.0 / 10)  # the first step left the window
    assert BusyWindow(10.0, since=0.0).fraction(now=4.0) == 0.0
    w2 = BusyWindow(10.0, since=0.0)
    w2.add(1.0, 1.0)
    assert w2.fraction(now=4.0) == pytest.approx(0.25)  # young server: divide by its age


def test_freed_heap_goes_back_once_the_engine_has_been_idle(make_engine, monkeypatch):
    """glibc keeps what a step freed resident; the engine thread hands it back (malloc_trim) after
    warming up and once it has been idle for IDLE_RELEASE_S, never while requests run, and not
    between requests that follow each other closely (the next prompt would re-fault the pages)."""
    import iterserve.server.async_engine as async_engine
    from iterserve.memory import release_free_heap

    calls = []
    monkeypatch.setattr(async_engine, "release_free_heap", lambda: calls.append(engine.engine.has_unfinished_requests()))
    monkeypatch.setattr(async_engine, "IDLE_RELEASE_S", 0.3)

    async def main():
        nonlocal engine
        engine = AsyncEngine(make_engine())
        engine.start()
        assert await asyncio.to_thread(engine.ready.wait, 30)
        assert calls == [False]  # after warming up
        for n in range(3):  # back to back
            stream = await engine.add_request(f"r{n}", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
            assert [o async for o in stream][-1].finish_reason == "length"
        assert calls == [False]
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert calls == [False, False]  # idle for 0.3 s: once, with no request in flight
        await asyncio.sleep(0.7)
        assert len(calls) == 2  # once per idle spell
        await engine.stop()

    engine = None
    run(main())
    assert release_free_heap() is True  # glibc (Linux): the real call


def test_warm_up_runs_before_ready_and_leaves_no_trace(make_engine):
    async def main():
        llm = make_engine()
        engine = AsyncEngine(llm)  # warmup=True: what the server does
        engine.start()
        assert await asyncio.to_thread(engine.ready.wait, 30)
        assert llm.step_count >= 2  # a prefill and a decode step ran
        assert engine.recent_steps() == [] and not llm.requests  # not in /v1/scheduler, nothing left over
        assert engine.state.kv.used_blocks == 0 and engine.state.step_count == llm.step_count
        await engine.stop()

    run(main())
