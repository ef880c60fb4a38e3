"""The tool-call parsers (iterserve/server/tool_parsers/) on the texts vLLM's parser tests use:
whole outputs, and streams cut at every position, which must give the same content and calls."""
from __future__ import annotations

import json

import pytest

from iterserve.server.tool_parsers import PARSERS, detect_parser, parser_class

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "temp": {"type": "number"},
                                     "tags": {"type": "array"}}}}}
AREA = {"type": "function", "function": {"name": "area", "parameters": {"type": "object", "properties": {
    "dimensions": {"type": "object"}, "precision": {"type": "int"}, "ratio": {"type": "float"}, "note": {"type": "string"}}}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "get_time"}}, AREA]
OSLO = ("get_weather", {"city": "Oslo"})

CASES = [  # parser, text, content, calls
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Let me check.", [OSLO]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None, [OSLO, ("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', None, [OSLO]),  # EOS, unclosed
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("hermes", "plain answer", "plain answer", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [OSLO]),
    ("llama3_json", '{"name": "searchTool", "parameters": {"query": "test"}}; '
                    '{"name": "getOpenIncidentsTool", "parameters": {}}', None,
     [("searchTool", {"query": "test"}), ("getOpenIncidentsTool", {})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Oslo"}}', None, [OSLO]),
    ("llama3_json", 'The answer is {"a": 1}', 'The answer is {"a": 1}', []),
    ("llama3_json", 'In C: if (x) { y(); } then {"name": "get_time", "parameters": {}}', "In C: if (x) { y(); } then",
     [("get_time", {})]),
    ("llama3_json", "{" + " " * 80 + '"name": "get_time", "parameters": {}}', None, [("get_time", {})]),
    ("llama3_json", 'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like to know more?',
     "Here is the result:  Would you like to know more?", [("getOpenIncidentsTool", {})]),
    ("llama3_json", '{"name": "searchTool", "parameters": {"query": "test1"}} ; '
                    '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\" [x]"}}', None,
     [("searchTool", {"query": "test1"}), ("parserTool", {"text": 'He said "Hello {world}" [x]'})]),
    ("llama3_json", '{"name": "invalidTool", "parameters": {invalid json}', '{"name": "invalidTool", "parameters": {invalid json}',
     []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ',
     []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {}}]', None, [OSLO, ("get_time", {})]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}', "Sure.",
     [OSLO, ("get_time", {})]),
    ("mistral", "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    ("mistral", '[TOOL_CALLS]add{"a": 3.5, "b": 4}', None, [("add", {"a": 3.5, "b": 4})]),  # v11
    ("mistral", '[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]', None, [("add", {"a": 3, "b": 4})]),
    ("mistral", '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]', None,
     [("get_age", {"name": "John Doe"})]),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {}}]', None, [OSLO, ("get_time", {})]),
    ("granite", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', None, [OSLO]),
    ("granite", '<|tool_call|>{"name": "get_weather"}', '<|tool_call|>{"name": "get_weather"}', []),
    ("pythonic", '[get_weather(city="Oslo"), get_time()]', None, [OSLO, ("get_time", {})]),
    ("pythonic", '[get_weather(city="Oslo", days=3, metric=True, tags=["a", {"b": null}])]', None,
     [("get_weather", {"city": "Oslo", "days": 3, "metric": True, "tags": ["a", {"b": None}]})]),
    ("pythonic", '<|python_start|>[get_weather(city="Oslo")]<|python_end|>', None, [OSLO]),
    ("pythonic", "[get_weather(city=os.environ)]", "[get_weather(city=os.environ)]", []),
    ("pythonic", "No calls [here]", "No calls [here]", []),
    ("qwen3_coder", "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
                    "<parameter=temp>\n-1.5\n</parameter>\n</function>\n</tool_call>", "I will check.",
     [("get_weather", {"city": "Oslo", "days": 3, "metric": True, "temp": -1.5})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>", None,
     [OSLO, ("get_time", {})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\nmany\n</parameter>\n"
                    "<parameter=tags>\n[1, 2]\n</parameter>\n</function>", None,
     [("get_weather", {"days": "many", "tags": [1, 2]})]),
    ("qwen3_coder", "<tool_call>\n<function=area>\n<parameter=dimensions>\n{\"width\": 10, \n \"height\": 20}\n</parameter>\n"
                    "<parameter=precision>\n2\n</parameter>\n<parameter=ratio>\n3.14\n</parameter>\n"
                    "<parameter=note>\nline 1\nline 2\n</parameter>\n</function>\n</tool_call>", None,
     [("area", {"dimensions": {"width": 10, "height": 20}, "precision": 2, "ratio": 3.14, "note": "line 1\nline 2"})]),
    ("qwen3_coder", "<tool_call>\nno function here\n</tool_call>", "<tool_call>\nno function here\n</tool_call>", []),
]


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole_and_streamed_agree(name, text, content, calls):
    parser = parser_class(name)(TOOLS)
    got_content, got_calls = parser.extract(text)
    assert (got_content, _calls(got_calls)) == (content, calls)
    assert all(c["type"] == "function" and c["id"] for c in got_calls)
    for split in range(len(text) + 1):
        for pieces in ([text[:split], text[split:]], [text[i:i + 1] for i in range(split)] + [text[split:]]):
            s = parser.stream()
            deltas = [d for p in pieces for d in s.feed(p)]
            tail, made = s.finish()
            deltas += tail
            assert made == bool(calls)
            streamed = "".join(d.get("content", "") for d in deltas)
            assert (streamed.strip() or None) == content if calls else streamed == text
            if calls:  # all content comes before the first call delta
                first = next(k for k, d in enumerate(deltas) if "tool_calls" in d)
                assert not any("content" in d for d in deltas[first:])
            names, args, ids = {}, {}, {}
            for d in deltas:
                assert set(d) <= {"content", "tool_calls"}
                for tc in d.get("tool_calls", []):
                    if "id" in tc:  # the first delta of a call: id, type and name before any arguments
                        assert tc["index"] not in names and tc["type"] == "function"
                        names[tc["index"]], ids[tc["index"]] = tc["function"]["name"], tc["id"]
                    args[tc["index"]] = args.get(tc["index"], "") + tc["function"].get("arguments", "")
            assert [(names[i], json.loads(args[i])) for i in sorted(names)] == calls
            if len(pieces) > 2:
                break


def test_mistral_ids_are_nine_alphanumerics():
    _, calls = parser_class("mistral")().extract('[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()


def test_registry_and_template_detection():
    assert set(PARSERS) >= {"hermes", "llama3_json", "mistral", "granite", "pythonic", "qwen3_coder"}
    with pytest.raises(ValueError, match="choose one of: granite, hermes, llama3_json"):
        parser_class("nope")
    assert detect_parser("{% if tools %}<tool_call>{{ x }}</tool_call>{% endif %}") == "hermes"
    assert detect_parser("<tool_call>\n<function=name>\n<parameter=x>") == "qwen3_coder"
    assert detect_parser("{{- '<|python_tag|>' }}") == "llama3_json"
    assert detect_parser("[AVAILABLE_TOOLS]...[TOOL_CALLS]") == "mistral"
    assert detect_parser("<|start_of_role|>available_tools<|end_of_role|><|tool_call|>") == "granite"
    assert detect_parser("[func_name1(params_name1=params_value1)]") == "pythonic"
    assert detect_parser("{{- '<|python_start|>' }}") == "pythonic"
    assert detect_parser("{{ messages }}") is None and detect_parser(None) is None


def test_unknown_parser_fails_at_start_up_with_the_names(capsys):
    from iterserve.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])
    assert "'granite', 'hermes', 'llama3_json', 'mistral', 'pythonic', 'qwen3_coder'" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "pythonic"


ROUND_TRIP = [("get_weather", {"city": 'Martha\'s "Vineyard" {x}', "days": 3, "metric": False, "temp": -1.5,
                               "tags": ["a", {"b": None}]}), ("get_time", {})]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_format_calls_is_read_back(name):
    """format_calls writes earlier calls (and the example in the instructions) for templates without
    a tools section; what it writes must parse back to the same calls."""
    parser = parser_class(name)(TOOLS)
    content, calls = parser.extract(parser.format_calls(ROUND_TRIP))
    assert content is None and _calls(calls) == ROUND_TRIP
    assert parser.format_calls([("function_name", {"argument": "value"})]) in parser.instructions() or name == "hermes"


def test_fallback_prompt_uses_the_parser_format():
    from iterserve.server.protocol import ChatCompletionRequest
    from iterserve.server.tool_calls import ToolMode, prompt_messages

    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"}], "tools": [WEATHER]})
    msgs = prompt_messages(body.messages, ToolMode.from_body(body, "pythonic"), native_tools=False)
    assert msgs[2]["content"] == "[get_weather(city='Oslo')]"
    assert "[function_name(argument='value')]" in msgs[0]["content"] and "<tool_call>" not in msgs[0]["content"]


PIECES = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|tool_call|>", "<function=f>",
          "<parameter=city>", "</parameter>", "</function>", "<|python_start|>", "[", "]", "(", ")", "{", "}", '"name"',
          '"arguments"', '"parameters"', ":", ",", ";", " ", "\n", '"x"', "1", "f", "=", "get_time", "'", "\\"]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_random_text_never_raises_and_streams_as_whole(name):
    """Any text, whole or fed in random pieces: no exception, and the same content and calls."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    parser = parser_class(name)(TOOLS)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=25), st.randoms())
    def check(parts, rnd):
        text = "".join(parts)
        content, calls = parser.extract(text)
        s = parser.stream()
        cuts = sorted(rnd.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        deltas = [d for a, b in zip([0] + cuts, cuts + [len(text)]) for d in s.feed(text[a:b])]
        tail, made = s.finish()
        deltas += tail
        streamed = "".join(d.get("content", "") for d in deltas)
        assert made == bool(calls)
        assert (streamed.strip() or None) == content if calls else streamed == text
        got = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                got.setdefault(tc["index"], [tc["function"].get("name"), ""])[1] += tc["function"].get("arguments", "")
        assert [tuple(v) for _, v in sorted(got.items())] == [(c["function"]["name"], c["function"]["arguments"])
                                                              for c in calls]

    check()
