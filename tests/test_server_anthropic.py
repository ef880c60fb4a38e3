"""/v1/messages and /v1/messages/count_tokens with the official `anthropic` client over real HTTP: the
server `iterserve serve` builds (cli_serve.build_server, with --api-key) under uvicorn on a loopback
port, over the tiny random-weight model. create (the same greedy text as the chat route), stream
(the raw SSE event order, and the client's own stream reader giving the non-streamed text), stop
sequences, a forced tool call answered by a tool_result, count_tokens against the rendered prompt,
output_config.format on the structured-output path,
x-api-key and Bearer auth, and Anthropic-shaped errors (OpenAI routes keep OpenAI's shape).
What the text says is not checked: the weights are random."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from http_server import HttpServer

MODEL = "tiny"
KEY = "sk-test-anthropic"
TOOL = {"name": "get_weather", "description": "Current weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                         "required": ["city"]}}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tiny_loaded):
    argv = [str(tiny_model_dir), "--served-model-name", MODEL, "--kv-cache-memory", "64MiB", "--max-model-len",
            "1024", "--api-key", KEY]
    with HttpServer(argv, tiny_loaded) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def sdk(**kw) -> dict:
    """The client's keyword arguments: sampling fields the current SDK no longer declares (temperature,
    top_p, top_k; the server still takes them, as older clients send them) go in extra_body."""
    extra = {k: kw.pop(k) for k in ("temperature", "top_p", "top_k") if k in kw}
    if extra:
        kw["extra_body"] = kw.get("extra_body", {}) | extra
    return kw


def tokenize(http, messages: list[dict]) -> int:
    return http.post("/tokenize", json={"messages": messages}).json()["count"]


def sse_events(http, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a raw streamed /v1/messages answer."""
    events = []
    with http.stream("POST", "/v1/messages", json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name  # each event's name is its data's type, as Anthropic sends
                events.append((name, data))
    return events


def test_create_is_the_chat_paths_answer(client, http):
    kw = dict(model=MODEL, max_tokens=8, temperature=0, system="Be brief.",
              messages=[{"role": "user", "content": "Hello there"}])
    m = client.messages.create(**sdk(**kw))
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m._request_id == m.id  # the request-id header
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None  # 8 random tokens hit no EOS
    chat_messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    assert m.usage.output_tokens == 8 and m.usage.input_tokens == tokenize(http, chat_messages)
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat_messages, "max_tokens": 8,
                                                   "temperature": 0}).json()
    assert m.content[0].text == chat["choices"][0]["message"]["content"]
    # system as text blocks (with cache_control, accepted as a no-op), content as text blocks: same prompt
    blocks = client.messages.create(**sdk(
        model=MODEL, max_tokens=8, temperature=0, metadata={"user_id": "u-1"},
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]))
    assert blocks.content[0].text == m.content[0].text and blocks.usage.input_tokens == m.usage.input_tokens
    assert client.messages.count_tokens(model=MODEL, system="Be brief.",
                                        messages=kw["messages"]).input_tokens == m.usage.input_tokens


