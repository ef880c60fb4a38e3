"""The OpenAI-compatible server's API contract, on the tiny random-weight model.

One in-process server for the module (tests/app_server.py: the app `iterserve serve` builds, over
httpx's ASGI transport); every test leaves it idle. What needs a real socket, a client that drops
its connection, runs against an `iterserve serve` process on 127.0.0.1 (marked slow).
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from iterserve.bench.launcher import ServerProcess

MODEL = "tiny"
SERVE_ARGS = ["--served-model-name", MODEL, "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
              "--max-output-len", "512"]


def scheduler(http: httpx.Client, **params) -> dict:
    return http.get("/v1/scheduler", params=params).json()


def wait_idle(http: httpx.Client, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        snap = scheduler(http)
        if snap["running"] == 0 and snap["waiting"] == 0 and snap["kv_cache"]["used_blocks"] == 0:
            return snap
        assert time.monotonic() < deadline, f"server not idle: {snap}"
        time.sleep(0.02)


def num_tokens(http: httpx.Client, **body) -> int:
    return http.post("/tokenize", json=body).json()["count"]


# ---- the official client, unchanged ---------------------------------------------------------------
def test_openai_client_completions(http, client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == num_tokens(http, prompt="The quick brown fox")
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert full.choices[0].text
    assert full.model_extra["iterserve"]["e2e"] >= full.model_extra["iterserve"]["ttft"] > 0

    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text  # greedy: streaming and not give the same text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert set(finals[0].model_extra["iterserve"]) == {"queue_time", "ttft", "e2e"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    wait_idle(http)


def test_openai_client_chat(http, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10
    assert full.usage.prompt_tokens == num_tokens(http, messages=messages)

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # without include_usage there is no usage chunk
    plain = list(client.chat.completions.create(**kw, stream=True))
    assert all(c.choices for c in plain) and plain[-1].choices[0].finish_reason == "length"


def test_max_completion_tokens_and_models(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                         max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="One two three", max_tokens=5, logprobs=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen <= 0
        assert max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy picks the top token
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True}, stream=True)
    entries = [e for c in chat if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 4 and all(len(e.top_logprobs) == 2 for e in entries)


def test_stop_string_and_stop_token(http, client):
    kw = dict(model=MODEL, prompt="Counting sheep", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    base = client.completions.create(**kw, logprobs=0)
    tokens = base.choices[0].logprobs.tokens
    cut = next(i for i in range(3, 12) if tokens[i].strip() and tokens[i] not in "".join(tokens[:i]))
    stop = tokens[cut]
    full = client.completions.create(**kw, stop=[stop])
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=[stop], stream=True))
    assert full.choices[0].finish_reason == "stop"
    assert full.choices[0].text == "".join(tokens[:cut]) == streamed  # the stop string itself is never sent

    for i, text in enumerate(tokens):  # a generated token whose text maps back to exactly one id
        ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
        if len(ids) == 1:
            break
    by_id = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "stop_token_ids": ids}})
    assert by_id.choices[0].finish_reason == "stop" and by_id.usage.completion_tokens <= i + 1


# ---- many clients at once -----------------------------------------------------------------------
async def _stream_one(http: httpx.AsyncClient, i: int) -> dict:
    body = {"model": MODEL, "prompt": f"Request number {i} says" + " hello" * i, "max_tokens": 8 + 2 * i,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text, usage, finish = "", None, None
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
                finish = chunk["choices"][0]["finish_reason"] or finish
            usage = chunk.get("usage") or usage
    return {"i": i, "prompt": body["prompt"], "max_tokens": body["max_tokens"], "text": text, "usage": usage,
            "finish": finish}


def test_16_concurrent_streams(server, http):
    before = scheduler(http)["step"]

    async def run():
        async with server.async_client(timeout=60) as aclient:
            return await asyncio.gather(*(_stream_one(aclient, i) for i in range(16)))

    results = server.run(run())
    for r in results:
        assert r["finish"] == "length"
        assert r["usage"]["completion_tokens"] == r["max_tokens"]
        assert r["usage"]["prompt_tokens"] == num_tokens(http, prompt=r["prompt"])
        assert r["text"]
    steps = scheduler(http, since_step=before)["steps"]
    assert max(s["batch_size"] for s in steps) >= 4  # they were batched together, not served one by one
    wait_idle(http)


# ---- aborts: a client that hangs up, over a real socket ------------------------------------------------
@pytest.fixture(scope="module")
def process(tiny_model_dir, tmp_path_factory):
    """`iterserve serve` in a process of its own, with the in-process server's flags."""
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    srv = ServerProcess([str(tiny_model_dir), *SERVE_ARGS], log_path=log)
    with srv:
        yield srv
    assert srv.proc.returncode == 0, log.read_text()[-2000:]


