"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as a view of the chat path.

A Messages body becomes a chat request (`to_chat_request`), as the Responses API's does
(responses.py): `system` the system message, each user turn's `tool_result` blocks tool messages
and its text a user message, each assistant turn's text and `tool_use` blocks an assistant message
with tool calls; `tools` (`input_schema` as the function's parameters), `tool_choice` (`auto`, `any`
-> "required", `tool` -> a named function, `none`), `stop_sequences`, the sampling fields and
`metadata.user_id` map onto the chat request's own fields. From there the chat path
(server/serving.py: chat_inputs, _generate) checks, tokenises, admits, aborts on disconnect and
counts it in the metrics exactly as a chat completion, behind the single server and the Ray
ingress alike; only the answer's shape differs (`MessagesFormat`): a message with `text` and
`tool_use` content blocks, or, streamed, Anthropic's event sequence (`message_start`, `ping`, per
block `content_block_start`, `content_block_delta`..., `content_block_stop`, then `message_delta`
with the stop reason and usage, and `message_stop`).

Only the chat path's results are read (the finished text parsed by parse_tool_calls, the streamed
deltas of ToolCallStream, finish_reason, stop_reason, token counts), so changes to how the chat path
finds tool calls or reasoning flow through. Reasoning: with a server started with
`--reasoning-parser`, `thinking` maps onto the chat path's switches (`reasoning_switch`: the
template's `enable_thinking`, `budget_tokens` as the thinking budget) and the parser's split comes
back as a leading `thinking` block (streamed: `thinking_delta` events); without one, `thinking`
enabled is refused (REASONING_MISSING).
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from iterserve.request import RequestOutput
from iterserve.server.anthropic_protocol import (MESSAGES_UNSUPPORTED_FIELDS, UNSUPPORTED_BLOCKS, AnthropicTool,
                                                 CountTokensRequest, MessagesRequest, TextBlock, ThinkingBlock,
                                                 ToolResultBlock, ToolUseBlock, anthropic_error_body)
from iterserve.server.async_engine import RequestStream
from iterserve.server.reasoning.request import RequestReasoning, template_kwargs
from iterserve.server.protocol import (APIError, ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDef,
                                       JsonSchemaFormat, NamedFunction, NamedToolChoice, ResponseFormat, ToolCall,
                                       ToolDef)
from iterserve.server.tool_calls import ToolCallStream, ToolMode, parse_tool_calls

REASONING_MISSING = ("thinking is not supported by this server: it was started without a reasoning parser "
                     "(--reasoning-parser), so no thinking blocks can be produced; send "
                     "thinking {\"type\": \"disabled\"} or leave it out")


# ---- content blocks, checked by type -----------------------------------------------------------------
BLOCKS: dict[str, dict[str, type[BaseModel]]] = {
    "system": {"text": TextBlock},
    "user": {"text": TextBlock, "tool_result": ToolResultBlock},
    "assistant": {"text": TextBlock, "tool_use": ToolUseBlock, "thinking": ThinkingBlock,
                  "redacted_thinking": ThinkingBlock},
}


