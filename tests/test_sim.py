"""The capacity simulator: it drives the engine's real scheduler classes, is deterministic, and its
profiles (measured on a tiny model, or analytic) survive a JSON round trip."""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

from iterserve.bench.conversation import ConversationOptions, build_conversations
from iterserve.bench.client import parse_slo
from iterserve.bench.report import ModeRun
from iterserve.bench.sketch import QuantileSketch
from iterserve.bench.workload import RequestSpec, bursty, poisson, poisson_stream, shared_prefix
from iterserve.cli import main
from iterserve.config import EngineConfig
from iterserve.engine_args import add_engine_args, engine_config_from_args, engine_flags_from_args
from iterserve.core.scheduler import Scheduler, WaitingQueue
from iterserve.core.static import StaticScheduler
from iterserve.sim.analytic import analytic_profile
from iterserve.sim.measure import ProfileGrid, measure_profile
from iterserve.sim.overhead import ServerOverhead, fit_gaps
from iterserve.sim.profile import Profile
from iterserve.sim import simulator
from iterserve.sim.simulator import SimEngine, conversation_plans, simulate
from iterserve.sim.step_model import FEATURES, LinearStepModel, StepFeatures


def linear_profile(coef=(0.004, 0.0002, 0.00002, 0.0, 1e-7, 0.0), **kw) -> Profile:
    return Profile(kind="measured", model="test", dtype="float32", step_model=LinearStepModel(list(coef)),
                   kv_bytes_per_token=1024, max_model_len=2048, **kw)


def outcome(run) -> dict:
    """Everything simulated, without the wall-clock figures of the run itself."""
    d = run.result.to_dict()
    return {"summary": d["summary"], "records": d["records"]}


def workload(n=300, rate=20.0, seed=1):
    return poisson(n, rate, seed=seed, input_len=(16, 512), output_len=(8, 128))


def test_simulate_drives_the_real_scheduler_classes(monkeypatch):
    specs, prof = workload(), linear_profile()
    base = simulate(specs, EngineConfig(max_num_seqs=8), prof)
    calls = []
    original = Scheduler.schedule
    monkeypatch.setattr(Scheduler, "schedule", lambda self, now: calls.append(now) or original(self, now))
    again = simulate(specs, EngineConfig(max_num_seqs=8), prof)
    assert len(calls) >= again.stats["steps"] > 0
    assert outcome(again) == outcome(base)
    # a change in the scheduler's code shows in the simulated result: serve the newest first (LIFO)
    monkeypatch.setattr(WaitingQueue, "key", lambda self, req: (-req.times.arrival, req.request_id))
    lifo = simulate(specs, EngineConfig(max_num_seqs=8), prof).result.summary()
    fifo = base.result.summary()
    assert lifo["completed"] == fifo["completed"] == len(specs)
    assert lifo["queue_time_ms"]["p99"] > 1.5 * fifo["queue_time_ms"]["p99"]


def test_static_scheduler_is_driven_and_partial_batches_time_out(monkeypatch):
    started = []
    original = StaticScheduler._start_batch
    monkeypatch.setattr(StaticScheduler, "_start_batch", lambda self, now: started.append(now) or original(self, now))
    specs = poisson(20, 1.0, seed=0, input_len=32, output_len=(4, 40))  # sparse: partial batches
    run = simulate(specs, EngineConfig(batching="static", max_batch_size=8, batch_timeout_ms=100.0),
                   linear_profile())
    s = run.result.summary()
    assert s["completed"] == 20 and s["failed"] == 0
    assert started
    # a lone request waits out the batch timeout before its batch starts
    assert s["queue_time_ms"]["median"] == pytest.approx(100.0, abs=1.0)
    # finished members are padding until their batch's slowest one ends
    assert any(step["num_padding"] for step in run.timelines[0].steps)


def test_continuous_beats_static_on_bursty_traffic():
    specs = bursty(400, base_rate=2.0, peak_rate=20.0, seed=3, input_len=(16, 512), output_len=(8, 256))
    prof = analytic_profile("a100-80gb", "llama-2-7b")
    res = {m: simulate(specs, EngineConfig(batching=m, max_num_seqs=16, max_batch_size=8, max_model_len=2048),
                       prof).result.summary() for m in ("static", "continuous")}
    assert res["continuous"]["e2e_ms"]["mean"] < res["static"]["e2e_ms"]["mean"]
    assert res["continuous"]["queue_time_ms"]["mean"] < res["static"]["queue_time_ms"]["mean"]


def test_deterministic_with_a_seed():
    prof = linear_profile()
    one = simulate(workload(seed=5), EngineConfig(max_num_seqs=4), prof, replicas=3, router="least-loaded")
    two = simulate(workload(seed=5), EngineConfig(max_num_seqs=4), prof, replicas=3, router="least-loaded")
    other = simulate(workload(seed=6), EngineConfig(max_num_seqs=4), prof, replicas=3, router="least-loaded")
    assert outcome(one) == outcome(two)
    assert [t.steps for t in one.timelines] == [t.steps for t in two.timelines]
    assert outcome(one)["records"] != outcome(other)["records"]


def test_preemption_and_rejection_are_the_engines():
    prof = linear_profile()
    specs = poisson(40, 50.0, seed=2, input_len=(64, 256), output_len=(64, 200))
    run = simulate(specs, EngineConfig(max_num_seqs=16, num_kv_blocks=40, block_size=16), prof)
    assert run.stats["preemptions"] > 0
    assert run.result.summary()["completed"] == 40
    too_long = poisson(3, 1.0, seed=0, input_len=4000, output_len=8)
    rejected = simulate(too_long, EngineConfig(), prof).result
    assert rejected.failed == 3 and "max_input_len" in rejected.records[0].error


