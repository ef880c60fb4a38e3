"""Speculative decoding's reporting and simulation: /metrics counters (with vLLM's names),
/v1/scheduler's `speculative` section and step fields, the dashboard ticks, bench serve's figures,
and the simulator's pricing and acceptance model (tune's num_speculative_tokens dimension)."""
from __future__ import annotations

import io
import json

import pytest

from iterserve.bench.client import RunResult, print_table, spec_decode_counters, spec_decode_delta
from iterserve.bench.workload import poisson
from iterserve.cli import main
from iterserve.config import EngineConfig
from iterserve.engine import StepRecord
from iterserve.request import RequestOutput, RequestTimes
from iterserve.server.api import scheduler_state, step_dict
from iterserve.server.async_engine import AsyncEngine, SpecTotals
from iterserve.server.engine_ticks import aggregate_steps
from iterserve.server.metrics import ServerMetrics
from iterserve.sim.profile import Profile
from iterserve.sim.simulator import simulate
from iterserve.sim.speculative import SpecPolicy, alpha_from_rate, alpha_from_totals, expected_accepted
from iterserve.sim.step_model import LinearStepModel, record_features

SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def spec_step(step: int = 1, rows: int = 2, drafts: int = 5, accepted: int = 3, per_pos=(2, 1)) -> StepRecord:
    """A decode step of `rows` verify rows: decode_tokens counts each verified position."""
    return StepRecord(step=step, start=0.0, duration=0.01, batch_size=rows, num_padding=0, num_running=rows,
                      num_waiting=0, prefill_tokens=0, decode_tokens=rows + drafts, kv_used_blocks=1,
                      kv_total_blocks=8, kv_tokens=10, decode_kv_tokens=0, prefill_kv_tokens=(rows + drafts) * 40,
                      spec_num_drafts=rows, spec_draft_tokens=drafts, spec_accepted_tokens=accepted,
                      spec_accepted_per_pos=list(per_pos), spec_propose_seconds=0.001)


def final_output(drafts: int, accepted: int, rows: int) -> RequestOutput:
    return RequestOutput("r1", [], "", True, "length", 4, 8, RequestTimes(0.0), spec_num_drafts=rows,
                         spec_draft_tokens=drafts, spec_accepted_tokens=accepted)


@pytest.fixture
def spec_engine(make_engine):
    return AsyncEngine(make_engine(speculative_config=SPEC), warmup=False)


def sample(text: str, name: str) -> float:
    """The value of the one series line that starts with `name` (labels included)."""
    lines = [ln for ln in text.splitlines() if ln.startswith(name)]
    assert len(lines) == 1, (name, lines)
    return float(lines[0].rsplit(" ", 1)[1])


def test_spec_totals_sum_steps_and_give_rates():
    t = SpecTotals()
    assert t.add(StepRecord(1, 0.0, 0.01, 1, 0, 1, 0, 0, 1, 1, 8, 1)) is t  # a step without drafts
    assert t.acceptance_rate is None and t.mean_accepted_length is None
    t = t.add(spec_step()).add(spec_step(2, rows=1, drafts=3, accepted=3, per_pos=(1, 1, 1)))
    assert (t.num_drafts, t.draft_tokens, t.accepted_tokens, t.accepted_per_pos) == (3, 8, 6, (3, 2, 1))
    assert t.acceptance_rate == pytest.approx(6 / 8) and t.mean_accepted_length == pytest.approx(1 + 6 / 3)


