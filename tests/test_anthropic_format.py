"""MessagesFormat without a model: the chat path's outputs for text that a random-weight model does
not write (content then a Hermes tool call under tool_choice auto, a cut-off forced call, a stop
sequence) become Anthropic's blocks and events; and the request mapping's checks that need no
server. The HTTP contract itself is tested in test_server_anthropic.py."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from iterserve.request import RequestOutput, RequestTimes
from iterserve.server.anthropic_messages import MessagesFormat, to_chat_request
from iterserve.server.anthropic_protocol import MessagesRequest
from iterserve.server.protocol import APIError, ChatCompletionRequest
from iterserve.server.reasoning import get_parser
from iterserve.server.reasoning.request import RequestReasoning
from iterserve.server.serving import OpenAIServing
from iterserve.server.tool_calls import ToolMode

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
AUTO_TEXT = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def body(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 50,
                                           "messages": [{"role": "user", "content": "Hi"}]} | kw)


def outputs(text: str, finish: str, stop_reason=None, size: int = 5) -> list[RequestOutput]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    return [RequestOutput("r", [1], p, i == len(pieces) - 1, finish if i == len(pieces) - 1 else None, 7, i + 1,
                          RequestTimes(0.0), output_text=text[: (i + 1) * size],
                          stop_reason=stop_reason if i == len(pieces) - 1 else None)
            for i, p in enumerate(pieces)]


class FakeStream:
    def __init__(self, outs: list[RequestOutput]) -> None:
        self.outs, self.request_id, self.finished = outs, "r", True

    async def __aiter__(self):
        for o in self.outs:
            yield o


def fmt_for(req: MessagesRequest, reasoning: RequestReasoning | None = None) -> MessagesFormat:
    chat = to_chat_request(req, reasoning is not None)
    serving = SimpleNamespace(settings=SimpleNamespace(served_model_name="m"), _merged=OpenAIServing._merged,
                              _abort_unfinished=lambda streams: None)
    return MessagesFormat(serving, req, ToolMode.from_body(ChatCompletionRequest.model_validate(
        chat.model_dump(exclude_none=True))), 7, reasoning)


def events(fmt: MessagesFormat, outs: list[RequestOutput]) -> list[dict]:
    async def collect():
        return [e async for e in fmt.stream("msg_1", [FakeStream(outs)], False)]

    out = []
    for raw in asyncio.run(collect()):
        name, data = raw.strip().split("\n")
        assert name == "event: " + json.loads(data[len("data: "):])["type"]
        out.append(json.loads(data[len("data: "):]))
    return out


def test_auto_tool_call_after_text_is_a_text_block_then_a_tool_use_block():
    req = body(tools=[TOOL])
    fmt = fmt_for(req)
    outs = outputs(AUTO_TEXT, "stop")
    whole = fmt.response("msg_1", [outs[-1]], [], False)
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"] and whole["stop_reason"] == "tool_use"
    assert whole["content"][0]["text"] == "Let me check." and whole["content"][1]["input"] == {"city": "Paris"}
    assert whole["content"][1]["id"].startswith("toolu_")
    ev = events(fmt, outs)
    kinds = [(e["type"], e.get("index")) for e in ev]
    assert kinds[:3] == [("message_start", None), ("ping", None), ("content_block_start", 0)]
    assert kinds[-6:] == [("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
                          ("content_block_stop", 1), ("message_delta", None), ("message_stop", None)]
    assert {k for k in kinds[3:-6]} == {("content_block_delta", 0)}
    text = "".join(e["delta"]["text"] for e in ev if e["type"] == "content_block_delta" and e["index"] == 0)
    assert text == "Let me check."
    tool = next(e for e in ev if e["type"] == "content_block_start" and e["index"] == 1)["content_block"]
    assert tool["type"] == "tool_use" and tool["name"] == "get_weather" and tool["input"] == {}
    args = "".join(e["delta"]["partial_json"] for e in ev if e["type"] == "content_block_delta" and e["index"] == 1)
    assert json.loads(args) == {"city": "Paris"}
    assert ev[-2]["delta"]["stop_reason"] == "tool_use" and ev[-2]["usage"]["output_tokens"] == len(outs)


def test_stop_reasons():
    fmt = fmt_for(body(stop_sequences=["END"]))
    for outs, reason, seq in ((outputs("abc", "stop", "END"), "stop_sequence", "END"),
                              (outputs("abc", "stop", 2), "end_turn", None),  # EOS: a stop token id
                              (outputs("abc", "length"), "max_tokens", None)):
        assert (fmt.response("msg_1", [outs[-1]], [], False)["stop_reason"],
                fmt.response("msg_1", [outs[-1]], [], False)["stop_sequence"]) == (reason, seq)
        assert events(fmt, outs)[-2]["delta"] == {"stop_reason": reason, "stop_sequence": seq}
    empty = outputs("", "stop", 2)
    assert fmt.response("msg_1", [empty[-1]], [], False)["content"] == []
    assert [e["type"] for e in events(fmt, empty)] == ["message_start", "ping", "message_delta", "message_stop"]


def test_a_forced_call_cut_off_by_max_tokens_stays_text():
    fmt = fmt_for(body(tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"}))
    whole = fmt.response("msg_1", [outputs('{"city": "Par', "length")[-1]], [], False)
    assert whole["content"] == [{"type": "text", "text": '{"city": "Par'}] and whole["stop_reason"] == "max_tokens"


@pytest.mark.parametrize("kw,words", [
    ({"thinking": {"type": "adaptive"}}, ["thinking", "--reasoning-parser"]),
    ({"output_config": {"effort": "high"}}, ["output_config.effort"]),
    ({"tool_choice": {"type": "any"}}, ["needs tools"]),
    ({"tools": [TOOL | {"input_examples": [{"city": "x"}]}]}, ["tools.0.input_examples"]),
    ({"tools": [TOOL | {"defer_loading": True}]}, ["tools.0.defer_loading"]),
    ({"output_format": {"type": "json_schema", "schema": {}},
      "output_config": {"format": {"type": "json_schema", "schema": {}}}}, ["not both"]),
])
def test_refusals_name_the_field(kw, words):
    with pytest.raises(APIError) as e:
        to_chat_request(body(**kw), False)
    assert e.value.status_code == 400 and all(w in e.value.message for w in words), e.value.message


def test_mapping_onto_the_chat_request():
    chat = to_chat_request(body(tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                stop_sequences=["x"], temperature=0.5, top_k=3, metadata={"user_id": "u"},
                                system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]), False)
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False and chat.stop == ["x"]
    assert (chat.temperature, chat.top_k, chat.user, chat.max_tokens) == (0.5, 3, "u", 50)
    assert chat.messages[0].role == "system" and chat.messages[0].content == "A\nB"
    assert chat.tools[0].function.parameters == TOOL["input_schema"]
    named = to_chat_request(body(tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"}), False)
    assert named.tool_choice.function.name == "get_weather"
    fmt = to_chat_request(body(output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}}),
                          False)
    assert fmt.response_format.type == "json_schema" and fmt.response_format.json_schema.schema_ == {"type": "object"}


def test_thinking_blocks_from_the_reasoning_parser():
    """With the server's reasoning parser (deepseek_r1 here: thinking up to </think>), the thinking
    is a leading thinking block, whole and streamed (thinking_delta events, the marker split across
    pieces), and the streamed text equals the whole."""
    parser = get_parser("deepseek_r1")
    text = "Let me think.</think>Paris"
    fmt = fmt_for(body(), RequestReasoning(parser(parser.prompt_state_of("<think>\n"))))
    whole = fmt.response("msg_1", [outputs(text, "stop", 2)[-1]], [], False)
    assert whole["content"] == [{"type": "thinking", "thinking": "Let me think.", "signature": ""},
                                {"type": "text", "text": "Paris"}]
    fmt = fmt_for(body(), RequestReasoning(parser(parser.prompt_state_of("<think>\n"))))
    ev = events(fmt, outputs(text, "stop", size=3))
    kinds = [e["content_block"]["type"] for e in ev if e["type"] == "content_block_start"]
    assert kinds == ["thinking", "text"]
    deltas = [e["delta"] for e in ev if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "Let me think."
    assert "".join(d.get("text", "") for d in deltas) == "Paris"
    assert ev[-2]["delta"]["stop_reason"] == "end_turn" and ev[-1]["type"] == "message_stop"


def test_thinking_maps_onto_the_chat_path():
    """thinking enabled needs a reasoning parser (refused by name without one); with one it turns the
    template's switch on and budget_tokens becomes the thinking budget; disabled turns the switch off."""
    enabled = {"thinking": {"type": "enabled", "budget_tokens": 2048}}
    with pytest.raises(APIError, match="--reasoning-parser"):
        to_chat_request(body(**enabled), False)
    chat = to_chat_request(body(**enabled), True)
    assert chat.chat_template_kwargs == {"enable_thinking": True} and chat.thinking_token_budget == 2048
    off = to_chat_request(body(thinking={"type": "disabled"}), True)
    assert off.chat_template_kwargs == {"enable_thinking": False} and off.thinking_token_budget is None
    assert to_chat_request(body(thinking={"type": "disabled"}), False).chat_template_kwargs is None
    with pytest.raises(APIError, match="between_tools"):
        to_chat_request(body(thinking={"type": "between_tools"}), True)
