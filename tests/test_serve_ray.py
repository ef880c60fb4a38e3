"""`iterserve serve --replicas`: a real local Ray cluster (started here), 2 replicas of the tiny model
with one thread each, behind the ingress; the official openai client and raw HTTP against it.

One module-scoped cluster keeps the start-up cost (Ray, Serve, two engines) to once; the tests that
kill a replica and the ingress run last.
"""
from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import time

import httpx
import openai
import pytest
import ray
from dashboard_page import dash, engine, has_colour, send_load

from iterserve.bench.browser import open_browser
from iterserve.config import EngineConfig
from iterserve.serve_ray.app import ScaleOutConfig, start
from iterserve.routing import RouterConfig
from iterserve.serve_ray.launch import LOCAL_CLUSTER_ENV
from iterserve.server.serving import ServerSettings

MODEL = "tiny"
pytestmark = pytest.mark.slow  # starts a Ray cluster (processes): skipped by make test-fast


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    port = free_port()
    config = EngineConfig(model=str(tiny_model_dir), kv_cache_memory="64MiB", max_model_len=2048)
    settings = ServerSettings(served_model_name=MODEL)
    scale = ScaleOutConfig(replicas=2, threads_per_replica=1, router=RouterConfig(policy="prefix"))
    saved = {key: os.environ.get(key) for key in LOCAL_CLUSTER_ENV}
    os.environ.update(LOCAL_CLUSTER_ENV)  # what `serve --replicas` runs a local cluster with
    start(config, settings, scale, "127.0.0.1", port,
          ray_init={"num_cpus": 4, "object_store_memory": 200 * 2**20, "include_dashboard": False,
                    "log_to_driver": False})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=10).status_code == 200 and \
                        len(httpx.get(base + "/v1/scheduler", timeout=10).json()["replicas"]) == 2:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the Ray Serve application did not become ready in 180 s")
        yield base
    finally:
        # the local cluster ends with this process's ray.init, Serve's actors with it; serve.delete and
        # serve.shutdown first drained the replicas gracefully: about 30 s that no test looks at
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0, timeout=60)


def wait_for(fn, what: str, timeout: float = 20.0):
    """The ingress shows replicas' state as they last reported it (every stats period): poll."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def replica_of(base: str, request_id: str) -> str:
    """Which replica admitted request_id, from the aggregated step records."""
    for _ in range(50):
        for st in httpx.get(base + "/v1/scheduler", params={"since_step": 0}, timeout=10).json()["steps"]:
            if any(a["request_id"] == request_id for a in st["admitted"]):
                return st["replica"]
        time.sleep(0.1)
    raise AssertionError(f"{request_id} is in no replica's step records")


def test_completions_and_chat_through_openai_client(client):
    out = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    again = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0)
    assert again.choices[0].text == out.choices[0].text  # greedy: same text whichever replica
    chunks = list(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content


def test_embeddings_echo_and_responses_through_the_ingress(client):
    """The new routes are the shared API's: embeddings pooled on the replicas, echo's prompt logprobs
    through coalesced replica outputs, the Responses store in the ingress."""
    emb = client.embeddings.create(model=MODEL, input=["Hello there", "Hi"], encoding_format="float")
    assert [len(d.embedding) for d in emb.data] == [64, 64]
    again = client.embeddings.create(model=MODEL, input="Hello there", encoding_format="float")
    assert max(abs(a - b) for a, b in zip(again.data[0].embedding, emb.data[0].embedding)) < 1e-4
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt="Count with me", max_tokens=8, temperature=0, echo=True,
                                        logprobs=1, stream=stream, extra_body={"ignore_eos": True})
        lps = [v for c in out if c.choices and c.choices[0].logprobs
               for v in c.choices[0].logprobs.token_logprobs] if stream else out.choices[0].logprobs.token_logprobs
        assert lps[0] is None and len(lps) > 8 and all(v is not None for v in lps[1:])
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0)
    second = client.responses.create(model=MODEL, input="Again", previous_response_id=first.id, max_output_tokens=3)
    assert client.responses.retrieve(second.id).previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens


def test_anthropic_messages_through_the_ingress(cluster, client):
    """/v1/messages is the shared API's too: the chat path over the replicas, Anthropic's answer (the
    stop reason coming from the replica's outputs) and its error shape."""
    import anthropic

    claude = anthropic.Anthropic(base_url=cluster, api_key="none", max_retries=0, timeout=60)
    body = dict(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi"}],
                extra_body={"temperature": 0})
    m = claude.messages.create(**body)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5
    chat = client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=5, temperature=0)
    assert m.content[0].text == chat.choices[0].message.content
    with claude.messages.stream(**body) as stream:
        assert "".join(stream.text_stream) == m.content[0].text
    assert claude.messages.count_tokens(model=MODEL, messages=body["messages"]).input_tokens == m.usage.input_tokens
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(**body | {"model": "nope"})
    assert e.value.body["error"]["type"] == "not_found_error"


