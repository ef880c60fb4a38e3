"""/v1/responses with the official openai client against the app `iterserve serve` builds
(tests/app_server.py) on the tiny random-weight model: create, stream (the documented event sequence,
read by the client's `responses.stream`), retrieve, delete, previous_response_id, function calls and
their outputs, JSON-schema output, the 400s and 404s in OpenAI's error shape, and the bounded store.
What the text says is checked on the embedded model (test_server_openai_real.py)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from iterserve.server.responses import ResponseStore

MODEL = "tiny"
SERVE_ARGS = ["--served-model-name", MODEL, "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
              "--responses-store-size", "1MiB", "--responses-store-ttl", "600"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"]}}


def chat_tokens(http, messages: list[dict]) -> int:
    return http.post("/tokenize", json={"messages": messages}).json()["count"]


def test_create_retrieve_delete(client, http):
    r = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=6, temperature=0,
                                metadata={"k": "v"})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # 6 random tokens
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant" and r.output_text
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.usage.input_tokens == chat_tokens(http, [{"role": "user", "content": "Hello there"}])
    assert r.metadata == {"k": "v"} and r.store is True
    # the same answer as the chat route gives (greedy)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                          max_tokens=6, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["param"] == "response_id" and e.value.body["type"] == "invalid_request_error"
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


def test_stream_event_sequence(client):
    kw = dict(model=MODEL, input="Give a number as JSON.", max_output_tokens=40, temperature=0,
              text={"format": {"type": "json_schema", "name": "num", "schema": SCHEMA}})
    whole = client.responses.create(**kw)
    assert whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), SCHEMA)
    assert set(json.loads(whole.output_text)) <= {"n", "ok"}
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * deltas + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert deltas > 1 and final.output_text == whole.output_text and final.status == "completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # a stream is stored too
    with client.responses.stream(model=MODEL, input="Hi", max_output_tokens=3) as stream:
        assert [e.type for e in stream][-1] == "response.incomplete"


def test_previous_response_id_continues_the_conversation(client, http):
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                                    max_output_tokens=5, temperature=0)
    second = client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is my name?"}]}], previous_response_id=first.id, max_output_tokens=5,
        temperature=0)
    assert second.previous_response_id == first.id and second.instructions is None
    # the history without the first turn's instructions (OpenAI's rule), its answer, the new question
    history = [{"role": "user", "content": "My name is Ada."},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == chat_tokens(http, history)
    third = client.responses.create(model=MODEL, input="And?", previous_response_id=second.id, max_output_tokens=2)
    assert third.usage.input_tokens == chat_tokens(http, history + [
        {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "And?"}])


def test_function_call_and_its_output(client, http):
    asked = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                    temperature=0)
    assert asked.status == "completed" and [o.type for o in asked.output] == ["function_call"]
    call = asked.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    # streamed, the same call arrives as function-call events
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=[TOOL],
                                 tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                                 temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert [o.type for o in final.output] == ["function_call"] and final.output[0].name == "get_weather"
    # the result goes back as a function_call_output item, after the call (from previous_response_id)
    answer = client.responses.create(model=MODEL, previous_response_id=asked.id, tools=[TOOL], max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": '{"sky": "clear"}'}])
    assert answer.status in ("completed", "incomplete")
    # the same conversation given in full, without the store: the same prompt
    full = client.responses.create(model=MODEL, tools=[TOOL], max_output_tokens=4, store=False, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}])
    assert full.usage.input_tokens == answer.usage.input_tokens


@pytest.mark.parametrize("body,status,param", [
    ({"input": "x", "reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, 400, "tools"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, 400, "include"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation"),
    ({"input": "x", "text": {"verbosity": "high"}}, 400, "text.verbosity"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0]"),
    ({"input": [{"content": "no role"}]}, 400, "input[0].role"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objx"}}}}, 400,
     "response_format"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 5000}, 400, None),
    ({}, 400, "input"),
    ({"input": "x", "model": "other"}, 404, "model"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
])
def test_bad_requests(http, body, status, param):
    resp = http.post("/v1/responses", json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if param in ("reasoning", "tools", "include", "background", "truncation", "text.verbosity"):
        assert err["code"] == "unsupported_field" and param.split(".")[-1] in err["message"]


def test_metrics_count_responses(client, http):
    def successes() -> float:
        text = http.get("/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("iterserve:request_success_total{"))

    before = successes()
    client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    assert successes() == before + 1


def test_store_is_bounded_by_size_and_age():
    now = [0.0]
    store = ResponseStore(max_bytes=1000, ttl_s=10, clock=lambda: now[0])
    big = {"text": "x" * 300}
    for i in range(3):
        assert store.put(f"r{i}", big, [])
    assert len(store) == 3 and store.bytes <= 1000
    store.put("r3", big, [])  # over the cap: the oldest goes
    assert store.get("r0") is None and store.get("r3") is not None and store.bytes <= 1000
    assert not store.put("huge", {"text": "x" * 2000}, []) and store.get("huge") is None
    now[0] = 11.0
    assert store.get("r3") is None and len(store) == 0 and store.bytes == 0
    store.put("a", {}, [{"role": "user", "content": "hi"}])
    assert store.delete("a") and not store.delete("a")
    off = ResponseStore(max_bytes=0)
    assert not off.put("a", {}, []) and off.get("a") is None
