"""Tool calls per model family over real HTTP (uvicorn on 127.0.0.1) with the openai client, in all
three tool_choice modes, streamed and not.

The model is a tiny random-weight model of each family's architecture (Qwen3 for hermes and
qwen3_coder, Llama for llama3_json and pythonic, Mistral, Granite) with a tokenizer made to look like
the family's: SmolLM2's vocabulary with a chat template that writes the family's call format (so the server picks the parser from it), and
for Mistral, Llama 3 and Granite the family's marker as a real special token (renamed from one of
SmolLM2's own special tokens). The scripted model: with tool_choice "auto" the test server adds a
Lark grammar that forces the output to a known script (the special marker as its token id, then the
family's call text), so the random model's greedy choices only pick how the script is cut into
tokens; the engine, the detokeniser, the parser and the SSE path are the real ones. "required" and a
named function run under their own forcing grammar, unscripted: their calls are checked against
the tools' schemas.
"""
from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
from http_server import HttpServer

from iterserve.server import serving
from iterserve.server.tool_parsers import resolve_parser
from iterserve.structured.params import StructuredOutputsParams

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
EXPECTED = [("get_weather", {"city": "Oslo"}), ("get_time", {})]
RENAMED = {"[TOOL_CALLS]": "<gh_stars>", "<|python_tag|>": "<issue_start>", "<|tool_call|>": "<issue_comment>"}

# parser: the model type of its family's tiny random model
MODEL_TYPES = {"hermes": "qwen3", "llama3_json": "llama", "mistral": "mistral", "granite": "granite",
               "pythonic": "llama", "qwen3_coder": "qwen3"}
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_hidden_layers=2, max_position_embeddings=2048, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)

# parser: (what the chat template says about calls, the special marker or None, the call text after it)
FAMILIES = {
    "hermes": (None, None, 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                           '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    "llama3_json": ("reply with <|python_tag|> and JSON", "<|python_tag|>",
                    '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'),
    "mistral": ("[TOOL_CALLS] then a JSON list", "[TOOL_CALLS]",
                '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'),
    "granite": ("<|tool_call|> then a JSON list", "<|tool_call|>",
                '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'),
    "pythonic": ("[func_name1(params_name1=params_value1)]", None, '[get_weather(city="Oslo"), get_time()]'),
    "qwen3_coder": ("<tool_call>\n<function=name>\n<parameter=x>", None,
                    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"),
}
TEMPLATE = ("{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}. Call them as: SAYS<|im_end|>\n{% endif %}"
            "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n")
SCRIPT: dict[str, str] = {}  # the grammar the test server forces on tool_choice "auto" requests
ANSWER = 'start: "It is clear in Oslo."'  # ... and once the conversation holds tool results


def family_dir(tiny_model_dir, tmp_path_factory, name: str):
    """A Hugging Face folder: the family's random model, SmolLM2's tokenizer dressed as the family's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    says, _, _ = FAMILIES[name]
    folder = tmp_path_factory.mktemp(f"tiny-{name}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(MODEL_TYPES[name], **TINY))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" not in pname:
                p.normal_(0.0, 1.0 if "embed" in pname else 0.25)
    model.save_pretrained(folder, safe_serialization=True)
    for f in tiny_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, folder)
    if says is None:
        return folder  # SmolLM2's own template: no tools section, the Hermes instructions
    for fname in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = folder / fname
        if path.exists():
            text = path.read_text()
            for new, old in RENAMED.items():
                text = text.replace(json.dumps(old), json.dumps(new))
            path.write_text(text)
    (folder / "chat_template.jinja").write_text(TEMPLATE.replace("SAYS", says))
    return folder


def scripted_grammar(tok, name: str) -> str:
    _, special, text = FAMILIES[name]
    head = ""
    if special is not None:
        ids = tok.encode(special, add_special_tokens=False)
        assert len(ids) == 1
        head = f"<[{ids[0]}]> "
    return f"start: {head}{json.dumps(text)}"


@pytest.fixture(scope="module", autouse=True)
def scripted():
    """Every tool_choice "auto" request of the test servers is held to SCRIPT's grammar."""
    original = serving.OpenAIServing.sampling_params

    def sampling_params(self, body, max_tokens, logprobs, structured=None, **kw):
        if structured is None and getattr(body, "tools", None) and body.tool_choice in (None, "auto"):
            answered = any(m.role == "tool" for m in body.messages)  # the tool results are in: answer
            structured = StructuredOutputsParams(grammar=ANSWER if answered else SCRIPT["grammar"])
        return original(self, body, max_tokens, logprobs, structured, **kw)

    serving.OpenAIServing.sampling_params = sampling_params
    yield
    serving.OpenAIServing.sampling_params = original


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tiny_model_dir, tmp_path_factory):
    from iterserve.model.loader import load_model

    name = request.param
    folder = family_dir(tiny_model_dir, tmp_path_factory, name)
    model, cfg, tok, _ = load_model(str(folder))
    SCRIPT["grammar"] = scripted_grammar(tok, name)
    with HttpServer([str(folder), "--max-model-len", "1024", "--kv-cache-memory", "64MiB"], (model, cfg, tok)) as srv:
        yield name, tok, openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


