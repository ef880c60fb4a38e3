"""LoRA adapters over real HTTP: `iterserve serve` on the tiny model with --enable-lora, in a process of
its own. A request picks its adapter by `model`; /v1/models lists adapters with their parent; adapters
load and unload behind the API key; an unknown adapter is a 404, a bad one a 400 (and the server keeps
serving), unloading one that a running request uses a 409."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from iterserve.bench.launcher import ServerProcess
from iterserve.bench.random_lora import AdapterSpec, make_random_adapter

pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # an `iterserve serve` process

KEY = "sk-lora-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [1, 523, 1777, 98, 3001, 45, 260, 3990]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("server-loras")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    return {"a1": str(make_random_adapter(base, root / "a1", AdapterSpec(rank=8, alpha=16), seed=1)),
            "big": str(make_random_adapter(base, root / "big", AdapterSpec(rank=32, alpha=32), seed=2))}


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters, tmp_path_factory):
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    args = [str(tiny_model_dir), "--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-memory", "32MiB",
            "--api-key", KEY, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
            "--lora-modules", f"a1={adapters['a1']}"]
    with ServerProcess(args, log_path=log, env={"ITERSERVE_MEASURE_KERNELS": "0"}) as srv:
        with httpx.Client(base_url=srv.base_url, headers=AUTH, timeout=60) as client:
            yield client


def complete(client: httpx.Client, model: str, max_tokens: int = 8) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True})


def test_adapter_by_model_name_and_models_list(server, adapters):
    models = server.get("/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("a1", "tiny")]
    assert not any("/" in m["root"] for m in models)  # no path on this machine in an answer
    base, a1 = complete(server, "tiny"), complete(server, "a1")
    assert base.status_code == a1.status_code == 200
    assert a1.json()["model"] == "a1"
    assert a1.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]
    # the same folder loaded again under another name gives the same text
    r = server.post("/v1/load_lora_adapter", json={"lora_name": "a1-again", "lora_path": adapters["a1"]})
    assert r.status_code == 200, r.text
    assert complete(server, "a1-again").json()["choices"][0]["text"] == a1.json()["choices"][0]["text"]
    assert [m["id"] for m in server.get("/v1/models").json()["data"]] == ["tiny", "a1", "a1-again"]
    r = server.post("/v1/chat/completions", json={"model": "a1-again", "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["model"] == "a1-again"


def test_unknown_adapter_is_404(server):
    r = complete(server, "no-such-adapter")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_load_and_unload_need_the_api_key(server, adapters):
    with httpx.Client(base_url=server.base_url, timeout=30) as anonymous:
        r = anonymous.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["a1"]})
        assert r.status_code == 401
        assert anonymous.post("/v1/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 401
    assert "x" not in [m["id"] for m in server.get("/v1/models").json()["data"]]


def test_bad_adapter_is_400_and_the_server_keeps_serving(server, adapters, tmp_path):
    before = complete(server, "a1").json()["choices"][0]["text"]
    r = server.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": adapters["big"]})
    assert r.status_code == 400 and "max-lora-rank" in r.json()["error"]["message"]
    r = server.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(tmp_path / "none")})
    assert r.status_code == 400 and str(tmp_path) not in r.json()["error"]["message"]
    r = server.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": adapters["a1"]})
    assert r.status_code == 400  # the name is taken
    assert complete(server, "a1").json()["choices"][0]["text"] == before
    assert complete(server, "big").status_code == 404


def test_unload_of_an_adapter_in_use_is_409(server, adapters):
    r = server.post("/v1/load_lora_adapter", json={"lora_name": "busy", "lora_path": adapters["a1"]})
    assert r.status_code == 200
    body = {"model": "busy", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with server.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["model"] == "busy"
        r = server.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "lora_in_use"
    # the stream is closed: its request is aborted, and then the adapter unloads
    for _ in range(100):
        r = server.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
        if r.status_code != 409:
            break
    assert r.status_code == 200, r.text
    assert complete(server, "busy").status_code == 404
    assert server.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}).status_code == 404


def test_metrics_and_scheduler_show_adapters(server):
    assert complete(server, "a1").status_code == 200
    text = server.get("/metrics").text
    assert 'vllm:lora_requests_info{' in text and 'max_lora="2"' in text
    assert 'iterserve:lora_requests_total{lora_name="a1",model_name="tiny"}' in text
    assert "iterserve:lora_loads_total" in text
    lora = server.get("/v1/scheduler").json()["lora"]
    assert "a1" in [s["name"] for s in lora["resident"]] and lora["max_loras"] == 2
