"""Unbounded integers and numbers in JSON schemas get digit bounds (structured/bounded_numbers.py),
so that a model pushed toward digits still ends its JSON instead of writing digits to max_tokens."""
from __future__ import annotations

import json
import time

import pytest

from iterserve.sampling import SamplingParams
from iterserve.structured.bounded_numbers import INT_BOUND, NUMBER_BOUND, bound_numbers
from iterserve.structured.params import StructuredOutputsParams


def test_rewrite_adds_only_missing_bounds_at_any_depth():
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "lo": {"type": "integer", "minimum": 0},
        "step": {"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 10},
        "maybe": {"type": ["number", "null"]}, "s": {"type": "string"},
        "items": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/d"}]}}},
        "$defs": {"d": {"type": "number", "maximum": 3}}}
    p = bound_numbers(schema)["properties"]
    assert p["n"] == {"type": "integer", "minimum": -INT_BOUND, "maximum": INT_BOUND}
    assert p["x"] == {"type": "number", "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND, "multipleOf": 1e-6}
    assert p["lo"] == {"type": "integer", "minimum": 0, "maximum": INT_BOUND}
    assert p["step"] == {"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 10, "minimum": -NUMBER_BOUND}
    assert p["maybe"]["maximum"] == NUMBER_BOUND and p["s"] == {"type": "string"}
    assert p["items"]["items"]["anyOf"][0]["maximum"] == INT_BOUND
    assert bound_numbers(schema)["$defs"]["d"] == {"type": "number", "maximum": 3, "minimum": -NUMBER_BOUND,
                                                     "multipleOf": 1e-6}
    assert schema["properties"]["n"] == {"type": "integer"}  # a copy: the request's own schema is untouched
    # a stated bound beyond the limit: the other side is not added (it would empty the range)
    assert bound_numbers({"type": "integer", "minimum": 2**64}) == {"type": "integer", "minimum": 2**64}
    assert bound_numbers({"type": "number", "exclusiveMaximum": -1e16}) == {"type": "number", "exclusiveMaximum": -1e16,
                                                                              "multipleOf": 1e-6}
    tiny = {"type": "number", "minimum": 1e-7, "maximum": 5e-7}  # no multiple of 1e-6 inside: no step added
    assert bound_numbers(tiny) == tiny


def _run(engine, params: SamplingParams, prompt: list[int]):
    engine.add_request(prompt_token_ids=prompt, request_id="r", params=params)
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        outs = engine.step()
        if not outs:
            time.sleep(0.005)
        for o in outs:
            if o.finished:
                return o
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("kind,value_type", [("integer", int), ("number", (int, float))])
def test_digit_loop_ends_in_valid_json(make_engine, kind, value_type):
    """A model pushed toward "1" by logit_bias would write digits until max_tokens under an unbounded
    integer (shown by the same request with the rewrite off); bounded, it closes the JSON."""
    schema = {"type": "object", "properties": {"population": {"type": kind}}, "required": ["population"]}
    engine = make_engine()
    tok = engine.tokenizer
    one = tok.encode("1", add_special_tokens=False)
    assert len(one) == 1
    bias = {one[0]: 100.0}
    prompt = tok.encode("Population:", add_special_tokens=False)
    params = SamplingParams(max_tokens=120, temperature=0.0, logit_bias=bias,
                            structured_outputs=StructuredOutputsParams(json=schema))
    out = _run(engine, params, prompt)
    assert out.finish_reason == "stop" and out.num_output_tokens < 60, out.output_text
    value = json.loads(out.output_text)["population"]
    assert isinstance(value, value_type) and str(int(value)).startswith("111") and abs(value) < 2**63

    unbounded = make_engine(structured_outputs_bound_numbers=False)
    out = _run(unbounded, params, prompt)
    assert out.finish_reason == "length", out.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_over_http_the_digit_loop_ends(tiny_model_dir, tiny_loaded, stream):
    """The same through `iterserve serve` and the openai client: response_format with an unbounded
    integer, logit_bias toward "1", and the answer is whole JSON well before max_tokens."""
    import openai
    from http_server import HttpServer

    tok = tiny_loaded[2]
    one = tok.encode("1", add_special_tokens=False)[0]
    schema = {"type": "object", "properties": {"population": {"type": "integer"}}, "required": ["population"]}
    with HttpServer([str(tiny_model_dir), "--max-model-len", "512", "--kv-cache-memory", "64MiB"], tiny_loaded) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        kw = dict(model=str(tiny_model_dir), messages=[{"role": "user", "content": "Population of Oslo?"}],
                  max_tokens=120, temperature=0, logit_bias={str(one): 100},
                  response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
        if stream:
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
            used = chunks[-1].usage.completion_tokens
        else:
            out = client.chat.completions.create(**kw)
            text, reason, used = out.choices[0].message.content, out.choices[0].finish_reason, out.usage.completion_tokens
    assert reason == "stop" and used < 60, text
    assert str(json.loads(text)["population"]).startswith("111")
