"""Prefix caching on the embedded SmolLM2-135M in float32: reusing cached KV changes no greedy
token, over multi-turn conversations that share a system prompt and under preemption."""
from __future__ import annotations

import pytest

from iterserve.config import EngineConfig
from iterserve.engine import LLMEngine
from iterserve.sampling import SamplingParams

SYSTEM = ("You are a patient tutor for a class of curious children. Answer in short, plain sentences, "
          "give one example when it helps, and never use words a ten year old would not know. "
          "If a question is unclear, say what you understood and answer that.")
TURNS = [["What is a planet?", "Which one is the biggest?", "Could people live there?"],
         ["Why do leaves fall in autumn?", "Do all trees lose them?", "What happens to the fallen leaves?"],
         ["How do fish breathe?", "Can they drown?", "Do whales breathe the same way?"]]


def engine(loaded, caching: bool, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory="256MiB", enable_prefix_caching=caching, **kw), loaded=loaded)


def run(eng: LLMEngine, messages: dict[str, list[dict]], max_tokens: int = 12) -> dict[str, str]:
    for rid, msgs in messages.items():
        eng.add_request(messages=msgs, request_id=rid,
                        params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    texts: dict[str, str] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                texts[o.request_id] = o.output_text
    return texts


def conversations(eng: LLMEngine) -> dict[str, str]:
    """All conversations turn by turn, concurrently; each turn resends the growing history."""
    history = {c: [{"role": "system", "content": SYSTEM}] for c in range(len(TURNS))}
    out = {}
    for t in range(len(TURNS[0])):
        msgs = {f"c{c}t{t}": history[c] + [{"role": "user", "content": TURNS[c][t]}] for c in history}
        texts = run(eng, msgs)
        for c in history:
            rid = f"c{c}t{t}"
            history[c] += [{"role": "user", "content": TURNS[c][t]}, {"role": "assistant", "content": texts[rid]}]
            out[rid] = texts[rid]
    return out


@pytest.mark.real_model
def test_multi_turn_greedy_output_identical_with_caching_on_and_off(smol_loaded):
    on, off = engine(smol_loaded, True), engine(smol_loaded, False)
    with_cache, without = conversations(on), conversations(off)
    assert with_cache == without
    assert all(with_cache.values())
    s = on.scheduler
    # the system prompt and every earlier turn were found cached: most prompt tokens after turn 1
    assert s.prefix_cache_hits > 0.5 * s.prefix_cache_queries
    assert off.scheduler.prefix_cache_hits == 0
    later = [rid for r in on.records for rid, cached in r.admitted if cached and not rid.endswith("t0")]
    assert len(later) == 6, "every later turn found its history cached"


@pytest.mark.real_model
def test_greedy_output_identical_with_caching_under_preemption(smol_loaded):
    """A small cache forces preemptions; a re-admitted request reuses its own cached blocks (the
    prompt and the tokens it had generated) and must still produce the same tokens."""
    prompts = {f"p{i}": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": TURNS[i % 3][i // 3]}] for i in range(6)}
    kw = dict(num_kv_blocks=40, block_size=16, max_num_batched_tokens=256)
    on, off = engine(smol_loaded, True, **kw), engine(smol_loaded, False, **kw)
    with_cache, without = run(on, prompts, max_tokens=48), run(off, prompts, max_tokens=48)
    assert on.scheduler.num_preemptions_total > 0 and off.scheduler.num_preemptions_total > 0
    assert with_cache == without
    assert on.scheduler.prefix_cache_hits > 0
    on.pool.check_invariants()
