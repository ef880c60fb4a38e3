"""The batching probe: its classifier on simulated servers, and its verdict against real iterserve
servers (continuous, static, and serial = continuous with one sequence) on the tiny model."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx

import numpy as np
import pytest

from iterserve.bench.probe_analysis import Timing, classify

TPOT, TTFT = 0.01, 0.02


# ---------------------------------------------------------------- a tiny discrete-event server model

@dataclass
class Arrival:
    name: str
    phase: str
    sent: float
    tokens: int


def _finish(a: Arrival, start: float) -> Timing:
    first = start + TTFT
    return Timing(a.name, a.phase, a.sent, first, first + (a.tokens - 1) * TPOT, a.tokens, a.tokens)


def simulate(kind: str, arrivals: list[Arrival], batch: int = 4, timeout: float = 0.2) -> list[Timing]:
    """Timings a continuous, static (fill-or-timeout) or serial server would give these arrivals."""
    pending = sorted(arrivals, key=lambda a: a.sent)
    if kind == "continuous":  # starts every request at once (enough slots)
        return [_finish(a, a.sent) for a in pending]
    out: list[Timing] = []
    free_at = 0.0
    size = 1 if kind == "serial" else batch
    while pending:
        start = max(free_at, pending[0].sent)
        if kind == "static":
            nth = pending[min(size, len(pending)) - 1].sent
            start = max(free_at, min(pending[0].sent + timeout, nth))
        members = [a for a in pending if a.sent <= start][:size]
        pending = [a for a in pending if a not in members]
        done = [_finish(a, start) for a in members]
        out += done
        free_at = max(t.end for t in done)
    return out


def probe_arrivals(long_tokens: int = 300, short_tokens: int = 16) -> list[Arrival]:
    """The probe's plan: a long request, 4 shorts while it runs, then a mixed burst of 8."""
    shorts = [Arrival(f"short-{i}", "overlap", 0.25 + f * long_tokens * TPOT, short_tokens)
              for i, f in enumerate((0.2, 0.4, 0.6, 0.8), 1)]
    burst = [Arrival(f"burst-{i}", "burst", 20.0, short_tokens * m)
             for i, m in enumerate((1, 4, 2, 1, 4, 1, 2, 1), 1)]
    return [Arrival("long", "overlap", 0.0, long_tokens), *shorts, *burst]


def jitter(timings: list[Timing], scale: float, seed: int) -> list[Timing]:
    """Client-side observation noise on every timestamp."""
    rng = np.random.default_rng(seed)
    out = []
    for t in timings:
        d = rng.uniform(0, scale, 2)
        out.append(Timing(t.name, t.phase, t.sent, t.first + d[0], max(t.first + d[0], t.end + d[1]),
                          t.tokens, t.max_tokens))
    return out


# ---------------------------------------------------------------- classifier on simulated servers

