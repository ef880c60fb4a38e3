"""The rest of the OpenAI surface against `iterserve serve smollm2-135m --dtype float32` on loopback,
with the official openai client: echo + logprobs against transformers, the Responses API on real
answers (text, streamed, JSON schema, a function call and its output, a conversation), and strict JSON
objects on held-out schemas, with the permissive flag restoring the old behaviour."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch
from app_server import AppServer
from model_utils import hf_llama_from

from iterserve.bench.launcher import ServerProcess
from iterserve.testing import BATCH_INVARIANCE_PROMPTS, STRICT_JSON_CASES, schema_keys_only

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
MODEL = "smollm2-135m"
ARGS = [MODEL, "--dtype", "float32", "--max-model-len", "1024"]
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    log = tmp_path_factory.mktemp("openai-real") / "server.log"
    with ServerProcess(ARGS, log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def json_answers(client, max_tokens: int = 64) -> list[tuple[str, str, dict]]:
    """Each held-out case's answer (greedy): 64 tokens leave room, the longest strict answer has 44."""
    def one(case):
        prompt, schema = case
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        return out.choices[0].message.content, out.choices[0].finish_reason, schema

    with ThreadPoolExecutor(len(STRICT_JSON_CASES)) as pool:
        return list(pool.map(one, STRICT_JSON_CASES))


def test_echo_logprobs_equal_transformers(srv, client, smol_loaded):
    hf = hf_llama_from(smol_loaded)
    prompts = BATCH_INVARIANCE_PROMPTS + [" ".join(BATCH_INVARIANCE_PROMPTS)]

    def one(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                         logprobs=1)

    with ThreadPoolExecutor(8) as pool:  # batched together, as an evaluation harness sends them
        outs = list(pool.map(one, prompts))
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        ids = httpx.post(srv.base_url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
        lps = out.choices[0].logprobs.token_logprobs
        assert len(lps) == len(ids) + 1 and lps[0] is None and out.choices[0].text.startswith(prompt)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        ref_lp = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        worst = max(worst, (torch.tensor(lps[1:len(ids)]) - ref_lp).abs().max().item())
    print(f"echo logprobs vs transformers (float32): max |diff| {worst:.2e}")
    assert worst < 1e-4


def test_responses_text_stream_and_conversation(client):
    kw = dict(model=MODEL, input="What is the capital of France? Answer in one word.", max_output_tokens=16,
              temperature=0)
    r = client.responses.create(**kw)
    assert "paris" in r.output_text.lower() and r.status in ("completed", "incomplete")
    with client.responses.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text
    first = client.responses.create(model=MODEL, input="My name is Ada. Remember it.", max_output_tokens=24,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=24, temperature=0)
    # the answer the chat route gives to the whole conversation written out
    history = [{"role": "user", "content": "My name is Ada. Remember it."},
               {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}]
    chat = client.chat.completions.create(model=MODEL, messages=history, max_tokens=24, temperature=0)
    assert second.output_text == chat.choices[0].message.content and second.output_text
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(first.id)  # the chain lives on in the later response's stored conversation
    third = client.responses.create(model=MODEL, input="Say it again.", previous_response_id=second.id,
                                    max_output_tokens=8, temperature=0)
    assert third.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_responses_json_schema_and_function_call(client):
    schema = STRICT_JSON_CASES[0][1]
    r = client.responses.create(model=MODEL, input="Describe a person as JSON.", max_output_tokens=64, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed"
    value = json.loads(r.output_text)
    jsonschema.validate(value, schema)
    assert schema_keys_only(value, schema)
    asked = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=48,
                                    temperature=0)
    (call,) = asked.output
    assert call.type == "function_call" and call.name == "get_weather"
    args = json.loads(call.arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    answer = client.responses.create(model=MODEL, previous_response_id=asked.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=32, input=[{"type": "function_call_output",
                                                                   "call_id": call.call_id,
                                                                   "output": '{"temperature_c": 18, "sky": "clear"}'}])
    assert answer.output_text.strip() and answer.output[0].type == "message"


def test_strict_json_objects_on_held_out_schemas(client):
    """Held-out object schemas without additionalProperties: only their keys, as valid JSON."""
    for text, reason, schema in json_answers(client):
        assert reason == "stop", text
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert schema_keys_only(value, schema), text


def test_permissive_flag_restores_invented_keys(smol_loaded):
    """The same schemas on a server started with the flag (in this process, over the model the session
    loaded: the same build as `iterserve serve`): JSON Schema's default lets the model invent keys."""
    with AppServer([*ARGS, "--structured-outputs-allow-additional-properties"], smol_loaded) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300,
                               http_client=server.client(timeout=300))
        answers = json_answers(client)
    extra = []
    for text, reason, schema in answers:
        try:
            extra.append(reason == "length" or not schema_keys_only(json.loads(text), schema))
        except ValueError:
            extra.append(True)
    print(f"permissive: {sum(extra)} of {len(answers)} answers have invented keys or were cut off, "
          f"{sum(r == 'length' for _, r, _ in answers)} by max_tokens")
    assert sum(extra) >= len(answers) // 3
