"""`iterserve compare`: timelines from step records, the report, bad input, and one real end-to-end
run of both servers on the tiny model."""
from __future__ import annotations

import argparse
import asyncio
import base64
import html
import json
import re
import time

import httpx
import numpy as np
import pytest

from iterserve import cli
from iterserve.bench.compare import seed_shape, server_flags, size_load, write_report
from iterserve.bench.workload import RequestSpec
from iterserve.bench.report import (ROWS, ModeRun, comparison, direction_notes, markdown_table, target_met,
                                    write_plots)
from iterserve.bench.timeline import SchedulerPoller, Timeline


def _step(i: int, t: float, dur: float, batch: int, padding: int = 0, kv: int = 10) -> dict:
    """A decode step as /v1/scheduler reports it (decode_tokens counts padding members, as the engine does)."""
    return {"step": i, "t": t, "t_run": t, "duration": dur, "batch_size": batch, "num_padding": padding,
            "num_running": batch, "num_waiting": 0, "prefill_tokens": 0, "decode_tokens": batch,
            "kv_used_blocks": kv, "kv_total_blocks": 100, "kv_tokens": 5 * kv}


# ---------------------------------------------------------------- timelines

def test_windows_measure_busy_and_useful_time():
    # window [0, 2): steps 0.0-0.5 (4 seqs, 1 padding) and 1.5-2.5 (8 seqs); window [2, 4): 2.0-2.5 only
    tl = Timeline("static", [_step(1, 0.0, 0.5, 4, padding=1), _step(2, 1.5, 1.0, 8, kv=30)])
    w = tl.windows(t_end=4.0, window_s=2.0)
    assert w["t"] == [1.0, 3.0]
    assert w["busy"] == pytest.approx([0.5, 0.25])
    assert w["useful"] == pytest.approx([(0.5 * 0.75 + 0.5) / 2, 0.25])
    assert w["batch"] == pytest.approx([6.0, 8.0])  # time-weighted: (0.5*4 + 0.5*8) / 1.0
    assert w["active"] == pytest.approx([5.5, 8.0])
    assert w["kv_usage"] == pytest.approx([0.2, 0.3])
    assert tl.busy_between(0.0, 3.0) == pytest.approx((0.5, (0.375 + 1.0) / 3))
    stats = tl.step_stats()
    assert stats["padding_share"] == pytest.approx(1 / 12)
    assert stats["saturated_s"] == 0 and stats["saturated_decode_tps"] is None  # nobody waited
    queued = Timeline("static", [{**_step(1, 0.0, 0.5, 4, padding=1), "num_waiting": 3}, _step(2, 1.0, 1.0, 8)])
    assert queued.step_stats()["saturated_decode_tps"] == pytest.approx(3 / 0.5)  # padding decodes nothing
    assert stats["mean_batch_size"] == pytest.approx((0.5 * 4 + 1.0 * 8) / 1.5)
    assert np.isnan(Timeline().windows(1.0, 1.0)["batch"][0])
    last = tl.windows(t_end=3.0, window_s=2.0)  # a shorter last window is measured over its own length
    assert last["t"] == [1.0, 2.5] and last["busy"] == pytest.approx([0.5, 0.5])