def test_streamed_outputs_coalesce_without_losing_tokens(client):
    """Replicas merge the outputs of several steps into one message (stream_interval_s): every
    token still arrives, with its logprob, in order."""
    full = client.completions.create(model=MODEL, prompt="Count with me", max_tokens=24, temperature=0,
                                     logprobs=1, extra_body={"ignore_eos": True})
    chunks = [c for c in client.completions.create(model=MODEL, prompt="Count with me", max_tokens=24,
                                                   temperature=0, logprobs=1, stream=True,
                                                   extra_body={"ignore_eos": True}) if c.choices]
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert tokens == full.choices[0].logprobs.tokens and len(tokens) == 24
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert len(chunks) < 24  # the tiny model steps faster than the interval: several tokens a chunk


def test_errors_are_the_servers_own(client, cluster):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    r = httpx.post(cluster + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5000},
                   timeout=30)
    assert r.status_code == 400 and "max_output_len 2048" in r.json()["error"]["message"]  # the replicas' limits
    r = httpx.post(cluster + "/v1/completions", json={"model": MODEL, "prompt": "x", "best_of": 2}, timeout=30)
    assert r.status_code == 400 and "best_of" in r.json()["error"]["message"]


def test_sixteen_concurrent_clients_all_complete(client, cluster):
    def one(i: int) -> int:
        return client.completions.create(model=MODEL, prompt=f"client {i} says", max_tokens=8,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, range(16))) == [8] * 16
    sched = wait_for(lambda: (s := httpx.get(cluster + "/v1/scheduler", timeout=10).json())["running"] == 0 and s,
                     "both replicas idle")
    assert len(sched["replicas"]) == 2 and all(r["step"] > 0 for r in sched["replicas"])  # both served
    mem = sched["memory"]  # the deployment's: KV caches summed, one file's mapped weights counted once
    assert mem["replicas"] == 2 and mem["kv_cache"] == sum(r["memory"]["kv_cache"] for r in sched["replicas"]) > 0
    assert mem["weights_mapped"] == max(r["memory"]["weights_mapped"] for r in sched["replicas"])


def test_metrics_label_each_replica(cluster):
    """Each replica's series carry its id, and the ingress's own (refusals before admission) carry
    "ingress": one refused request first, so the test does not lean on an earlier test's."""
    bad = httpx.post(cluster + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}, timeout=30)
    assert bad.status_code == 400, bad.text
    text = httpx.get(cluster + "/metrics", timeout=10).text
    replicas = {r["replica"] for r in httpx.get(cluster + "/v1/scheduler", timeout=10).json()["replicas"]}
    for rid in replicas:
        assert f'iterserve:num_requests_running{{model_name="{MODEL}",replica="{rid}"}}' in text
    assert f'iterserve:request_rejected_total{{model_name="{MODEL}",replica="ingress",status_code="400"}}' in text