def test_metrics_count_drafts_with_vllm_twins_and_a_per_request_rate(spec_engine):
    m = ServerMetrics(spec_engine, "tiny")
    text = m.render().decode()
    for pos in range(3):  # every position of the config is there from the start, at zero
        assert sample(text, f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{pos}"}}') == 0
    m.on_step(spec_step())
    m.on_step(spec_step(2))
    m.on_finish(final_output(drafts=10, accepted=6, rows=4))
    m.on_finish(final_output(drafts=0, accepted=0, rows=0))  # drafted nothing: not observed
    text = m.render().decode()
    for prefix in ("iterserve", "vllm"):
        assert sample(text, f'{prefix}:spec_decode_num_drafts_total{{model_name="tiny"}}') == 4
        assert sample(text, f'{prefix}:spec_decode_num_draft_tokens_total{{model_name="tiny"}}') == 10
        assert sample(text, f'{prefix}:spec_decode_num_accepted_tokens_total{{model_name="tiny"}}') == 6
        assert sample(text, f'{prefix}:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="1"}}') == 2
    assert sample(text, 'iterserve:request_spec_acceptance_rate_count{model_name="tiny"}') == 1
    assert sample(text, 'iterserve:request_spec_acceptance_rate_sum{model_name="tiny"}') == pytest.approx(0.6)


def test_metrics_exist_at_zero_without_a_spec_config(make_engine):
    text = ServerMetrics(AsyncEngine(make_engine(), warmup=False), "tiny").render().decode()
    assert sample(text, 'vllm:spec_decode_num_drafts_total{model_name="tiny"}') == 0
    assert "position=" not in text


def test_scheduler_answer_has_the_speculative_section_and_step_fields(spec_engine, make_engine):
    spec_engine._on_step(spec_step())
    spec_engine._on_step(spec_step(2))
    spec_engine.state = spec_engine._take_state()
    answer = scheduler_state(spec_engine, {})
    spec = answer["speculative"]
    assert spec["config"]["num_speculative_tokens"] == 3 and spec["config"]["method"] == "ngram"
    assert (spec["num_drafts"], spec["draft_tokens"], spec["accepted_tokens"]) == (4, 10, 6)
    assert spec["acceptance_rate"] == pytest.approx(0.6) and spec["mean_accepted_length"] == pytest.approx(2.5)
    assert spec["accepted_per_pos"] == [4, 2]
    step = answer["steps"][-1]
    assert (step["spec_num_drafts"], step["spec_draft_tokens"], step["spec_accepted_tokens"]) == (2, 5, 3)
    assert step["spec_accepted_per_pos"] == [2, 1] and step["spec_propose_seconds"] == pytest.approx(0.001)
    json.dumps(answer)  # the config is plain data
    off = scheduler_state(AsyncEngine(make_engine(), warmup=False), {})["speculative"]
    assert off["config"] is None and off["num_drafts"] == 0 and off["acceptance_rate"] is None


def test_ticks_count_a_verify_row_once_and_sum_spec_figures():
    agg = aggregate_steps([spec_step(), spec_step(2, rows=3, drafts=6, accepted=0, per_pos=())])
    assert (agg["seqs_prefill"], agg["seqs_decode"]) == (0, 5)  # rows, not verified positions
    assert agg["decode_tokens"] == 2 + 5 + 3 + 6
    assert (agg["spec_drafts"], agg["spec_draft_tokens"], agg["spec_accepted_tokens"]) == (5, 11, 3)


def test_step_record_features_price_verify_rows_as_prompt_chunks():
    f = record_features(step_dict(spec_step(), 0.0))
    assert (f.seqs, f.tokens, f.prefill_tokens) == (2, 7, 7)
    assert record_features({"batch_size": 1, "prefill_tokens": 0, "decode_tokens": 1, "decode_kv_tokens": 9,
                            "prefill_kv_tokens": 0}).prefill_tokens == 0  # records without spec fields: as before


# ---------------------------------------------------------------- bench serve

METRICS = """# HELP x
iterserve:spec_decode_num_drafts_total{model_name="m"} 10.0
iterserve:spec_decode_num_draft_tokens_total{model_name="m"} 40.0
iterserve:spec_decode_num_accepted_tokens_total{model_name="m"} 20.0
iterserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 8.0
vllm:spec_decode_num_drafts_total{model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 40.0
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 20.0
"""


def test_bench_reads_the_spec_counters_once_and_reports_the_run_delta():
    before = spec_decode_counters(METRICS)
    assert before == {"num_drafts": 10, "draft_tokens": 40, "accepted_tokens": 20}  # twins not summed
    vllm_only = "\n".join(ln for ln in METRICS.splitlines() if not ln.startswith("iterserve"))
    assert spec_decode_counters(vllm_only) == before
    assert spec_decode_counters("vllm:num_requests_running 1\n") is None  # no spec decode on that server
    after = {"num_drafts": 30, "draft_tokens": 120, "accepted_tokens": 80}
    delta = spec_decode_delta(before, after)
    assert delta["acceptance_rate"] == pytest.approx(60 / 80) and delta["mean_accepted_length"] == pytest.approx(4.0)
    assert spec_decode_delta(None, after) is None
    result = RunResult("http://x", "m", "completions", 1.0, [], [])
    out = io.StringIO()
    print_table(result, out)
    assert "Spec decode" not in out.getvalue()
    result.meta["spec_decode"] = delta
    out = io.StringIO()
    print_table(result, out)
    assert "Spec decode acceptance rate:" in out.getvalue() and "75.0%" in out.getvalue()
    assert "4.00" in out.getvalue()


# ---------------------------------------------------------------- simulator

def decode_bound_profile() -> Profile:
    """A step costs mostly its fixed part: drafting pays while batches are small."""
    return Profile(kind="measured", model="test", dtype="float32",
                   step_model=LinearStepModel([0.01, 0.0002, 0.00005, 0.0, 1e-7, 0.0]),
                   kv_bytes_per_token=1024, max_model_len=2048)


def spec_config(k: int | None, **kw) -> EngineConfig:
    return EngineConfig(max_num_seqs=8, speculative_config=None if k is None else {**SPEC, "num_speculative_tokens": k,
                                                                                      **kw})


def test_acceptance_model_inverts_a_measured_rate():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert alpha_from_rate(expected_accepted(0.7, 4) / 4, 4) == pytest.approx(0.7, abs=1e-6)
    assert alpha_from_rate(0.4, 1) == 0.4
    assert alpha_from_totals(10, 40, expected_accepted(0.6, 4) * 10) == pytest.approx(0.6, abs=1e-6)
    assert alpha_from_totals(0, 0, 0) is None
    policy = SpecPolicy(4, 0.6, seed=3)
    draws = [policy.accepted(4) for _ in range(20000)]
    assert sum(draws) / len(draws) == pytest.approx(expected_accepted(0.6, 4), rel=0.03)
    assert max(draws) == 4 and SpecPolicy(4, 0.0).accepted(4) == 0


def test_simulated_speculation_emits_several_tokens_per_verify_row():
    specs, prof = poisson(60, 2.0, seed=1, input_len=(16, 256), output_len=(64, 128)), decode_bound_profile()
    off = simulate(specs, spec_config(None), prof)
    assert off.stats["speculative"] is None
    on = simulate(specs, spec_config(4), prof, spec_acceptance=0.7)
    s = on.stats["speculative"]
    assert s["acceptance_rate"] == pytest.approx(expected_accepted(0.7, 4) / 4, rel=0.1)
    assert s["mean_accepted_length"] > 2
    a, b = off.result.summary(), on.result.summary()
    assert b["completed"] == a["completed"] == 60 and b["total_output_tokens"] == a["total_output_tokens"]
    assert on.stats["steps"] < off.stats["steps"] and b["tpot_ms"]["mean"] < a["tpot_ms"]["mean"]
    steps = on.timelines[0].steps
    assert sum(st["spec_draft_tokens"] for st in steps) == s["draft_tokens"]
    # drafts that are never right only cost: each verify row is priced as a prompt chunk
    useless = simulate(specs, spec_config(4), prof, spec_acceptance=0.0).result.summary()
    assert useless["tpot_ms"]["mean"] > a["tpot_ms"]["mean"]
    again = simulate(specs, spec_config(4), prof, spec_acceptance=0.7)
    assert again.result.summary() == b  # deterministic


def test_simulated_speculation_switches_off_above_the_batch_limit():
    specs, prof = poisson(60, 50.0, seed=2, input_len=(16, 64), output_len=(64, 96)), decode_bound_profile()
    busy = simulate(specs, spec_config(4, disable_by_batch_size=1), prof, spec_acceptance=0.7)
    free = simulate(specs, spec_config(4, disable_by_batch_size=None), prof, spec_acceptance=0.7)
    assert busy.stats["speculative"]["num_drafts"] < free.stats["speculative"]["num_drafts"] / 2
    for st in busy.timelines[0].steps:  # drafted only in steps planned when at most one request ran
        if st["spec_num_drafts"]:
            assert st["batch_size"] <= 8


def test_simulating_a_spec_config_needs_an_acceptance():
    with pytest.raises(ValueError, match="acceptance"):
        simulate(poisson(2, 1.0, seed=1), spec_config(2), decode_bound_profile())


def test_tune_simulate_searches_num_speculative_tokens(tmp_path, capsys):
    prof_path, out = tmp_path / "p.json", tmp_path / "tune"
    decode_bound_profile().save(prof_path)
    rc = main(["tune", "--simulate", str(prof_path), "--verify", "0", "--max-num-seqs", "8", "--block-size", "16",
               "--num-speculative-tokens", "0,2,4", "--spec-acceptance", "0.8", "--workload", "poisson", "--rate", "2",
               "--num-requests", "30", "--input-len", "64", "--output-len", "96", "--slo", "e2e_p95=60s",
               "--out", str(out), "--raw-dir", str(tmp_path / "raw"), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads((out / "tune.json").read_text())
    assert len(report["simulated"]) == 3 and "spec k" in text
    assert report["chosen"].endswith("spec=4")  # high acceptance, small batches: the most drafts win
    assert "num_speculative_tokens=4" in text
    assert main(["tune", "--simulate", str(prof_path), "--num-speculative-tokens", "0,2", "--out", str(out)]) != 0
    assert "--spec-acceptance" in capsys.readouterr().err


def test_simulate_cli_measures_alpha_from_a_scheduler_answer(tmp_path, capsys):
    prof_path, saved = tmp_path / "p.json", tmp_path / "scheduler.json"
    decode_bound_profile().save(prof_path)
    saved.write_text(json.dumps({"speculative": {"num_drafts": 200, "draft_tokens": 600,
                                                 "accepted_tokens": 175}}))  # 200 x (0.5 + 0.25 + 0.125)
    rc = main(["simulate", "--profile", str(prof_path), "--spec-tokens", "3", "--spec-from", str(saved),
               "--workload", "poisson", "--rate", "2", "--num-requests", "10", "--input-len", "32",
               "--output-len", "32"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    assert "acceptance 0.500 per draft token" in captured.err
    assert "Spec decode acceptance rate:" in captured.out
