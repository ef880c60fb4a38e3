"""Hostile and careless clients against one guarded server (real HTTP, tiny model): bodies over the
size cap, huge lists and texts, extreme sampling values, fields OpenAI defines that iterserve does
not implement, every route with and without the API key, a foreign Host header.

The server: --api-key, --max-request-bytes 16MiB (so a 10M-character prompt gets past the body cap
and meets the character bound), --max-model-len 1024.
"""
from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import pytest

from iterserve.bench.launcher import ServerProcess
from iterserve.server.protocol import MAX_TOKEN_IDS, UNSUPPORTED_FIELDS

pytestmark = pytest.mark.slow  # real sockets: a 100 MB upload, chunked bodies, Host headers

KEY = "sk-hardening"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 16 * 2**20


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    srv = ServerProcess([str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-memory", "64MiB",
                         "--max-model-len", "1024", "--max-output-len", "512", "--api-key", KEY,
                         "--max-request-bytes", "16MiB"], log_path=log)
    with srv:
        yield srv
    assert srv.proc.returncode == 0, log.read_text()[-2000:]


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client


def metric(text: str, name: str, **labels) -> float:
    """Sum of a series over the label values not given."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} {labels} missing"
    return total


class Stream:
    """A long streaming completion in a thread, recording when each token arrived."""

    def __init__(self, base_url: str, max_tokens: int = 400) -> None:
        self.times: list[float] = []
        self.finish = None
        self.body = {"prompt": "keep going", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.thread = threading.Thread(target=self._run, args=(base_url,), daemon=True)
        self.thread.start()

    def _run(self, base_url: str) -> None:
        with httpx.stream("POST", base_url + "/v1/completions", json=self.body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.times.append(time.monotonic())
                    self.finish = json.loads(line[6:])["choices"][0]["finish_reason"] or self.finish

    def wait_started(self, n: int = 3) -> None:
        deadline = time.monotonic() + 30
        while len(self.times) < n:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.01)

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(t0 <= t <= t1 for t in self.times)


def raw_post(port: int, path: str, headers: dict[str, str], body_chunks, read_timeout: float = 30) -> tuple[int, bytes]:
    """POST over a plain socket, sending chunks until the server answers or closes; returns the
    status and body. (httpx insists on sending the whole body before reading the answer.)"""
    sock = socket.create_connection(("127.0.0.1", port))
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall((head + "\r\n").encode())
    sock.settimeout(2.0)  # a server that stopped reading makes sendall time out: then read its answer
    received = b""
    try:
        for chunk in body_chunks:
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(chunk)
            except (TimeoutError, BrokenPipeError, ConnectionResetError):
                break
        sock.settimeout(read_timeout)
        while b"\r\n\r\n" not in received or len(received) < _expected_len(received):
            try:
                got = sock.recv(65536)
            except ConnectionResetError:
                break
            if not got:
                break
            received += got
    finally:
        sock.close()
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _expected_len(received: bytes) -> int:
    head, _, _ = received.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(head) + 4 + int(line.split(b":")[1])
    return 0


# ---- size limits ----------------------------------------------------------------------------------------
def test_100mb_body_gets_413_while_a_stream_keeps_going(server):
    before = httpx.get(server.base_url + "/metrics", headers=AUTH).text
    stream = Stream(server.base_url)
    stream.wait_started()
    chunk = b"x" * 2**20
    t0 = time.monotonic()
    status, body = raw_post(server.port, "/v1/completions",
                            {**AUTH, "Content-Type": "application/json", "Content-Length": str(100 * 2**20)},
                            (chunk for _ in range(100)))
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    # no Content-Length: the streamed body is cut off once it passes the cap
    status, body = raw_post(server.port, "/v1/completions",
                            {**AUTH, "Content-Type": "application/json", "Transfer-Encoding": "chunked"},
                            (b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(100)))
    t1 = time.monotonic()
    assert status == 413 and "16777216" in json.loads(body)["error"]["message"]
    time.sleep(0.3)
    assert stream.tokens_between(t0, t1 + 0.3) > 0  # the stream kept getting tokens meanwhile
    stream.thread.join(120)
    assert stream.finish == "length"
    after = httpx.get(server.base_url + "/metrics", headers=AUTH).text
    assert metric(after, "iterserve:request_rejected_total", status_code="413") - \
        metric(before, "iterserve:request_rejected_total", status_code="413") == 2


def test_million_token_detokenize_is_refused_by_the_schema(http):
    tokens = list(range(1000)) * 1000
    t0 = time.monotonic()
    resp = http.post("/detokenize", json={"tokens": tokens})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tokens"
    assert str(MAX_TOKEN_IDS) in resp.json()["error"]["message"]
    print(f"\n1M-token /detokenize refused in {time.monotonic() - t0:.2f} s")
    ok = http.post("/detokenize", json={"tokens": [1000] * MAX_TOKEN_IDS})  # the cap itself decodes fine
    assert ok.status_code == 200 and ok.json()["prompt"]


def test_ten_million_character_prompt_is_refused_before_tokenisation(server, http):
    stream = Stream(server.base_url, max_tokens=200)
    stream.wait_started()
    for path, body in (("/v1/completions", {"prompt": "a" * 10_000_000}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 10_000_000}]}),
                       ("/tokenize", {"prompt": "a" * 10_000_000})):
        t0 = time.monotonic()
        resp = http.post(path, json=body)
        elapsed = time.monotonic() - t0
        err = resp.json()["error"]
        assert resp.status_code == 400 and "10000000 characters" in err["message"], (path, err)
        print(f"\n10M-character {path} refused in {elapsed:.2f} s (request and body transfer included)")
        assert elapsed < 5  # tokenising it would take far longer; the bound is loose for shared CPUs
    stream.thread.join(120)
    assert stream.finish == "length"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "stop": ["x"] * 17}, "stop"),
    ({"prompt": "hi", "stop": "x" * 2000}, "stop"),
    ({"prompt": "hi", "stop_token_ids": [5] * 2000}, "stop_token_ids"),
    ({"prompt": [[1, 2], [3, 4]]}, "prompt"),
    ({"prompt": [7] * (MAX_TOKEN_IDS + 1)}, "prompt"),
])
def test_list_and_string_caps(http, body, param):
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"].startswith(param), resp.text


# ---- sampling values at the edges ------------------------------------------------------------------------
def test_extreme_sampling_values_never_produce_nan(http):
    base = {"prompt": "The edge of the map", "max_tokens": 8, "ignore_eos": True}
    greedy = http.post("/v1/completions", json={**base, "temperature": 0}).json()["choices"][0]["text"]
    for temperature in (1e-39, 5e-324, 1e-6):  # below the greedy threshold: exactly greedy
        out = http.post("/v1/completions", json={**base, "temperature": temperature})
        assert out.status_code == 200 and out.json()["choices"][0]["text"] == greedy, temperature
    accepted = [{"temperature": 1e-4}, {"temperature": 1e30}, {"top_p": 1e-300}, {"min_p": 1.0},
                {"top_k": 2**31 - 1}, {"repetition_penalty": 100.0}, {"repetition_penalty": 0.01},
                {"presence_penalty": 2.0, "frequency_penalty": -2.0}, {"seed": 2**64 - 1, "temperature": 2.0},
                {"repetition_penalty": 100.0, "temperature": 1e-4, "top_p": 1e-9}]
    for extra in accepted:
        out = http.post("/v1/completions", json={**base, **extra, "logprobs": 1})
        assert out.status_code == 200, (extra, out.text)
        choice = out.json()["choices"][0]
        assert out.json()["usage"]["completion_tokens"] == 8
        assert all(lp == lp for lp in choice["logprobs"]["token_logprobs"]), extra  # no NaN
    for extra, param in (({"repetition_penalty": 1e300}, "repetition_penalty"),
                         ({"repetition_penalty": 1e-300}, "repetition_penalty"),
                         ({"temperature": -1e-300}, "temperature"), ({"top_p": 0.0}, "top_p"),
                         ({"presence_penalty": 2.5}, "presence_penalty")):
        out = http.post("/v1/completions", json={**base, **extra})
        assert out.status_code == 400 and out.json()["error"]["param"] == param, (extra, out.text)
    for raw in ('{"prompt": "x", "temperature": NaN}', '{"prompt": "x", "temperature": Infinity}',
                '{"prompt": "x", "top_p": 1e400}'):
        out = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert out.status_code == 400, raw


# ---- fields iterserve does not implement ---------------------------------------------------------------
USING = {"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
         "tool_choice": "auto", "logit_bias": {"50": 10}, "functions": [{"name": "f"}], "function_call": "auto",
         "parallel_tool_calls": True, "suffix": "end", "best_of": 2, "echo": True, "n": 2,
         "audio": {"voice": "alloy"}, "modalities": ["text", "audio"], "prediction": {"type": "content"},
         "web_search_options": {}, "guided_whitespace_pattern": " ", "guided_decoding_backend": "xgrammar",
         "reasoning_effort": "high"}
NOT_USING = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "logit_bias": {},
             "best_of": 1, "echo": False, "n": 1, "modalities": ["text"], "suffix": None,
             "guided_decoding_backend": "guidance"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", [u.field for u in UNSUPPORTED_FIELDS])
def test_unsupported_field_is_refused_by_name(http, path, field):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    base["max_tokens"] = 2
    value = USING[field] if field != "web_search_options" else {"search_context_size": "low"}
    resp = http.post(path, json={**base, field: value})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == field and field in err["message"] and err["code"] == "unsupported_field"
    if field in NOT_USING:  # the value that asks for nothing is fine
        assert http.post(path, json={**base, field: NOT_USING[field]}).status_code == 200


def test_unknown_fields_are_ignored(http):
    resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "store": True, "frobnicate": 1})
    assert resp.status_code == 200


# ---- auth and Host -----------------------------------------------------------------------------------------
def routes(server) -> list[tuple[str, str]]:
    schema = httpx.get(server.base_url + "/openapi.json", headers=AUTH).json()
    found = [(m.upper(), p) for p, ops in schema["paths"].items() for m in ops]
    return found + [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/nowhere")]


def test_every_route_needs_the_key_except_health(server):
    seen = routes(server)
    assert ("GET", "/metrics") in seen and ("POST", "/detokenize") in seen and ("GET", "/v1/scheduler") in seen
    for method, path in seen:
        body = {"json": {}} if method == "POST" else {}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}):
            resp = httpx.request(method, server.base_url + path, headers=headers, **body)
            if path == "/health":
                assert resp.status_code == 200
                continue
            assert resp.status_code == 401, (method, path, headers, resp.status_code)
            assert resp.json()["error"]["type"] == "authentication_error"
            assert "/" not in resp.json()["error"]["message"].replace("Bearer <key>", "")  # no paths, no data
        for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme is case-insensitive
            resp = httpx.request(method, server.base_url + path, headers={"Authorization": f"{scheme} {KEY}"}, **body)
            assert resp.status_code != 401 and resp.status_code < 500, (method, path, resp.text)


def test_answers_name_no_file_path(server, tiny_model_dir, http):
    for path in ("/v1/models", "/v1/scheduler"):
        text = http.get(path).text
        assert str(tiny_model_dir) not in text, path


def test_foreign_host_header_is_refused(server):
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
        resp = httpx.get(server.base_url + "/health", headers={"Host": host})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_host", host
    for host in ("localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}"):
        assert httpx.get(server.base_url + "/health", headers={"Host": host}).status_code == 200, host


def test_metrics_export_vllm_names(http):
    http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True})
    text = http.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:inter_token_latency_seconds_count",
                 "vllm:num_preemptions_total", "vllm:request_queue_time_seconds_count"):
        ours = name.replace("vllm:", "iterserve:").replace("gpu_cache", "kv_cache")
        assert metric(text, name) == metric(text, ours), name
    # the per-token histogram has one observation per gap between tokens
    assert metric(text, "iterserve:inter_token_latency_seconds_count") >= 4
    assert metric(text, "iterserve:request_failure_total", reason="error") == 0
