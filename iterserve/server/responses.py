"""OpenAI's Responses API (`/v1/responses`) as a view of the chat path, and its bounded store.

A Responses body becomes a chat request (`to_chat_request`): `instructions` a system message, the
stored conversation of `previous_response_id` next, then `input` (text, messages, earlier
`function_call` items, `function_call_output` items as tool messages); function `tools`,
`tool_choice` and `text.format` map onto the chat request's own fields. From there the chat path
(server/serving.py) checks, tokenises, admits, aborts on disconnect and counts it in the metrics,
exactly as a chat completion; only the shape of the answer differs (`ResponsesFormat`): a response
object with output items (a message with `output_text`, `function_call` items parsed as the chat
path parses tool calls), or, streamed, OpenAI's event sequence (`response.created`,
`response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta` ... `response.output_text.done`, `response.content_part.done`,
`response.output_item.done`, `response.completed`, or `response.incomplete` when max_output_tokens
cut it, `response.failed` when the engine failed it).

The store (`ResponseStore`) keeps a finished response with `store` (OpenAI's default: true) for
`GET /v1/responses/{id}`, `DELETE` and `previous_response_id`, in this process's memory: bounded in
bytes (`--responses-store-size`, the oldest go first) and in age (`--responses-store-ttl`). Each entry
holds the whole conversation it ended (without its instructions, which OpenAI does not carry over),
so a chain never depends on its older links still being stored.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pydantic import ValidationError

from iterserve.request import RequestOutput
from iterserve.server.async_engine import RequestStream
from iterserve.server.protocol import (APIError, ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDef,
                                       JsonSchemaFormat, NamedFunction, NamedToolChoice, ResponseContentPart,
                                       ResponseFormat, ResponsesRequest, ToolCall, ToolDef)
from iterserve.server.reasoning.request import RequestReasoning
from iterserve.server.tool_calls import ToolCallStream, ToolMode, parse_tool_calls

TEXT_PARTS = ("input_text", "output_text", "text")
DEFAULT_STORE_BYTES = 64 * 2**20
DEFAULT_STORE_TTL_S = 3600.0


# ---- the store ----------------------------------------------------------------------------------------
@dataclass
class StoredResponse:
    response: dict  # the response object, as GET returns it
    conversation: list[dict]  # the chat messages it ended with (input and output, no instructions)
    expires: float
    size: int


class ResponseStore:
    """Finished responses by id, in memory: at most `max_bytes` of them (their JSON size; the oldest
    are dropped first) and none older than `ttl_s`. `max_bytes` 0 stores nothing. Used from the
    event loop only (no lock)."""

    def __init__(self, max_bytes: int = DEFAULT_STORE_BYTES, ttl_s: float = DEFAULT_STORE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 0 or ttl_s <= 0:
            raise ValueError("the responses store needs a size >= 0 and a TTL > 0")
        self.max_bytes, self.ttl_s, self.clock = max_bytes, ttl_s, clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self.bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def put(self, response_id: str, response: dict, conversation: list[dict]) -> bool:
        """Stores a response; False when it alone is larger than the whole store."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        self.delete(response_id)
        if size > self.max_bytes:
            return False
        self._items[response_id] = StoredResponse(response, conversation, self.clock() + self.ttl_s, size)
        self.bytes += size
        self._expire()
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        if response_id not in self._items:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        self.bytes -= self._items.pop(response_id).size

    def _expire(self) -> None:
        now = self.clock()
        while self._items:
            oldest = next(iter(self._items.values()))
            if oldest.expires > now:
                break
            self._drop(next(iter(self._items)))


# ---- request: Responses body -> chat body ----------------------------------------------------------------
def _text(parts: str | list[ResponseContentPart] | None, param: str) -> str | None:
    if parts is None or isinstance(parts, str):
        return parts
    out = []
    for j, part in enumerate(parts):
        if part.type not in TEXT_PARTS:
            raise APIError(f"{param}[{j}]: content of type {part.type!r} is not supported by this server "
                           "(text only)", param=f"{param}[{j}].type", code="unsupported_field")
        if part.text is None:
            raise APIError(f"{param}[{j}]: a {part.type} part needs text", param=f"{param}[{j}].text")
        out.append(part.text)
    return "".join(out)


