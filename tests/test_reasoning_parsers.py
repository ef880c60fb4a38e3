"""Reasoning parsers (server/reasoning/) on the texts vLLM's parser tests use, each streamed cut at
every position and character by character (the deltas must add up to the whole-text split), and
the engine side of thinking (thinking.py): phases, the budget's forced end marker, the grammar gate."""
from __future__ import annotations

import random

import pytest

from iterserve.server.protocol import APIError
from iterserve.server.reasoning import PromptState, get_parser, parser_names
from iterserve.server.reasoning.request import check_default_template_kwargs, request_reasoning, template_kwargs
from iterserve.thinking import Phase, ThinkingSpec, ThinkingState

R, C = "This is a reasoning section", "This is the rest"

CASES = {
    # name, prompt state: [(output, (reasoning, content))]
    ("deepseek_r1", PromptState.NEUTRAL): [
        (f"<think>{R}</think>{C}", (R, C)),
        (f"<think>{R}</think>", (R, None)),
        (f"{R}</think>{C}", (R, C)),  # the template put <think> in the prompt
        (f"<think>{R}", (R, None)),  # no </think>: all reasoning
        (R, (R, None)),
        (f"<think></think>{C}", (None, C)),
        (f"</think>{C}", (None, C)),
        ("<think>This is a reasoning\nsection</think>This is the rest\nThat", ("This is a reasoning\nsection",
                                                                             "This is the rest\nThat")),
        (f"<think>{R}</think>{C}</think>more", (R, f"{C}</think>more")),  # only the first end marker counts
    ],
    ("qwen3", PromptState.NEUTRAL): [
        (f"<think>{R}</think>{C}", (R, C)),
        (f"<think>{R}</think>", (R, None)),
        (C, (None, C)),  # no thinking block: all content
        (f"{R}</think>{C}", (None, f"{R}</think>{C}")),  # no <think> at the start: content
        (f"<think>{R}", (R, None)),  # opened and cut off: reasoning
        (f"<think></think>{C}", (None, C)),
        (f"\n<think>\n{R}\n</think>\n\n{C}", (f"\n{R}\n", f"\n\n{C}")),
        (f"<thinking>{C}", (None, f"<thinking>{C}")),
        ("", (None, None)),
    ],
    ("qwen3", PromptState.THINKING): [  # Qwen3-Thinking-2507 / Qwen3.5: <think> is in the prompt
        (f"{R}</think>{C}", (R, C)),
        (R, (R, None)),
        (f"<think>{R}</think>{C}", (R, C)),
    ],
    ("qwen3", PromptState.CLOSED): [  # enable_thinking false: <think>\n\n</think>\n\n in the prompt
        (C, (None, C)),
        (f"{R}</think>{C}", (None, f"{R}</think>{C}")),
    ],
    ("granite", PromptState.NEUTRAL): [
        (f"Here is my thought process:{R}Here is my response:{C}", (R, C)),
        (f"Here's my thought process:{R}Here's my response:{C}", (R, C)),
        (f"Here is my thought process: {R} Here's my response: {C}", (f" {R} ", f" {C}")),
        (f"Here is my thought process:{R}Here is my response:", (R, None)),
        (f"Here is my thought process:{R}", (R, None)),  # no response marker: reasoning (vLLM streams it so)
        (C, (None, C)),
        (f"Here is my answer: {C}", (None, f"Here is my answer: {C}")),
        (f"Here is my thought process:\n{R}\nHere is my response:\n{C}\nHere is my response: x",
         (f"\n{R}\n", f"\n{C}\nHere is my response: x")),
    ],
}


def params():
    for (name, state), cases in CASES.items():
        for text, want in cases:
            yield pytest.param(name, state, text, want, id=f"{name}-{state.value}-{text[:30]!r}")


@pytest.mark.parametrize("name,state,text,want", list(params()))
def test_split_and_stream(name, state, text, want):
    parser = get_parser(name)(state)
    assert parser.split(text) == want

    def streamed(pieces):
        st = parser.stream()
        r = c = ""
        for p in pieces:
            dr, dc = st.feed(p)
            r, c = r + dr, c + dc
        dr, dc = st.finish()
        return (r + dr) or None, (c + dc) or None

    for cut in range(len(text) + 1):
        assert streamed([text[:cut], text[cut:]]) == want, cut
    assert streamed(list(text)) == want
    assert streamed([text]) == want
    rng = random.Random(len(text))
    for _ in range(50):  # many cuts at once
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 6))))
        assert streamed([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]) == want, cuts


