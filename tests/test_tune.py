"""`iterserve tune`: the sweep's bookkeeping on made-up results, and one real 2x2 sweep on the tiny model."""
from __future__ import annotations

import json
import time

import pytest

from iterserve.bench import tune
from iterserve.sim import tune_simulated
from iterserve.bench.client import parse_slo
from iterserve.bench.tune import ConfigResult, GridPoint, KvStats, best_config, kv_stats, markdown_table


def _step(i, used, tokens, batch=2, total=100, dur=0.01):
    return {"step": i, "t": i * dur, "duration": dur, "batch_size": batch, "kv_used_blocks": used,
            "kv_total_blocks": total, "kv_tokens": tokens, "num_running": batch, "num_waiting": 0}


def test_kv_stats_weights_fragmentation_by_step_time():
    steps = [_step(0, 4, 64), _step(1, 4, 32, dur=0.03), _step(2, 0, 0, batch=0)]  # idle step ignored
    steps[1]["num_preempted"] = 1
    kv = kv_stats(steps, block_size=16)
    assert kv.steps == 2 and kv.preemptions == 1
    assert kv.internal_fragmentation == pytest.approx((0.0 * 0.01 + 0.5 * 0.03) / 0.04)
    assert kv.kv_usage_peak == pytest.approx(0.04)
    assert kv.mean_batch == 2.0 and kv.mean_step_ms == pytest.approx(20.0)
    assert kv_stats([], 16) == KvStats()


def _result(seqs, block, goodput, thr, met, status="ok"):
    lat = {"mean": 100.0, "median": 90.0, "p95": 150.0, "p99": 160.0, "count": 4}
    summary = {"goodput": goodput, "output_throughput": thr, "request_throughput": 1.0, "e2e_ms": lat,
               "ttft_ms": lat, "queue_time_ms": lat} if status == "ok" else {}
    return ConfigResult(GridPoint(seqs, block), status, summary=summary,
                        kv=KvStats(1, 2.0, 10.0, 0.1, 0.2, 0.05), slo_met=met)


def test_best_config_prefers_slo_then_goodput_then_throughput():
    results = [_result(4, 8, 3.0, 90, False), _result(8, 8, 2.0, 80, True), _result(8, 16, 2.0, 85, True),
               _result(16, 8, 0, 0, False, status="skipped")]
    best, met = best_config(results)
    assert met and best.point == GridPoint(8, 16)
    best, met = best_config([r for r in results if not r.slo_met])
    assert not met and best.point == GridPoint(4, 8)
    assert best_config([results[-1]]) == (None, False)
    table = markdown_table(results).splitlines()
    assert len(table) == 2 + len(results) and "missed" in table[2] and "skipped" in table[-1]


def test_best_config_without_a_winner_takes_the_closest_to_the_percentile_slo():
    """Nothing meets e2e p95 <= 2 s: the choice is the lowest p95 / 2 s, not the most goodput."""
    def missed(seqs, p95_ms, goodput):
        r = _result(seqs, 16, goodput, 100.0, False)
        r.summary["slos"] = [{"slo": "e2e_p95=2s", "percentile": 95.0, "threshold_ms": 2000.0, "run_value_ms": p95_ms}]
        return r

    results = [missed(4, 9000.0, 0.5), missed(8, 5200.0, 0.3), missed(16, 5700.0, 0.4)]
    best, met = best_config(results)
    assert not met and best.point == GridPoint(8, 16)
    assert tune.slo_shortfall(best) == pytest.approx(2.6)
    assert [r.point.max_num_seqs for r in tune.ranked(results)] == [8, 16, 4]
    results.append(missed(32, None, 0.9))  # no value at all: farthest away
    assert tune.ranked(results)[-1].point.max_num_seqs == 32
    met_one = _result(2, 16, 0.1, 10.0, True)
    assert best_config(results + [met_one]) == (met_one, True)  # meeting the SLO still beats everything
    assert "came closest, at 2.60x" in tune.explain(results, best, False, [parse_slo("e2e_p95=2s")])[0]


