"""The live dashboard: the stream's aggregation, the stream over real HTTP, and the page in headless
Chromium (Debian's chromium, installed by iterserve/bench/browser.py when missing) against a real server
on loopback with the tiny model: it receives step records, redraws, draws the block map, asks for
the API key, and reconnects after a restart."""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from app_server import AppServer
from dashboard_page import dash, engine, has_colour, send_load
from prometheus_client.parser import text_string_to_metric_families

from iterserve.bench.browser import open_browser
from iterserve.bench.launcher import ServerProcess
from iterserve.core.block_hash import hash_block_chain
from iterserve.core.block_pool import BlockPool
from iterserve.engine import StepRecord
from iterserve.sampling import SamplingParams
from iterserve.config import EngineConfig
from iterserve.serve_ray.dashboard_feed import ReplicaTicks, merge_ticks
from iterserve.serve_ray.ingress import build_ingress_app
from iterserve.serve_ray.remote_engine import RemoteEngine
from iterserve.serve_ray.replica import EngineInfo
from iterserve.server.async_engine import AsyncEngine
from iterserve.server.dashboard import PAGE_PATHS, SchedulerStream, StreamConfig
from iterserve.server.serving import ServerSettings
from iterserve.server.engine_ticks import EngineTicks, aggregate_steps, percentile


MODEL = "tiny"
KEY = "s3cret-key"


def _rec(step: int, batch: int, decode: int, padding: int = 0, waiting: int = 0) -> StepRecord:
    return StepRecord(step=step, start=0.0, duration=0.01, batch_size=batch, num_padding=padding, num_running=batch,
                      num_waiting=waiting, prefill_tokens=(batch - decode) * 10, decode_tokens=decode,
                      kv_used_blocks=1, kv_total_blocks=8, kv_tokens=10, finished=[("a", 1)] if step == 2 else [])


def server_args(model_dir, *extra: str) -> list[str]:
    return [str(model_dir), "--served-model-name", MODEL, "--num-kv-blocks", "96", "--max-num-seqs", "4",
            "--max-model-len", "512", "--enable-prefix-caching", *extra]


