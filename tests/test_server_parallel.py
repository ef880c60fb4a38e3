"""Parallel sampling (`n` > 1) through the server app (in process, tests/app_server.py): one choice per index, streamed with `index`, usage
summed as OpenAI does, and the choices sharing the prompt's KV blocks through the prefix cache.

The tiny random-weight model checks the protocol and the sharing; SmolLM2-135M in float32 checks
that four greedy choices are identical and that seeded ones differ, reproducibly.
"""
from __future__ import annotations

import json

import httpx
import pytest
from app_server import AppServer

MODEL = "tiny"
SERVE_ARGS = ["--served-model-name", MODEL, "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
              "--block-size", "16"]


def post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    return http.post(path, json={"model": MODEL, **body})


def prefix_cache(http: httpx.Client) -> dict:
    return http.get("/v1/scheduler").json()["prefix_cache"]


PROMPT = list(range(1000, 1070))  # 70 token ids: 4 full blocks of 16 + 6


def test_n_choices_usage_and_shared_prompt_blocks(http):
    before = prefix_cache(http)
    resp = post(http, "/v1/completions", {"prompt": PROMPT, "n": 4, "max_tokens": 5, "ignore_eos": True,
                                            "temperature": 0})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert len({c["text"] for c in out["choices"]}) == 1, "greedy choices of one prompt are identical"
    assert out["usage"] == {"prompt_tokens": 70, "completion_tokens": 20, "total_tokens": 90}
    after = prefix_cache(http)
    assert after["enabled"]
    # choices 1..3 found the 4 full prompt blocks of choice 0 cached (only the partial one is recomputed)
    assert after["hits"] - before["hits"] >= 3 * 64
    assert after["queries"] - before["queries"] == 4 * 70
    metrics = http.get("/metrics").text
    hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("iterserve:prefix_cache_hits_total"))
    assert hits == after["hits"]


def test_streamed_chat_choices_carry_their_index_and_usage_is_summed(http):
    body = {"messages": [{"role": "user", "content": "Count with me."}], "n": 3, "max_tokens": 4,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    texts = {0: "", 1: "", 2: ""}
    finished, usage = set(), None
    with http.stream("POST", "/v1/chat/completions", json={"model": MODEL, **body}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                texts[c["index"]] += c["delta"].get("content") or ""
                if c["finish_reason"]:
                    finished.add(c["index"])
    assert finished == {0, 1, 2}
    assert usage["completion_tokens"] == 12 and usage["total_tokens"] == usage["prompt_tokens"] + 12
    assert all(texts.values())


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "best_of": 2}, "best_of"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 65}, "n"),
])
def test_bad_n_and_best_of_are_refused(http, body, param):
    resp = post(http, "/v1/completions", body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


@pytest.mark.real_model
def test_real_model_n4_greedy_identical_seeded_reproducible_and_different(smol_loaded):
    """smol_loaded is float32 (the loader's default), so the choices are computed in float32."""
    with AppServer(["smollm2-135m", "--max-model-len", "512"], smol_loaded) as srv, srv.client(timeout=120) as http:
        _real_model_n4(http)


def _real_model_n4(http: httpx.Client) -> None:
    url = "/v1/chat/completions"
    base = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
            "n": 4, "max_tokens": 24}
    greedy = http.post(url, json={**base, "temperature": 0}).json()
    texts = [c["message"]["content"] for c in greedy["choices"]]
    assert len(texts) == 4 and len(set(texts)) == 1 and texts[0]
    seeded = [http.post(url, json={**base, "temperature": 1.0, "seed": 7}).json() for _ in range(2)]
    first, second = ([c["message"]["content"] for c in s["choices"]] for s in seeded)
    assert first == second, "the same seed gives the same four choices"
    assert len(set(first)) > 1, "choice i samples with seed + i: the choices differ"