def test_more_replicas_more_capacity():
    prof, specs = linear_profile(), workload(n=400, rate=60.0)
    one = simulate(specs, EngineConfig(max_num_seqs=8), prof).result.summary()
    four = simulate(specs, EngineConfig(max_num_seqs=8), prof, replicas=4, router="least-loaded").result.summary()
    assert four["e2e_ms"]["p95"] < one["e2e_ms"]["p95"]
    assert four["duration_s"] < one["duration_s"]


def test_linear_fit_recovers_its_coefficients():
    true = LinearStepModel([0.003, 0.0001, 0.00002, 0.00001, 2e-7, 1e-6])
    rows = [StepFeatures(b + (p > 0), b + p, p, b * c, p * (p + c) / 1e3)
            for b in (1, 4, 16) for c in (100, 1000) for p in (0, 64, 512)]
    fit = LinearStepModel.fit(rows, [true.predict(r) for r in rows])
    assert fit.coef == pytest.approx(true.coef, rel=1e-6, abs=1e-12)
    assert len(fit.coef) == len(FEATURES)


def test_analytic_profile_is_a_labelled_roofline():
    prof = analytic_profile("a100-80gb", "llama-2-7b")
    assert prof.estimate and "ESTIMATE" in prof.note
    decode16 = prof.step_model.predict(StepFeatures(16, 16, 0, 16 * 512, 0.0))
    # memory-bound: ~13.5 GB of weights at 70% of 2.04 TB/s, plus 2 ms
    assert 0.009 < decode16 < 0.015
    prefill = prof.step_model.predict(StepFeatures(1, 1024, 1024, 0, 1024 * 1024 / 1e3))
    assert prefill > 3 * decode16  # compute-bound
    back = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert back.step_model.predict(StepFeatures(16, 16, 0, 8192, 0.0)) == decode16
    assert back.num_kv_blocks(EngineConfig(block_size=16)) == prof.num_kv_blocks(EngineConfig(block_size=16))


def test_tiny_model_profile_round_trips_through_json(tiny_model_dir, tmp_path):
    grid = ProfileGrid(decode_batches=[1, 4], context_lens=[32, 96], prefill_chunks=[16, 64], chunk_context=32,
                       mixed_decode=[2], mixed_chunks=[16], shared_prefix=32, shared_batches=[3])
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="16MiB", block_size=16)
    prof = measure_profile(cfg, grid, repeats=1, progress=False)
    # the shared-prefix step: 3 rows at 96, the two after the first reading its 32 leading tokens' blocks
    assert [(s["seqs"], s["decode_kv"], s["decode_kv_shared"]) for s in prof.samples if s["decode_kv_shared"]] == [(3, 3 * 97, 64)]
    assert prof.kind == "measured" and not prof.estimate
    assert prof.fit["points"] == len(prof.samples) >= 8
    assert prof.machine["cpu_model"] is not None and prof.engine_flags["model"] == str(tiny_model_dir)
    path = tmp_path / "p.json"
    prof.save(path)
    back = Profile.load(path)
    assert back.to_dict() == json.loads(json.dumps(prof.to_dict()))  # tuples come back as lists
    f = StepFeatures(4, 4, 0, 400, 0.0)
    assert back.step_model.predict(f) == prof.step_model.predict(f) > 0
    with pytest.raises(ValueError, match="not an iterserve step profile"):
        Profile.from_dict({"format": "other"})