def wait_for(fn, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# ---- pure parts -------------------------------------------------------------------------------
def test_aggregate_steps_splits_rows_and_keeps_every_step():
    steps = [_rec(1, 4, decode=1, waiting=3), _rec(2, 4, decode=4, padding=1), _rec(3, 2, decode=2)]
    agg = aggregate_steps(steps)
    assert agg["steps"] == 3 and (agg["first_step"], agg["last_step"]) == (1, 3)
    assert (agg["seqs_prefill"], agg["seqs_decode"], agg["seqs_padding"]) == (3, 6, 1)
    assert agg["seqs_prefill"] + agg["seqs_decode"] + agg["seqs_padding"] == sum(s.batch_size for s in steps)
    assert agg["decode_tokens"] == 6 and agg["prefill_tokens"] == 30  # padding rows compute no useful token
    assert agg["batch_max"] == 4 and agg["waiting_max"] == 3 and agg["finished"] == 1
    assert agg["busy_s"] == pytest.approx(0.03)
    assert aggregate_steps([]) == {"steps": 0}


def test_percentile_nearest_rank():
    assert percentile([], 50) is None
    values = sorted(float(v) for v in range(1, 101))
    assert percentile(values, 50) == 50.0 and percentile(values, 95) == 95.0 and percentile([7.0], 95) == 7.0


def _replica_tick(seq: int, first: int, n: int, t: float, running: int = 2) -> dict:
    """A replica's tick as ReplicaFeed numbers it: aggregate_steps of n steps from `first`, plus state."""
    steps = [_rec(first + i, 4 if i % 2 else 2, decode=2, waiting=i) for i in range(n)]
    return {"seq": seq, "t": t, "dt": 0.2, **aggregate_steps(steps), "step": first + n - 1, "running": running,
            "waiting": 0, "kv_used": 3, "kv_total": 8, "kv_tokens": 30, "busy_fraction": 0.5, "latency": {"n": seq}}


def test_merge_ticks_sums_counts_keeps_maxima_and_the_latest_state():
    a, idle, b = _replica_tick(1, 10, 3, 1.0), {**_replica_tick(2, 0, 0, 1.2), "running": 0}, _replica_tick(3, 13, 2, 1.4)
    merged = merge_ticks([a, idle, b])
    assert merged["steps"] == 5 and (merged["first_step"], merged["last_step"]) == (10, 14)
    assert merged["seqs_prefill"] == a["seqs_prefill"] + b["seqs_prefill"] and merged["busy_s"] == pytest.approx(0.05)
    assert merged["batch_max"] == 4 and merged["waiting_max"] == 2
    assert merged["dt"] == pytest.approx(0.6) and merged["t"] == 1.4 and merged["latency"] == {"n": 3}
    assert "seq" not in merged
    assert merge_ticks([idle]) == {k: v for k, v in idle.items() if k not in ("seq", "first_step", "last_step")}


def test_replica_ticks_label_merge_and_never_resend():
    """The ingress's source over two fake replicas' reports: each replica's unseen ticks merged and
    labelled with its id, config and block map the first time, the map again only when it changed,
    nothing twice, a skipped report's ticks still counted, a replica gone from `live`."""
    feeds = {rid: {"seq": 0, "ticks": [], "blocks": None, "blocks_seq": 0} for rid in ("r1", "r2")}
    reports = {rid: {"scheduler": {"config": {"step_limit": 4, "name": rid}, "uptime_s": 1.0, "step": 0},
                     "dashboard": feed} for rid, feed in feeds.items()}

    def push(rid: str, tick: dict, blocks: dict | None = None) -> None:
        feed = feeds[rid]
        feed["seq"] = tick["seq"]
        feed["ticks"] = (feed["ticks"] + [tick])[-25:]
        if blocks is not None:
            feed["blocks"], feed["blocks_seq"] = blocks, tick["seq"]

    source = ReplicaTicks(lambda: reports, lambda: False)
    source.start()
    map1 = {"total": 8, "held": [[0, [0, 1]]], "cached": []}
    push("r1", _replica_tick(1, 1, 3, 0.2), map1)
    push("r2", _replica_tick(1, 1, 2, 0.3), {"total": 8, "held": [], "cached": []})
    hello = source.hello()
    assert [p["replica"] for p in hello["replicas"]] == ["r1", "r2"] and hello["replicas"][0]["blocks"] == map1
    first = source.tick(1.0)
    assert first["live"] == ["r1", "r2"]
    parts = {p["replica"]: p for p in first["replicas"]}
    assert parts["r1"]["config"]["name"] == "r1" and parts["r1"]["blocks"] == map1 and parts["r1"]["steps"] == 3
    assert parts["r2"]["steps"] == 2
    assert source.tick(1.1)["replicas"] == []  # nothing new: nothing resent
    # r1 reports twice between two ingress ticks (one report skipped); r2 once, with a new map
    push("r1", _replica_tick(2, 4, 4, 0.4))
    push("r1", _replica_tick(3, 8, 1, 0.6))
    map2 = {"total": 8, "held": [[1, [2]]], "cached": [0, 1]}
    push("r2", _replica_tick(2, 3, 5, 0.5), map2)
    parts = {p["replica"]: p for p in source.tick(1.3)["replicas"]}
    assert (parts["r1"]["first_step"], parts["r1"]["last_step"], parts["r1"]["steps"]) == (4, 8, 5)
    assert "blocks" not in parts["r1"] and "config" not in parts["r1"]  # unchanged: not resent
    assert parts["r2"]["blocks"] == map2 and parts["r2"]["first_step"] == 3
    del reports["r2"]  # e.g. killed: Serve brings it back under a new id
    assert source.tick(1.5)["live"] == ["r1"]
    # a new reader after the last one left starts afresh: the newest tick, with config and map
    source.stop()
    source.start()
    parts = source.tick(1.6)["replicas"]
    assert len(parts) == 1 and parts[0]["config"]["name"] == "r1" and parts[0]["first_step"] == 8


def test_block_map_copies_tables():
    pool = BlockPool(8, 4)
    pool.allocate("a", 9)
    pool.allocate("b", 1)
    bm = pool.block_map()
    assert bm.num_blocks == 8 and dict(bm.held) == {"a": (0, 1, 2), "b": (3,)} and bm.cached == ()
    pool.free("a")
    assert dict(bm.held)["a"] == (0, 1, 2)  # a copy: later changes do not reach it
    assert dict(pool.block_map().held) == {"b": (3,)}


def test_block_map_shows_cached_and_shared_blocks():
    """With prefix caching, a finished request's full blocks stay cached; a new request with the
    same prefix shares them (each shared block is in both tables) until its owners release it."""
    pool = BlockPool(8, 4, enable_caching=True)
    tokens = list(range(9))
    hashes = hash_block_chain(tokens, 4)
    pool.allocate("a", 9)
    pool.cache_blocks("a", hashes, 9)
    prefix = pool.find_cached_prefix(hashes)
    pool.allocate("b", 9, cached_blocks=prefix)
    bm = pool.block_map()
    assert dict(bm.held) == {"a": (0, 1, 2), "b": (0, 1, 3)} and bm.cached == ()
    pool.free("a")
    pool.free("b")
    assert pool.block_map().held == () and set(pool.block_map().cached) == {0, 1}


def test_hub_in_process_gathers_only_while_read_and_closes_a_slow_reader(make_engine):
    """The hub over a real AsyncEngine (tiny model): steps taken with no stream open are not
    gathered; a reader gets hello then ticks whose steps add up to the engine's; a reader that
    stops reading is closed after max_backlog ticks instead of being sent a gap; shutdown ends it."""
    engine = AsyncEngine(make_engine(num_kv_blocks=64, max_model_len=256), warmup=False)
    ticks = EngineTicks(engine, {"step_limit": 4})
    hub = SchedulerStream(ticks, StreamConfig(interval_s=0.02, max_backlog=4))

    async def generate(n: int) -> None:
        streams = [await engine.add_request(f"r{i}-{n}", [5, 6, 7, 8 + i], SamplingParams(max_tokens=8, ignore_eos=True))
                   for i in range(n)]
        for stream in streams:
            async for _ in stream:
                pass

    async def drain(stream) -> list[bytes]:
        return [chunk async for chunk in stream]

    async def go() -> tuple[list[bytes], list[bytes], list[bytes]]:
        engine.start()
        await generate(3)  # nobody reads: nothing may be gathered
        assert ticks._pending == [] and engine.state.step_count > 0
        reader = hub.subscribe()
        events = [await anext(reader)]
        load = asyncio.create_task(generate(6))
        while not (load.done() and json.loads(events[-1].split(b"data: ")[1])["running"] == 0):
            events.append(await anext(reader))
        slow = hub.subscribe()
        await anext(slow)  # its hello; then it stops reading
        await asyncio.sleep(0.02 * 12)
        rest = await asyncio.wait_for(drain(slow), 5)  # what was queued, then the end of its stream
        engine.begin_shutdown()
        tail = await asyncio.wait_for(drain(reader), 5)  # shutdown ends every stream (uvicorn waits for them)
        await engine.stop()
        return events, rest, tail

    events, rest, tail = asyncio.run(go())
    parsed = [json.loads(e.split(b"data: ")[1]) for e in events]
    assert events[0].startswith(b"event: hello") and parsed[0]["config"] == {"step_limit": 4}
    ticks = [t for t in parsed[1:] if t["steps"]]
    assert sum(t["steps"] for t in ticks) == ticks[-1]["last_step"] - ticks[0]["first_step"] + 1
    assert ticks[-1]["last_step"] == engine.state.step_count and ticks[0]["first_step"] > 1
    assert 1 <= len(rest) <= 4  # closed at the backlog bound, not left to grow
    assert len(tail) <= 4


# ---- the stream over real HTTP ----------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("dashboard-server") / "server.log"
    with ServerProcess(server_args(tiny_model_dir), log_path=log) as srv:
        yield srv
    assert srv.proc.returncode == 0, log.read_text()[-2000:]


def read_events(base_url: str, stop: threading.Event, events: list, headers: dict | None = None) -> None:
    with httpx.stream("GET", base_url + "/v1/scheduler/stream", headers=headers, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        buf = ""
        for chunk in r.iter_text():
            buf += chunk
            while "\n\n" in buf:
                block, buf = buf.split("\n\n", 1)
                lines = dict(line.split(": ", 1) for line in block.splitlines())
                events.append((lines["event"], json.loads(lines["data"])))
            if stop.is_set():
                return


@pytest.mark.slow  # a real iterserve serve process
def test_stream_counts_every_step_at_a_few_ticks_a_second(server, tiny_model_dir):
    stop, events = threading.Event(), []
    reader = threading.Thread(target=read_events, args=(server.base_url, stop, events), daemon=True)
    reader.start()
    wait_for(lambda: events, what="the hello event")
    t0 = time.monotonic()
    send_load(server.base_url).join(timeout=120)

    def idle_tick():
        ticks = [e for name, e in events if name == "tick"]
        return ticks and ticks[-1]["running"] == 0 and ticks[-1]["kv_used"] == 0 and ticks[-1]["steps"] == 0

    wait_for(idle_tick, what="an idle tick after the load")
    elapsed = time.monotonic() - t0
    stop.set()
    hello = events[0]
    assert hello[0] == "hello" and hello[1]["config"]["batching"] == "continuous"
    assert hello[1]["config"]["step_limit"] == 4 and hello[1]["config"]["num_kv_blocks"] == 96
    assert str(tiny_model_dir) not in json.dumps(hello[1])  # no path on this machine in an answer
    ticks = [e for name, e in events[1:] if name == "tick"]
    busy = [t for t in ticks if t["steps"]]
    # no step lost: each tick's steps are contiguous and follow the previous tick's
    for prev, cur in zip(busy, busy[1:]):
        assert cur["first_step"] == prev["last_step"] + 1
    assert all(t["last_step"] - t["first_step"] + 1 == t["steps"] for t in busy)
    total = sum(t["steps"] for t in busy)
    assert total == busy[-1]["last_step"] - busy[0]["first_step"] + 1
    server_step = httpx.get(server.base_url + "/v1/scheduler").json()["step"]
    assert busy[-1]["last_step"] == server_step
    # throttled: a few ticks a second however fast the engine steps
    assert len(ticks) <= elapsed / 0.25 + 4
    assert max(t["steps"] for t in busy) > 1
    assert max(t["batch_max"] for t in busy) == 4 and max(t["waiting_max"] for t in busy) > 0
    assert sum(t["decode_tokens"] for t in busy) + sum(t["seqs_prefill"] for t in busy) >= 12 * 120
    assert ticks[-1]["latency"]["n"] == 12 and ticks[-1]["latency"]["e2e_p95"] >= ticks[-1]["latency"]["ttft_p50"]
    # the block map: held by up to 4 requests under load, all free again at the end
    maps = [t["blocks"] for t in ticks if "blocks" in t]
    assert max(len(m["held"]) for m in maps) >= 2
    assert maps[-1]["held"] == [] and maps[-1]["total"] == 96
    assert len(maps[-1]["cached"]) >= 12 * 4  # each request's full blocks, kept for reuse by prefix caching


def test_ingress_dashboard_is_behind_the_api_key(tiny_model_dir):
    """The Ray ingress's app (built as in the Serve deployment, here with no cluster: no replica
    reports) guards its stream like the single server and leaves the page open."""
    info = EngineInfo(EngineConfig(model=str(tiny_model_dir)), 512, 512, 512, 49152, (2,), 16)
    remote = RemoteEngine(None, info)
    app = build_ingress_app(remote, ServerSettings(served_model_name=MODEL, api_key=KEY), None, "EngineReplica",
                            "prefix")

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost") as http:
            answers = [await http.get(path) for path in PAGE_PATHS]
            answers.append(await http.get("/dashboard/static/other.js"))
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                answers.append(await http.get("/v1/scheduler/stream", headers=headers))
            remote.shutting_down = True  # the stream ends at once (ASGITransport reads a response whole)
            answers.append(await http.get("/v1/scheduler/stream", headers={"Authorization": f"Bearer {KEY}"}))
            return answers

    answers = asyncio.run(go())
    assert [r.status_code for r in answers] == [200, 200, 200, 401, 401, 401, 200]
    assert "dashboard/static/dashboard.js" in answers[0].text
    assert answers[4].json()["error"]["message"]  # OpenAI's error format, as on the single server


@pytest.fixture(scope="module")
def http(tiny_model_dir, tiny_loaded):
    """The app `iterserve serve` builds, in process (tests/app_server.py): for what needs no socket."""
    with AppServer(server_args(tiny_model_dir), tiny_loaded) as srv, srv.client(timeout=60) as client:
        yield client


def test_dashboard_page_is_package_data(http):
    page = http.get("/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for ref in ("dashboard/static/dashboard.js", "dashboard/static/dashboard.css"):
        assert ref in page.text
        assert http.get(f"/{ref}").status_code == 200
    assert "http://" not in page.text and "https://" not in page.text  # nothing fetched from elsewhere
    assert http.get("/dashboard/static/nope.js").status_code == 404


def test_grafana_dashboard_queries_only_exported_metrics(http):
    """docs/grafana-dashboard.json: every iterserve metric a panel or variable queries is in /metrics."""
    dashboard = json.loads((Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"]]
    queried = {m for e in exprs for m in re.findall(r"iterserve:[a-z0-9_]+", e)}
    assert len(queried) >= 15
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).status_code == 200
    samples = [s for fam in text_string_to_metric_families(http.get("/metrics").text) for s in fam.samples]
    exported = {s.name for s in samples}
    assert queried <= exported, f"queried but not exported: {sorted(queried - exported)}"
    info = [s for s in samples if s.name == "iterserve:engine_config_info"]
    assert info[0].labels["step_limit"] == "4" and info[0].labels["batching"] == "continuous" and info[0].value == 1


# ---- the page in a real browser ---------------------------------------------------------------
@pytest.mark.slow  # a real iterserve serve process
def test_dashboard_in_browser_draws_live_steps_and_reconnects(tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    srv = ServerProcess(server_args(tiny_model_dir), log_path=log).start()
    driver = open_browser()
    try:
        driver.get(srv.base_url + "/dashboard")
        wait_for(lambda: dash(driver)["status"] == "live" and dash(driver)["ticks"] > 0, what="the page to go live")
        before = engine(driver)
        config = driver.find_element("css selector", ".config").text
        assert config.count("\n") >= 8 and "continuous" in config
        # one engine: one panel, as the page was before replicas, with no replica title
        assert len(driver.find_elements("css selector", "#engines .engine")) == 1
        assert not driver.find_element("css selector", ".engine-title").is_displayed()
        load = send_load(srv.base_url, n=12, max_tokens=150)
        held = wait_for(lambda: (e := engine(driver))["blocks"]["held"] > 0 and e, what="held blocks on the map")
        assert held["blocks"]["requests"] >= 1
        assert has_colour(driver, ".chart-batch", (26, 115, 232))  # decode rows, drawn as bars
        load.join(timeout=120)
        server_step = httpx.get(srv.base_url + "/v1/scheduler").json()["step"]
        after = wait_for(lambda: (e := engine(driver))["lastStep"] == server_step and e["blocks"]["held"] == 0 and e,
                         what="the page to see every step and the blocks freed")
        assert after["gaps"] == 0
        assert after["steps"] > 12  # every step of the load, counted through aggregated ticks
        assert after["redraws"]["chart-batch"] > before["redraws"]["chart-batch"] + 3
        assert after["blockUpdates"] > before["blockUpdates"] + 1  # changed under load and when requests finished
        # prefix caching keeps the finished requests' full blocks for reuse: drawn as cached, not free
        assert after["blocks"]["cached"] > 0 and after["blocks"]["free"] + after["blocks"]["cached"] == 96
        assert has_colour(driver, ".block-map", (0x81, 0xC9, 0x95))
        assert driver.find_element("id", "stat-step").text == str(server_step)
        # a server restart on the same port: the page reconnects by itself and starts afresh
        port = srv.port
        assert srv.stop() == 0
        wait_for(lambda: dash(driver)["status"] == "reconnecting", what="the page to notice the restart")
        assert "stream" in dash(driver)["message"] or "answer" in dash(driver)["message"]
        srv = ServerProcess(server_args(tiny_model_dir), port=port, log_path=tmp_path / "server2.log").start()
        again = wait_for(lambda: (d := dash(driver))["status"] == "live" and d["restarts"] == 1 and d, timeout=60,
                         what="the page to reconnect")
        assert again["connections"] == 2
        send_load(srv.base_url, n=2, max_tokens=40).join(timeout=60)
        assert list(dash(driver)["engines"]) == [""]  # one panel, not a second one for the new process
        wait_for(lambda: engine(driver)["lastStep"] == httpx.get(srv.base_url + "/v1/scheduler").json()["step"],
                 what="steps from the new server")
    finally:
        driver.quit()
        srv.stop()


@pytest.mark.slow  # a real iterserve serve process
def test_dashboard_asks_for_the_api_key(tiny_model_dir, tmp_path):
    with ServerProcess(server_args(tiny_model_dir, "--api-key", KEY), log_path=tmp_path / "server.log") as srv:
        assert httpx.get(srv.base_url + "/dashboard").status_code == 200  # the page holds no data
        for asset in ("dashboard.js", "dashboard.css"):
            assert httpx.get(f"{srv.base_url}/dashboard/static/{asset}").status_code == 200
        assert httpx.get(srv.base_url + "/dashboard/static/other.js").status_code == 401  # only the page is open
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert httpx.get(srv.base_url + "/v1/scheduler/stream", headers=headers).status_code == 401
        driver = open_browser()
        try:
            driver.get(srv.base_url + "/dashboard")
            wait_for(lambda: dash(driver)["status"] == "auth", what="the key prompt")
            banner = driver.find_element("id", "auth")
            assert banner.is_displayed() and "needs an API key" in banner.text
            assert dash(driver)["ticks"] == 0
            driver.find_element("id", "auth-key").send_keys("wrong")
            driver.find_element("css selector", "#auth-form button").click()
            wait_for(lambda: "refused" in driver.find_element("id", "auth-message").text, what="the refusal")
            assert driver.find_element("id", "auth").is_displayed() and dash(driver)["ticks"] == 0
            driver.find_element("id", "auth-key").send_keys(KEY)
            driver.find_element("css selector", "#auth-form button").click()
            wait_for(lambda: dash(driver)["status"] == "live" and dash(driver)["ticks"] > 0, what="the keyed stream")
            assert not driver.find_element("id", "auth").is_displayed()
            # the key from the URL fragment (never sent to the server), in a fresh tab session
            driver.execute_script("sessionStorage.clear()")
            driver.get("about:blank")
            driver.get(srv.base_url + f"/dashboard#key={KEY}")
            wait_for(lambda: dash(driver)["status"] == "live", what="the fragment's key")
            assert "key=" not in driver.current_url
        finally:
            driver.quit()