def test_prefix_router_keeps_conversations_on_one_replica(client, cluster):
    """Each turn extends the previous turn's prompt and answer; every turn of a conversation goes to
    one replica, and the conversations use both. The conversations run concurrently, so their turns
    are routed at the same moments: a router whose chosen replica went to another pending request
    (Serve's FIFO matching instead of by request id) would split them."""
    def talk(conv: int) -> set[str]:
        prompt = f"Conversation number {conv} begins with a long opening line about topic {conv * 7} " * 3
        seen = set()
        for turn in range(3):
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
            seen.add(replica_of(cluster, out.id))
            prompt += out.choices[0].text + f" and then turn {turn} asks more about it."
        return seen

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        homes = list(pool.map(talk, range(4)))
    assert all(len(seen) == 1 for seen in homes), f"a conversation was split: {homes}"
    assert len(set.union(*homes)) == 2, homes


def test_disconnect_frees_blocks_on_its_replica(cluster):
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", cluster + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert first
            busy = wait_for(lambda: [s for s in http.get(cluster + "/v1/scheduler").json()["replicas"]
                                     if s["running"]], "the request running on a replica")
            assert len(busy) == 1 and busy[0]["kv_cache"]["used_blocks"] > 0
            replica = busy[0]["replica"]
        # leaving the block closed the connection mid-stream
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            state = {s["replica"]: s for s in http.get(cluster + "/v1/scheduler").json()["replicas"]}
            if state[replica]["running"] == 0 and state[replica]["kv_cache"]["used_blocks"] == 0:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"replica {replica} still holds the aborted request: {state[replica]}")


def test_dashboard_draws_one_panel_per_replica(cluster):
    """/dashboard on the ingress in headless Chromium: one panel per replica, each fed by its own
    replica's ticks (labelled through the ingress's stream), drawing its batch sizes and block map
    under load and seeing every step of its replica."""
    driver = open_browser()
    try:
        driver.get(cluster + "/dashboard")
        wait_for(lambda: dash(driver)["status"] == "live" and len(dash(driver)["engines"]) == 2, "two replica panels")
        replicas = {r["replica"] for r in httpx.get(cluster + "/v1/scheduler", timeout=10).json()["replicas"]}
        assert set(dash(driver)["engines"]) == replicas
        titles = [el.text for el in driver.find_elements("css selector", "#engines .engine-title")]
        assert len(titles) == 2 and all(t.startswith("replica ") for t in titles)
        assert driver.find_element("id", "stat-replicas").text == "2"
        assert "multi" in driver.find_element("id", "engines").get_attribute("class")  # panels side by side
        def replica_steps() -> dict[str, int]:
            return {r["replica"]: r["step"] for r in httpx.get(cluster + "/v1/scheduler", timeout=10).json()["replicas"]}

        def page_matches_replicas() -> dict[str, int] | None:  # the page and /v1/scheduler read the same reports
            steps = replica_steps()
            return steps if all((e := engine(driver, rid))["lastStep"] in (steps[rid], None) and
                                e["blocks"]["held"] == 0 for rid in replicas) else None

        steps_before = wait_for(page_matches_replicas, "each panel to catch up with its idle replica")
        before = {rid: engine(driver, rid) for rid in replicas}
        load = send_load(cluster, n=16, max_tokens=400, model=MODEL)
        held = {rid: False for rid in replicas}
        deadline = time.monotonic() + 120
        while load.is_alive() and time.monotonic() < deadline:
            for rid in replicas:
                held[rid] = held[rid] or engine(driver, rid)["blocks"]["held"] > 0
            time.sleep(0.1)
        load.join(timeout=1)
        assert not load.is_alive() and all(held.values()), held  # both replicas' maps showed held blocks
        steps_after = wait_for(lambda: (s := page_matches_replicas()) and s != steps_before and
                               all(engine(driver, rid)["lastStep"] == s[rid] for rid in replicas) and s,
                               "each panel to see its replica's last step and the blocks freed")
        for rid in replicas:
            after = engine(driver, rid)
            assert after["gaps"] == 0, rid
            # every step of this replica's share of the load, counted through its ticks
            assert after["steps"] - before[rid]["steps"] == steps_after[rid] - steps_before[rid] > 20, rid
            assert after["ticks"] > before[rid]["ticks"] + 3  # the batch-size series grew
            assert after["redraws"]["chart-batch"] > before[rid]["redraws"]["chart-batch"] + 3
            assert after["blockUpdates"] > before[rid]["blockUpdates"] + 1  # the block map changed
            assert has_colour(driver, f'[data-replica="{rid}"] .chart-batch', (26, 115, 232))  # decode rows
    finally:
        driver.quit()