def test_stream_event_sequence_and_text(client, http):
    body = dict(model=MODEL, max_tokens=12, temperature=0, messages=[{"role": "user", "content": "Tell me a story"}])
    whole = client.messages.create(**sdk(**body))
    events = sse_events(http, body)
    kinds = [k for k, _ in events]
    deltas = kinds.count("content_block_delta")
    assert kinds == ["message_start", "ping", "content_block_start"] + ["content_block_delta"] * deltas + [
        "content_block_stop", "message_delta", "message_stop"]
    assert deltas > 1
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == whole.usage.input_tokens
    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    assert {d["delta"]["type"] for k, d in events if k == "content_block_delta"} == {"text_delta"}
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == whole.content[0].text
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} and end["usage"]["output_tokens"] == 12
    # the client's own reader
    with client.messages.stream(**sdk(**body)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12


def test_stop_sequences(client):
    base = client.messages.create(**sdk(model=MODEL, max_tokens=24, temperature=0,
                                  messages=[{"role": "user", "content": "Count with me"}])).content[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]
    assert stop.strip() and base.find(stop) > 0
    m = client.messages.create(**sdk(model=MODEL, max_tokens=24, temperature=0, stop_sequences=["\x00never", stop],
                               messages=[{"role": "user", "content": "Count with me"}]))
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == base[: base.find(stop)]
    with client.messages.stream(**sdk(model=MODEL, max_tokens=24, temperature=0, stop_sequences=[stop],
                                messages=[{"role": "user", "content": "Count with me"}])) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == m.content[0].text


def test_tool_use_round_trip(client, http):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    forced = dict(model=MODEL, max_tokens=40, temperature=0, tools=[TOOL], messages=[question],
                  tool_choice={"type": "tool", "name": "get_weather"})
    asked = client.messages.create(**sdk(**forced))
    assert asked.stop_reason == "tool_use" and [b.type for b in asked.content] == ["tool_use"]
    call = asked.content[0]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, TOOL["input_schema"])
    # streamed: the tool_use block's arguments as input_json_delta, the same call in the end
    events = sse_events(http, forced)
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    block = events[2][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for k, d in events if k == "content_block_delta")
    assert json.loads(partial) == call.input and events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(**sdk(**forced)) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == call.input
    # the client answers with a tool_result and gets a final answer
    said = [b.model_dump(exclude_none=True) for b in asked.content]
    conversation = [question, {"role": "assistant", "content": said},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
    answer = client.messages.create(**sdk(model=MODEL, max_tokens=10, temperature=0, tools=[TOOL],
                                          messages=conversation, tool_choice={"type": "none"}))
    assert answer.stop_reason in ("end_turn", "max_tokens") and [b.type for b in answer.content] == ["text"]
    # the tool's definition, the call and its result are in the prompt: count_tokens renders the same one
    assert client.messages.count_tokens(model=MODEL, tools=[TOOL], messages=conversation,
                                        tool_choice={"type": "none"}).input_tokens == answer.usage.input_tokens
    with_result_as_error = [*conversation[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C", "is_error": True}]}]
    assert client.messages.count_tokens(model=MODEL, tools=[TOOL], messages=with_result_as_error).input_tokens > \
        client.messages.count_tokens(model=MODEL, tools=[TOOL], messages=conversation).input_tokens
    # tool_choice any: a call is forced too
    anyone = client.messages.create(**sdk(model=MODEL, max_tokens=40, temperature=0, tools=[TOOL], messages=[question],
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    assert anyone.stop_reason in ("tool_use", "max_tokens")
    if anyone.stop_reason == "tool_use":
        assert [b.type for b in anyone.content] == ["tool_use"] and anyone.content[0].name == "get_weather"


def test_count_tokens_is_the_rendered_prompt(client, http):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": [{"type": "text", "text": "How are you?"}]}]
    got = client.messages.count_tokens(model=MODEL, system="You are terse.", messages=messages)
    assert got.input_tokens == tokenize(http, [{"role": "system", "content": "You are terse."},
                                               {"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Hello!"},
                                               {"role": "user", "content": "How are you?"}])
    with_tools = client.messages.count_tokens(model=MODEL, system="You are terse.", messages=messages, tools=[TOOL])
    assert with_tools.input_tokens > got.input_tokens  # the tool's definition is in the prompt
    # a system turn inside the conversation; consecutive turns of one role are one turn (Anthropic's rule)
    turns = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be terse."},
             {"role": "user", "content": "Again"}, {"role": "user", "content": [{"type": "text", "text": "Go"}]}]
    assert client.messages.count_tokens(model=MODEL, messages=turns).input_tokens == tokenize(http, [
        {"role": "user", "content": "Hi"}, {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Again\nGo"}])


def test_output_config_format_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
    m = client.messages.create(**sdk(model=MODEL, max_tokens=40, temperature=0,
                                     messages=[{"role": "user", "content": "A number as JSON"}],
                                     output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_auth_x_api_key_and_bearer(server, http):
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        assert httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=60).status_code == 200
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0, timeout=60)
    assert bearer.messages.create(**sdk(**body)).usage.output_tokens == 1
    wrong = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(**body)
    assert e.value.status_code == 401 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    none = httpx.post(server.url + "/v1/messages/count_tokens", json=body, timeout=60)
    assert none.status_code == 401 and none.json()["error"]["type"] == "authentication_error"
    assert "missing API key" in none.json()["error"]["message"]
    # the same key as x-api-key opens the other routes; their errors keep OpenAI's shape
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    openai_401 = httpx.get(server.url + "/v1/models", headers={"x-api-key": "nope"})
    assert openai_401.status_code == 401 and openai_401.json()["error"]["code"] == "invalid_api_key"


def anthropic_error(resp: httpx.Response, status: int, kind: str, *words: str) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    for w in words:
        assert w in body["error"]["message"], body


def test_errors_have_anthropics_shape(client, http):
    user = {"role": "user", "content": "Hi"}
    ok = {"model": MODEL, "max_tokens": 2, "messages": [user]}
    post = lambda body, path="/v1/messages": http.post(path, json=body)  # noqa: E731
    anthropic_error(post({"model": MODEL, "messages": [user]}), 400, "invalid_request_error", "max_tokens",
                    "required")
    anthropic_error(post(ok | {"frobnicate": 1}), 400, "invalid_request_error", "frobnicate",
                    "Extra inputs are not permitted")
    anthropic_error(post(ok | {"container": "c-1"}), 400, "invalid_request_error", "container", "not supported")
    anthropic_error(post(ok | {"mcp_servers": [{"type": "url", "url": "x", "name": "m"}]}), 400,
                    "invalid_request_error", "mcp_servers")
    anthropic_error(post(ok | {"thinking": {"type": "enabled", "budget_tokens": 2048}}), 400, "invalid_request_error",
                    "thinking", "--reasoning-parser")
    assert post(ok | {"thinking": {"type": "disabled"}}).status_code == 200
    anthropic_error(post(ok | {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}), 400,
        "invalid_request_error", "image", "messages.0.content.0")
    anthropic_error(post(ok | {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}), 400,
                    "invalid_request_error", "web_search_20250305")
    # bad roles and order: a tool turn (OpenAI's, not Anthropic's), a tool_result with no tool_use
    # before it, a tool_use left unanswered, a tool_use in a user turn, a final assistant turn (prefill)
    anthropic_error(post(ok | {"messages": [{"role": "tool", "content": "x"}, user]}), 400,
                    "invalid_request_error", "messages.0.role")
    anthropic_error(post(ok | {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]}), 400, "invalid_request_error",
        "unexpected tool_use_id", "toolu_1")
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                                             "input": {"city": "Paris"}}]}
    anthropic_error(post(ok | {"tools": [TOOL], "messages": [user, use, user]}), 400, "invalid_request_error",
                    "without tool_result", "toolu_2")
    anthropic_error(post(ok | {"messages": [{"role": "user", "content": use["content"]}]}), 400,
                    "invalid_request_error", "tool_use", "assistant turn")
    anthropic_error(post(ok | {"messages": [user, {"role": "assistant", "content": "Sure,"}]}), 400,
                    "invalid_request_error", "prefill")
    anthropic_error(post(ok | {"messages": [{"role": "user", "content": []}]}), 400, "invalid_request_error",
                    "messages.0.content")
    anthropic_error(post(ok | {"messages": [{"role": "system", "content": "Be brief."}]}), 400,
                    "invalid_request_error", "user turn")
    anthropic_error(post(ok | {"tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]}), 400,
                    "invalid_request_error", "nope")
    anthropic_error(post(ok | {"temperature": 1.5}), 400, "invalid_request_error", "temperature")
    anthropic_error(post(ok | {"max_tokens": "2"}), 400, "invalid_request_error", "max_tokens")
    anthropic_error(post(ok | {"max_tokens": 100000}), 400, "invalid_request_error")
    anthropic_error(http.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"}),
                    400, "invalid_request_error", "JSON")
    anthropic_error(post(ok | {"model": "claude-sonnet-4-5"}), 404, "not_found_error", "claude-sonnet-4-5")
    anthropic_error(post({"model": MODEL, "messages": [user], "max_tokens": 3}, "/v1/messages/count_tokens"), 400,
                    "invalid_request_error", "max_tokens")
    anthropic_error(http.get("/v1/messages/batches"), 404, "not_found_error")
    anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=2, messages=[user], extra_body={"frobnicate": True})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    # OpenAI's routes keep OpenAI's shape; the server still serves after all of this
    openai_400 = http.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert openai_400.status_code == 400 and "param" in openai_400.json()["error"]
    assert post(ok).json()["usage"]["output_tokens"] == 2


def test_guards_and_failures_answer_in_anthropics_shape(http):
    """The body cap (middleware) and a failed request's 503 / 500 from the chat path (re-shaped) on the
    Messages routes; the same errors elsewhere stay OpenAI's."""
    from fastapi.responses import JSONResponse

    from iterserve.server.anthropic_messages import anthropic_errors
    from iterserve.server.middleware import error_response
    from iterserve.server.protocol import error_body

    big = b'{"model": "' + b"x" * (4 * 2**20) + b'"}'
    anthropic_error(http.post("/v1/messages", content=big, headers={"content-type": "application/json"}), 413,
                    "request_too_large", "--max-request-bytes")
    assert http.post("/v1/chat/completions", content=big).json()["error"]["code"] == "request_too_large"
    full = anthropic_errors(JSONResponse(error_body("queue full", 503), status_code=503, headers={"Retry-After": "1"}))
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert json.loads(full.body) == {"type": "error", "error": {"type": "overloaded_error", "message": "queue full"}}
    crashed = json.loads(error_response("boom", 500, path="/v1/messages/count_tokens").body)
    assert crashed == {"type": "error", "error": {"type": "api_error", "message": "boom"}}
    assert json.loads(error_response("boom", 500, path="/v1/chat/completions").body)["error"]["type"] == "server_error"


def test_earlier_thinking_blocks_are_left_out_of_the_prompt(client):
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "Again"}]
    with_thinking = [plain[0], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "The user greets me.", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "Hello!"}]}, plain[2]]
    assert client.messages.count_tokens(model=MODEL, messages=with_thinking).input_tokens == \
        client.messages.count_tokens(model=MODEL, messages=plain).input_tokens


