"""Reasoning models end to end: `iterserve serve --reasoning-parser qwen3` over real HTTP on
127.0.0.1, read with the openai client, on a scripted tiny Qwen3 (tests/scripted_model.py) whose
greedy output is `<think>Okay, let me add these numbers quickly</think>The answer is 4.` (and
`The answer is 4.` when the template's enable_thinking is false): the thinking in reasoning_content
and reasoning, streamed and not; chat_template_kwargs over --default-chat-template-kwargs; the
thinking budget (--reasoning-budget and thinking_token_budget) forcing </think>; a grammar and a
forced tool call applied to the answer only; the Responses API's reasoning item; the 400s; and an
unknown parser refused at start-up."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from scripted_model import save_scripted_qwen3, thinking_tokenizer

MODEL = "scripted"
REASONING, ANSWER = "Okay, let me add these numbers quickly", "The answer is 4."
SCRIPT = f"<think>{REASONING}</think>{ANSWER}"
QUESTION = [{"role": "user", "content": "What is 2+2?"}]
FREE = {"thinking_token_budget": -1}  # the server's default budget is 3 tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(args: list[str], log) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.Popen([sys.executable, "-m", "iterserve.cli", "serve", *args], stdout=log,
                            stderr=subprocess.STDOUT, env=env, text=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scripted-qwen3")
    tok = thinking_tokenizer()
    ids = tok.encode(SCRIPT, add_special_tokens=False)
    answer = ids[ids.index(tok.convert_tokens_to_ids("</think>")) + 1:]

    def prompt_end(**kw) -> int:
        return tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False, **kw),
                          add_special_tokens=False)[-1]

    save_scripted_qwen3(folder, [[prompt_end()] + ids + [tok.eos_token_id],
                                 [prompt_end(enable_thinking=False)] + answer], tok)
    return folder


@pytest.fixture(scope="module")
def base_url(model_dir, tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("reasoning-server") / "server.log", "w+")
    proc = _serve([str(model_dir), "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
                   "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--no-cpu-kernels",  # torch is enough here
                   "--reasoning-parser", "qwen3",
                   "--reasoning-budget", "3", "--default-chat-template-kwargs", '{"enable_thinking": true}'], log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, "the server exited: " + (log.seek(0) or log.read())[-2000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, stream: bool = False, **extra):
    return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                                          stream=stream, extra_body=extra)


def streamed(client, **extra) -> tuple[str | None, str | None, list[str]]:
    """(reasoning, content) the deltas add up to, and the kinds of delta in order."""
    reasoning = content = ""
    kinds = []
    for chunk in chat(client, stream=True, **extra):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        r = getattr(d, "reasoning_content", None)
        assert r == getattr(d, "reasoning", None)
        if r:
            reasoning += r
            kinds.append("reasoning")
        if d.content:
            content += d.content
            kinds.append("content")
    return reasoning or None, content or None, kinds


def message_of(out) -> tuple[str | None, str | None]:
    m = out.choices[0].message
    assert getattr(m, "reasoning_content") == getattr(m, "reasoning")
    return m.reasoning_content, m.content


def test_thinking_split_from_the_answer(client):
    assert message_of(chat(client, **FREE)) == (REASONING, ANSWER)
    reasoning, content, kinds = streamed(client, **FREE)
    assert (reasoning, content) == (REASONING, ANSWER)
    assert kinds.index("content") > 0 and "reasoning" not in kinds[kinds.index("content"):]
    assert message_of(chat(client, include_reasoning=False, **FREE)) == (None, ANSWER)
    reasoning, content, kinds = streamed(client, include_reasoning=False, **FREE)
    assert (reasoning, content, set(kinds)) == (None, ANSWER, {"content"})
    # n = 2: each choice has its own stream of thinking and answer
    got = {0: ["", ""], 1: ["", ""]}
    for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, n=2,
                                                stream=True, extra_body=FREE):
        for c in chunk.choices:
            got[c.index][0] += getattr(c.delta, "reasoning_content", None) or ""
            got[c.index][1] += c.delta.content or ""
    assert got == {0: [REASONING, ANSWER], 1: [REASONING, ANSWER]}


def test_chat_template_kwargs_turn_thinking_off(client, base_url):
    off = {"chat_template_kwargs": {"enable_thinking": False}, **FREE}  # the request's key wins over the default
    assert message_of(chat(client, **off)) == (None, ANSWER)
    assert streamed(client, **off)[:2] == (None, ANSWER)
    on, off_ = (httpx.post(base_url + "/tokenize", json={"messages": QUESTION, **kw}).json()["count"]
                for kw in ({}, {"chat_template_kwargs": {"enable_thinking": False}}))
    assert off_ == on + 4  # <think>, "\n\n", </think>, "\n\n": /tokenize renders as the chat route does
    assert chat(client, **off).usage.prompt_tokens == off_


@pytest.mark.parametrize("budget,reasoning", [(None, "Okay, let"), (1, "Okay"), (0, None), (5, "Okay, let me add")])
def test_thinking_budget_forces_the_end_marker(client, budget, reasoning):
    extra = {} if budget is None else {"thinking_token_budget": budget}  # None: --reasoning-budget 3
    out = chat(client, **extra)
    assert message_of(out) == (reasoning, ANSWER)  # </think> forced, then the scripted answer
    assert streamed(client, **extra)[:2] == (reasoning, ANSWER)


def test_budget_and_grammar_hold_with_predicted_output(client):
    # OpenAI's `prediction` drafts tokens (speculative decoding): a thinking request drafts nothing, so
    # its forced end marker and its answer-only grammar are not skipped by verified drafts
    predicted = {"prediction": {"type": "content", "content": SCRIPT}}
    assert message_of(chat(client, thinking_token_budget=1, **predicted)) == ("Okay", ANSWER)
    forced = {"structured_outputs": {"regex": r"The answer is 5\."}, **FREE, **predicted}
    assert message_of(chat(client, **forced)) == (REASONING, "The answer is 5.")
    assert message_of(chat(client, **FREE, **predicted)) == (REASONING, ANSWER)


def test_grammar_applies_to_the_answer_only(client):
    # the grammar allows neither <think> nor the thinking's words: applied from the start, it would
    # have changed them; from </think> on, the scripted answer fits the first and is forced by the second
    fits = {"structured_outputs": {"regex": r"The answer is [0-9]\."}, **FREE}
    assert message_of(chat(client, **fits)) == (REASONING, ANSWER)
    forced = {"structured_outputs": {"regex": r"The answer is 5\."}, **FREE}
    assert message_of(chat(client, **forced)) == (REASONING, "The answer is 5.")
    assert streamed(client, **forced)[:2] == (REASONING, "The answer is 5.")
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"op": {"enum": ["plus"]}}, "required": ["op"]}}}
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, tools=[tool],
                                         tool_choice={"type": "function", "function": {"name": "add"}},
                                         extra_body=FREE)
    assert out.choices[0].message.reasoning_content == REASONING
    assert out.choices[0].message.tool_calls[0].function.arguments == '{"op": "plus"}'
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, tools=[tool],
                                         tool_choice="required", parallel_tool_calls=False, extra_body=FREE)
    m = out.choices[0].message
    assert m.reasoning_content == REASONING and out.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in m.tool_calls] == [("add", '{"op": "plus"}')]


def test_responses_reasoning_item(client):
    r = client.responses.create(model=MODEL, input="What is 2+2?", max_output_tokens=40, temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].type == "reasoning_text" and r.output[0].content[0].text == "Okay, let"
    assert r.output[0].summary == [] and r.output_text == ANSWER
    assert r.usage.output_tokens_details.reasoning_tokens == 3  # "Okay", ",", " let": the budget of 3
    kinds = []
    with client.responses.stream(model=MODEL, input="What is 2+2?", max_output_tokens=40, temperature=0) as st:
        for event in st:
            kinds.append(event.type)
        final = st.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Okay, let" and final.output_text == ANSWER
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.reasoning_text.done") \
        < kinds.index("response.output_text.delta")
    # the output given back as input (the SDK's way to hold a conversation): the reasoning item is taken
    again = client.responses.create(model=MODEL, input=[{"role": "user", "content": "What is 2+2?"}, *r.output,
                                                        {"role": "user", "content": "And 3+3?"}],
                                    max_output_tokens=5, temperature=0)
    assert again.status == "incomplete"


@pytest.mark.parametrize("extra,param", [
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"thinking_token_budget": -2}, "thinking_token_budget"),
    ({"thinking_token_budget": "5"}, "thinking_token_budget"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),  # OpenAI's, not implemented: refused by name
])
def test_bad_fields_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **extra)
    assert param in (e.value.body.get("param") or "") + e.value.body["message"]
    assert message_of(chat(client, **FREE)) == (REASONING, ANSWER)  # and the server serves on


def test_unknown_parser_fails_at_start_up(model_dir, tmp_path):
    with open(tmp_path / "log", "w+") as log:
        proc = _serve([str(model_dir), "--no-cpu-kernels", "--reasoning-parser", "qwen4"], log)
        assert proc.wait(120) != 0
        log.seek(0)
        text = log.read()
    assert re.search(r"unknown reasoning parser 'qwen4'; choose one of: deepseek_r1, granite, qwen3", text), text


def test_flags_and_config_file(tmp_path):
    from iterserve.cli import build_parser
    from iterserve.server.cli_serve import resolve_args

    def resolve(*argv):
        return resolve_args(build_parser().parse_args(["serve", *argv]))

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("reasoning_parser: deepseek_r1\ndefault_chat_template_kwargs:\n  enable_thinking: false\n"
                   "reasoning_budget: 7\n")
    a = resolve("--config", str(cfg))
    assert (a.reasoning_parser, a.default_chat_template_kwargs, a.reasoning_budget) == (
        "deepseek_r1", {"enable_thinking": False}, 7)
    a = resolve("--config", str(cfg), "--default-chat-template-kwargs", '{"thinking": true}')  # the flag wins
    assert a.default_chat_template_kwargs == {"thinking": True}
    assert resolve().reasoning_budget == -1 and resolve().default_chat_template_kwargs is None
    for argv, message in [(["--default-chat-template-kwargs", "{oops"], "not valid JSON"),
                          (["--default-chat-template-kwargs", '{"tokenize": true}'], "cannot set tokenize"),
                          (["--reasoning-budget", "5"], "needs --reasoning-parser"),
                          (["--reasoning-parser", "qwen3", "--reasoning-budget", "-2"], "-1 \\(unlimited\\)"),
                          (["--reasoning-parser", "qwen4"], "choose one of: deepseek_r1, granite, qwen3, smollm3")]:
        with pytest.raises(ValueError, match=message):
            resolve(*argv)


def test_anthropic_messages_thinking_blocks(base_url):
    """Anthropic's Messages API on the same server, with the official SDK: `thinking` enabled (its
    budget_tokens over the server's 3-token default) gives a thinking block before the text, whole
    and streamed; disabled turns the template's thinking off; absent keeps the server's defaults
    (the 3-token budget forces </think>)."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    ask = dict(model=MODEL, max_tokens=40, messages=QUESTION)
    on = client.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **ask)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in on.content] == [
        ("thinking", REASONING), ("text", ANSWER)]
    with client.messages.stream(thinking={"type": "enabled", "budget_tokens": 1024}, **ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == REASONING
    assert "".join(d.text for d in deltas if d.type == "text_delta") == ANSWER
    assert [b.type for b in final.content] == ["thinking", "text"]
    off = client.messages.create(thinking={"type": "disabled"}, **ask)
    assert [(b.type, b.text) for b in off.content] == [("text", ANSWER)]
    default = client.messages.create(**ask)  # the server's --reasoning-budget 3
    assert default.content[0].type == "thinking" and len(default.content[0].thinking) < len(REASONING)
