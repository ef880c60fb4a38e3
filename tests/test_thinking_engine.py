"""The engine's side of thinking on a scripted tiny Qwen3 (tests/scripted_model.py) whose prompt
ends with `<think>` (as DeepSeek-R1's and Qwen3-Thinking-2507's templates leave it): the phase is
read from the prompt's tail with the real tokenizer, the model never writes `<think>`, the budget
forces `</think>` after exactly N thinking tokens, a grammar waits for the answer, and the parsers
split the text the engine made."""
from __future__ import annotations

import pytest
from scripted_model import save_scripted_qwen3, thinking_tokenizer

from iterserve.config import EngineConfig
from iterserve.engine import LLMEngine
from iterserve.sampling import SamplingParams
from iterserve.server.reasoning import PromptState, get_parser
from iterserve.server.reasoning.request import request_reasoning
from iterserve.structured.params import StructuredOutputsParams
from iterserve.thinking import Phase

REASONING, ANSWER = "First add, then check", "Four."


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scripted-think-prompt")
    tok = thinking_tokenizer()
    prompt = tok.encode("Question: 2+2?<think>", add_special_tokens=False)
    out = tok.encode(f"{REASONING}</think>{ANSWER}", add_special_tokens=False)
    save_scripted_qwen3(folder, [prompt[-1:] + out + [tok.eos_token_id]], tok)
    engine = LLMEngine(EngineConfig(model=str(folder), kv_cache_memory="64MiB", cpu_kernels=False))
    return engine, tok, prompt


def run(engine, prompt, params) -> str:
    engine.add_request(prompt_token_ids=prompt, params=params)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    return done[0].output_text


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("budget,reasoning", [(-1, REASONING), (0, None), (2, "First add")])
def test_budget_from_a_prompt_that_opened_the_thinking(setup, name, budget, reasoning):
    engine, tok, prompt = setup
    r = request_reasoning(get_parser(name), tok, prompt, budget, -1, False, None)
    assert r.parser.prompt_state == PromptState.THINKING
    assert (r.spec is None) == (budget == -1) and (r.spec is None or r.spec.phase == Phase.THINKING)
    text = run(engine, prompt, SamplingParams(max_tokens=30, temperature=0, thinking=r.spec))
    assert r.parser.split(text) == (reasoning, ANSWER)


def test_grammar_starts_after_the_end_marker(setup):
    engine, tok, prompt = setup
    r = request_reasoning(get_parser("deepseek_r1"), tok, prompt, None, 1, True, None)
    so = StructuredOutputsParams(regex=r"Five\.")  # would forbid every thinking token
    text = run(engine, prompt, SamplingParams(max_tokens=30, temperature=0, thinking=r.spec, structured_outputs=so))
    assert r.parser.split(text) == ("First", "Five.")
    # without the thinking spec the grammar applies from the first token: no thinking survives
    plain = run(engine, prompt, SamplingParams(max_tokens=30, temperature=0, structured_outputs=so))
    assert plain == "Five."