def test_simulate_cli_writes_bench_serve_json(tmp_path, capsys):
    prof_path, out = tmp_path / "a100.json", tmp_path / "sim.json"
    assert main(["profile", "--analytic", "--gpu", "a100-80gb", "--model-shape", "llama-2-7b",
                 "--out", str(prof_path)]) == 0
    assert main(["simulate", "--profile", str(prof_path), "--workload", "poisson", "--rate", "4",
                 "--num-requests", "50", "--input-len", "16:256", "--output-len", "8:64",
                 "--slo", "e2e_p95=2s", "--result-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) >= {"base_url", "model", "endpoint", "meta", "summary", "records"}
    assert data["summary"]["completed"] == 50 and len(data["records"]) == 50
    assert data["meta"]["simulated"]["estimate"] is True
    assert main(["simulate", "--profile", str(tmp_path / "missing.json"), "--num-requests", "5"]) == 2
    assert "cannot read profile" in capsys.readouterr().err


def test_sampled_replicas_are_exact_under_round_robin():
    prof, specs = linear_profile(), workload(n=400, rate=60.0)
    full = simulate(specs, EngineConfig(max_num_seqs=8), prof, replicas=4)
    part = simulate(specs, EngineConfig(max_num_seqs=8), prof, replicas=4, sample_replicas=1)
    by_index = {r.index: r for r in full.result.records}
    assert len(part.result.records) == 100
    for r in part.result.records:
        assert r == by_index[r.index]
    with pytest.raises(ValueError, match="round-robin"):
        simulate(specs, EngineConfig(), prof, replicas=4, router="least-loaded", sample_replicas=1)


def test_simulate_compare_out_writes_compares_report(tmp_path, capsys):
    prof_path, out = tmp_path / "a100.json", tmp_path / "cmp"
    analytic_profile("a100-80gb", "llama-2-7b").save(prof_path)
    assert main(["simulate", "--profile", str(prof_path), "--workload", "bursty", "--rate", "1.5",
                 "--num-requests", "120", "--input-len", "16:1024", "--output-len", "8:64",
                 "--max-model-len", "2048", "--compare-out", str(out)]) == 0
    table = capsys.readouterr().out
    summary = json.loads((out / "compare.json").read_text())
    rows = {r["key"]: r for r in summary["rows"]}
    assert rows["saturated_request_throughput"]["continuous"] > 1.5 * rows["saturated_request_throughput"]["static"]
    assert rows["mean_queue_s"]["continuous"] < rows["mean_queue_s"]["static"]
    assert "| Capacity: req/s at saturation |" in table and (out / "latency_cdf.png").exists()


def test_plan_finds_the_fewest_replicas_meeting_the_slo(tmp_path, capsys):
    prof_path = tmp_path / "a100.json"
    analytic_profile("a100-80gb", "llama-2-7b").save(prof_path)
    argv = ["plan", "--profile", str(prof_path), "--workload", "poisson", "--num-requests", "300",
            "--input-len", "16:1024", "--output-len", "8:64", "--max-model-len", "2048", "--target-rate", "25",
            "--seqs-grid", "16", "--max-replicas", "16"]
    assert main(argv + ["--slo", "e2e_p95=2s"]) == 0
    out = capsys.readouterr().out
    n = int(out.split("plan: ")[1].split(" replicas")[0])
    assert 1 < n <= 16 and f"with {n - 1} replicas" in out and "SLO missed" in out
    # the same traffic through n and n - 1 least-loaded replicas: only n meets it
    specs = poisson(300, 30.0, seed=0, input_len=(16, 1024), output_len=(8, 64))
    cfg = EngineConfig(max_model_len=2048)
    p95 = lambda k: simulate(specs, cfg, Profile.load(prof_path), k, "least-loaded").result.summary()["e2e_ms"]["p95"]  # noqa: E731
    assert p95(n) <= 2000 < p95(n - 1)
    assert main(argv + ["--slo", "ttft=1ms"]) == 1  # no fleet meets it
    assert "no configuration met the SLO" in capsys.readouterr().out


def test_prefix_caching_is_the_engines(monkeypatch):
    """The pool caches prefixes as the engine's does (on by default with continuous batching): the
    same prompt twice is a hit, and the hit shortens the second request's prefill in the simulation."""
    specs = [RequestSpec(0, 0.0, 512, 8), RequestSpec(1, 5.0, 512, 8)]
    prof = linear_profile(coef=(0.004, 0.0, 0.0001, 0.0, 0.0, 0.0))
    distinct = simulate(specs, EngineConfig(), prof)
    assert distinct.stats["prefix_cache_hits"] == 0 and distinct.stats["prefix_cache_queries"] > 0
    monkeypatch.setattr("iterserve.sim.simulator.prompt_ids", lambda spec: [7] * spec.input_len)
    shared = simulate(specs, EngineConfig(), prof)
    assert shared.stats["prefix_cache_hits"] >= 496
    ttft = [r.ttft_s for r in shared.result.records]
    assert ttft[1] < 0.5 * ttft[0]
    off = simulate(specs, EngineConfig(enable_prefix_caching=False), prof)
    assert off.stats["prefix_cache_hits"] == 0


@pytest.mark.slow
def test_tune_simulate_verifies_the_best_by_real_replay(tiny_model_dir, tmp_path, capsys):
    grid = ProfileGrid(decode_batches=[1, 4], context_lens=[32, 96], prefill_chunks=[16, 64], chunk_context=32,
                       mixed_decode=[2], mixed_chunks=[16])
    prof_path, out, raw = tmp_path / "p.json", tmp_path / "tune", tmp_path / "raw"
    measure_profile(EngineConfig(model=str(tiny_model_dir), kv_cache_memory="64MiB"), grid, repeats=1,
                    progress=False).save(prof_path)
    rc = main(["tune", "--simulate", str(prof_path), "--verify", "1", "--model", str(tiny_model_dir),
               "--max-num-seqs", "1,2,4", "--block-size", "16", "--server-args", "--kv-cache-memory 64MiB",
               "--workload", "constant", "--rate", "20", "--num-requests", "8", "--input-len", "24",
               "--output-len", "12:40", "--slo", "e2e_p95=5s", "--run-grace", "60", "--out", str(out),
               "--raw-dir", str(raw), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads((out / "tune.json").read_text())
    assert len(report["simulated"]) == 3 and all(r["detail"] == "simulated" for r in report["simulated"])
    assert len(report["verified"]) == 1 and report["verified"][0]["status"] == "ok"
    assert report["verified"][0]["summary"]["completed"] == 8
    assert "predicted (sim) vs measured (real)" in text and "TTFT p50 ms sim" in text
    verified = report["verified"][0]["config"]
    assert report["chosen"] == f"seqs={verified['max_num_seqs']} block={verified['block_size']}"
    assert "chosen: " in text and "(measured best of the 1 verified" in text


def test_shared_prefix_workload_hits_the_prefix_cache():
    specs = shared_prefix(60, 4.0, system_prompt_len=400, seed=0, input_len=(16, 64), output_len=(8, 32))
    prof = linear_profile(coef=(0.004, 0.0002, 0.0001, 0.0, 1e-7, 0.0))
    run = simulate(specs, EngineConfig(), prof)
    assert run.result.summary()["completed"] == 60
    assert run.stats["prefix_cache_hits"] >= 59 * 384  # every request after the first reuses the system prompt
    assert run.result.records[0].prompt_tokens == 400 + specs[0].input_len
    off = simulate(specs, EngineConfig(enable_prefix_caching=False), prof).result.summary()
    assert off["ttft_ms"]["mean"] > run.result.summary()["ttft_ms"]["mean"]


def test_multi_turn_conversations_grow_a_cached_history(capsys):
    opts = ConversationOptions(num_conversations=4, turns=4, system_prompt_len=200, user_len=(16, 32),
                               output_len=16, think_time_s=0.5, stagger_s=1.0, seed=3)
    plans = conversation_plans(opts)
    assert [p.output_lens for p in plans] == [c.output_lens for c in build_conversations(opts)]
    assert [p.think_s for p in plans] == [c.think_s for c in build_conversations(opts)]
    prof = linear_profile(coef=(0.004, 0.0002, 0.0001, 0.0, 1e-7, 0.0))
    run = simulate([], EngineConfig(), prof, conversations=plans)
    recs = run.result.records
    assert len(recs) == 16 and all(r.success for r in recs)
    # each turn's prompt is the last one's prompt + its answer + the new message, sent after the answer
    first = sorted(recs, key=lambda r: r.index)[:4]
    assert all(r.prompt_tokens >= 200 for r in first)
    later = [r for r in recs if r.index >= 4]
    assert all(r.prompt_tokens > 200 + 16 for r in later)
    assert run.stats["prefix_cache_hits"] > 0.6 * run.stats["prefix_cache_queries"]
    assert main(["simulate", "--profile", "/nonexistent.json", "--workload", "multi-turn"]) == 2
    # distinct system prompts: the same conversations, but only each one's own history can hit
    distinct = conversation_plans(ConversationOptions(**{**vars(opts), "system_prompts": "distinct"}))
    assert [p.user_lens for p in distinct] == [p.user_lens for p in plans]
    alone = simulate([], EngineConfig(), prof, conversations=distinct).stats
    assert 0 < alone["prefix_cache_hits"] <= run.stats["prefix_cache_hits"] - 2 * 192


def test_a_later_turn_hits_its_previous_prompt_not_the_answer():
    """Clients send the answer back as text, and its re-tokenisation is not the generated ids, so
    the next turn reuses the previous prompt's blocks only: 80 prompt tokens (5 blocks of 16) hit,
    not the 112 of prompt + answer."""
    opts = ConversationOptions(num_conversations=1, turns=2, system_prompt_len=64, user_len=16, output_len=32,
                               think_time_s=0.0, seed=0)
    run = simulate([], EngineConfig(block_size=16), linear_profile(), conversations=conversation_plans(opts))
    assert sorted(r.prompt_tokens for r in run.result.records) == [80, 128]
    assert run.stats["prefix_cache_hits"] == 80


def overhead_profile(**kw) -> Profile:
    return linear_profile(server_overhead=ServerOverhead(gap_s=[0.002, 0.0001], admit_s=0.001,
                                                         arrival_s=[0.003, 2e-5], first_token_s=0.004,
                                                         finish_s=0.005, fit={"gap_points": 10}), **kw)


def test_server_overhead_round_trips_and_is_charged(tmp_path):
    prof = overhead_profile()
    prof.save(tmp_path / "p.json")
    back = Profile.load(tmp_path / "p.json")
    assert back.server_overhead == prof.server_overhead
    assert back.to_dict() == prof.to_dict()
    specs, cfg = workload(n=100, rate=5.0), EngineConfig(max_num_seqs=8)
    plain = simulate(specs, cfg, linear_profile()).result.summary()
    charged = simulate(specs, cfg, back)
    assert outcome(charged) == outcome(simulate(specs, cfg, overhead_profile()))  # deterministic
    s = charged.result.summary()
    assert s["completed"] == plain["completed"] == len(specs)
    # at a light load each request pays at least the arrival + first-token terms before its first token
    # and the finish term after its last; each step the gap after it
    assert s["ttft_ms"]["median"] > plain["ttft_ms"]["median"] + 7.0
    assert s["e2e_ms"]["mean"] > plain["e2e_ms"]["mean"] + 10.0
    for rec in charged.result.records:  # times are the client's: from the send time
        assert rec.e2e_s == pytest.approx(rec.end_at_s - rec.sent_at_s)


def test_gap_after_a_step_delays_the_next_one():
    specs = [RequestSpec(0, 0.0, 16, 10)]
    oh = ServerOverhead(gap_s=[0.01, 0.0])
    run = simulate(specs, EngineConfig(), linear_profile(server_overhead=oh))
    steps = run.timelines[0].steps
    assert len(steps) == 10
    for a, b in zip(steps, steps[1:]):
        assert b["t"] - (a["t"] + a["duration"]) == pytest.approx(0.01)


def test_profiles_without_the_newer_terms_still_load(tmp_path):
    d = linear_profile().to_dict()
    d.pop("server_overhead")
    d["step_model"] = {"form": "linear", "features": list(FEATURES[:6]), "coef": [0.004, 0.0002, 0.00002, 0, 1e-7, 0]}
    (tmp_path / "old.json").write_text(json.dumps(d))
    old = Profile.load(tmp_path / "old.json")
    assert old.server_overhead is None and old.overhead == ServerOverhead()
    specs = workload(n=50)
    assert outcome(simulate(specs, EngineConfig(), old)) == outcome(simulate(specs, EngineConfig(), linear_profile()))


def test_cut_over_terms_fit_a_jump_at_the_engines_cut():
    true = LinearStepModel([0.003, 0.0001, 0.00002, 0.0, 2e-7, 0.0, 0.004, 0.001], twin_max_tokens=4, head_max_seqs=4)
    rows = [StepFeatures(b, b, 0, b * c, 0.0) for b in (1, 2, 4, 5, 8, 16) for c in (100, 1000)]
    rows += [StepFeatures(1, p, p, 0, p * p / 1e3) for p in (64, 512)]
    fit = LinearStepModel.fit(rows, [true.predict(r) for r in rows], 4, 4)
    assert fit.predict(StepFeatures(6, 6, 0, 600, 0.0)) == pytest.approx(true.predict(StepFeatures(6, 6, 0, 600, 0.0)))
    assert fit.predict(StepFeatures(5, 5, 0, 500, 0.0)) - fit.predict(StepFeatures(4, 4, 0, 400, 0.0)) > 0.004
    assert LinearStepModel.fit(rows, [true.predict(r) for r in rows]).coef[6:8] == [0.0, 0.0]  # no cut: off


def test_shared_kv_is_priced_apart_and_older_models_keep_their_price():
    """Decode KV read from blocks another row of the step reads too (prefix caching's shared
    blocks) has a price of its own, fitted where the grid has such steps; a model fitted without
    any, or saved before the term, prices them as any KV token; a later chunk's reads of its cached
    context likewise have their own term, 0 in older models."""
    from iterserve.sim.step_model import CACHED_PKV, DECODE_KV, SHARED_KV, model_from_dict
    true = LinearStepModel([0.003, 0.0001, 0.00002, 0.0, 4e-7, 1e-4, 0.0, 0.0, 1e-7, 3e-4])
    rows = [StepFeatures(b, b, 0, b * c, 0.0) for b in (1, 2, 4, 8, 16) for c in (100, 1000)]
    rows += [StepFeatures(b, b, 0, b * c, 0.0, (b - 1) * 384) for b in (4, 16) for c in (512, 1024)]
    rows += [StepFeatures(1, p, p, 0, p * (p + ctx) / 1e3, 0, p * ctx / 1e3) for p in (64, 256, 1024) for ctx in (0, 512)]
    fit = LinearStepModel.fit(rows, [true.predict(r) for r in rows])
    assert fit.coef[SHARED_KV] == pytest.approx(1e-7, rel=1e-3) and fit.coef[DECODE_KV] == pytest.approx(4e-7, rel=1e-3)
    assert fit.coef[CACHED_PKV] == pytest.approx(3e-4, rel=1e-3)
    shared, distinct = StepFeatures(16, 16, 0, 16 * 800, 0.0, 15 * 384), StepFeatures(16, 16, 0, 16 * 800, 0.0)
    assert fit.predict(shared) < fit.predict(distinct)
    plain = [r for r in rows if not r.decode_kv_shared]
    refit = LinearStepModel.fit(plain, [true.predict(r) for r in plain])
    assert refit.coef[SHARED_KV] == refit.coef[DECODE_KV] > 0 and refit.predict(shared) == refit.predict(distinct)
    old = LinearStepModel([0.003, 0.0001, 0.00002, 0.0, 4e-7, 1e-4, 0.0, 0.0])  # an 8-term profile
    assert old.predict(shared) == old.predict(distinct) and old.coef[CACHED_PKV] == 0.0
    saved = {"form": "linear", "features": list(FEATURES[:8]), "coef": old.coef[:8]}  # as written before the terms
    assert model_from_dict(saved).predict(shared) == old.predict(shared)


def features_of_each_step(engine, block_size: int) -> list:
    """Wraps the engine's runner so that each step's `step_features` (of the SchedulerOutput it was
    handed) is appended to the returned list as the engine runs."""
    from iterserve.sim.step_model import step_features

    seen = []
    execute = engine.runner.execute

    def spy(sched):
        seen.append(step_features(sched, block_size))
        return execute(sched)

    engine.runner.execute = spy
    return seen


def test_step_records_count_shared_blocks_and_cached_prefill_reads(make_engine):
    """Three requests with one 48-token prefix under prefix caching: once the first has computed it,
    the others hit its three blocks; their step records say how much decode KV was read from blocks
    another row read too (2 rows x 48) and what a later chunk read from its cached context (chunk x
    48), and the step model's features from the records are the SchedulerOutput's."""
    from iterserve.sampling import SamplingParams
    from iterserve.server.api import step_dict
    from iterserve.sim.step_model import record_features

    engine = make_engine(max_num_seqs=4, block_size=16, enable_prefix_caching=True)
    seen = features_of_each_step(engine, 16)
    prefix = list(range(5, 53))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request(params=params, request_id="a", prompt_token_ids=prefix + [60, 61])
    engine.step()  # a's prompt computed: its three full blocks are cached
    for rid, tail in (("b", [70, 71, 72, 73, 74]), ("c", [80, 81, 82])):
        engine.add_request(params=params, request_id=rid, prompt_token_ids=prefix + tail)
    while engine.has_unfinished_requests():
        engine.step()
    records = [step_dict(rec, 0.0) for rec in engine.records]
    assert [record_features(r) for r in records] == seen
    assert any(r["prefill_cached_kv_tokens"] == (5 + 3) * 48 for r in records)  # b's and c's chunks after the hit
    assert max(r["decode_kv_shared_tokens"] for r in records) == 2 * 48
    assert all(r["decode_kv_shared_tokens"] == 0 for r in records if r["batch_size"] == 1)


def test_gap_fit_recovers_the_gap_between_busy_steps():
    steps, t = [], 0.0
    for k in range(40):
        batch = 1 + k % 8
        admitted = [("r", 0)] * (k % 3)
        t += 0.001 * len(admitted)  # this step's admissions, before its forward pass
        steps.append({"step": k + 1, "t_run": t, "duration": 0.02, "batch_size": batch, "admitted": admitted,
                      "num_running": 0 if k == 19 else batch})
        t += 0.02 + (5.0 if k == 19 else 0.002 + 0.0003 * batch)  # an idle wait after step 20: not a gap
    gap, admit, info = fit_gaps(steps)
    assert gap == pytest.approx([0.002, 0.0003], rel=1e-3)
    assert admit == pytest.approx(0.001, rel=1e-3)
    assert info["gap_points"] <= 38


def test_engine_flags_from_args_round_trip():
    """What profile --server-overhead hands the server it starts: the same engine as the profile's."""

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--max-num-seqs", "8", "--block-size", "32", "--no-cpu-kernels", "--enable-prefix-caching"])
    words = engine_flags_from_args(args)
    assert "--max-num-seqs" in words and "--no-cpu-kernels" in words
    assert engine_config_from_args(p.parse_args(words)) == engine_config_from_args(args)
    assert engine_flags_from_args(p.parse_args([])) == []


# ---------------------------------------------------------------- lazy workloads, streaming summary

def light_stream(n: int, seed: int = 1):
    """A load one engine keeps up with: the requests in flight stay few however many are sent."""
    return poisson_stream(n, 5.0, seed=seed, input_len=(16, 128), output_len=(4, 16))


class LiveCount:
    """How many of the objects handed to `keep` are still alive (a finalizer counts each one out)."""

    def __init__(self) -> None:
        self.alive = 0

    def keep(self, obj):
        self.alive += 1
        weakref.finalize(obj, self._gone)
        return obj

    def _gone(self) -> None:
        self.alive -= 1


@contextlib.contextmanager
def only_new_objects_collected() -> Iterator[None]:
    """gc.freeze(): what the process held before (a whole suite's modules and models) moves out of
    the collector's reach, so each gc.collect() below walks only what the test made since, which is
    all it counts; in a full run each collect otherwise walked the suite's heap."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_live_requests_and_records_stay_bounded_as_the_request_count_grows(monkeypatch):
    with only_new_objects_collected():
        live_objects_stay_bounded(monkeypatch)


def live_objects_stay_bounded(monkeypatch) -> None:
    """The specs, engine requests and records alive at once, at 1000 and 4000 requests."""
    specs, requests, records = LiveCount(), LiveCount(), LiveCount()
    add, record = SimEngine.add, simulator._record
    monkeypatch.setattr(SimEngine, "add", lambda self, *a, **k: requests.keep(add(self, *a, **k)))
    monkeypatch.setattr(simulator, "_record", lambda *a, **k: records.keep(record(*a, **k)))

    def most_alive(n: int) -> int:
        peak = 0

        def counted():
            nonlocal peak
            for j, spec in enumerate(light_stream(n)):
                if j % 250 == 0:
                    gc.collect()
                    peak = max(peak, specs.alive + requests.alive + records.alive)
                yield specs.keep(spec)
        run = simulate(counted(), EngineConfig(max_num_seqs=8), linear_profile(), streaming_summary=True,
                       keep_steps=False)
        assert run.result.completed == n and run.result.records == []
        assert records.alive + requests.alive >= 0
        return peak

    small, large = most_alive(1000), most_alive(4000)
    assert 0 < large <= max(2 * small, 30)  # four times the requests, not four times the objects
    assert large < 4000 / 50
    # the counter sees what it should: a list of records keeps every one alive
    kept = simulate(list(light_stream(300)), EngineConfig(max_num_seqs=8), linear_profile())
    gc.collect()
    assert records.alive >= 300 and len(kept.result.records) == 300


def test_streaming_summary_percentiles_are_within_the_sketchs_error():
    specs = poisson_stream(3000, 15.0, seed=2, input_len=(16, 512), output_len=(8, 96))
    slos = [parse_slo("e2e_p95=2s"), parse_slo("ttft=300ms")]
    exact = simulate(specs, EngineConfig(max_num_seqs=8), linear_profile(), slos=slos)
    sketch = simulate(specs, EngineConfig(max_num_seqs=8), linear_profile(), slos=slos, streaming_summary=True)
    e, s = exact.result.summary(), sketch.result.summary()
    err = s["percentiles"]["relative_error"]
    assert s["percentiles"]["method"] == "sketch" and "percentiles" not in e
    assert e["e2e_ms"]["p99"] > 2 * e["e2e_ms"]["median"] > 0  # a spread worth testing
    for key in ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens", "peak_concurrency",
                "good_requests"):
        assert s[key] == e[key], key
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_time_ms", "itl_ms"):
        assert s[metric]["count"] == e[metric]["count"]
        assert s[metric]["mean"] == pytest.approx(e[metric]["mean"], rel=1e-9)
        for q in ("median", "p95", "p99"):
            assert abs(s[metric][q] - e[metric][q]) <= err * e[metric][q] + 1e-9, (metric, q)
    for srow, erow in zip(s["slos"], e["slos"]):
        assert srow["requests_met"] == erow["requests_met"]
    assert s["slos"][0]["run_value_ms"] == pytest.approx(e["slos"][0]["run_value_ms"], rel=err)
    # compare's table reads it as it reads a measured run
    table = ModeRun("continuous", sketch.result.to_dict(), exact.timelines[0]).metrics()
    assert table["p95_latency_s"] == pytest.approx(e["e2e_ms"]["p95"] / 1e3, rel=err)


def test_sketches_merge_and_state_their_error():
    rng = np.random.default_rng(0)
    values = rng.lognormal(-3, 1.2, 4000)
    whole, left, right = QuantileSketch(0.01), QuantileSketch(0.01), QuantileSketch(0.01)
    whole.add_many(values)
    for v in values[:1500]:
        left.add(float(v))
    right.add_many(values[1500:])
    left.merge(right)
    assert np.array_equal(left.counts, whole.counts) and left.count == 4000
    for q in (0.01, 0.5, 0.9, 0.99):
        assert abs(left.quantile(q) - np.percentile(values, 100 * q)) <= 0.01 * np.percentile(values, 100 * q)
    with pytest.raises(ValueError, match="same relative error"):
        left.merge(QuantileSketch(0.02))


def test_streaming_summary_is_deterministic_with_a_seed():
    def run(seed):
        return simulate(light_stream(800, seed), EngineConfig(max_num_seqs=4), linear_profile(), replicas=3,
                        router="least-loaded", streaming_summary=True).result.summary()
    assert run(4) == run(4)
    assert run(4) != run(5)


def test_a_lazy_workload_simulates_as_its_list_does():
    """The eager path (a list, sorted whole) and the lazy one (an iterator in send order, reordered
    by when each reaches the engine) see the requests in the same order: the same records."""
    prof = overhead_profile()
    lazy = poisson_stream(400, 30.0, seed=9, input_len=(16, 900), output_len=(8, 64))
    listed = simulate(list(lazy), EngineConfig(max_num_seqs=8), prof, replicas=3, sample_replicas=2)
    streamed = simulate(iter(lazy), EngineConfig(max_num_seqs=8), prof, replicas=3, sample_replicas=2)
    assert outcome(streamed) == outcome(listed)
    assert streamed.stats["offered_requests"] == 400
    backwards = [RequestSpec(0, 2.0, 16, 4), RequestSpec(1, 1.0, 16, 4)]
    with pytest.raises(ValueError, match="send order"):
        simulate(iter(backwards), EngineConfig(), prof)


def test_simulate_cli_streaming_summary_keeps_no_records(tmp_path, capsys):
    prof_path, out = tmp_path / "a100.json", tmp_path / "sim.json"
    analytic_profile("a100-80gb", "llama-2-7b").save(prof_path)
    assert main(["simulate", "--profile", str(prof_path), "--workload", "poisson", "--rate", "100",
                 "--num-requests", "3000", "--input-len", "16:1024", "--output-len", "8:64", "--replicas", "20",
                 "--sample-replicas", "2", "--streaming-summary", "--result-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["records"] == [] and data["summary"]["completed"] == 300
    assert data["summary"]["percentiles"]["method"] == "sketch"
    err = capsys.readouterr().err
    assert "300 requests of 3000 offered (2 of 20 replicas)" in err and "peak RSS" in err and "s CPU" in err


@pytest.mark.parametrize("command, flag", [("profile", "--analytic"), ("simulate", "--streaming-summary"),
                                           ("plan", "--target-rate")])
def test_sim_commands_help(command, flag, capsys):
    """--help renders (a bare % in a help text once broke it)."""
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0 and flag in capsys.readouterr().out


def test_streaming_peak_concurrency_is_exact_with_server_overheads():
    """A request's end is stamped at its step's forward-pass end, which another replica's later event
    can already have passed (the gap after a step): the sweep must hold events that long."""
    prof = linear_profile(server_overhead=ServerOverhead(gap_s=[0.05, 0.0], admit_s=0.0, arrival_s=[0.0, 0.0],
                                                         first_token_s=0.0, finish_s=0.0, fit={"gap_points": 10}))
    for seed in (0, 1):
        specs = poisson_stream(400, 30.0, seed=seed, input_len=(16, 256), output_len=(1, 3))
        exact = simulate(specs, EngineConfig(max_num_seqs=8), prof, replicas=3).result.summary()
        sketch = simulate(specs, EngineConfig(max_num_seqs=8), prof, replicas=3, streaming_summary=True)
        assert sketch.result.summary()["peak_concurrency"] == exact["peak_concurrency"] > 1


def test_server_step_records_carry_the_step_models_features(make_engine):
    """A step record (`/v1/scheduler`'s step dict) gives the step model the same features as the
    SchedulerOutput the step ran, so the model can be checked on a server's own steps."""
    from iterserve.sampling import SamplingParams
    from iterserve.server.api import step_dict
    from iterserve.sim.step_model import record_features

    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=32, block_size=16)
    seen = features_of_each_step(engine, 16)
    for i, n in enumerate((40, 7, 70)):  # chunked prompts next to decodes: every kind of step
        engine.add_request(params=SamplingParams(max_tokens=5, ignore_eos=True), request_id=f"r{i}",
                           prompt_token_ids=list(range(3 + i, 3 + i + n)))
    while engine.has_unfinished_requests():
        engine.step()
    got = [record_features(step_dict(rec, 0.0)) for rec in engine.records]
    assert got == seen and any(f.prefill_tokens and f.decode_kv for f in got)
    assert record_features({"batch_size": 1, "prefill_tokens": 0, "decode_tokens": 1}) is None  # older server


@pytest.mark.real_model
def test_multi_turn_framing_makes_simulated_prompts_as_long_as_the_real_ones():
    """The completions endpoint's flattened prompts carry "System:" / "User:" / "Assistant:" and a
    preamble; counted with SmolLM2's tokenizer, the simulated prompts come within a token or two per
    turn of the real prompts' lengths (without the framing they are ~25 tokens short at turn 1)."""
    from iterserve.bench.conversation import _flatten, _messages, conversation_framing
    from iterserve.bench.workload import prose_source
    from iterserve.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("smollm2-135m"))
    framing = conversation_framing(tok)
    assert framing.system > 10 and framing.user > 3  # the preamble; "User: ...\n\nAssistant:"
    opts = ConversationOptions(num_conversations=3, turns=3, system_prompt_len=300, user_len=(16, 64),
                               output_len=48, think_time_s=0.0, seed=5)
    source = prose_source(tok)
    plans = conversation_plans(opts, framing)
    for conv, plan in zip(build_conversations(opts, tok), plans):
        sim_len = plan.system_prompt_len + plan.framing.system
        for turn in range(opts.turns):
            sim_len += plan.user_len(turn)
            real_len = len(tok.encode(_flatten(_messages(conv, turn)), add_special_tokens=False))
            assert abs(real_len - sim_len) <= 2 + turn, (conv.index, turn, real_len, sim_len)
            answer = source.text(plan.output_lens[turn], 101 * turn + conv.index)  # stands in for the answer
            conv.history += [{"role": "user", "content": conv.user_turns[turn]},
                             {"role": "assistant", "content": answer}]
            sim_len += plan.answer_len(plan.output_lens[turn])
    # and the simulator sends exactly those lengths
    run = simulate([], EngineConfig(block_size=16), linear_profile(), conversations=plans)
    first = min((r for r in run.result.records), key=lambda r: r.index)
    assert first.prompt_tokens == 300 + framing.system + plans[0].user_len(0)


def test_calibration_refits_on_the_servers_own_steps(tmp_path):
    """A profile keeps the server's in-service steps; `calibrated()` fits grid and in-service steps
    together, so a step model that is 25% fast on the server's decode steps moves toward them, and
    the profile round-trips through JSON with them."""
    import dataclasses as dc

    true = LinearStepModel([0.004, 0.0003, 0.00002, 0.00001, 2e-7, 0.0001])
    grid = [StepFeatures(b, b, 0, b * ctx, 0.0) for b in (1, 2, 4, 8, 16) for ctx in (128, 512)]
    grid += [StepFeatures(1, n, n, 0, n * n / 1e3) for n in (16, 64, 256)]
    grid += [StepFeatures(5, 4 + n, n, 4 * 256, n * n / 1e3) for n in (64, 256)]
    samples = [{**dc.asdict(f), "seconds": true.predict(f)} for f in grid]
    served = [StepFeatures(b, b, 0, b * 300, 0.0) for b in (1, 1, 2, 3, 5, 8, 12, 16)]
    in_service = [{**dc.asdict(f), "seconds": 1.25 * true.predict(f)} for f in served]
    prof = linear_profile(coef=true.coef, samples=samples, in_service_samples=in_service)
    before = prof.in_service_errors()
    assert set(before) == {"decode"} and before["decode"]["steps"] == 8
    assert before["decode"]["mean"] == pytest.approx(-0.2)  # predicts 1/1.25 of the served time
    cal = prof.calibrated()
    after = cal.in_service_errors()["decode"]
    assert abs(after["mean"]) < abs(before["decode"]["mean"]) and cal.fit["calibrated_on_in_service_steps"] == 8
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").in_service_samples == in_service
    with pytest.raises(ValueError, match="in-service steps"):
        linear_profile().calibrated()
    assert main(["profile", "--calibrate", "--out", str(tmp_path / "q.json")]) == 2  # needs --server-overhead


def test_validation_spread_counts_real_runs_that_differ_beyond_a_target():
    """benchmarks/sim_validation_spread.py: two runs of the same replays; a target whose two real
    measurements differ by more than the target is counted (here throughput 1.0 vs 1.2, +20% > 5%)
    and one within it is not (e2e mean +5% < 10%); a point failed in one run is left out."""
    import sim_validation_spread as mod  # benchmarks/ is on sys.path (pyproject's pytest pythonpath)

    def run(tp, e2e, failed=False):
        point = {"workload": "bursty", "load": "near", "mode": "continuous",
                 "errors": {"throughput": [tp, 1.1], "e2e_mean": [e2e, 1000.0], "e2e_p95": [None, None],
                            "ttft_p50": [100.0, 100.0]}}
        other = {"workload": "bursty", "load": "over", "mode": "static", **({"error": "boom"} if failed else
                                                                             {"errors": point["errors"]})}
        return {"runs": [point, other]}

    text, over, compared, worst = mod.spread_table(run(1.0, 1000.0), run(1.2, 1050.0, failed=True))
    assert (over, compared) == (1, 3) and worst == pytest.approx(0.2)
    assert "**+20%**" in text and "+5%" in text and "over" not in text


def test_a_simulated_engine_takes_its_profiles_device_default_step_budget():
    """Without --max-num-batched-tokens the budget is the device's (config.DEFAULT_STEP_TOKENS): a GPU's
    profile simulates 2048-token steps, a CPU's 512, and a budget given is kept; so one 1,500-token
    prompt is one prefill step on the GPU and three on the CPU."""
    specs = [RequestSpec(index=0, arrival_s=0.0, input_len=1500, output_len=1)]
    gpu, cpu = analytic_profile("a100-80gb", "llama-2-7b"), linear_profile()
    assert (gpu.device_type, cpu.device_type) == ("cuda", "cpu")
    for prof, budget in ((gpu, 2048), (cpu, 512)):
        steps = simulate(specs, EngineConfig(max_model_len=2048), prof).timelines[0].steps
        chunks = [s["prefill_tokens"] for s in steps if s["prefill_tokens"]]
        assert chunks == ([1500] if budget > 1500 else [512, 512, 476])
    kept = simulate(specs, EngineConfig(max_model_len=2048, max_num_batched_tokens=1024), cpu)
    assert [s["prefill_tokens"] for s in kept.timelines[0].steps if s["prefill_tokens"]] == [1024, 476]