def test_stream_holds_only_a_possible_marker():
    st = get_parser("deepseek_r1")(PromptState.NEUTRAL).stream()
    assert st.feed("<thi") == ("", "")
    assert st.feed("nk>abc</th") == ("abc", "")  # "</th" may be the end marker: held
    assert st.feed("ird") == ("</third", "")
    assert st.feed("</think>x") == ("", "x")
    st = get_parser("qwen3")(PromptState.NEUTRAL).stream()
    assert st.feed("Hello") == ("", "Hello")  # decided at once: no marker can begin here


def test_prompt_state_and_registry():
    qwen3 = get_parser("qwen3")
    assert qwen3.prompt_state_of("<|im_start|>assistant\n") == PromptState.NEUTRAL
    assert qwen3.prompt_state_of("<|im_start|>assistant\n<think>\n") == PromptState.THINKING
    assert qwen3.prompt_state_of("<|im_start|>assistant\n<think>\n\n</think>\n\n") == PromptState.CLOSED
    assert get_parser("smollm3") is get_parser("deepseek_r1")  # what vLLM's users pass for SmolLM3
    assert {"qwen3", "deepseek_r1", "granite", "smollm3"} <= set(parser_names())
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'; choose one of: deepseek_r1, granite"):
        get_parser("nope")


def feed(state, tokens):
    return [state.on_token(t) for t in tokens]


def test_thinking_state_phases_and_budget():
    START, END = (7,), (8, 9)  # a one-token start marker, a two-token end marker
    st = ThinkingState(ThinkingSpec(START, END, Phase.UNDECIDED, budget=3))
    assert st.forced_token(False) is None and st.gate_token() == 7
    assert feed(st, [7, 1, 2]) == [False, False, False] and st.phase == Phase.THINKING
    assert st.num_thinking_tokens == 2 and st.forced_token(False) is None
    assert feed(st, [8]) == [False]  # the model began the end marker as the budget ran out
    assert st.forced_token(False) == 9  # ... so the marker is completed, not restarted
    assert feed(st, [9, 5]) == [False, True] and st.answering and st.forced_token(False) is None
    st = ThinkingState(ThinkingSpec(START, END, Phase.THINKING, budget=0))
    assert st.forced_token(False) == 8  # budget 0: the end marker at once
    assert feed(st, [8, 9, 3]) == [False, False, True]
    st = ThinkingState(ThinkingSpec(START, END, Phase.UNDECIDED))
    assert feed(st, [3, 7]) == [True, True] and st.answering  # answered without thinking
    st = ThinkingState(ThinkingSpec(START, END, Phase.THINKING, budget=2))
    assert feed(st, [7, 1]) == [False, False] and st.num_thinking_tokens == 1  # a written <think> is not counted
    feed(st, [1])
    assert st.forced_token(False) == 8
    st = ThinkingState(ThinkingSpec((7, 6), END, Phase.UNDECIDED))
    feed(st, [7])
    assert st.forced_token(True) == 6 and st.forced_token(False) is None  # under a grammar: completed
    with pytest.raises(ValueError):
        ThinkingSpec(START, (), Phase.THINKING)


class _Tok:
    """encode/decode over characters: enough for request_reasoning."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_request_reasoning_and_template_kwargs():
    tok = _Tok()
    prompt = tok.encode("<|im_start|>assistant\n<think>\n")
    r = request_reasoning(get_parser("qwen3"), tok, prompt, None, -1, False, None)
    assert r.parser.prompt_state == PromptState.THINKING and r.spec is None and r.include
    r = request_reasoning(get_parser("qwen3"), tok, prompt, 4, -1, False, False)
    assert r.spec.budget == 4 and r.spec.phase == Phase.THINKING and r.spec.end_ids == tuple(map(ord, "</think>"))
    assert not r.include
    assert request_reasoning(get_parser("qwen3"), tok, prompt, None, 7, False, None).spec.budget == 7
    assert request_reasoning(get_parser("qwen3"), tok, prompt, -1, 7, True, None).spec.budget is None
    assert request_reasoning(None, tok, prompt, -1, -1, True, None).parser is None
    with pytest.raises(APIError, match="thinking_token_budget needs a reasoning model"):
        request_reasoning(None, tok, prompt, 3, -1, False, None)
    assert template_kwargs({"a": 1, "b": 2}, {"b": 3}) == {"a": 1, "b": 3}
    assert template_kwargs(None, None) is None
    with pytest.raises(APIError, match="'tools'"):
        template_kwargs(None, {"tools": []})
    with pytest.raises(ValueError, match="JSON object"):
        check_default_template_kwargs([1])