def test_killed_replica_loses_no_request_silently(cluster):
    """A replica killed mid-load: each request either completes in full or ends with a clear error;
    none hangs; Serve restarts the replica."""
    def one(i: int) -> str:
        body = {"model": MODEL, "prompt": f"request {i} of the load", "max_tokens": 600, "ignore_eos": True}
        if i % 2:
            with httpx.stream("POST", cluster + "/v1/completions", json={**body, "stream": True}, timeout=90) as r:
                if r.status_code != 200:
                    return f"error {r.status_code}"
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-3:]  # the stream always ends properly
            if any('"error"' in e for e in events):
                return "error"
            assert sum(1 for e in events if '"text"' in e) >= 1
            return "ok"
        r = httpx.post(cluster + "/v1/completions", json=body, timeout=90)
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 600
            return "ok"
        assert r.json()["error"]["message"]
        return f"error {r.status_code}"

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            busy = [s for s in httpx.get(cluster + "/v1/scheduler", timeout=10).json()["replicas"]
                    if s["running"] >= 2]
            if busy:
                break
            time.sleep(0.1)
        assert busy, "the load never reached the replicas"
        os.kill(busy[0]["pid"], signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]  # never hangs
    assert "ok" in results and any(r.startswith("error") for r in results), results
    deadline = time.monotonic() + 120  # Serve replaces the dead replica
    while time.monotonic() < deadline:
        if len(httpx.get(cluster + "/v1/scheduler", timeout=10).json()["replicas"]) == 2:
            break
        time.sleep(1)
    else:
        pytest.fail("Serve did not restart the killed replica")
    out = httpx.post(cluster + "/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 3},
                     timeout=60)
    assert out.status_code == 200


def test_dashboard_reconnects_after_the_ingress_restarts(cluster):
    """The ingress's actor killed (Serve starts a new one): the open page notices, reconnects by
    itself and starts afresh with a panel per replica. Runs last: the new ingress's router starts
    without the old one's memory."""
    driver = open_browser()
    try:
        driver.get(cluster + "/dashboard")
        wait_for(lambda: dash(driver)["status"] == "live" and len(dash(driver)["engines"]) == 2, "two replica panels")
        replicas = set(dash(driver)["engines"])
        ingress = [a for a in ray.util.list_named_actors(all_namespaces=True) if "#Ingress#" in a["name"]]
        assert len(ingress) == 1, ingress
        ray.kill(ray.get_actor(ingress[0]["name"], namespace=ingress[0]["namespace"]), no_restart=True)
        wait_for(lambda: dash(driver)["status"] == "reconnecting", "the page to notice the ingress is gone")
        again = wait_for(lambda: (d := dash(driver))["status"] == "live" and d["restarts"] == 1 and
                         set(d["engines"]) == replicas and d, "the page to reconnect to the new ingress", timeout=120)
        assert again["connections"] >= 2
        wait_for(lambda: all(engine(driver, rid)["ticks"] > 0 for rid in replicas), "ticks from the new ingress")
    finally:
        driver.quit()