def ask(client, stream: bool, **kw):
    """(content, [(name, arguments)], finish_reason, ids) of one chat request, streamed or not."""
    body = dict(model="x", messages=[{"role": "user", "content": "Weather in Oslo, and the time?"}], tools=TOOLS,
                max_tokens=200, temperature=0) | kw
    body["model"] = client.models.list().data[0].id
    if not stream:
        out = client.chat.completions.create(**body)
        msg = out.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
        return msg.content, calls, out.choices[0].finish_reason, [c.id for c in msg.tool_calls or []]
    content, names, args, ids, reason = "", {}, {}, {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in names and tc.function.name
                names[tc.index], ids[tc.index] = tc.function.name, tc.id
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
        reason = ch.finish_reason or reason
    calls = [(names[i], json.loads(args[i])) for i in sorted(names)]
    return content.strip() or None, calls, reason, [ids[i] for i in sorted(ids)]


def test_template_picks_the_parser(family):
    name, tok, _ = family
    assert resolve_parser(None, tok) == (name, FAMILIES[name][1] is not None)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_family_format(family, stream):
    name, _, client = family
    content, calls, reason, ids = ask(client, stream)
    assert calls == EXPECTED and reason == "tool_calls"
    assert content == ("Checking." if name == "hermes" else None)
    if name == "mistral":  # Mistral's templates take back only 9-character ids
        assert all(len(i) == 9 and i.isalnum() for i in ids)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_parse_under_every_parser(family, stream, choice):
    _, _, client = family
    content, calls, reason, _ = ask(client, stream, tool_choice=choice, parallel_tool_calls=False)
    assert reason == "tool_calls" and content is None and len(calls) == 1, (content, calls)
    fn = {t["function"]["name"]: t["function"] for t in TOOLS}[calls[0][0]]
    jsonschema.validate(calls[0][1], fn["parameters"])
    if isinstance(choice, dict):
        assert calls[0][0] == "get_weather"


def test_malformed_call_text_is_content(family):
    name, tok, client = family
    _, special, text = FAMILIES[name]
    broken = text.replace('"Oslo"', '"Oslo').replace("Oslo\n</parameter>", "").replace("get_time()", "get_time(")
    if name == "qwen3_coder":
        broken = "<tool_call>\nno function\n</tool_call>"
    SCRIPT["grammar"] = f"start: {json.dumps(broken)}"
    try:
        for stream in (False, True):
            content, calls, reason, _ = ask(client, stream)
            assert calls == [] and reason == "stop" and content == broken.strip()
    finally:
        SCRIPT["grammar"] = scripted_grammar(tok, name)


def test_agent_loop_as_documented(family):
    """docs/server.md's agent loop: the calls, their results sent back with the call ids, the answer."""
    _, _, client = family
    impl = {"get_weather": lambda city: {"city": city, "sky": "clear"}, "get_time": lambda: {"utc": "12:00"}}
    messages = [{"role": "user", "content": "Weather in Oslo, and the time?"}]
    model = client.models.list().data[0].id
    for _ in range(3):
        out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="auto",
                                             max_tokens=200, temperature=0)
        msg = out.choices[0].message
        if out.choices[0].finish_reason != "tool_calls":
            break
        messages.append({"role": "assistant", "content": msg.content,
                         "tool_calls": [c.model_dump() for c in msg.tool_calls]})
        for call in msg.tool_calls:
            result = impl[call.function.name](**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    assert msg.content == "It is clear in Oslo." and len(messages) == 4  # user, assistant calls, two results


@pytest.mark.parametrize("stream", [False, True])
def test_responses_api_reads_the_family_format(family, stream):
    """/v1/responses shares the chat path: the family's calls become function_call items."""
    _, _, client = family
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    kw = dict(model=client.models.list().data[0].id, input="Weather in Oslo, and the time?", tools=tools,
              max_output_tokens=200, temperature=0)
    if stream:
        with client.responses.stream(**kw) as events:
            kinds = [e.type for e in events]
            r = events.get_final_response()
        assert kinds.count("response.function_call_arguments.done") == 2
    else:
        r = client.responses.create(**kw)
    calls = [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    assert calls == EXPECTED and r.status == "completed"
