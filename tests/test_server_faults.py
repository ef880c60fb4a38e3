"""Fault injection over real HTTP (tiny model, uvicorn on a loopback port in this process, so that the
engine's runner can be made to fail): the runner raising a BaseException, hanging, failing on every
step, failing once; the detokeniser failing for one request; and SIGTERM with requests in flight (a
server process). Each ends with every accepted request either completed or given a clear error,
/health telling the truth, and the counters matching.
"""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest
import uvicorn

from iterserve.bench.launcher import ServerProcess, free_port
from iterserve.config import EngineConfig
from iterserve.engine import LLMEngine
from iterserve.request import Request
from iterserve.server.api import build_app
from iterserve.server.async_engine import AsyncEngine
from iterserve.server.serving import ServerSettings

pytestmark = pytest.mark.slow  # uvicorn on a real port, and a server process for SIGTERM

POISON = 4242  # a prompt starting with this token id breaks its detokenisation


class Panic(BaseException):
    """What a Rust panic surfaces as in Python (pyo3's PanicException is a BaseException)."""


class LiveServer:
    """build_app over an LLMEngine we hold, served by uvicorn on a free port in a thread."""

    def __init__(self, tiny_loaded, tiny_model_dir, **engine_kw) -> None:
        self.llm = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory="64MiB", max_model_len=1024,
                                          max_output_len=512), loaded=tiny_loaded)
        self.engine = AsyncEngine(self.llm, warmup=False, **engine_kw)
        self.app = build_app(self.engine, ServerSettings(served_model_name="tiny"))
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.real_execute = self.llm.runner.execute

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        self.llm.runner.execute = self.real_execute
        self.server.should_exit = True
        self.thread.join(30)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics").text


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and \
                all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def one(http: httpx.AsyncClient, i: int, stream: bool, max_tokens: int = 300, prompt=None) -> dict:
    """A completion; returns its HTTP status, finish reason or error, and token count."""
    body = {"prompt": prompt or [1, 2, 3, 10 + i], "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    if not stream:
        r = await http.post("/v1/completions", json=body)
        data = r.json()
        if r.status_code != 200:
            return {"status": r.status_code, "error": data["error"]}
        return {"status": 200, "finish": data["choices"][0]["finish_reason"],
                "tokens": data["usage"]["completion_tokens"]}
    out = {"status": None, "tokens": 0, "finish": None, "error": None, "done": False}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread())["error"]
            return out
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]
                else:
                    out["tokens"] += 1
                    out["finish"] = chunk["choices"][0]["finish_reason"] or out["finish"]
    return out


def run_clients(url: str, n: int, max_tokens: int = 300, during=None, prompts=None) -> list[dict]:
    """n concurrent requests (alternately streaming and not); `during(http)` runs once they are in flight."""
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            tasks = [asyncio.ensure_future(one(http, i, stream=i % 2 == 0, max_tokens=max_tokens,
                                               prompt=prompts[i] if prompts else None)) for i in range(n)]
            if during is not None:
                await asyncio.sleep(0.5)
                await during(http)
            return await asyncio.gather(*tasks)

    return asyncio.run(main())


def assert_each_ended_clearly(results: list[dict]) -> tuple[list[dict], list[dict]]:
    """Every request completed (200, finish length) or got a clear error; returns (completed, failed)."""
    done, failed = [], []
    for r in results:
        if r["status"] == 200 and r.get("error") is None:
            assert r["finish"] == "length", r
            done.append(r)
        else:
            err = r["error"]
            assert err is not None and err["message"] and err["type"], r
            failed.append(r)
    for r in results:
        if "done" in r and r["status"] == 200:
            assert r["done"], r  # every stream was closed with [DONE], even after an error event
    return done, failed


def health(url: str) -> tuple[int, str]:
    r = httpx.get(url + "/health")
    return r.status_code, (r.json()["error"]["message"] if r.status_code != 200 else "")


# ---- the runner fails -------------------------------------------------------------------------------------
def test_runner_base_exception_kills_the_engine_cleanly(tiny_loaded, tiny_model_dir):
    with LiveServer(tiny_loaded, tiny_model_dir) as srv:
        calls = {"n": 0}

        def panicking(sched):
            calls["n"] += 1
            if calls["n"] >= 20 and len(srv.llm.requests) == 6:  # all six admitted
                raise Panic("tokenizer panicked")
            return srv.real_execute(sched)

        srv.llm.runner.execute = panicking
        results = run_clients(srv.url, 6)
        done, failed = assert_each_ended_clearly(results)
        assert len(failed) == 6 and all("Panic" in r["error"]["message"] for r in failed)
        assert {r["status"] for r in failed} <= {200, 500}  # streams: 200 then an error event; others 500
        status, reason = health(srv.url)
        assert status == 503 and "dead" in reason and "Panic" in reason
        refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and "dead" in refused.json()["error"]["message"]
        m = srv.metrics()
        assert metric(m, "iterserve:request_failure_total", reason="error") == 6
        assert metric(m, "iterserve:request_success_total") == 0
        assert metric(m, "iterserve:request_rejected_total", status_code="503") == 1