@pytest.mark.parametrize("kind", ["continuous", "static", "serial"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_classifier_names_simulated_servers(kind, seed):
    timings = jitter(simulate(kind, probe_arrivals()), scale=0.005, seed=seed)
    v = classify(timings, tpot=TPOT, ttft=TTFT)
    assert v.verdict == kind, v.evidence
    assert v.confidence >= 0.6
    assert v.evidence


def test_continuous_evidence_says_shorts_finished_first():
    v = classify(simulate("continuous", probe_arrivals()), tpot=TPOT, ttft=TTFT)
    assert v.stats["joined"] == v.stats["join_candidates"] == 4
    assert any("4 of 4" in line and "did not wait" in line for line in v.evidence)


def test_static_evidence_shows_sawtooth_and_waves():
    v = classify(simulate("static", probe_arrivals()), tpot=TPOT, ttft=TTFT)
    joins = v.stats["joins"]
    assert [j["joined"] for j in joins] == [False] * 4
    # first tokens all right after the long one's end: TTFT falls as arrival moves later
    ttfts = [j["ttft"] for j in sorted(joins, key=lambda j: j["sent"])]
    assert ttfts == sorted(ttfts, reverse=True)
    assert any("saw-tooth" in line for line in v.evidence)
    assert any("2 wave(s) (4, 4)" in line for line in v.evidence)


def test_serial_evidence_says_no_overlap():
    v = classify(simulate("serial", probe_arrivals()), tpot=TPOT, ttft=TTFT)
    assert v.stats["overlapping_requests"] == 0
    assert any("strictly serial" in line for line in v.evidence)


def test_static_with_batch_of_one_is_serial():
    """A static batcher of size 1 is indistinguishable from (and is) a serial server."""
    v = classify(simulate("static", probe_arrivals(), batch=1), tpot=TPOT, ttft=TTFT)
    assert v.verdict == "serial"


def test_unknown_when_nothing_ran_together():
    solo = [Timing(f"r{i}", "burst", i * 1.0, i * 1.0 + 0.02, i * 1.0 + 0.2, 16, 16) for i in range(4)]
    v = classify(solo, tpot=TPOT, ttft=TTFT)
    assert v.verdict == "unknown" and v.confidence == 0.0


def test_failed_requests_are_reported_and_ignored():
    timings = simulate("continuous", probe_arrivals())
    timings.append(Timing("short-9", "overlap", 1.0, error="HTTP 503: busy"))
    v = classify(timings, tpot=TPOT, ttft=TTFT)
    assert v.verdict == "continuous"
    assert v.stats["failed"] == 1 and "HTTP 503" in v.evidence[0]
    json.dumps(v.to_dict())  # the JSON report must be serialisable


# ---------------------------------------------------------------- pieces of the experiment

def test_plan_scales_the_long_request_to_the_server_speed():
    from iterserve.bench.probe import make_plan

    slow = make_plan(ttft=0.05, tpot=0.05, ignore_eos=True, long_seconds=3.0)
    fast = make_plan(ttft=0.01, tpot=0.002, ignore_eos=True, long_seconds=3.0)
    assert slow.long_tokens == 64 and slow.short_tokens == 8  # floor: 60 tokens would do
    assert fast.long_tokens == 1024 and fast.short_tokens == 16  # capped
    assert make_plan(0.01, 0.005, True, 3.0).long_tokens == 600
    assert fast.burst_tokens == [16, 64, 32, 16, 64, 16, 32, 16]


@pytest.mark.parametrize("text,expected", [
    ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3.0\n',
     ("vllm:num_requests_running", 3)),
    ("# HELP llamacpp:requests_processing Number of requests processing.\n"
     "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n",
     ("llamacpp:requests_processing", 2)),
    ("# TYPE other gauge\nother 1\n", None),
])
def test_running_gauge_is_read_from_prometheus_text(text, expected):
    from iterserve.bench.probe import running_gauge

    assert running_gauge(text) == expected


def test_probe_unreachable_server_is_a_one_line_error(capsys):
    from iterserve.bench.launcher import free_port
    from iterserve.cli import main

    assert main(["probe", "--base-url", f"http://127.0.0.1:{free_port()}", "--time-limit", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "connection refused" in err and "\n" not in err


class FakeServer:
    """A generic OpenAI-compatible server in an httpx transport: SSE at a fixed time per token, no
    metrics, and it refuses `ignore_eos` (as OpenAI's API does). serial=True serves one at a time."""

    def __init__(self, serial: bool, tpot: float = 0.004) -> None:
        self.lock = asyncio.Lock() if serial else None
        self.tpot = tpot
        self.refused = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake"}]})
        if request.url.path != "/v1/completions":
            return httpx.Response(404)
        body = json.loads(request.content)
        if "ignore_eos" in body:
            self.refused += 1
            return httpx.Response(400, json={"error": {"message": "Unrecognized request argument: ignore_eos"}})
        return httpx.Response(200, content=self.stream(body["max_tokens"]),
                              headers={"content-type": "text/event-stream"})

    async def stream(self, n: int):
        # the lock is released before [DONE]: the client stops reading there and never resumes us
        if self.lock is not None:
            await self.lock.acquire()
        for i in range(n):
            await asyncio.sleep(self.tpot)
            if i == n - 1 and self.lock is not None:
                self.lock.release()
            yield f'data: {json.dumps({"choices": [{"index": 0, "text": " x"}]})}\n\n'.encode()
        yield b"data: [DONE]\n\n"


@pytest.mark.parametrize("kind", ["continuous", "serial"])
def test_probe_falls_back_without_ignore_eos_on_a_generic_server(kind):
    from iterserve.bench.probe import Prober

    server = FakeServer(serial=kind == "serial")
    prober = Prober("http://fake", long_seconds=0.8, time_limit=30, transport=httpx.MockTransport(server))
    result = asyncio.run(prober.run())
    assert server.refused == 1 and result.plan is not None and not result.plan.ignore_eos
    assert any("refused ignore_eos" in note for note in result.notes)
    assert result.witness is None  # no /v1/scheduler, no /metrics
    assert result.verdict.verdict == kind, result.verdict.evidence
    assert len(result.timings) <= 25


# ---------------------------------------------------------------- against real iterserve servers

SERVERS = {
    "continuous": [],
    "static": ["--batching", "static", "--max-batch-size", "4", "--batch-timeout", "200"],
    "serial": ["--max-num-seqs", "1"],  # continuous scheduler, one sequence at a time
}


@pytest.mark.parametrize("kind", list(SERVERS))
@pytest.mark.slow
def test_probe_verdict_against_iterserve(kind, tiny_model_dir, tmp_path, capsys):
    from iterserve.bench.launcher import ServerProcess
    from iterserve.cli import main

    args = [str(tiny_model_dir), "--kv-cache-memory", "64MiB", *SERVERS[kind]]
    with ServerProcess(args, log_path=tmp_path / "server.log") as srv:
        rc = main(["probe", "--base-url", srv.base_url, "--long-seconds", "2.5", "--time-limit", "60",
                   "--json", str(tmp_path / "probe.json"), "--plot", str(tmp_path / "probe.png")])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    assert f"verdict: {kind}" in lines, out
    confidence = float(next(line for line in lines if line.startswith("confidence:")).split()[1])
    assert confidence >= 0.6, out
    report = json.loads((tmp_path / "probe.json").read_text())
    assert report["verdict"]["verdict"] == kind
    assert report["verdict"]["stats"]["witness"]["verdict"] == kind  # /v1/scheduler agrees
    assert len(report["timings"]) <= 25  # the probe bounds its own load
    assert report["host"]["cores"] >= 1 and report["date"]  # what ran where
    assert (tmp_path / "probe.png").stat().st_size > 10_000