def _checked(model: type[BaseModel], raw: dict, where: str):
    """`raw` as `model`, or a 400 naming the field at fault (`messages.0.content.1.id: ...`)."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join([where, *(str(p) for p in err.get("loc", ()))])
        raise APIError(f"{loc}: {err.get('msg', 'invalid value')}", param=loc) from None


def _block(raw: dict, role: str, where: str):
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise APIError(f"{where}.type: Field required (a content block needs a type)", param=f"{where}.type")
    if kind in UNSUPPORTED_BLOCKS:
        raise APIError(f"{where}: {kind} content blocks are not supported by this server (text, tool_use and "
                       "tool_result only)", param=f"{where}.type")
    model = BLOCKS[role].get(kind)
    if model is None:
        other = next((r for r in BLOCKS if kind in BLOCKS[r]), None)
        why = (f"a {kind} block belongs in {'an' if other == 'assistant' else 'a'} {other} turn, not a {role} turn"
               if other is not None else f"unknown content block type {kind!r}")
        raise APIError(f"{where}: {why}", param=f"{where}.type")
    return _checked(model, raw, where)


def _joined(texts: list[str]) -> str:
    return "\n".join(texts)


def _tool_result_text(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        parts = []
        for j, raw in enumerate(content):
            at = f"{where}.content.{j}"
            kind = raw.get("type")
            if kind != "text":
                raise APIError(f"{at}: {kind} content is not supported by this server in a tool_result (text only)",
                               param=f"{at}.type")
            parts.append(_checked(TextBlock, raw, at).text)
        text = _joined(parts)
    return f"Error: {text}" if block.is_error else text


# ---- request: Messages body -> chat body ---------------------------------------------------------------
def extra_fields_error(body: BaseModel) -> APIError | None:
    """A field Anthropic defines that is not served here is refused by name; any other unknown field
    as Anthropic refuses it."""
    for name, value in (body.model_extra or {}).items():
        known = MESSAGES_UNSUPPORTED_FIELDS.get(name)
        if known is None:
            return APIError(f"{name}: Extra inputs are not permitted", param=name)
        accepts, hint = known
        if not accepts(value):
            return APIError(f"{name} is not supported by this server" + (f" ({hint})" if hint else ""), param=name)
    return None


def reasoning_switch(body: CountTokensRequest, reasoning: bool) -> dict:
    """`thinking` as the chat path's reasoning fields (`reasoning`: the server has a reasoning parser).
    Absent: the server's defaults. Disabled: the template's `enable_thinking` off (Qwen3, SmolLM3; a
    template without the switch ignores it). Enabled / adaptive: `enable_thinking` on, and
    `budget_tokens` becomes the thinking budget (the engine forces the end of the thinking there);
    the split-off thinking comes back as thinking blocks. `between_tools` (interleaved thinking) has
    no equivalent in the chat path and is refused."""
    thinking = body.thinking
    if thinking is None:
        return {}
    if thinking.type == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}} if reasoning else {}
    if not reasoning:
        raise APIError(REASONING_MISSING, param="thinking")
    if thinking.type == "between_tools":
        raise APIError("thinking type between_tools is not supported by this server", param="thinking.type")
    fields: dict = {"chat_template_kwargs": {"enable_thinking": True}}
    if thinking.budget_tokens is not None:
        fields["thinking_token_budget"] = thinking.budget_tokens
    return fields


def output_effort_refused(body: CountTokensRequest) -> None:
    """output_config.effort has no counterpart here (OpenAI's reasoning_effort is refused too)."""
    if body.output_config is not None and body.output_config.effort is not None:
        raise APIError("output_config.effort is not supported by this server (no reasoning switch to set)",
                       param="output_config.effort")


def response_format(body: CountTokensRequest) -> ResponseFormat | None:
    """output_config.format (or its older name output_format): the answer constrained to a JSON
    schema, on the chat path's structured outputs."""
    fmt = body.output_config.format if body.output_config is not None else None
    older = getattr(body, "output_format", None)
    if fmt is not None and older is not None:
        raise APIError("give output_config.format or output_format, not both", param="output_format")
    fmt = fmt or older
    if fmt is None:
        return None
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="output", schema=fmt.schema_))


def system_text(body: CountTokensRequest) -> str | None:
    if body.system is None or isinstance(body.system, str):
        return body.system
    return _joined([b.text for b in body.system])


def _turns(body: CountTokensRequest) -> list[tuple[str, list, str]]:
    """(role, blocks, where) per turn; consecutive turns of one role are one turn, as Anthropic
    combines them."""
    turns: list[tuple[str, list, str]] = []
    for i, m in enumerate(body.messages):
        where = f"messages.{i}.content"
        blocks = ([TextBlock(type="text", text=m.content)] if isinstance(m.content, str)
                  else [_block(raw, m.role, f"{where}.{j}") for j, raw in enumerate(m.content)])
        if turns and turns[-1][0] == m.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((m.role, blocks, f"messages.{i}"))
    return turns