@pytest.mark.slow
def test_dropped_stream_frees_blocks(process):
    body = {"model": MODEL, "prompt": "never ending", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=process.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            got = 0
            while got < 5:
                got += next(lines).startswith("data: ")
            snap = scheduler(http)
            assert snap["running"] == 1 and snap["kv_cache"]["used_blocks"] > 0
        # leaving the block closes the connection mid-stream
        dropped = time.monotonic()
        snap = wait_idle(http, timeout=1.0)
        assert time.monotonic() - dropped < 1.0
        metrics = http.get("/metrics").text
    assert 'iterserve:request_success_total{finished_reason="abort",model_name="tiny"}' in metrics


@pytest.mark.slow
def test_dropped_responses_stream_frees_blocks(process):
    """The Responses API's event stream is the chat path's: a client that hangs up aborts it."""
    body = {"model": MODEL, "input": "never ending", "max_output_tokens": 500, "stream": True}
    with httpx.Client(base_url=process.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/responses", json=body) as resp:
            lines = resp.iter_lines()
            got = 0
            while got < 8:
                got += next(lines).startswith("event: response.output_text.delta")
            assert scheduler(http)["running"] == 1
        dropped = time.monotonic()
        wait_idle(http, timeout=1.0)
        assert time.monotonic() - dropped < 1.0


def aborted_total(http: httpx.Client) -> float:
    line = 'iterserve:request_success_total{finished_reason="abort",model_name="tiny"}'
    return sum(float(x.split()[-1]) for x in http.get("/metrics").text.splitlines() if x.startswith(line))


@pytest.mark.slow
def test_dropped_non_streaming_request_frees_blocks(process):
    """A client that closes its connection while waiting for a whole completion: the request is
    aborted and its blocks freed within a second. The connection is closed as soon as the request
    runs (a raw socket, not a client timeout: a tiny model on a fast CPU finished 500 tokens inside
    a 0.6 s timeout, and the test then checked nothing)."""
    body = json.dumps({"model": MODEL, "prompt": "never ending", "max_tokens": 512, "ignore_eos": True}).encode()
    host, port = process.base_url.removeprefix("http://").rsplit(":", 1)
    with httpx.Client(base_url=process.base_url, timeout=30) as http:
        before = aborted_total(http)
        sock = socket.create_connection((host, int(port)))
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 10
        while (snap := scheduler(http))["running"] == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.005)
        assert snap["kv_cache"]["used_blocks"] > 0
        sock.close()
        dropped = time.monotonic()
        wait_idle(http, timeout=1.0)
        assert time.monotonic() - dropped < 1.0
        assert aborted_total(http) == before + 1, "the request finished before the client left: make it longer"


# ---- bad input ----------------------------------------------------------------------------------------
LONG_PROMPT = "word " * 1100  # > max_model_len 1024 tokens
BAD = [
    ("malformed json", "/v1/completions", '{"prompt": "hi", ', 400, None),
    ("body not an object", "/v1/completions", "[1, 2]", 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "three"}, 400, "max_tokens"),
    ("bool for int", "/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("temperature < 0", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p = 0", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p > 1", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, 400, "top_p"),
    ("max_tokens 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("n = 0", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("best_of", "/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, None),
    ("empty token list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("token out of vocab", "/v1/completions", {"prompt": [1, 10**9]}, 400, None),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("empty stop string", "/v1/completions", {"prompt": "hi", "stop": [""]}, 400, None),
    ("unknown model", "/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404, "model"),
    ("unknown model chat", "/v1/chat/completions", {"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]},
     404, "model"),
    ("max_tokens over cap", "/v1/completions", {"prompt": "hi", "max_tokens": 513}, 400, None),
    ("prompt too long", "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, None),
    ("unknown route", "/v1/images/generations", {"prompt": "x"}, 404, None),
    ("empty embedding input", "/v1/embeddings", {"input": []}, 400, "input"),
    ("unknown previous response", "/v1/responses", {"input": "x", "previous_response_id": "resp_nope"}, 404,
     "previous_response_id"),
]


def test_bad_inputs_answer_openai_errors_and_disturb_nothing(server, http):
    body = {"model": MODEL, "prompt": "a long running request", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def run():
        async with server.async_client(timeout=30) as aclient:
            running = asyncio.create_task(aclient.post("/v1/completions", json=body))
            while (await aclient.get("/v1/scheduler")).json()["running"] == 0:
                await asyncio.sleep(0.01)
            for name, path, payload, status, param in BAD:
                kw = {"content": payload, "headers": {"content-type": "application/json"}} if isinstance(payload, str) \
                    else {"json": payload}
                resp = await aclient.post(path, **kw)
                assert resp.status_code == status, (name, resp.text)
                err = resp.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], name
                if param:
                    assert err["param"] == param, (name, err)
            return (await running).text

    lines = server.run(run()).splitlines()
    rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"  # the running request never noticed
    assert http.get("/health").status_code == 200


def test_too_long_states_limit_and_length(http):
    n = num_tokens(http, prompt=LONG_PROMPT)
    resp = http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 1})
    msg = resp.json()["error"]["message"]
    assert resp.status_code == 400 and str(n) in msg and "1024" in msg
    resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 600})
    msg = resp.json()["error"]["message"]
    assert "600" in msg and "512" in msg


# ---- observability ------------------------------------------------------------------------------------
def test_scheduler_snapshot_contract(http):
    http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
    snap = scheduler(http)
    assert snap["batching"] == "continuous"
    assert set(snap["kv_cache"]) >= {"used_blocks", "total_blocks", "usage", "tokens_stored", "internal_fragmentation"}
    assert 0 <= snap["busy_fraction"] <= 1 and snap["uptime_s"] > 0
    assert snap["config"]["max_model_len"] == 1024 and snap["config"]["max_num_seqs"] == 16
    # the switches as resolved ("auto" replaced by what the platform chose)
    assert snap["config"]["device"] == "cpu" and snap["config"]["dtype"] in ("float32", "bfloat16")
    assert snap["config"]["decode_attention"] in ("torch", "cpu") and isinstance(snap["config"]["cpu_kernels"], bool)
    step = snap["steps"][-1]
    assert set(step) >= {"step", "t", "duration", "batch_size", "num_padding", "num_running", "num_waiting",
                         "prefill_tokens", "decode_tokens", "kv_used_blocks", "kv_total_blocks", "kv_tokens"}
    later = scheduler(http, since_step=step["step"] - 2)["steps"]
    assert [s["step"] for s in later] == [step["step"] - 1, step["step"]]
    assert 0 <= later[0]["t"] <= later[1]["t"] <= snap["uptime_s"]


def test_metrics_count_requests(http):
    def value(text: str, name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} missing")

    before = http.get("/metrics").text
    http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 7, "ignore_eos": True})
    after = http.get("/metrics").text
    for name in ("iterserve:num_requests_running", "iterserve:num_requests_waiting", "iterserve:kv_cache_usage_perc",
                 "iterserve:engine_busy_fraction", "iterserve:num_preemptions_total",
                 "iterserve:time_to_first_token_seconds_count", "iterserve:inter_token_latency_seconds_count",
                 "iterserve:e2e_request_latency_seconds_count", "iterserve:request_queue_time_seconds_count",
                 "iterserve:batch_size_count"):
        value(after, name)
    assert value(after, "iterserve:generation_tokens_total") - value(before, "iterserve:generation_tokens_total") == 7
    assert value(after, "iterserve:e2e_request_latency_seconds_count") == \
        value(before, "iterserve:e2e_request_latency_seconds_count") + 1


def test_tokenize_detokenize_roundtrip(http):
    ids = http.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert ids and http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "Hello world"
    assert http.post("/tokenize", json={}).status_code == 400
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400
