"""Static batching behind the server, the YAML config file, the CLI parser, and SIGTERM shutdown.

A static-batching server configured through --config (with one flag overriding the file): in
process (tests/app_server.py) for what it answers, and as an `iterserve serve` process for the
SIGTERM shutdown with requests in flight and for the command line's start-up errors (marked slow).
"""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from app_server import AppServer

from iterserve.bench.launcher import ServerProcess
from iterserve.cli import build_parser
from iterserve.server.cli_serve import resolve_args


def parse(argv: list[str], config_text: str | None = None, tmp_path=None):
    if config_text is not None:
        path = tmp_path / "serve.yaml"
        path.write_text(config_text)
        argv = argv + ["--config", str(path)]
    return resolve_args(build_parser().parse_args(["serve", *argv]))


def test_config_file_fills_defaults_and_flags_win(tmp_path):
    args = parse(["--max-num-seqs", "16", "--port", "9001"],
                 "max-num-seqs: 4\nmax_batch_size: 3\nbatching: static\nport: 9000\nlog-scheduler: true\n"
                 "batch-timeout: 20\nmodel: some-model\n", tmp_path)
    assert args.max_num_seqs == 16  # given on the command line (even if equal to the default): the flag wins
    assert args.port == 9001
    assert (args.max_batch_size, args.batching, args.log_scheduler, args.batch_timeout_ms) == (3, "static", True, 20)
    assert args.model == "some-model"
    plain = parse([])
    assert (plain.max_num_seqs, plain.port, plain.host, plain.model) == (16, 8000, "127.0.0.1", "smollm2-135m")


@pytest.mark.parametrize("text,error", [("max-num-sequences: 3\n", "unknown key"), ("batching: dynamic\n", "dynamic"),
                                        ("- a\n- b\n", "mapping")])
def test_config_file_errors(tmp_path, text, error):
    with pytest.raises(ValueError, match=error):
        parse([], text, tmp_path)


def test_model_positional_or_flag():
    assert parse(["--model", "x.gguf"]).model == "x.gguf"
    assert parse(["x.gguf"]).model == "x.gguf"
    with pytest.raises(ValueError, match="two models"):
        parse(["a.gguf", "--model", "b.gguf"])


def test_serve_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--gpu-memory-utilization",
                 "--kv-cache-memory", "--num-kv-blocks", "--max-model-len", "--scheduling-policy", "--dtype",
                 "--served-model-name", "--api-key", "--host", "--port", "--batching", "--max-batch-size",
                 "--batch-timeout", "--max-input-len", "--max-output-len", "--max-waiting", "--log-scheduler",
                 "--config", "--log-level"):
        assert flag in text


@pytest.mark.slow
def test_serve_fails_fast_with_one_line_errors(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run([sys.executable, "-m", "iterserve.cli", "serve", str(tiny_model_dir), "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert busy.returncode == 2 and "cannot listen on" in busy.stderr and "Traceback" not in busy.stderr
    missing = subprocess.run([sys.executable, "-m", "iterserve.cli", "serve", str(tiny_model_dir / "nope"), "--port", "0"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.startswith("error:")


# ---- a static-batching server -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def static_argv(tiny_model_dir, tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("static-server")
    (folder / "serve.yaml").write_text("batching: static\nmax-batch-size: 8\nbatch-timeout: 30\n"
                                       "kv-cache-memory: 64MiB\nserved-model-name: tiny-static\ndecode-attention: torch\n")
    return [str(tiny_model_dir), "--config", str(folder / "serve.yaml"), "--max-batch-size", "4", "--shutdown-timeout", "0.5"]


@pytest.fixture(scope="module")
def server(static_argv, tiny_loaded):
    with AppServer(static_argv, tiny_loaded) as srv:
        yield srv


def test_static_batching_serves(server):
    http = server.client(timeout=60)
    snap = http.get("/v1/scheduler").json()
    assert snap["batching"] == "static" and snap["config"]["max_batch_size"] == 4  # the flag beat the file
    assert snap["config"]["decode_attention"] == "torch"  # a kernel switch from the file, as resolved
    before = snap["step"]

    async def one(http, i):
        body = {"model": "tiny-static", "prompt": f"static {i}", "max_tokens": 4 + 4 * i, "ignore_eos": True,
                "stream": i % 2 == 0, "stream_options": {"include_usage": True}}
        resp = await http.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        if not body["stream"]:
            return resp.json(), body["max_tokens"]
        chunks = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        final = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
        return {**final, "usage": chunks[-1]["usage"]}, body["max_tokens"]

    async def run():
        async with server.async_client(timeout=60) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(6)))

    for out, want in server.run(run()):
        assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == want
        assert out["iterserve"]["e2e"] >= out["iterserve"]["ttft"] >= out["iterserve"]["queue_time"] >= 0
    steps = http.get("/v1/scheduler", params={"since_step": before}).json()["steps"]
    assert max(s["batch_size"] for s in steps) == 4
    assert any(s["num_padding"] > 0 for s in steps)  # finished members kept their slot until the batch ended


@pytest.mark.slow  # timing
def test_static_partial_batch_starts_on_timeout(server):
    t0 = time.monotonic()
    resp = server.client().post("/v1/completions", json={"prompt": "alone", "max_tokens": 2, "ignore_eos": True})
    assert resp.status_code == 200
    queue = resp.json()["iterserve"]["queue_time"]
    assert 0.025 <= queue < 0.5  # waited for the 30 ms batch timeout, not for a full batch
    assert time.monotonic() - t0 < 2


@pytest.fixture
def process(static_argv, tmp_path):
    srv = ServerProcess(static_argv, log_path=tmp_path / "server.log")
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.slow
def test_sigterm_ends_in_flight_with_errors_and_exits_0(process):
    """--shutdown-timeout 0.5: the 1000-token requests cannot finish, so they end with the shutdown
    error (a 503 for the non-streaming one, never a 200)."""
    server = process
    results: dict[str, object] = {}

    def stream():
        with httpx.stream("POST", server.base_url + "/v1/completions", timeout=30,
                          json={"prompt": "s", "max_tokens": 1000, "ignore_eos": True, "stream": True}) as resp:
            results["stream"] = [line for line in resp.iter_lines() if line.startswith("data: ")]

    def plain():
        resp = httpx.post(server.base_url + "/v1/completions", timeout=30,
                          json={"prompt": "p", "max_tokens": 1000, "ignore_eos": True})
        results["plain"] = (resp.status_code, resp.json())

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while True:  # both in: either in one batch, or one running and one waiting for the next batch
        snap = httpx.get(server.base_url + "/v1/scheduler").json()
        if snap["running"] >= 1 and snap["running"] + snap["waiting"] == 2:
            break
        assert time.monotonic() < deadline
        time.sleep(0.02)
    t0 = time.monotonic()
    assert server.stop(timeout=20) == 0
    assert time.monotonic() - t0 < 10
    for t in threads:
        t.join(5)
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "shutdown"
    status, body = results["plain"]
    assert status == 503 and body["error"]["code"] == "shutdown"
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base_url + "/health")
