"""Load client against a fake streaming server whose delays are known, plus SLOs and the CLI."""
from __future__ import annotations

import asyncio
import io
import json
import re
import socket
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from iterserve.bench import cli_bench
from iterserve.bench.client import (ClientError, RequestRecord, RunResult, parse_slo,
                                    print_table, run_load)
from iterserve.bench.workload import RequestSpec

TOL_S = 0.06  # absolute slack for a shared 2-core machine


# ---------------------------------------------------------------- fake server

def _params(prompt: str) -> dict[str, float]:
    """The prompt tells the fake server how to behave: `ttft=0.2 gap=0.03 status=500 usage=0`."""
    found = dict(re.findall(r"(\w+)=([0-9.]+)", prompt))
    defaults = {"ttft": 0.01, "gap": 0.005, "status": 200, "usage": 1, "qt": 0.0}
    return {k: float(found.get(k, v)) for k, v in defaults.items()}


def _event(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj)
    body = f"data: {data}\n\n".encode()
    return b"%x\r\n%s\r\n" % (len(body), body)


async def _reply(writer: asyncio.StreamWriter, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: "
                 f"{len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await writer.drain()


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        method, target, _ = (await reader.readline()).decode().split()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, value = line.decode().split(":", 1)
            headers[key.strip().lower()] = value.strip()
        if target == "/v1/models":
            return await _reply(writer, 200, {"object": "list", "data": [{"id": "fake-model"}]})
        body = json.loads(await reader.readexactly(int(headers["content-length"])))
        chat = target.endswith("/chat/completions")
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        p = _params(prompt)
        if p["status"] != 200:
            return await _reply(writer, int(p["status"]), {"error": {"message": "boom"}})
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        await asyncio.sleep(p["ttft"])
        n = body["max_tokens"]
        for i in range(n):
            choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else \
                {"index": 0, "text": f" t{i}"}
            writer.write(_event({"choices": [choice]}))
            await writer.drain()
            if i < n - 1:
                await asyncio.sleep(p["gap"])
        if p["usage"]:
            writer.write(_event({"choices": [], "iterserve": {"queue_time": p["qt"]},
                                 "usage": {"prompt_tokens": 11, "completion_tokens": n}}))
        writer.write(_event("[DONE]") + b"0\r\n\r\n")
        await writer.drain()
    finally:
        writer.close()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The fake server on its own event loop in a thread, so the client's loop is undisturbed."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    port: list[int] = []

    def serve() -> None:
        srv = loop.run_until_complete(asyncio.start_server(_handle, "127.0.0.1", 0))
        port.append(srv.sockets[0].getsockname()[1])
        started.set()
        loop.run_forever()
        srv.close()
        leftovers = asyncio.all_tasks(loop)  # handlers of requests the client gave up on
        for task in leftovers:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(5)
    yield f"http://127.0.0.1:{port[0]}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _spec(i: int, arrival: float, out: int, **behaviour: float) -> RequestSpec:
    prompt = " ".join(f"{k}={v}" for k, v in behaviour.items()) or "hello"
    return RequestSpec(i, arrival, 4, out, prompt)


def _run(base_url: str, specs: list[RequestSpec], **kwargs) -> RunResult:
    return asyncio.run(run_load(base_url, specs, progress=False, **kwargs))


# ---------------------------------------------------------------- timings

@pytest.mark.slow  # wall-clock bounds
def test_ttft_tpot_e2e_and_percentiles(server: str) -> None:
    ttfts = [0.05 + 0.04 * i for i in range(6)]
    gap, out = 0.03, 5
    specs = [_spec(i, 0.1 * i, out, ttft=t, gap=gap, qt=0.01 * i) for i, t in enumerate(ttfts)]
    result = _run(server, specs)
    assert result.model == "fake-model" and result.completed == 6 and result.failed == 0
    for rec, ttft in zip(result.records, ttfts):
        assert rec.success and rec.output_tokens == out and rec.prompt_tokens == 11
        assert rec.ttft_s == pytest.approx(ttft, abs=TOL_S)
        assert rec.e2e_s == pytest.approx(ttft + (out - 1) * gap, abs=TOL_S)
        assert rec.tpot_s == pytest.approx((rec.e2e_s - rec.ttft_s) / (out - 1))
        assert rec.tpot_s == pytest.approx(gap, abs=0.015)
        assert len(rec.itl_s) == out - 1 and np.mean(rec.itl_s) == pytest.approx(gap, abs=0.015)
        assert rec.queue_time_s == pytest.approx(0.01 * rec.index)
        assert rec.sent_at_s == pytest.approx(rec.scheduled_s, abs=TOL_S)
    s = result.summary()
    assert s["ttft_ms"]["median"] == pytest.approx(np.percentile(ttfts, 50) * 1e3, abs=TOL_S * 1e3)
    assert s["ttft_ms"]["p95"] == pytest.approx(np.percentile(ttfts, 95) * 1e3, abs=TOL_S * 1e3)
    measured = [r.e2e_s * 1e3 for r in result.records]
    assert s["e2e_ms"]["p99"] == pytest.approx(np.percentile(measured, 99))
    assert s["itl_ms"]["count"] == 6 * (out - 1)
    assert s["queue_time_ms"]["mean"] == pytest.approx(25.0)
    assert s["request_throughput"] == pytest.approx(6 / result.duration_s)
    assert s["output_throughput"] == pytest.approx(6 * out / result.duration_s)
    assert s["total_token_throughput"] == pytest.approx(6 * (out + 11) / result.duration_s)
    dumped = json.loads(result.to_json())
    assert len(dumped["records"]) == 6 and dumped["summary"]["completed"] == 6


@pytest.mark.slow  # wall-clock bounds
def test_open_loop_chat_without_usage(server: str) -> None:
    """Requests go out on schedule while earlier ones still stream; tokens counted from chunks."""
    specs = [_spec(i, 0.03 * i, 3, ttft=0.4, usage=0) for i in range(5)]
    result = _run(server, specs, endpoint="chat", model="given")
    assert result.model == "given" and result.completed == 5
    assert all(r.output_tokens == 3 and r.prompt_tokens is None for r in result.records)
    assert all(r.sent_at_s == pytest.approx(r.scheduled_s, abs=TOL_S) for r in result.records)
    assert result.summary()["peak_concurrency"] == 5


def test_http_errors_count_as_failed(server: str) -> None:
    specs = [_spec(i, 0.0, 2, status=500 if i % 2 else 200) for i in range(6)]
    result = _run(server, specs)
    assert (result.completed, result.failed) == (3, 3)
    assert all(r.error.startswith("HTTP 500") for r in result.records if not r.success)
    table = io.StringIO()
    print_table(result, table)
    assert "Failed requests:" in table.getvalue() and "error x3: HTTP 500" in table.getvalue()


@pytest.mark.slow  # wall-clock bounds
def test_run_timeout_cancels_running_and_unsent(server: str) -> None:
    specs = [_spec(0, 0.0, 2, ttft=5.0), _spec(1, 10.0, 2)]
    result = _run(server, specs, timeout_s=0.3)
    assert result.failed == 2 and result.duration_s < 2.0
    assert [r.error for r in result.records] == ["cancelled: run timeout", "not sent: run timeout"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_raises_client_error() -> None:
    port = _free_port()
    with pytest.raises(ClientError) as info:
        _run(f"http://127.0.0.1:{port}/v1", [_spec(0, 0.0, 1)])
    assert str(info.value) == f"cannot reach http://127.0.0.1:{port}/v1/models: connection refused"


# ---------------------------------------------------------------- SLOs and goodput

def _record(i: int, ttft: float, e2e: float, tpot: float | None, ok: bool = True) -> RequestRecord:
    return RequestRecord(i, 0.0, 4, 8, sent_at_s=0.0, end_at_s=e2e, ttft_s=ttft, tpot_s=tpot,
                         e2e_s=e2e, output_tokens=8, success=ok)


def test_parse_slo_forms() -> None:
    assert parse_slo("ttft=500ms").threshold_s == pytest.approx(0.5)
    assert parse_slo("tpot:50").threshold_s == pytest.approx(0.05)  # bare number: ms
    slo = parse_slo("e2e_p95=2s")
    assert (slo.metric, slo.threshold_s, slo.percentile) == ("e2e", 2.0, 95.0)
    assert parse_slo("queue_time_p99=1s").metric == "queue_time"
    for bad in ("latency=1s", "ttft", "ttft=fast", "e2e_p0=1s"):
        with pytest.raises(ClientError, match="bad --slo"):
            parse_slo(bad)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = [_record(0, 0.1, 1.0, 0.02), _record(1, 0.6, 1.0, 0.02),   # ttft too slow
               _record(2, 0.1, 3.0, 0.02), _record(3, 0.1, 1.5, None),   # e2e too slow; 1 token
               _record(4, 0.1, 1.0, 0.08), _record(5, 0.1, 0.5, 0.01, ok=False)]
    result = RunResult("u", "m", "completions", 2.0, records,
                       [parse_slo(s) for s in ("ttft=500ms", "tpot=50ms", "e2e_p95=2s")])
    report = result.slo_report()
    assert report["good_requests"] == 2 and report["goodput"] == pytest.approx(1.0)
    e2e = report["slos"][2]
    e2e_values = [1.0, 1.0, 3.0, 1.5, 1.0]
    assert e2e["requests_met"] == 4
    assert e2e["run_value_ms"] == pytest.approx(np.percentile(e2e_values, 95) * 1e3)
    assert e2e["run_met"] is False
    assert result.summary()["failed"] == 1


# ---------------------------------------------------------------- command line

def test_cli_unreadable_trace_is_one_error_line(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nope.csv"
    assert cli_bench.main(["serve", "--base-url", "http://127.0.0.1:9", "--trace",
                           str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: trace file not found: {missing}\n"


def test_cli_runs_and_writes_json(server: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "res" / "run.json"
    code = cli_bench.main(["serve", "--base-url", server, "--workload", "constant", "--rate",
                           "50", "--num-requests", "4", "--input-len", "8", "--output-len", "3",
                           "--slo", "ttft=2s", "e2e_p99=5s", "--no-progress",
                           "--result-json", str(out)])
    assert code == 0
    assert "Successful requests:" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["summary"]["completed"] == 4 and saved["summary"]["good_requests"] == 4
    assert saved["meta"]["workload"]["kind"] == "constant" and len(saved["records"]) == 4