def test_poller_keeps_new_steps_once_on_the_run_clock():
    """A fake /v1/scheduler whose clock runs 100 s ahead of the run's: steps map back by the offset."""
    t0 = time.perf_counter()
    seen_since = []
    steps = [{"step": i, "t": 100.0 + 0.1 * i, "duration": 0.05, "batch_size": 2, "num_padding": 0}
             for i in range(1, 7)]

    def handler(request: httpx.Request) -> httpx.Response:
        since = int(request.url.params["since_step"])
        seen_since.append(since)
        uptime = 100.0 + (time.perf_counter() - t0)
        visible = [s for s in steps[: 3 * len(seen_since)] if s["step"] > since - 1]  # one stale step too
        return httpx.Response(200, json={"batching": "continuous", "running": 2, "waiting": 1,
                                         "kv_cache": {"usage": 0.25}, "busy_fraction": 0.5,
                                         "uptime_s": uptime, "step": 6, "steps": visible,
                                         "config": {"max_num_seqs": 16}})

    async def go() -> SchedulerPoller:
        poller = SchedulerPoller("http://fake", t0=t0, start_step=0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            await poller.poll_once(http)
            await poller.poll_once(http)
        return poller

    poller = asyncio.run(go())
    tl = poller.result()
    assert seen_since == [0, 3]
    assert [s["step"] for s in tl.steps] == [1, 2, 3, 4, 5, 6]
    assert tl.clock_offset_s == pytest.approx(-100.0, abs=0.05)
    assert [s["t_run"] for s in tl.steps] == pytest.approx([0.1 * i for i in range(1, 7)], abs=0.05)
    assert tl.snapshots[0].waiting == 1 and tl.snapshots[0].kv_usage == 0.25
    assert tl.config == {"max_num_seqs": 16}
    assert tl.clock_error_s < 0.05
    # re-based onto a run that started 1 s before the poller: everything 1 s later
    snap_t = tl.snapshots[0].t
    rebased = poller.result(t0=t0 - 1.0)
    assert [s["t_run"] for s in rebased.steps] == pytest.approx([1 + 0.1 * i for i in range(1, 7)], abs=0.05)
    assert rebased.snapshots[0].t == pytest.approx(snap_t + 1.0)


# ---------------------------------------------------------------- the report

def _run(mode: str, e2e: list[float], queue: list[float], duration: float, steps: list[dict],
         saturation: dict | None = None) -> ModeRun:
    records = [{"index": i, "scheduled_s": 0.5 * i, "input_len": 10, "max_tokens": 8, "sent_at_s": 0.5 * i,
                "end_at_s": 0.5 * i + e, "ttft_s": q + 0.05, "tpot_s": 0.01, "itl_s": [], "e2e_s": e,
                "output_tokens": 8, "prompt_tokens": 10, "queue_time_s": q, "success": True, "error": ""}
               for i, (e, q) in enumerate(zip(e2e, queue))]
    e2e_ms, q_ms = np.array(e2e) * 1e3, np.array(queue) * 1e3
    stat = lambda v: {"mean": float(v.mean()), "median": float(np.median(v)),  # noqa: E731
                      "p95": float(np.percentile(v, 95)), "p99": float(np.percentile(v, 99)), "count": len(v)}
    summary = {"completed": len(records), "failed": 0, "duration_s": duration, "total_output_tokens": 8 * len(records),
               "request_throughput": len(records) / duration, "output_throughput": 8 * len(records) / duration,
               "peak_concurrency": 3, "e2e_ms": stat(e2e_ms), "queue_time_ms": stat(q_ms),
               "ttft_ms": stat(q_ms + 50)}
    return ModeRun(mode, {"summary": summary, "records": records}, Timeline(mode, steps, config={}), saturation=saturation)


def test_table_changes_and_targets():
    static = _run("static", [2.0, 3.0, 4.0, 5.0], [1.0, 1.0, 2.0, 2.0], 10.0,
                  [_step(1, 0.0, 4.0, 8, padding=4), _step(2, 6.0, 1.0, 8)],
                  saturation={"request_throughput": 0.8, "output_throughput": 40.0, "useful_utilisation": 0.6})
    cont = _run("continuous", [1.0, 1.0, 1.5, 2.0], [0.01, 0.02, 0.01, 0.02], 2.0,
                [_step(1, 0.0, 1.8, 16)],
                saturation={"request_throughput": 2.0, "output_throughput": 100.0, "useful_utilisation": 0.99})
    c = comparison(static, cont)
    assert c["static"]["utilisation"] == pytest.approx(0.5)
    assert c["static"]["useful_utilisation"] == pytest.approx(0.3)
    assert c["continuous"]["utilisation"] == pytest.approx(0.9)
    assert c["static"]["busy_throughput"] == pytest.approx(4 / 5.0)  # completed / busy seconds
    met = {r["key"]: r["target_met"] for r in c["rows"]}
    assert met["utilisation"] is True and met["saturated_request_throughput"] is True  # 2.5x at saturation
    assert met["p95_latency_s"] is True and met["mean_queue_s"] is True
    table = markdown_table(static, cont)
    assert len(table.splitlines()) == 2 + len(ROWS)
    assert "| Throughput over the run (req/s) | 0.400 | 2.000 | +400% (5.00×) |  |" in table
    assert "| Capacity: req/s at saturation | 0.800 | 2.000 | +150% (2.50×) | ≥ 2× met |" in table
    assert "| Useful utilisation at saturation | 60% | 99% | +39 pts |  |" in table
    assert c["direction_notes"] == []  # the case's direction on every row
    # a row against the case's direction says why
    notes = direction_notes({"utilisation": 0.9, "mean_queue_s": 0.1}, {"utilisation": 0.6, "mean_queue_s": 0.2})
    assert len(notes) == 2 and notes[0].startswith("Utilisation (busy fraction): static 90%, continuous 60%")
    assert "time inside engine steps" in notes[0] and "queue" in notes[1]
    assert "| Utilisation (busy fraction) | 50% | 90% | +40 pts | continuous ≥ 80% met |" in table
    # a p95 only 30% lower misses its target
    assert target_met("p95_latency_s", {"p95_latency_s": 1.0}, {"p95_latency_s": 0.7}) is False
    assert target_met("mean_queue_s", {"mean_queue_s": 0.0}, {"mean_queue_s": 0.0}) is None


def test_plots_are_written(tmp_path):
    runs = {"static": _run("static", [2.0, 3.0], [1.0, 0.5], 6.0, [_step(1, 0.0, 1.0, 8, 2), _step(2, 1.0, 1.0, 8, 5)]),
            "continuous": _run("continuous", [1.0, 1.2], [0.0, 0.0], 3.0, [_step(1, 0.0, 2.0, 12)])}
    paths = write_plots(runs, tmp_path, window_s=1.0)
    assert len(paths) == 5
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_report_html_is_one_self_contained_page(tmp_path):
    runs = {"static": _run("static", [2.0, 3.0], [1.0, 0.5], 6.0, [_step(1, 0.0, 1.0, 8, 2), _step(2, 1.0, 1.0, 8, 5)]),
            "continuous": _run("continuous", [1.0, 1.2], [0.0, 0.0], 3.0, [_step(1, 0.0, 2.0, 12)])}
    table = write_report(runs, tmp_path, 1.0, {"model": "tiny<model>", "command": "iterserve compare"})
    page = (tmp_path / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 5
    for png in tmp_path.glob("*.png"):
        assert base64.b64encode(png.read_bytes()).decode() in page
    assert "http" not in page.replace("data:image/png", "")  # nothing linked from elsewhere
    assert "tiny&lt;model&gt;" in page  # escaped
    rows = re.findall(r"<tr>(.*?)</tr>", page, re.S)
    assert len(rows) == 1 + len(ROWS)
    cells = [re.findall(r"<td>(.*?)</td>", r) for r in rows[1:]]
    assert [c[0] for c in cells] == [r.label for r in ROWS]
    for line, c in zip(table.splitlines()[2:], cells):  # the same cells as the Markdown table
        assert line == "| " + " | ".join(html.unescape(x) for x in c) + " |"


def test_only_the_batching_flags_differ_between_the_servers():
    args = argparse.Namespace(max_input_len=1024, max_output_len=256, server_args="--block-size 32 --threads 2",
                              max_batch_size=8, batch_timeout=100.0, max_num_seqs=16)
    static, cont = server_flags("static", args), server_flags("continuous", args)
    assert static[:7] == ["--batching", "static", "--max-batch-size", "8", "--batch-timeout", "100",
                          "--max-input-len"]
    assert cont[:4] == ["--batching", "continuous", "--max-num-seqs", "16"]
    assert static[6:] == cont[4:] == ["--max-input-len", "1024", "--max-output-len", "256",
                                       "--block-size", "32", "--threads", "2"]


def test_the_seed_shape():
    shape = seed_shape(base_rate=0.5, num_requests=36)
    assert shape["peak_rate"] == 3.0
    mean = 0.5 * 0.8 + 3.0 * 0.2
    assert shape["burst_every"] == pytest.approx(36 / (3 * mean)) and shape["burst_len"] == pytest.approx(
        0.2 * shape["burst_every"])


def test_load_sizing_sets_the_rate_or_the_trace_time_scale():
    trace = argparse.Namespace(workload="trace", time_scale=None, rate=None)
    size_load(trace, 0.25, [RequestSpec(i, float(t), 10, 10) for i, t in enumerate([0, 1, 2, 3])])
    assert trace.time_scale == pytest.approx(4.0)  # 1 req/s at scale 1 -> 0.25 req/s
    bursty = argparse.Namespace(workload="bursty", rate=None, peak_rate=None, burst_every=None, burst_len=20.0,
                                num_requests=36)
    size_load(bursty, 1.0, [])
    assert bursty.rate == pytest.approx(0.5) and bursty.peak_rate == pytest.approx(3.0)
    assert bursty.burst_every == pytest.approx(12.0) and bursty.burst_len == 20.0  # given flags are kept


# ---------------------------------------------------------------- bad input: one line, exit 2

def _one_line_error(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    last = err.splitlines()[-1]  # progress lines may come first; the error is one line at the end
    assert last.startswith("error: ")
    return last


def test_unreadable_trace(capsys, tmp_path):
    err = _one_line_error(capsys, ["compare", "--trace", str(tmp_path / "missing.csv"), "--out", str(tmp_path)])
    assert "missing.csv" in err


def test_trace_with_an_unknown_column(capsys, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("when,prompt_words,answer_words\n0,10,5\n1,12,6\n")
    err = _one_line_error(capsys, ["compare", "--workload", "trace", "--trace", str(trace), "--out", str(tmp_path)])
    assert "timestamp column" in err


def test_unreachable_server(capsys, tmp_path, tiny_model_dir):
    err = _one_line_error(capsys, ["compare", "--model", str(tiny_model_dir), "--num-requests", "2",
                                   "--static-url", "http://127.0.0.1:9", "--continuous-url", "http://127.0.0.1:9",
                                   "--out", str(tmp_path), "--no-progress"])
    assert "127.0.0.1:9" in err and "refused" in err


def test_a_model_that_does_not_load(capsys, tmp_path):
    err = _one_line_error(capsys, ["compare", "--model", str(tmp_path / "no-such-model"), "--num-requests", "2",
                                   "--out", str(tmp_path), "--no-progress"])
    assert "no-such-model" in err


# ---------------------------------------------------------------- end to end, real servers

@pytest.mark.slow
def test_compare_end_to_end_on_the_tiny_model(capsys, tmp_path, tiny_model_dir):
    out, raw = tmp_path / "cmp", tmp_path / "raw"
    # the default path: each server's capacity at saturation first; static's sizes the bursty load
    rc = cli.main(["compare", "--model", str(tiny_model_dir), "--out", str(out), "--raw-dir", str(raw),
                   "--num-requests", "12",
                   "--input-len", "8:32", "--output-len", "4:24", "--max-batch-size", "4", "--max-num-seqs", "8",
                   "--load", "0.8", "--saturation-requests", "16", "--window", "0.5", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    table = captured.out
    assert "| metric | static | continuous | change | target |" in table
    assert "| Completed / failed | 12 / 0 | 12 / 0 |" in table
    for png in ("utilisation", "batch_size", "latency_cdf", "queue_time", "kv_usage"):
        assert (out / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 5
    summary = json.loads((out / "compare.json").read_text())
    assert summary["workload"]["kind"] == "bursty" and summary["table"] in table
    # the summary says where and what ran; the raw records stay out of --out
    assert summary["raw_dir"] == str(raw) and summary["host"]["cores"] >= 1 and summary["date"]
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".json") == ["compare.json"]
    assert (out / "compare.json").stat().st_size < 20_000
    assert sorted(p.name for p in (raw / "logs").iterdir()) == ["server-continuous.log", "server-static.log"]
    cap = summary["capacity"]
    assert cap["static"]["completed"] == cap["continuous"]["completed"] == 16
    assert cap["static"]["request_throughput"] > 0 and cap["load"] == 0.8
    assert summary["workload"]["base_rate"] * 2 == pytest.approx(0.8 * cap["static"]["request_throughput"])
    rows = {r["key"]: r for r in summary["rows"]}
    assert rows["saturated_request_throughput"]["static"] == cap["static"]["request_throughput"]
    # every row against the case's direction is explained, in the output and the summary
    for note in summary["direction_notes"]:
        assert f"- {note}" in table
    runs = {m: json.loads((raw / f"{m}.json").read_text()) for m in ("static", "continuous")}
    for mode, run in runs.items():
        assert run["timeline"]["batching"] == mode
        assert run["result"]["summary"]["completed"] == 12
        steps = run["timeline"]["steps"]
        slack = 0.2 + run["timeline"]["clock_error_s"]  # the server's clock is mapped over HTTP round trips
        # warm-up excluded; the engine stepped only while the client had requests in flight
        assert steps and steps[0]["t_run"] >= min(r["sent_at_s"] for r in run["result"]["records"]) - slack
        assert steps[-1]["t_run"] <= max(r["end_at_s"] for r in run["result"]["records"]) + slack
        assert all(r["queue_time_s"] is not None for r in run["result"]["records"])
    static_steps = runs["static"]["timeline"]["steps"]
    assert max(s["batch_size"] for s in static_steps) <= 4
    assert max(s["batch_size"] for s in runs["continuous"]["timeline"]["steps"]) <= 8
    assert sum(s["num_padding"] for s in static_steps) > 0
    assert not any(s["num_padding"] for s in runs["continuous"]["timeline"]["steps"])
    assert "--batching static" in " ".join(runs["static"]["server_flags"])
    # --replot redraws the same table from the raw records that compare.json points to
    (out / "latency_cdf.png").unlink()
    assert cli.main(["compare", "--replot", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == table.strip()
    assert (out / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"


def test_summaries_are_written_without_machine_paths(tmp_path):
    """Results go into git: the home folder and the checkout's folder are written as ~ and ."""
    from pathlib import Path

    from iterserve.bench.summary import write_json

    here = str(Path(__file__).resolve().parents[1])
    data = {"model": str(Path.home() / "models" / "m.gguf"), "out": [here + "/results/x.json"],
            str(Path.home()): 1, "n": 3, "dir": Path(here) / "runs"}
    written = json.loads(write_json(tmp_path / "s.json", data).read_text())
    assert written == {"model": "~/models/m.gguf", "out": ["./results/x.json"], "~": 1, "n": 3, "dir": "./runs"}


def test_summaries_keep_one_record_per_line_and_read_back_whole(tmp_path):
    """A summary's records of at most two levels (a cell's metrics with its load averages, a table
    row) sit on one line each; deeper structure is indented; the file reads back equal."""
    from iterserve.bench.summary import write_json

    data = {"cells": {"a c16": {"iterserve": {"tok_s": 1.5, "load": [0.5, 0.6, 0.7], "cpu": {"share": 0.01}},
                                "vllm": {"tok_s": 1.0, "load": []}}},
            "rows": [["model", "x"], ["m", "1.5x"]], "empty": {}, "n": None}
    text = write_json(tmp_path / "s.json", data).read_text()
    assert json.loads(text) == data
    lines = text.splitlines()
    assert '   "iterserve": {"tok_s": 1.5, "load": [0.5, 0.6, 0.7], "cpu": {"share": 0.01}},' in lines
    assert ' "rows": [["model", "x"], ["m", "1.5x"]],' in lines
    assert lines[0] == "{" and lines[-1] == "}"