def test_runner_failing_every_step_declares_the_engine_dead(tiny_loaded, tiny_model_dir):
    """A sticky fault: each failed step fails the requests in it; the third in a row declares the engine
    dead, and from then on requests are refused with 503 instead of being accepted to fail."""
    with LiveServer(tiny_loaded, tiny_model_dir, max_consecutive_failures=3) as srv:
        def broken(sched):
            raise RuntimeError("sticky device fault")

        srv.llm.runner.execute = broken
        failed = []
        for i in range(3):
            assert health(srv.url)[0] == 200  # not dead yet
            failed += assert_each_ended_clearly(run_clients(srv.url, 1))[1]  # one request, one failed step
        assert len(failed) == 3 and not any("sticky" in r["error"]["message"] for r in failed)  # no internals
        status, reason = health(srv.url)
        assert status == 503 and "3 engine steps failed in a row" in reason
        refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and "dead" in refused.json()["error"]["message"]
        m = srv.metrics()
        assert metric(m, "iterserve:engine_step_failures_total") == 3
        assert metric(m, "iterserve:request_failure_total", reason="error") == 3
        assert metric(m, "iterserve:request_rejected_total", status_code="503") == 1
        assert srv.engine.state.kv.used_blocks == 0


def test_runner_failing_once_fails_its_requests_and_serving_goes_on(tiny_loaded, tiny_model_dir):
    with LiveServer(tiny_loaded, tiny_model_dir) as srv:
        calls = {"n": 0}

        def flaky(sched):
            calls["n"] += 1
            if calls["n"] == 15:
                raise RuntimeError("one bad step")
            return srv.real_execute(sched)

        srv.llm.runner.execute = flaky
        results = run_clients(srv.url, 4)
        done, failed = assert_each_ended_clearly(results)
        assert failed and all(r["error"]["message"].startswith("internal error in the engine step") for r in failed)
        assert health(srv.url)[0] == 200
        after = run_clients(srv.url, 4, max_tokens=20)  # the engine serves on
        assert all(r["status"] == 200 and r["finish"] == "length" for r in after)
        m = srv.metrics()
        assert metric(m, "iterserve:engine_step_failures_total") == 1
        assert metric(m, "iterserve:request_failure_total", reason="error") == len(failed)
        assert metric(m, "iterserve:request_success_total", finished_reason="length") == len(done) + 4
        assert srv.engine.state.kv.used_blocks == 0


def test_hung_step_turns_health_503_and_fails_open_requests(tiny_loaded, tiny_model_dir):
    with LiveServer(tiny_loaded, tiny_model_dir, step_timeout=1.0) as srv:
        release = threading.Event()
        calls = {"n": 0}

        def hanging(sched):
            calls["n"] += 1
            if calls["n"] == 10:
                release.wait(30)
            return srv.real_execute(sched)

        srv.llm.runner.execute = hanging
        seen: dict = {}

        async def during(http):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                r = await http.get("/health")
                if r.status_code == 503:
                    seen["health"] = r.json()["error"]["message"]
                    refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                    seen["refused"] = refused.status_code
                    return
                await asyncio.sleep(0.1)

        t0 = time.monotonic()
        results = run_clients(srv.url, 4, during=during)
        elapsed = time.monotonic() - t0
        _, failed = assert_each_ended_clearly(results)
        assert len(failed) == 4 and all("hung" in r["error"]["message"] for r in failed)
        assert "running for" in seen["health"] and "--step-timeout" in seen["health"] and seen["refused"] == 503
        assert elapsed < 15  # ended by the watchdog, not by the step returning (at 30 s)
        release.set()
        deadline = time.monotonic() + 10
        while health(srv.url)[0] != 200:  # the step returned: healthy again, the aborted requests freed
            assert time.monotonic() < deadline
            time.sleep(0.05)
        while srv.engine.state.kv.used_blocks:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        again = run_clients(srv.url, 2, max_tokens=10)
        assert all(r["status"] == 200 for r in again)
        assert metric(srv.metrics(), "iterserve:request_failure_total", reason="error") == 4


