"""Tool calling's text handling, without a model: the prompt fallback, the forcing grammars, and the
parser for whole outputs and for streams (checked against each other on every split point)."""
from __future__ import annotations

import json

import pytest

from iterserve.server.protocol import APIError, ChatCompletionRequest
from iterserve.server.tool_calls import ToolCallStream, ToolMode, parse_tool_calls, prompt_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def mode(tool_choice=None, tools=(WEATHER, TIME), **kw) -> ToolMode:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": list(tools), **kw}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    return ToolMode.from_body(ChatCompletionRequest.model_validate(body))


def test_tool_choice_defaults_and_errors():
    assert mode().choice == "auto"
    assert mode(tools=()).choice == "none" and not mode(tools=()).active
    with pytest.raises(APIError, match="not among the tools"):
        mode({"type": "function", "function": {"name": "nope"}})
    with pytest.raises(APIError, match="needs tools"):
        mode("required", tools=())


def test_forcing_grammars():
    named = mode({"type": "function", "function": {"name": "get_weather"}}).structured_outputs()
    assert named.json == WEATHER["function"]["parameters"]
    req = mode("required").structured_outputs().json
    assert req["minItems"] == 1 and "maxItems" not in req
    assert [o["properties"]["name"]["const"] for o in req["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert mode("required", parallel_tool_calls=False).structured_outputs().json["maxItems"] == 1
    assert mode("auto").structured_outputs() is None


def test_fallback_prompt_and_history():
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"}], "tools": [WEATHER]})
    m = ToolMode.from_body(body)
    msgs = prompt_messages(body.messages, m, native_tools=False)
    assert msgs[0]["role"] == "system" and '"get_weather"' in msgs[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in msgs[2]["content"]
    assert msgs[3] == {"role": "tool", "content": "<tool_response>\n3 C\n</tool_response>"}
    native = prompt_messages(body.messages, m, native_tools=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert native[2]["tool_call_id"] == "c1" and native[0]["role"] == "user"


AUTO_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.mark.parametrize("choice,text,content,calls", [
    ("auto", AUTO_TEXT, "Let me check.", [("get_weather", {"city": "Oslo"})]),
    ("auto", "Just text, no <tool_call", "Just text, no <tool_call", []),
    ("auto", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
    ("required", '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "A"}}]',
     None, [("get_time", {}), ("get_weather", {"city": "A"})]),
    ("required", '[{"name": "get_ti', '[{"name": "get_ti', []),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Rome"}', None,
     [("get_weather", {"city": "Rome"})]),
])
def test_parse_whole_and_streamed_agree(choice, text, content, calls):
    m = mode(choice)
    got_content, got_calls = parse_tool_calls(text, m)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    for split in range(len(text) + 1):  # every way of cutting the text into two deltas
        s = ToolCallStream(m)
        deltas = s.feed(text[:split]) + s.feed(text[split:])
        tail, made = s.finish()
        deltas += tail
        assert made == bool(calls)
        streamed = "".join(d.get("content", "") for d in deltas)
        if calls:  # content streams up to the call; the whole parse also drops the whitespace before it
            assert streamed.strip() == (content or "")
        else:
            assert streamed == text
        args: dict[int, str] = {}
        names: dict[int, str] = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                names.setdefault(tc["index"], tc["function"].get("name"))
                args[tc["index"]] = args.get(tc["index"], "") + tc["function"].get("arguments", "")
        assert [(names[i], json.loads(args[i])) for i in sorted(args)] == calls