def test_a_failed_engine_step_ends_in_anthropics_error(server, http):
    """A request the engine fails after admission: 500 api_error, or, streamed, an `error` event after
    message_start; never a message with partial text. The server serves on."""
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    runner = server.engine.engine.runner
    real = runner.execute

    def failing(sched):
        raise RuntimeError("a bad step")

    runner.execute = failing
    try:
        anthropic_error(http.post("/v1/messages", json=body), 500, "api_error", "engine step")
        events = sse_events(http, body)
    finally:
        runner.execute = real
    assert [k for k, _ in events] == ["message_start", "ping", "error"]
    assert events[-1][1]["error"]["type"] == "api_error" and "engine step" in events[-1][1]["error"]["message"]
    assert http.post("/v1/messages", json=body).json()["usage"]["output_tokens"] == 4


def test_tool_turns_render_as_the_chat_routes_tool_messages(client, http):
    """tool_use blocks are the assistant's tool_calls and tool_result blocks tool messages: the same
    prompt /tokenize renders from the OpenAI form of the conversation, which holds the call and result."""
    conversation = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": "Sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_b", "content": [{"type": "text", "text": "Rain"}],
             "is_error": True},
            {"type": "text", "text": "Thanks!"}]}]
    openai_form = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_b", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_a", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "toolu_b", "content": "Error: Rain"},
        {"role": "user", "content": "Thanks!"}]
    tokens = http.post("/tokenize", json={"messages": openai_form}).json()["tokens"]
    assert client.messages.count_tokens(model=MODEL, messages=conversation).input_tokens == len(tokens)
    prompt = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    for part in ("Checking.", '"Paris"', '"Rome"', "Sunny", "Error: Rain", "Thanks!"):
        assert part in prompt