def input_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """`input` as chat messages: consecutive function_call items become one assistant message with
    tool calls, function_call_output items tool messages."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [ChatMessage(role="user", content=body.input)]
    out: list[ChatMessage] = []
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.type or "message"
        if kind == "message":
            if item.role is None:
                raise APIError(f"{where}: a message needs a role", param=f"{where}.role")
            content = _text(item.content, f"{where}.content")
            out.append(ChatMessage(role=item.role, content=content or ""))
        elif kind == "function_call":
            if not (item.call_id and item.name and item.arguments is not None):
                raise APIError(f"{where}: a function_call needs call_id, name and arguments", param=where)
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if out and out[-1].role == "assistant" and out[-1].tool_calls:
                out[-1].tool_calls.append(call)
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            if not item.call_id or item.output is None:
                raise APIError(f"{where}: a function_call_output needs call_id and output", param=where)
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                   content=_text(item.output, f"{where}.output")))
        elif kind == "reasoning":
            continue  # an earlier turn's thinking, given back with its output: templates leave it out
        else:
            raise APIError(f"{where}: input items of type {kind!r} are not supported by this server (messages, "
                           "function_call, function_call_output and reasoning only)", param=f"{where}.type",
                           code="unsupported_field")
    return out


def chat_tools(body: ResponsesRequest) -> tuple[list[ToolDef] | None, object]:
    """Function tools and tool_choice in the chat request's terms; any other tool type is refused."""
    tools = None
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            if t.type != "function":
                raise APIError(f"tools[{i}]: {t.type} is not supported by this server (function tools only)",
                               param="tools", code="unsupported_field")
            if not t.name:
                raise APIError(f"tools[{i}]: a function tool needs a name", param="tools")
            tools.append(ToolDef(type="function", function=FunctionDef(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)))
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return tools, choice
    if choice.type != "function":
        raise APIError(f"tool_choice of type {choice.type!r} is not supported by this server (none, auto, "
                       "required or a function)", param="tool_choice", code="unsupported_field")
    if not choice.name:
        raise APIError("tool_choice: a function choice needs a name", param="tool_choice")
    return tools, NamedToolChoice(type="function", function=NamedFunction(name=choice.name))


def chat_response_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise APIError("text.format json_schema needs a schema", param="text.format")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))


def to_chat_request(body: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[ChatMessage]]:
    """The chat request this Responses body asks for, and the conversation it continues (history and
    input, without the instructions) that the stored response will carry on."""
    try:
        conversation = [ChatMessage.model_validate(m) for m in history] + input_messages(body)
        tools, tool_choice = chat_tools(body)
        response_format = chat_response_format(body)
    except ValidationError as e:  # a part the chat models refuse (e.g. a field of the wrong kind)
        raise APIError(f"input: {e.errors()[0].get('msg', 'invalid value')}", param="input") from None
    if not conversation:
        raise APIError("input must not be empty", param="input")
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    chat = ChatCompletionRequest.model_construct(
        model=body.model, messages=system + conversation, max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
        repetition_penalty=body.repetition_penalty, tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=body.parallel_tool_calls, response_format=response_format, stream=bool(body.stream),
        priority=body.priority or 0, user=body.user)
    return chat, conversation