def test_tune_simulate_chooses_the_best_verified_replay_not_the_simulated_tie():
    """The simulator prices two block sizes alike (a tie, the first wins); the replays of the
    finalists decide. With no replay, or none completed, the simulated best stands."""
    def missed(seqs, block, p95_ms):
        r = _result(seqs, block, 0.0, 100.0, False)
        r.summary["slos"] = [{"slo": "e2e_p95=2s", "percentile": 95.0, "threshold_ms": 2000.0, "run_value_ms": p95_ms}]
        return r

    simulated = [missed(8, 16, 8400.0), missed(8, 32, 8400.0), missed(16, 16, 9700.0), missed(4, 16, 12800.0)]
    finalists = tune.ranked(simulated)[:3]
    assert [(r.point.max_num_seqs, r.point.block_size) for r in finalists] == [(8, 16), (8, 32), (16, 16)]
    replays = {GridPoint(8, 16): missed(8, 16, 9100.0), GridPoint(8, 32): missed(8, 32, 7700.0),
               GridPoint(16, 16): missed(16, 16, 9400.0)}
    chosen, source = tune_simulated.simulated_choice(simulated, [replays[r.point] for r in finalists])
    assert chosen is replays[GridPoint(8, 32)] and source == "measured best of the 3 verified"
    chosen, source = tune_simulated.simulated_choice(simulated, [])
    assert chosen is simulated[0] and "nothing verified" in source
    failed = _result(8, 16, 0, 0, False, status="failed")
    chosen, source = tune_simulated.simulated_choice(simulated, [failed])
    assert chosen is simulated[0] and "no replay completed" in source


def test_budget_skips_remaining_configs(monkeypatch):
    ran = []

    def fake_run(point, *args, **kwargs):
        ran.append(point)
        time.sleep(0.1)  # longer than the whole budget
        return _result(point.max_num_seqs, point.block_size, 1.0, 10.0, True)

    monkeypatch.setattr(tune, "run_config", fake_run)
    points = [GridPoint(s, b) for s in (4, 8) for b in (8, 16)]
    from iterserve.bench.workload import RequestSpec

    out = tune.sweep(points, "m", [], [RequestSpec(0, 0.0, 8, 8, "x")], [parse_slo("e2e_p95=2s")],
                     budget_minutes=0.05 / 60, progress=False)
    assert ran == points[:1]
    assert [r.status for r in out.results] == ["ok", "skipped", "skipped", "skipped"]
    assert out.skipped_for_budget == 3 and "budget" in out.conclusion[-1]


@pytest.mark.slow
def test_tune_2x2_on_tiny_model_end_to_end(tiny_model_dir, tmp_path, capsys):
    from iterserve.cli import main

    out, raw = tmp_path / "tune", tmp_path / "raw"
    rc = main(["tune", "--model", str(tiny_model_dir), "--max-num-seqs", "2,4", "--block-size", "8,16",
               "--server-args", "--kv-cache-memory 64MiB", "--workload", "constant", "--rate", "20",
               "--num-requests", "8", "--input-len", "24", "--output-len", "12:40", "--slo", "e2e_p95=5s",
               "--run-grace", "60", "--out", str(out), "--raw-dir", str(raw), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    report = json.loads((out / "tune.json").read_text())
    assert len(report["results"]) == 4
    for r in report["results"]:
        assert r["status"] == "ok", r
        s = r["summary"]
        assert s["completed"] == 8 and s["failed"] == 0
        assert s["output_throughput"] > 0 and s["e2e_ms"]["p95"] > 0
        assert r["kv"]["steps"] > 0 and 0 < r["kv"]["kv_usage_peak"] <= 1
        assert 0 <= r["kv"]["internal_fragmentation"] < 1
        assert r["kv"]["mean_batch"] <= r["config"]["max_num_seqs"]  # the server honoured the grid value
    # block 16 leaves more slots unfilled than block 8 for the same requests
    frag = {(r["config"]["max_num_seqs"], r["config"]["block_size"]): r["kv"]["internal_fragmentation"]
            for r in report["results"]}
    assert frag[(4, 16)] > frag[(4, 8)]
    assert report["best"] is not None and report["conclusion"][0].startswith("best:")
    assert "| max-num-seqs |" in text and "best:" in text
    assert (out / "tune.md").read_text().count("\n|") >= 5
    assert (out / "heatmap.png").stat().st_size > 10_000
    assert len(list((raw / "logs").glob("*.log"))) == 4
    # the summary has no per-request records; the raw file has all of them, and says where it ran
    assert all("requests" not in r for r in report["results"]) and report["raw_dir"] == str(raw)
    assert report["host"]["cores"] >= 1 and report["date"]
    full = json.loads((raw / "tune.json").read_text())
    assert [len(r["requests"]) for r in full["results"]] == [8] * 4
    assert [r["summary"] for r in full["results"]] == [r["summary"] for r in report["results"]]


def test_config_result_round_trips_through_json():
    r = _result(8, 16, 2.0, 80.0, True)
    r.requests = [{"index": 0, "e2e_s": 1.0}]
    assert ConfigResult.from_dict(json.loads(json.dumps(r.to_dict()))) == r