def chat_messages(body: CountTokensRequest) -> list[ChatMessage]:
    """The conversation as chat messages. Every tool_use must be answered by a tool_result in the
    next (user) turn and every tool_result must answer a tool_use of the turn before, as Anthropic
    checks; a conversation that ends with an assistant turn (a prefill) is refused."""
    out: list[ChatMessage] = []
    system = system_text(body)
    if system:
        out.append(ChatMessage(role="system", content=system))
    turns = _turns(body)
    pending: list[str] = []  # tool_use ids of the last assistant turn, not yet answered
    for role, blocks, where in turns:
        if role == "system":
            out.append(ChatMessage(role="system", content=_joined([b.text for b in blocks])))
            continue
        if role == "assistant":
            if pending:
                raise APIError(f"{where}: tool_use ids were found without tool_result blocks immediately after: "
                               f"{', '.join(pending)}", param="messages")
            texts = [b.text for b in blocks if isinstance(b, TextBlock)]
            calls = [ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
                     for b in blocks if isinstance(b, ToolUseBlock)]
            pending = [c.id for c in calls]
            out.append(ChatMessage(role="assistant", content=_joined(texts) if texts or not calls else None,
                                   tool_calls=calls or None))
            continue
        results = [b for b in blocks if isinstance(b, ToolResultBlock)]
        for b in results:
            if b.tool_use_id not in pending:
                raise APIError(f"{where}: unexpected tool_use_id found in tool_result blocks: {b.tool_use_id}. "
                               "Each tool_result block must have a corresponding tool_use block in the previous "
                               "message", param="messages")
        missing = [t for t in pending if t not in {b.tool_use_id for b in results}]
        if missing:
            raise APIError(f"{where}: tool_use ids were found without tool_result blocks immediately after: "
                           f"{', '.join(missing)}", param="messages")
        pending = []
        out += [ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=_tool_result_text(b, where))
                for b in results]
        texts = [b.text for b in blocks if isinstance(b, TextBlock)]
        if texts or not results:
            out.append(ChatMessage(role="user", content=_joined(texts)))
    if pending:
        raise APIError(f"tool_use ids were found without tool_result blocks immediately after: "
                       f"{', '.join(pending)}", param="messages")
    if not any(role == "user" for role, _, _ in turns):
        raise APIError("messages: the conversation needs a user turn", param="messages")
    if turns[-1][0] == "assistant":
        raise APIError(f"{turns[-1][2]}: the last message is an assistant turn (a prefill), which this server does "
                       "not continue: end with a user turn", param="messages")
    return out