# ---- response: outputs -> response object / events ---------------------------------------------------------
def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """OpenAI's reasoning item: the thinking as one reasoning_text part (no summary is written)."""
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [reasoning_text(text)],
            "encrypted_content": None, "status": status}


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def assistant_message(output: list[dict]) -> dict:
    """The chat message that a response's output items stand for (what the next turn sees)."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    return {"role": "assistant", "content": text if text or not calls else None,
            **({"tool_calls": calls} if calls else {})}


class ResponsesFormat:
    """The Responses API's answer to one request: the response object, or its stream of events; a
    finished response with `store` goes into the store. `serving` is the OpenAIServing that runs it
    (its settings, store, and stream helpers)."""

    chat = True
    id_prefix = "resp"

    def __init__(self, serving, body: ResponsesRequest, chat: ChatCompletionRequest,
                 tools: ToolMode, conversation: list[ChatMessage], reasoning: RequestReasoning | None = None) -> None:
        self.serving, self.body, self.chat_body = serving, body, chat
        self.reasoning = reasoning or RequestReasoning()  # with --reasoning-parser: a reasoning item first
        self.tools = tools if tools.active else None
        self.conversation = [m.model_dump(exclude_none=True) for m in conversation]
        self.created = int(time.time())

    def new_id(self) -> str:
        return _item_id("resp")

    # ---- the response object --------------------------------------------------------------------------
    def response_object(self, response_id: str, status: str, output: list[dict], last: RequestOutput | None,
                        error: dict | None = None) -> dict:
        body, chat = self.body, self.chat_body
        tools = [{"type": "function", "name": t.function.name, "description": t.function.description,
                  "parameters": t.function.parameters, "strict": t.function.strict} for t in chat.tools or []]
        choice = chat.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        elif not isinstance(choice, str):
            choice = {"type": "function", "name": choice.function.name}
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        usage = None
        if last is not None:
            usage = {"input_tokens": last.num_prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": last.num_output_tokens,
                     "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(output)},
                     "total_tokens": last.num_prompt_tokens + last.num_output_tokens}
        done = status in ("completed", "incomplete", "failed")
        obj = {
            "id": response_id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.serving.settings.served_model_name, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": None, "store": body.store is not False,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice, "tools": tools, "top_p": body.top_p if body.top_p is not None else 1.0,
            "truncation": "disabled", "usage": usage, "user": body.user, "metadata": body.metadata or {},
            "completed_at": int(time.time()) if done else None,
        }
        if last is not None and done:
            obj["iterserve"] = last.times.summary()
        return obj

    def reasoning_tokens(self, output: list[dict]) -> int:
        """The reasoning items' text tokenised again (the markers around it are not counted)."""
        text = "".join(p["text"] for it in output if it["type"] == "reasoning" for p in it["content"])
        return len(self.serving.llm.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def _finish(self, response_id: str, last: RequestOutput, output: list[dict]) -> dict:
        status = "incomplete" if last.finish_reason == "length" else "completed"
        obj = self.response_object(response_id, status, output, last)
        if self.body.store is not False:
            self.serving.responses_store.put(response_id, obj, self.conversation + [assistant_message(output)])
        return obj

    def response(self, response_id: str, lasts: list[RequestOutput], choices: list, want_lp: bool) -> dict:
        last = lasts[0]
        status = "incomplete" if last.finish_reason == "length" else "completed"
        text, calls, thought = last.output_text, [], None
        if self.reasoning.parser is not None:
            thought, text = self.reasoning.parser.split(text)
            text = text or ""
        if self.tools is not None:
            text, calls = parse_tool_calls(text, self.tools)
        output = []
        if thought and self.reasoning.include:
            output.append(reasoning_item(_item_id("rs"), thought, "completed" if text or calls else status))
        if text or not calls:
            output.append(message_item(_item_id("msg"), text or "", status))
        output += [function_call_item(_item_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"],
                                      "completed") for c in calls]
        return self._finish(response_id, last, output)

    # ---- the event stream --------------------------------------------------------------------------------
    def stream(self, response_id: str, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[str]:
        return self._events(response_id, streams[0])

    async def _events(self, response_id: str, stream: RequestStream) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

        output: list[dict] = []  # the items, in order, as they grow
        message: dict | None = None  # the open message item
        calls: dict[int, dict] = {}  # tool call index -> its open function_call item
        parser = ToolCallStream(self.tools) if self.tools is not None else None
        thinking = self.reasoning.parser.stream() if self.reasoning.parser is not None else None
        reasoning: dict | None = None  # the open reasoning item

        def open_reasoning() -> list[str]:
            nonlocal reasoning
            if reasoning is not None:
                return []
            reasoning = reasoning_item(_item_id("rs"), "", "in_progress")
            output.append(reasoning)
            i = len(output) - 1
            return [event("response.output_item.added", output_index=i, item=_copy(reasoning, content=[])),
                    event("response.content_part.added", item_id=reasoning["id"], output_index=i, content_index=0,
                          part=reasoning_text(""))]

        def close_reasoning(status: str) -> list[str]:
            if reasoning is None or reasoning["status"] != "in_progress":
                return []
            i, text = output.index(reasoning), reasoning["content"][0]["text"]
            reasoning["status"] = status
            return [event("response.reasoning_text.done", item_id=reasoning["id"], output_index=i, content_index=0,
                          text=text),
                    event("response.content_part.done", item_id=reasoning["id"], output_index=i, content_index=0,
                          part=reasoning_text(text)),
                    event("response.output_item.done", output_index=i, item=reasoning)]

        def open_message() -> list[str]:
            nonlocal message
            if message is not None:
                return []
            message = message_item(_item_id("msg"), "", "in_progress")
            message["content"] = []
            output.append(message)
            i = len(output) - 1
            part = output_text("")
            message["content"].append(part)
            return [event("response.output_item.added", output_index=i, item=_copy(message, content=[])),
                    event("response.content_part.added", item_id=message["id"], output_index=i, content_index=0,
                          part=output_text(""))]

        def close_message(status: str) -> list[str]:
            if message is None or message["status"] != "in_progress":
                return []
            i, text = output.index(message), message["content"][0]["text"]
            message["status"] = status
            return [event("response.output_text.done", item_id=message["id"], output_index=i, content_index=0,
                          text=text, logprobs=[]),
                    event("response.content_part.done", item_id=message["id"], output_index=i, content_index=0,
                          part=output_text(text)),
                    event("response.output_item.done", output_index=i, item=message)]

        def close_calls() -> list[str]:
            out = []
            for item in calls.values():
                if item["status"] != "in_progress":
                    continue
                item["status"] = "completed"
                i = output.index(item)
                out += [event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                              name=item["name"], arguments=item["arguments"]),
                        event("response.output_item.done", output_index=i, item=item)]
            return out

        def feed(delta: dict) -> list[str]:
            out: list[str] = []
            if delta.get("reasoning"):
                out += open_reasoning()
                reasoning["content"][0]["text"] += delta["reasoning"]
                out.append(event("response.reasoning_text.delta", item_id=reasoning["id"],
                                 output_index=output.index(reasoning), content_index=0, delta=delta["reasoning"]))
            if delta.get("content") or delta.get("tool_calls"):
                out += close_reasoning("completed")  # the answer begins: the thinking is whole
            if delta.get("content"):
                out += open_message()
                message["content"][0]["text"] += delta["content"]
                out.append(event("response.output_text.delta", item_id=message["id"],
                                 output_index=output.index(message), content_index=0, delta=delta["content"],
                                 logprobs=[]))
            for tc in delta.get("tool_calls", ()):
                fn = tc.get("function", {})
                if tc["index"] not in calls:  # a new item: the one before it is whole
                    out += close_message("completed") + close_calls()
                    item = function_call_item(_item_id("fc"), tc["id"], fn["name"], "", "in_progress")
                    calls[tc["index"]] = item
                    output.append(item)
                    out.append(event("response.output_item.added", output_index=len(output) - 1, item=dict(item)))
                item = calls[tc["index"]]
                if fn.get("arguments"):
                    item["arguments"] += fn["arguments"]
                    out.append(event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=output.index(item), delta=fn["arguments"]))
            return out

        try:
            yield event("response.created", response=self.response_object(response_id, "in_progress", [], None))
            yield event("response.in_progress", response=self.response_object(response_id, "in_progress", [], None))
            if parser is None and thinking is None:
                for e in open_message():
                    yield e
            async for _, out in self.serving._merged([stream]):
                if out.error:
                    error = {"code": "server_error", "message": out.error}
                    yield event("response.failed", response=self.response_object(
                        response_id, "failed", output, out, error=error))
                    return
                text, pre = out.text_delta, []
                if thinking is not None:  # the thinking as reasoning deltas, the rest as the answer
                    thought, text = thinking.feed(text)
                    if out.finished:
                        more_thought, more_text = thinking.finish()
                        thought, text = thought + more_thought, text + more_text
                    if thought and self.reasoning.include:
                        pre = [{"reasoning": thought}]
                deltas = pre + (parser.feed(text) if parser is not None else [{"content": text}])
                if out.finished and parser is not None:
                    deltas += parser.finish()[0]
                for d in deltas:
                    for e in feed(d):
                        yield e
                if not out.finished:
                    continue
                status = "incomplete" if out.finish_reason == "length" else "completed"
                if not any(it["type"] != "reasoning" for it in output):
                    for e in close_reasoning(status) + open_message():
                        yield e
                for e in close_reasoning(status) + close_message(status) + close_calls():
                    yield e
                final = self._finish(response_id, out, output)
                yield event("response.incomplete" if status == "incomplete" else "response.completed", response=final)
        finally:
            self.serving._abort_unfinished([stream])


def _copy(item: dict, **changes) -> dict:
    return {**item, **changes}
