"""The multi-turn and shared-system-prompt workloads of `iterserve bench`: what they send (growing
histories over one system prompt), and that they run against a real server over HTTP and read its
prefix-cache hit rate from vLLM-named counters."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest
from http_server import HttpServer

from iterserve.bench import workload as wl
from iterserve.bench.client import _PREFIX_CACHE_RE, prefix_cache_delta, run_load
from iterserve.bench.conversation import (ConversationOptions, turn_body, build_conversations, later_turn_stats,
                                          run_conversations)
from iterserve.bench.workload import WorkloadError

MODEL = "tiny"


def test_conversations_share_one_system_prompt_and_are_seeded() -> None:
    opts = ConversationOptions(num_conversations=3, turns=4, system_prompt_len=50, user_len=(5, 9),
                               output_len=7, think_time_s=0.5, stagger_s=1.0, seed=3)
    convs = build_conversations(opts)
    assert len(convs) == 3 and all(len(c.user_turns) == len(c.output_lens) == len(c.think_s) == 4 for c in convs)
    assert len({c.system_prompt for c in convs}) == 1
    assert all(0 <= c.start_s <= 1.0 for c in convs) and all(o == 7 for c in convs for o in c.output_lens)
    assert [c.user_turns for c in build_conversations(opts)] == [c.user_turns for c in convs]
    assert [c.user_turns for c in build_conversations(ConversationOptions(**{**vars(opts), "seed": 4}))] != \
        [c.user_turns for c in convs]
    with pytest.raises(WorkloadError):
        ConversationOptions(turns=0)


def test_distinct_system_prompts_change_only_the_system_prompts() -> None:
    opts = ConversationOptions(num_conversations=4, turns=3, system_prompt_len=60, user_len=(5, 9), seed=2)
    shared = build_conversations(opts)
    distinct = build_conversations(ConversationOptions(**{**vars(opts), "system_prompts": "distinct"}))
    assert len({c.system_prompt for c in distinct}) == 4 and shared[0].system_prompt not in \
        {c.system_prompt for c in distinct}
    assert [(c.start_s, c.user_turns, c.output_lens, c.think_s) for c in distinct] == \
        [(c.start_s, c.user_turns, c.output_lens, c.think_s) for c in shared]
    again = build_conversations(ConversationOptions(**{**vars(opts), "system_prompts": "distinct"}))
    assert [c.system_prompt for c in again] == [c.system_prompt for c in distinct]
    with pytest.raises(WorkloadError, match="system_prompts"):
        ConversationOptions(system_prompts="each")


def test_each_turn_resends_the_whole_history() -> None:
    conv = build_conversations(ConversationOptions(num_conversations=1, turns=2, system_prompt_len=20))[0]
    first = turn_body(conv, 0, "m", chat=True, ignore_eos=True)["messages"]
    conv.history += [{"role": "user", "content": conv.user_turns[0]}, {"role": "assistant", "content": "ANSWER"}]
    second = turn_body(conv, 1, "m", chat=True, ignore_eos=True)["messages"]
    assert second[: len(first)] == first and second[len(first)]["content"] == "ANSWER"
    prompt = turn_body(conv, 1, "m", chat=False, ignore_eos=True)["prompt"]
    assert prompt.startswith("System: " + conv.system_prompt) and "Assistant: ANSWER" in prompt


def test_shared_prefix_workload_prompts() -> None:
    specs = wl.build_prompts(wl.make_workload("shared-prefix", num_requests=5, rate=2.0, system_prompt_len=30,
                                              input_len=8))
    assert len({s.system_prompt for s in specs}) == 1 and specs[0].system_prompt
    assert len({s.prompt for s in specs}) == 5


def test_prefix_cache_counters_read_vllm_and_iterserve_names() -> None:
    lines = ['vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0',
             'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 900.0',
             'vllm:prefix_cache_queries_created{engine="0"} 1.7e9',
             'iterserve:prefix_cache_hits_total{model_name="tiny"} 5.0',
             'vllm:gpu_prefix_cache_hits_total 3']
    found = [(m[1], float(m[2])) for line in lines if (m := _PREFIX_CACHE_RE.match(line))]
    assert found == [("queries", 1200.0), ("hits", 900.0), ("hits", 5.0)]
    assert prefix_cache_delta({"queries": 100, "hits": 10}, {"queries": 300, "hits": 110}) == \
        {"query_tokens": 200, "hit_tokens": 100, "hit_rate": 0.5}
    assert prefix_cache_delta(None, {"queries": 1, "hits": 1}) is None


@pytest.fixture(scope="module")
def server(tiny_model_dir, tiny_loaded):
    """`iterserve serve` on a loopback port in this process (tests/http_server.py): the clients talk
    real HTTP to it, as to any server, without the start of a server process and its model load."""
    with HttpServer([str(tiny_model_dir), "--served-model-name", MODEL, "--kv-cache-memory", "64MiB",
                     "--max-model-len", "1024"], tiny_loaded) as srv:
        yield srv


@pytest.mark.slow  # an iterserve server over real HTTP: the client any server gets
def test_multi_turn_against_a_server_reports_hits_and_later_turns(server) -> None:
    opts = ConversationOptions(num_conversations=3, turns=3, system_prompt_len=120, user_len=10,
                               output_len=6, think_time_s=0.05, stagger_s=0.2)
    result = asyncio.run(run_conversations(server.url, build_conversations(opts), progress=False))
    assert result.completed == 9 and result.failed == 0
    for c in range(3):
        turns = sorted((r for r in result.records if r.conversation == c), key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2]
        prompts = [r.prompt_tokens for r in turns]
        assert prompts[0] < prompts[1] < prompts[2], "each turn resends a longer history"
    cache = result.meta["prefix_cache"]
    assert cache["hit_rate"] > 0.5, cache  # the system prompt and every earlier turn come back
    assert result.meta["later_turns"]["count"] == 6
    assert later_turn_stats(result.records)["ttft_p50_ms"] > 0


@pytest.mark.slow  # an iterserve server over real HTTP: the client any server gets
def test_shared_prefix_against_a_server_hits_the_system_prompt(server) -> None:
    specs = wl.build_prompts(wl.make_workload("shared-prefix", num_requests=4, rate=20.0, system_prompt_len=100,
                                              input_len=8, output_len=3))
    result = asyncio.run(run_load(server.url, specs, endpoint="chat", progress=False))
    assert result.completed == 4
    assert result.meta["prefix_cache"]["hit_tokens"] > 0


@pytest.mark.slow  # an iterserve server over real HTTP: the client any server gets
def test_bench_serve_cli_multi_turn(server, tmp_path) -> None:
    out = tmp_path / "mt.json"
    proc = subprocess.run([sys.executable, "-m", "iterserve.cli", "bench", "serve", "--base-url", server.url,
                           "--endpoint", "chat", "--workload", "multi-turn", "--conversations", "2", "--turns", "2",
                           "--system-prompt-len", "40", "--user-len", "6", "--output-len", "4",
                           "--think-time", "0", "--stagger", "0", "--no-progress", "--result-json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Prefix cache hit rate" in proc.stdout and "Later-turn TTFT" in proc.stdout
    assert httpx.get(server.url + "/health").status_code == 200
    assert '"kind": "multi-turn"' in out.read_text()