@pytest.mark.real_model
@pytest.mark.slow
def test_real_answers_on_the_embedded_model(smol_loaded):
    """SmolLM2-135M-Instruct through the Messages API: the system prompt and turns reach its chat
    template as they should (a right answer), and a forced call's input names the city asked about."""
    with HttpServer(["smollm2-135m", "--max-model-len", "1024"], smol_loaded) as srv:
        claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=300)
        m = claude.messages.create(**sdk(model="smollm2-135m", max_tokens=16, temperature=0,
                                         system="Answer in one word.",
                                         messages=[{"role": "user", "content": "What is the capital of France?"}]))
        assert "paris" in m.content[0].text.lower()
        tool = TOOL | {"input_schema": TOOL["input_schema"] | {"properties": {"city": {"type": "string",
                                                                                        "maxLength": 20}}}}
        question = {"role": "user", "content": "What is the weather in Paris?"}
        asked = claude.messages.create(**sdk(model="smollm2-135m", max_tokens=48, temperature=0, tools=[tool],
                                             messages=[question], tool_choice={"type": "tool", "name": "get_weather"}))
        (call,) = asked.content
        assert call.type == "tool_use" and "paris" in call.input["city"].lower()
        turns = [question, {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "18 C, clear sky"}]}]
        answer = claude.messages.create(**sdk(model="smollm2-135m", max_tokens=32, temperature=0, tools=[tool],
                                              tool_choice={"type": "none"}, messages=turns))
        assert answer.content and answer.content[0].type == "text" and answer.content[0].text.strip()


