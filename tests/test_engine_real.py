"""Continuous batching on the embedded SmolLM2-135M: a request's greedy text does not depend on
what else is in the batch, nor on when it arrived. And the `generate` CLI's JSONL round trip."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from iterserve.config import EngineConfig
from iterserve.engine import LLMEngine
from iterserve.sampling import SamplingParams

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
    "Write a haiku about the sea.", "What is 12 times 7?", "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?", "Explain photosynthesis in one sentence.",
    "What is the boiling point of water?", "List two programming languages.",
    "How many legs does a spider have?", "What does a CPU do?", "Translate 'hello' to Spanish.",
    "What is the largest planet?", "Suggest a name for a cat.", "What is gravity?",
    "Describe a rainbow.", "What is the opposite of cold?", "How do bees make honey?",
    "Tell me a fun fact about octopuses.", "What is the speed of light?", "Why do we sleep?",
    "What is a prime number?", "Recommend a book for children.", "What causes rain?",
    "How many days are in a leap year?", "What is the chemical symbol for gold?",
    "Write one sentence about autumn.", "What is an atom?", "How does a compass work?",
    "What is the tallest mountain?", "Give a tip for learning to cook.",
]


def engine(loaded, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory="256MiB", **kw), loaded=loaded)


def add(eng: LLMEngine, i: int) -> None:
    eng.add_request(messages=[{"role": "user", "content": QUESTIONS[i]}], request_id=f"q{i}",
                    params=SamplingParams(max_tokens=6 + (i * 13) % 17, temperature=0.0))


def drain(eng: LLMEngine, texts: dict[str, str], steps: int | None = None) -> None:
    n = 0
    while eng.has_unfinished_requests() and (steps is None or n < steps):
        for o in eng.step():
            if o.finished:
                texts[o.request_id] = o.output_text
        n += 1


@pytest.mark.real_model
def test_32_requests_together_and_staggered_match_alone(smol_loaded):
    n = len(QUESTIONS)
    assert n == 32
    alone: dict[str, str] = {}
    solo = engine(smol_loaded, max_num_seqs=1)
    for i in range(n):
        add(solo, i)
    drain(solo, alone)  # max_num_seqs=1: each request runs by itself, one after the other
    assert max(r.batch_size for r in solo.records) == 1

    together: dict[str, str] = {}
    eng = engine(smol_loaded)  # defaults: max_num_seqs 16, so requests join as others finish
    for i in range(n):
        add(eng, i)
    drain(eng, together)
    assert max(r.batch_size for r in eng.records) == 16
    assert len({r.batch_size for r in eng.records}) > 2

    staggered: dict[str, str] = {}
    eng = engine(smol_loaded, max_num_batched_tokens=256)  # also chunks the prefills of each wave
    for wave in (range(0, 5), range(5, 14), range(14, 15), range(15, 27), range(27, 32)):
        for i in wave:
            add(eng, i)
        drain(eng, staggered, steps=4)
    drain(eng, staggered)
    assert any(r.prefill_tokens and r.decode_tokens for r in eng.records)

    assert set(alone) == set(together) == set(staggered) == {f"q{i}" for i in range(n)}
    assert all(alone.values())
    differ = [(rid, alone[rid], together[rid], staggered[rid]) for rid in alone
              if not alone[rid] == together[rid] == staggered[rid]]
    assert not differ, f"{len(differ)} requests changed with batching (alone, together, staggered): {differ}"


@pytest.mark.slow
def test_generate_cli_jsonl_round_trip(tiny_model_dir, tmp_path):
    rows = [
        {"prompt": "Tell me a story", "max_tokens": 7, "ignore_eos": True},
        {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 3, "ignore_eos": True, "priority": 5},
        {"prompt": "Sampled", "max_tokens": 5, "temperature": 0.8, "seed": 11, "ignore_eos": True, "priority": -1},
        {"prompt": "Short", "max_tokens": 1, "ignore_eos": True},
        {"prompt": "Longer one " * 20, "max_tokens": 9, "ignore_eos": True, "top_p": 0.9},
    ]
    inp, out = tmp_path / "x.jsonl", tmp_path / "y.jsonl"
    inp.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "iterserve.cli", "generate", "--model", str(tiny_model_dir),
           "--input", str(inp), "--output", str(out), "--no-progress", "--max-num-seqs", "2",
           "--scheduling-policy", "priority", "--kv-cache-memory", "32MiB", "--log-scheduler"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "", "with --output and no prompt arguments, results go only to the file"
    assert "step 1 |" in proc.stderr, "--log-scheduler logs each step"
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["completion_tokens"] for r in results] == [7, 3, 5, 1, 9], "input order is kept"
    for r in results:
        assert set(r) >= {"text", "finish_reason", "prompt_tokens", "completion_tokens",
                          "queue_time", "ttft", "e2e"}
        assert r["finish_reason"] == "length" and r["prompt_tokens"] > 0
        assert isinstance(r["text"], str)
        assert 0 <= r["queue_time"] <= r["ttft"] <= r["e2e"]
    # priority -1 ran first, priority 5 last: the queue times show it
    assert results[2]["queue_time"] <= min(r["queue_time"] for r in results)
    assert results[1]["queue_time"] >= max(r["queue_time"] for r in results)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"max_tokens": 3}\n')
    proc = subprocess.run(cmd[:6] + ["--input", str(bad)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "bad.jsonl:2: each line needs 'prompt' or 'messages'" in proc.stderr


@pytest.mark.real_model
def test_the_step_budget_defaults_to_the_devices_and_a_given_one_holds(smol_loaded):
    """A CPU engine without --max-num-batched-tokens takes config.DEFAULT_STEP_TOKENS["cpu"] (512): a
    1,200-token prompt is prefilled in chunks of at most 512, and the resolved budget is what the
    engine reports; a budget given is kept."""
    prompt = list(range(100, 1300))
    for given, budget in ((None, 512), (2048, 2048)):
        eng = engine(smol_loaded, max_num_batched_tokens=given)
        assert EngineConfig(max_num_batched_tokens=given).max_num_batched_tokens == given  # unresolved until then
        assert eng.config.max_num_batched_tokens == budget
        eng.add_request(prompt_token_ids=prompt, request_id="long", params=SamplingParams(max_tokens=1, temperature=0.0))
        drain(eng, {})
        chunks = [r.prefill_tokens for r in eng.records if r.prefill_tokens]
        assert chunks == ([512, 512, 176] if budget == 512 else [1200])