def chat_tools(body: CountTokensRequest) -> tuple[list[ToolDef] | None, object, bool | None]:
    """tools, tool_choice and parallel_tool_calls in the chat request's terms."""
    tools = None
    if body.tools:
        tools = []
        for i, raw in enumerate(body.tools):
            kind = raw.get("type")
            if kind not in (None, "custom"):
                raise APIError(f"tools.{i}: tool type {kind!r} is not supported by this server (custom tools with "
                               "an input_schema only)", param=f"tools.{i}.type")
            t = _checked(AnthropicTool, raw, f"tools.{i}")
            tools.append(ToolDef(type="function", function=FunctionDef(
                name=t.name, description=t.description, parameters=t.input_schema, strict=t.strict)))
    choice = body.tool_choice
    if choice is None:
        return tools, None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise APIError("tool_choice: a tool choice needs a name", param="tool_choice.name")
        return tools, NamedToolChoice(type="function", function=NamedFunction(name=choice.name)), parallel
    if choice.name is not None:
        raise APIError("tool_choice.name: only a tool choice of type \"tool\" names a tool", param="tool_choice.name")
    if not tools:  # auto / none without tools ask for nothing
        if choice.type == "any":
            raise APIError('tool_choice {"type": "any"} needs tools', param="tool_choice")
        return None, None, parallel
    return tools, {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def to_chat_request(body: CountTokensRequest, reasoning: bool) -> ChatCompletionRequest:
    """The chat request this Messages body asks for (count_tokens' bodies have no sampling fields);
    `reasoning`: the server has a reasoning parser (reasoning_switch)."""
    error = extra_fields_error(body)
    if error is not None:
        raise error
    output_effort_refused(body)
    thinking = reasoning_switch(body, reasoning)
    messages = chat_messages(body)
    tools, tool_choice, parallel = chat_tools(body)
    metadata = getattr(body, "metadata", None)
    user = metadata.user_id if metadata is not None and metadata.user_id is not None else body.user_profile_id
    return ChatCompletionRequest.model_construct(
        model=body.model, messages=messages, max_tokens=getattr(body, "max_tokens", None),
        temperature=getattr(body, "temperature", None), top_p=getattr(body, "top_p", None),
        top_k=getattr(body, "top_k", None), stop=getattr(body, "stop_sequences", None) or None, tools=tools,
        tool_choice=tool_choice, parallel_tool_calls=parallel, stream=bool(getattr(body, "stream", False)),
        response_format=response_format(body), priority=0, user=user, include_reasoning=True, **thinking)


# ---- the endpoints ---------------------------------------------------------------------------------------
async def create_message(serving, body: MessagesRequest, http: Request):
    """POST /v1/messages: the chat path (chat_inputs, _generate) with Anthropic's answer."""
    arrival = time.monotonic()
    serving.check_model(body.model)
    chat = to_chat_request(body, serving.reasoning_parser is not None)
    tools, ids, params, reasoning = await serving.chat_inputs(chat)
    fmt = MessagesFormat(serving, body, tools, len(ids), reasoning)
    response = anthropic_errors(await serving._generate(fmt, chat, http, ids, params, arrival))
    if "x-request-id" in response.headers:  # Anthropic's clients read it as `request-id` (the SDK's _request_id)
        response.headers["request-id"] = response.headers["x-request-id"]
    return response


async def count_tokens(serving, body: CountTokensRequest) -> dict:
    """POST /v1/messages/count_tokens: the prompt /v1/messages would compute, rendered by the same
    code (system, messages and tools through the chat template), counted."""
    serving.check_model(body.model)
    chat = to_chat_request(body, serving.reasoning_parser is not None)
    tools = ToolMode.from_body(chat, serving.tool_parser)
    serving.check_text_length(sum(len(m.content or "") for m in chat.messages), serving.llm.max_model_len,
                              "messages", "messages")
    kwargs = template_kwargs(serving.settings.default_chat_template_kwargs, chat.chat_template_kwargs)
    return {"input_tokens": len(await serving.encode_chat(chat.messages, tools, kwargs))}


def anthropic_errors(response):
    """The chat path answers a failed request (500, 503, a client gone) in OpenAI's shape: re-shape it."""
    if not isinstance(response, JSONResponse) or response.status_code < 400:
        return response
    message = json.loads(response.body).get("error", {}).get("message", "request failed")
    headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
    return JSONResponse(anthropic_error_body(message, response.status_code), status_code=response.status_code,
                        headers=headers)


# ---- response: outputs -> message / events -----------------------------------------------------------------
def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _input(arguments: str) -> dict | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class MessagesFormat:
    """Anthropic's answer to one request: the message object, or its stream of events. `serving` is
    the OpenAIServing that runs it (its stream helpers)."""

    chat = True

    def __init__(self, serving, body: MessagesRequest, tools: ToolMode, num_prompt_tokens: int,
                 thinking: RequestReasoning | None = None) -> None:
        self.serving, self.body = serving, body
        self.thinking = thinking or RequestReasoning()  # the chat path's reasoning parser, if the server has one
        self.tools = tools if tools.active else None
        self.num_prompt_tokens = num_prompt_tokens
        self.model = serving.settings.served_model_name  # _generate names a LoRA adapter here

    def new_id(self) -> str:
        return f"msg_{uuid.uuid4().hex}"

    def stop(self, last: RequestOutput, made_calls: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) from the chat path's finish_reason and stop_reason."""
        if last.finish_reason == "length":
            return "max_tokens", None
        if made_calls:
            return "tool_use", None
        if isinstance(last.stop_reason, str) and last.stop_reason in (self.body.stop_sequences or ()):
            return "stop_sequence", last.stop_reason
        return "end_turn", None

    def usage(self, last: RequestOutput) -> dict:
        return {"input_tokens": last.num_prompt_tokens, "output_tokens": last.num_output_tokens}

    def reasoning(self, last: RequestOutput) -> tuple[str | None, str]:
        """(thinking, answer text) of a finished output, split by the server's reasoning parser (all
        of it the answer without one); the thinking becomes a leading thinking block."""
        if self.thinking.parser is None:
            return None, last.output_text
        thinking, text = self.thinking.parser.split(last.output_text)
        return thinking, text or ""

    def response(self, request_id: str, lasts: list[RequestOutput], choices: list, want_lp: bool) -> dict:
        last = lasts[0]
        thinking, text = self.reasoning(last)
        calls = []
        if self.tools is not None:
            text, calls = parse_tool_calls(text, self.tools)
        content = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []
        content += [{"type": "text", "text": text}] if text else []
        for c in calls:
            args = _input(c["function"]["arguments"])
            if args is None:  # a forced call cut off by max_tokens: its text, as the model wrote it
                content.append({"type": "text", "text": c["function"]["arguments"]})
            else:
                content.append({"type": "tool_use", "id": new_tool_use_id(), "name": c["function"]["name"],
                                "input": args})
        reason, sequence = self.stop(last, any(b["type"] == "tool_use" for b in content))
        return {"id": request_id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": self.usage(last),
                "iterserve": last.times.summary()}

    # ---- the event stream --------------------------------------------------------------------------------
    def chat_deltas(self, parser: ToolCallStream | None, out: RequestOutput, thinking=None) -> list[dict]:
        """The chat path's deltas for one output: `reasoning_content` (split off by `thinking`, the
        reasoning parser's stream, where the server has one), then `content` / `tool_calls` of the answer."""
        text, deltas = out.text_delta, []
        if thinking is not None:
            reasoning, text = thinking.feed(text)
            if out.finished:
                more_reasoning, more_text = thinking.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning:
                deltas.append({"reasoning_content": reasoning})
        if parser is None:
            return deltas + [{"content": text}]
        deltas += parser.feed(text)
        if out.finished:
            deltas += parser.finish()[0]
        return deltas

    def stream(self, request_id: str, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[str]:
        return self._events(request_id, streams[0])

    async def _events(self, request_id: str, stream: RequestStream) -> AsyncIterator[str]:
        def event(kind: str, **data) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"

        index = -1  # the open block's index
        kind: str | None = None  # the open block's type
        calls: dict[int, int] = {}  # tool call index -> its block index
        made = False

        def close() -> list[str]:
            nonlocal kind
            if kind is None:
                return []
            kind = None
            return [event("content_block_stop", index=index)]

        def open_block(block: dict) -> list[str]:
            nonlocal index, kind
            out = close()
            index, kind = index + 1, block["type"]
            return out + [event("content_block_start", index=index, content_block=block)]

        def feed(delta: dict) -> list[str]:
            nonlocal made
            out: list[str] = []
            if delta.get("reasoning_content"):  # the chat path's reasoning, once it has a parser
                if kind != "thinking":
                    out += open_block({"type": "thinking", "thinking": "", "signature": ""})
                out.append(event("content_block_delta", index=index,
                                 delta={"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                if kind != "text":
                    out += open_block({"type": "text", "text": ""})
                out.append(event("content_block_delta", index=index,
                                 delta={"type": "text_delta", "text": delta["content"]}))
            for tc in delta.get("tool_calls", ()):
                fn = tc.get("function", {})
                if tc["index"] not in calls:
                    made = True
                    out += open_block({"type": "tool_use", "id": new_tool_use_id(), "name": fn["name"],
                                       "input": {}})
                    calls[tc["index"]] = index
                if fn.get("arguments"):
                    out.append(event("content_block_delta", index=calls[tc["index"]],
                                     delta={"type": "input_json_delta", "partial_json": fn["arguments"]}))
            return out

        parser = ToolCallStream(self.tools) if self.tools is not None else None
        thinking = self.thinking.parser.stream() if self.thinking.parser is not None else None
        try:
            yield event("message_start", message={
                "id": request_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": self.num_prompt_tokens, "output_tokens": 0}})
            yield event("ping")
            async for _, out in self.serving._merged([stream]):
                if out.error:
                    status = 503 if out.finish_reason == "shutdown" else 500
                    yield event("error", error=anthropic_error_body(out.error, status)["error"])
                    return
                for d in self.chat_deltas(parser, out, thinking):
                    for e in feed(d):
                        yield e
                if not out.finished:
                    continue
                for e in close():
                    yield e
                reason, sequence = self.stop(out, made)
                yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                            usage={"output_tokens": out.num_output_tokens}, iterserve=out.times.summary())
                yield event("message_stop")
        finally:
            self.serving._abort_unfinished([stream])