@pytest.mark.slow
def test_schemathesis_on_the_messages_routes_finds_no_5xx(http):
    """The server's own schema for the two routes, `model` pinned to the served name (else nearly every
    case stops at the 404) and max_tokens small: generated bodies, valid and not, get 200 or an
    Anthropic-shaped 4xx, never a 5xx, and leave nothing running or holding blocks."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    doc = http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for name in ("MessagesRequest", "CountTokensRequest"):
        schemas[name]["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    schemas["MessagesRequest"]["properties"]["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 4}
    ops = [r.ok() for r in schemathesis.openapi.from_dict(doc).get_all_operations()]
    ops = [op for op in ops if op.path.startswith("/v1/messages")]
    assert {op.path for op in ops} == {"/v1/messages", "/v1/messages/count_tokens"}
    for op in ops:
        for mode in ("positive", "negative"):
            statuses: list[int] = []

            @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=GenerationMode(mode)))
            def run(case):
                kw = case.as_transport_kwargs(base_url=str(http.base_url).rstrip("/"), headers={})
                content = json.dumps(kw["json"], allow_nan=False) if "json" in kw else kw.get("data")
                resp = http.request(kw["method"], op.path, content=content,
                                    headers={k: v for k, v in kw["headers"].items() if k.lower() != "authorization"})
                statuses.append(resp.status_code)
                assert resp.status_code < 500, (case.body, resp.text[:500])
                if resp.status_code >= 400:
                    assert resp.json()["type"] == "error" and resp.json()["error"]["message"], resp.text

            run()
            print(f"\n{mode} {op.path}: {dict(sorted((c, statuses.count(c)) for c in set(statuses)))}")
            if mode == "positive":
                assert 200 in statuses  # some generated bodies are served, not only refused
    snap = http.get("/v1/scheduler").json()
    assert snap["running"] == 0 and snap["kv_cache"]["used_blocks"] == 0