def test_detokeniser_error_ends_only_its_request(tiny_loaded, tiny_model_dir, monkeypatch):
    real = Request.detokenize_step

    def poisoned(self, tokenizer):
        if self.prompt_token_ids[0] == POISON and self.num_output_tokens >= 5:
            raise ValueError("decoder exploded")
        return real(self, tokenizer)

    monkeypatch.setattr(Request, "detokenize_step", poisoned)
    with LiveServer(tiny_loaded, tiny_model_dir) as srv:
        prompts = [[POISON, 5, 6], [POISON, 9, 9], [7, 8, 9], [11, 12, 13]]  # streamed, not, streamed, not
        results = run_clients(srv.url, 4, max_tokens=40, prompts=prompts)
        done, failed = assert_each_ended_clearly(results)
        assert [r in failed for r in results] == [True, True, False, False], results
        assert all("processing the output" in r["error"]["message"] for r in failed)
        assert results[1]["status"] == 500  # non-streaming: an error status, not 200
        # each ran to max_tokens; a streamed chunk may carry several tokens (bytes of one character
        # are held back until it is whole), so the non-streamed one's usage is what counts them
        assert all(r["finish"] == "length" for r in done) and results[3]["tokens"] == 40
        assert health(srv.url)[0] == 200
        m = srv.metrics()
        assert metric(m, "iterserve:engine_step_failures_total") == 0
        assert metric(m, "iterserve:request_failure_total", reason="error") == 2
        assert srv.engine.state.kv.used_blocks == 0


# ---- SIGTERM: drain --------------------------------------------------------------------------------------
def test_sigterm_drains_then_aborts_with_errors(tiny_model_dir, tmp_path):
    """A server process with --shutdown-timeout 2: a short request in flight finishes, long ones are ended
    with an error (503 for a non-streaming one, an error event for a stream), new requests and /health get
    503 with Retry-After while it drains, and the process exits 0."""
    srv = ServerProcess([str(tiny_model_dir), "--kv-cache-memory", "64MiB", "--max-model-len", "2048",
                         "--max-output-len", "2000", "--shutdown-timeout", "2"], log_path=tmp_path / "server.log")
    seen: dict = {}
    with srv:
        async def during(http):
            # an idle keep-alive connection for the requests below: a draining server accepts no new
            # connection, so they must not need one (the long requests hold the others)
            assert (await http.get("/health")).status_code == 200
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            r = await http.get("/health")
            seen["health"] = (r.status_code, r.headers.get("Retry-After"))
            r = await http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            seen["late"] = (r.status_code, r.headers.get("Retry-After"), r.json()["error"]["message"])

        async def main():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as http:
                # long enough to outlast the 2 s drain on a fast host (1000 tokens once did not)
                long = [asyncio.ensure_future(one(http, i, stream=i % 2 == 0, max_tokens=2000)) for i in range(4)]
                short = asyncio.ensure_future(one(http, 9, stream=False, max_tokens=30))
                await asyncio.sleep(0.5)
                await during(http)
                return await asyncio.gather(*long), await short

        t0 = time.monotonic()
        long, short = asyncio.run(main())
        assert srv.proc.wait(30) == 0
        elapsed = time.monotonic() - t0
    assert short["status"] == 200 and short["finish"] == "length" and short["tokens"] == 30
    _, failed = assert_each_ended_clearly(long)
    assert len(failed) == 4
    for r in failed:
        assert r["error"]["code"] == "shutdown" and "shut down" in r["error"]["message"]
    assert [r["status"] for r in long[1::2]] == [503, 503]  # non-streaming: an error status, never 200
    assert seen["health"] == (503, "1")
    assert seen["late"][0] == 503 and seen["late"][1] == "1" and "shutting down" in seen["late"][2]
    assert 2 <= elapsed < 15


def test_step_timeout_covers_the_longest_step_of_a_large_model():
    """--step-timeout is a floor: an 8B's full prefill step (2,048 tokens, ~70 s on two cores) must not be
    taken for a hung kernel, a tiny model keeps the flag's value."""
    from types import SimpleNamespace

    from iterserve.config import ModelConfig
    from iterserve.server.async_engine import longest_step_s

    llama_8b = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                           num_kv_heads=8, head_dim=128)
    tiny = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16)
    budget = EngineConfig(max_num_batched_tokens=2048)
    big = longest_step_s(SimpleNamespace(model_config=llama_8b, config=budget))
    assert 900 < big < 1000  # 6.98e9 weights x 2 x 2048 tokens at 3e10 FLOP/s
    assert longest_step_s(SimpleNamespace(model_config=tiny, config=budget)) < 1
