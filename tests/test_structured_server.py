"""The official openai client against `iterserve serve smollm2-135m` on loopback: a plain answer,
streamed and not; then structured outputs and tool calls, every output checked with the jsonschema
package, regex and choice constraints, tools, and the 400s for what cannot be served. One server
process for the module: starting the real model is the most of what a test of it costs."""
from __future__ import annotations

import itertools
import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from iterserve.bench.launcher import ServerProcess

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
MODEL = "smollm2-135m"

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confident": {"type": "boolean"}},
     "required": ["answer", "confident"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "y": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 15},
                                      "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
     "required": ["title"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                          {"type": "string", "maxLength": 5}]}},
     "required": ["value"], "additionalProperties": False},
]
PROMPTS = ["Describe a person.", "Is the sky blue?", "Give tags for a photo of a beach.", "Pick a point on a grid.",
           "What colour is grass?", "Name a film.", "Give me a value.", "Reply in JSON about anything."]
CASES = list(itertools.product(range(len(SCHEMAS)), range(len(PROMPTS))))  # 56 prompt x schema pairs


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured-server") / "server.log"
    with ServerProcess([MODEL, "--max-model-len", "512", "--max-num-seqs", "16"], log_path=log) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_chat_answers_capital_of_france(client):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert "paris" in out.choices[0].message.content.lower()
    assert out.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def sampling(i: int) -> dict:
    """Half greedy, half sampled (seeded), so outputs vary beyond the prompt."""
    return {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": i}


def json_schema_chat(client, case: int, stream: bool) -> tuple[str, str]:
    s, p = CASES[case]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[p] + " Answer in JSON."}], max_tokens=64,
              response_format={"type": "json_schema", "json_schema": {"name": f"s{s}", "schema": SCHEMAS[s]}},
              **sampling(case))
    if not stream:
        out = client.chat.completions.create(**kw)
        return out.choices[0].message.content, out.choices[0].finish_reason
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_outputs_validate(client, stream):
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda c: json_schema_chat(client, c, stream), range(len(CASES))))
    for case, (text, reason) in enumerate(results):
        schema = SCHEMAS[CASES[case][0]]
        assert reason == "stop", f"case {case}: {reason} {text!r}"
        jsonschema.validate(json.loads(text), schema)


def test_completions_json_schema_and_json_object(client):
    schema = SCHEMAS[0]
    out = client.completions.create(model=MODEL, prompt="A person in JSON:", max_tokens=48, temperature=0,
                                    extra_body={"response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": "p", "schema": schema}}})
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    for body in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}):
        out = client.completions.create(model=MODEL, prompt="A JSON object about cats:", max_tokens=60,
                                        temperature=0.7, seed=3, extra_body=body)
        if out.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(out.choices[0].text), dict)
        else:  # cut by max_tokens: still the start of an object
            assert out.choices[0].text.lstrip().startswith("{")


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"json": SCHEMAS[0]}},
    {"guided_json": SCHEMAS[0]},
    {"guided_json": json.dumps(SCHEMAS[0])},
], ids=["structured_outputs", "guided_json", "guided_json_text"])
def test_vllm_json_names(client, body):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person, as JSON."}],
                                         max_tokens=48, temperature=0, extra_body=body)
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMAS[0])


def test_regex_and_choice_hold(client):
    phone, choices = r"\(\d{3}\) \d{3}-\d{4}", ["positive", "negative", "neutral"]
    bodies = [({"structured_outputs": {"regex": phone}}, phone), ({"guided_regex": phone}, phone),
              ({"structured_outputs": {"regex": r"[A-Z][a-z]{2,8}"}}, r"[A-Z][a-z]{2,8}"),
              ({"structured_outputs": {"choice": choices}}, None), ({"guided_choice": choices}, None)]
    jobs = [(b, pat, i) for i, (b, pat) in enumerate(bodies * 3)]

    def run(job):
        body, pat, i = job
        if i % 2:
            out = client.completions.create(model=MODEL, prompt=f"Example {i}:", max_tokens=20, extra_body=body,
                                            **sampling(i))
            return out.choices[0].text, out.choices[0].finish_reason
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Example {i}?"}],
                                             max_tokens=20, extra_body=body, **sampling(i))
        return out.choices[0].message.content, out.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, jobs))
    for (body, pat, _), (text, reason) in zip(jobs, results):
        assert reason == "stop", (body, text)
        assert re.fullmatch(pat, text) if pat else text in choices, (body, text)


def test_grammar_lark_and_gbnf(client):
    for grammar in ('start: "ok" | "not ok"', 'root ::= "ok" | "not ok"'):
        out = client.completions.create(model=MODEL, prompt="Status:", max_tokens=8, temperature=0,
                                        extra_body={"structured_outputs": {"grammar": grammar}})
        assert out.choices[0].text in ("ok", "not ok") and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model=MODEL, prompt="Digits:", max_tokens=8, temperature=0,
                                    extra_body={"guided_grammar": 'start: /[0-9]{3}/'})
    assert re.fullmatch(r"[0-9]{3}", out.choices[0].text)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                         "parameters": {"type": "object", "properties": {
                                             "zone": {"type": "string", "maxLength": 12}},
                                             "required": ["zone"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_have_valid_arguments(client, tool_choice):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=80,
              temperature=0, parallel_tool_calls=False)
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].id.startswith("call_") and choice.message.content is None
    if isinstance(tool_choice, dict):
        assert calls[0].function.name == "get_time"
    jsonschema.validate(json.loads(calls[0].function.arguments), PARAMS[calls[0].function.name])
    # streamed: the deltas add up to the same call
    chunks = list(client.chat.completions.create(stream=True, **kw))
    name, args = None, ""
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            assert tc.index == 0
            name = name or tc.function.name
            args += tc.function.arguments or ""
    assert (name, json.loads(args)) == (calls[0].function.name, json.loads(calls[0].function.arguments))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_results_in_the_history(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "clear"}'}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=24,
                                         temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.choices[0].message.content or out.choices[0].message.tool_calls
    none = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_logit_bias(client):
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == client.with_options().completions.create(
        model=MODEL, prompt="Hello", max_tokens=1, temperature=0, logit_bias={"42": 100}).choices[0].text * 5


@pytest.mark.parametrize("body,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objx"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"guided_json": {"not": {"type": "string"}}}, "guided_json", "Unimplemented keys"),
    ({"guided_json": "{not json"}, "guided_json", "JSON schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs", "grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "Extra"),
    ({"guided_json": SCHEMAS[0], "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    ({"guided_json": SCHEMAS[0], "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "not several"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex", "forces the output"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
])
def test_bad_constraints_are_400(client, body, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body)
    err = e.value.body
    assert message in err["message"] and err["param"] == param, err
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)  # and nothing else changed
    assert ok.choices[0].finish_reason in ("stop", "length")
