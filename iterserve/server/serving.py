"""OpenAI completions and chat completions over the AsyncEngine.

A body becomes token ids (tokenised off the event loop) and SamplingParams; the engine admits the
request or says why not before any byte of the response is sent; then the outputs become either
SSE chunks or one JSON response. Parallel sampling (`n` > 1) is n engine requests over the same
prompt: the first computes the prompt, the others wait for its blocks in the prefix cache and share
them (each computes only the prompt's last, partial block); with a seed, choice i uses seed + i, as
vLLM does. Usage counts the prompt once and sums the completions, as OpenAI does. A client that goes away (stream cancelled, or a disconnect seen
while a non-streaming request waits) aborts its request, which frees its KV blocks at the next
step boundary.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from iterserve.request import RequestOutput, RequestTimes
from iterserve.sampling import SamplingParams
from iterserve.server.async_engine import AsyncEngine, RequestStream
from iterserve.server.protocol import (APIError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                       GenerationRequest, error_body, unsupported_field)
from iterserve.server.tool_calls import ToolCallStream, ToolMode, parse_tool_calls, prompt_messages, template_has_tools
from iterserve.structured.params import StructuredOutputError, StructuredOutputsParams

MIN_LOGPROB = -9999.0  # JSON has no -inf
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ServerSettings:
    """Every switch of the HTTP layer (the engine's are in EngineConfig)."""

    served_model_name: str
    api_key: str | None = None
    retry_after_s: int = 1
    max_request_bytes: int = 4 * 2**20  # larger bodies get 413 before they are read in full
    metrics_without_key: bool = False  # with api_key: let scrapers read /metrics without it
    allowed_hosts: list[str] | None = None  # Host header names accepted; None or "*" = any
    vllm_metrics: bool = True  # also export vllm:* names so vLLM's dashboards and routers read us


def max_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: text longer than n times this cannot fit in n
    tokens, so it can be refused without tokenising it (a 100 MB prompt would otherwise cost
    gigabytes before its 400). Byte-level BPE vocab strings have one character per byte, so their
    length bounds the decoded text's length."""
    return max(1, max(len(t) for t in tokenizer.get_vocab()))


def timings(t: RequestTimes) -> dict:
    """The `iterserve` key: server-side seconds a client cannot see for itself."""
    return {"queue_time": t.queue_time, "ttft": t.ttft, "e2e": t.e2e}


def usage(outs: list[RequestOutput]) -> dict:
    """One request's usage over its choices: the prompt once, the completions summed (OpenAI's)."""
    prompt, completion = outs[0].num_prompt_tokens, sum(o.num_output_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def structured_outputs_from(body: GenerationRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """The one output constraint a body asks for, from OpenAI's response_format or vLLM's
    structured_outputs / guided_* names, and the parameter it came from (for errors)."""
    found: list[tuple[str, dict]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError("response_format json_schema needs json_schema.schema", param="response_format")
        found.append(("response_format", {"json": rf.json_schema.schema_}))
    so = body.structured_outputs
    if so is not None:
        given = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                 "json_object": so.json_object or None}
        found.append(("structured_outputs", {k: v for k, v in given.items() if v is not None}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(body, name) is not None:
            found.append((name, {key: getattr(body, name)}))
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError("give one output constraint, not several: " + ", ".join(n for n, _ in found),
                       param=found[1][0])
    param, kw = found[0]
    try:
        return StructuredOutputsParams(**kw), param
    except StructuredOutputError as e:
        raise APIError(f"{param}: {e}", param=param) from None


def message_chars(messages: list[ChatMessage]) -> int:
    return sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content or ())
               for m in messages)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


async def wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.llm = engine.engine
        tok = self.llm.tokenizer
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda i: tok.decode([i]))
        self.max_token_chars = max_token_chars(tok)

    def check_text_length(self, num_chars: int, max_tokens: int, what: str, param: str) -> None:
        """Refuses text that cannot fit in max_tokens tokens, before any tokenisation."""
        if num_chars > max_tokens * self.max_token_chars:
            raise APIError(f"{what} has {num_chars} characters: more than {max_tokens} tokens can hold "
                           f"(at most {self.max_token_chars} characters per token)", param=param)

    # ---- validation ---------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.served_model_name:
            raise APIError(f"model {name!r} does not exist; this server serves "
                           f"{self.settings.served_model_name!r}", 404, param="model", code="model_not_found")

    @staticmethod
    def check_supported(body: GenerationRequest) -> None:
        error = unsupported_field(body)
        if error is not None:
            raise error

    def sampling_params(self, body: GenerationRequest, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        given = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                                "stop_token_ids", "presence_penalty", "frequency_penalty",
                                                "repetition_penalty") if getattr(body, k) is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, ignore_eos=bool(body.ignore_eos),
                                  structured_outputs=structured, logit_bias=self.logit_bias(body), **given)
        except ValueError as e:
            raise APIError(str(e), param="logit_bias" if "logit_bias" in str(e) else None) from None

    def logit_bias(self, body: GenerationRequest) -> dict[int, float] | None:
        if not body.logit_bias:
            return None
        vocab = self.llm.model_config.vocab_size
        out = {}
        for key, bias in body.logit_bias.items():
            try:
                tok = int(key)
            except ValueError:
                raise APIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
            if not 0 <= tok < vocab:
                raise APIError(f"logit_bias: token id {tok} is outside the vocabulary (0..{vocab - 1})",
                               param="logit_bias")
            out[tok] = bias
        return out

    async def compile_grammar(self, structured: StructuredOutputsParams | None, param: str | None) -> None:
        """Waits (off the loop and off the engine thread) for the grammar, so that one that cannot
        compile is a 400 before the request is admitted; the engine then finds it in the cache."""
        if structured is None:
            return
        try:
            await asyncio.wrap_future(self.llm.structured.compile(structured))
        except StructuredOutputError as e:
            raise APIError(f"{param}: {e}", param=param) from None

    # ---- endpoints ----------------------------------------------------------------------------------
    async def completion(self, body: CompletionRequest, http: Request):
        arrival = time.monotonic()
        self.check_model(body.model)
        self.check_supported(body)
        text, ids = self._completion_prompt(body.prompt)
        if ids is None:
            self.check_text_length(len(text), self.llm.max_input_len, "prompt", "prompt")
            ids = await self.engine.encode(prompt=text)
        max_tokens = body.max_tokens or min(DEFAULT_COMPLETION_MAX_TOKENS, self.llm.max_output_len)
        structured, param = structured_outputs_from(body)
        params = self.sampling_params(body, max_tokens, body.logprobs, structured)
        await self.compile_grammar(structured, param)
        return await self._generate(_Format(False, self), body, http, ids, params, arrival)

    async def chat(self, body: ChatCompletionRequest, http: Request):
        arrival = time.monotonic()
        self.check_model(body.model)
        self.check_supported(body)
        if not body.messages:
            raise APIError("messages must not be empty", param="messages")
        self.check_text_length(message_chars(body.messages), self.llm.max_input_len, "messages", "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
        tools = ToolMode.from_body(body)
        structured, param = structured_outputs_from(body)
        forced = tools.structured_outputs()
        if forced is not None:
            if structured is not None:
                raise APIError(f'tool_choice "required" or a named function forces the output; drop {param}',
                               param=param)
            structured, param = forced, "tools"
        ids = await self.encode_chat(body.messages, tools)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(
            1, min(self.llm.max_output_len, self.llm.max_model_len - len(ids)))
        params = self.sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                                      structured)
        await self.compile_grammar(structured, param)
        return await self._generate(_Format(True, self, tools if tools.active else None), body, http, ids,
                                    params, arrival)

    async def encode_chat(self, messages: list[ChatMessage], tools: ToolMode | None = None) -> list[int]:
        tools = tools or ToolMode([], "none")
        native = template_has_tools(getattr(self.llm.tokenizer, "chat_template", None))
        try:
            return await self.engine.encode(messages=prompt_messages(messages, tools, native),
                                            tools=tools.template_tools() if native else None)
        except (ValueError, TypeError, KeyError, IndexError) as e:  # template rejected the conversation
            raise APIError(f"cannot apply the chat template: {e}", param="messages") from None
        except Exception as e:
            if type(e).__module__.startswith("jinja2"):
                raise APIError(f"cannot apply the chat template: {e}", param="messages") from None
            raise

    @staticmethod
    def _completion_prompt(prompt) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, str):
            return prompt, None
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return None, list(prompt)
        if len(prompt) != 1:
            raise APIError("send one prompt per request (batched prompts are not supported)", param="prompt")
        one = prompt[0]
        return (one, None) if isinstance(one, str) else (None, list(one))

    # ---- generation -----------------------------------------------------------------------------------
    async def _generate(self, fmt: "_Format", body: GenerationRequest, http: Request, ids: list[int],
                        params: SamplingParams, arrival: float):
        request_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        streams = await self._add_choices(request_id, ids, params, body.n or 1, body.priority or 0, arrival)
        http.state.admitted = True  # from here on an error is a failure, not a rejection (metrics)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream(fmt, request_id, streams, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})
        outputs = await self._collect(streams, http)
        if outputs is None:  # the client is gone; nobody reads this
            return JSONResponse(error_body("client disconnected", 400), status_code=400)
        lasts = [outs[-1] for outs in outputs]
        failed = next((o for o in lasts if o.error), None)
        if failed is not None:
            return self.failed(failed)
        choices = [([t for o in outs for t in o.new_token_ids], [lp for o in outs for lp in o.new_logprobs])
                   for outs in outputs]
        return JSONResponse(fmt.response(request_id, lasts, choices, params.logprobs is not None),
                            headers={"X-Request-Id": request_id})

    async def _add_choices(self, request_id: str, ids: list[int], params: SamplingParams, n: int,
                           priority: int, arrival: float) -> list[RequestStream]:
        """One engine request per choice, all admitted or none (a refusal aborts those added)."""
        if n == 1:
            return [await self.engine.add_request(request_id, ids, params, priority=priority, arrival_time=arrival)]
        streams: list[RequestStream] = []
        try:
            for i in range(n):
                p = params if params.seed is None else dataclasses.replace(params, seed=(params.seed + i) % 2**64)
                streams.append(await self.engine.add_request(
                    f"{request_id}-{i}", ids, p, priority=priority, arrival_time=arrival,
                    prefix_leader=f"{request_id}-0" if i else None))
        except BaseException:
            for st in streams:
                self.engine.abort(st.request_id)
            raise
        return streams

    def failed(self, out: RequestOutput) -> JSONResponse:
        """A request that was accepted but cannot complete: shutdown is 503 (retry elsewhere or later),
        anything else 500; never a 200 with partial text."""
        if out.finish_reason == "shutdown":
            return JSONResponse(error_body(out.error, 503, code="shutdown"), status_code=503,
                                headers={"Retry-After": str(self.settings.retry_after_s)})
        return JSONResponse(error_body(out.error, 500), status_code=500)

    def _abort_unfinished(self, streams: list[RequestStream]) -> None:
        for st in streams:
            if not st.finished:
                self.engine.abort(st.request_id)

    async def _collect(self, streams: list[RequestStream], http: Request) -> list[list[RequestOutput]] | None:
        outputs: list[list[RequestOutput]] = [[] for _ in streams]

        async def consume(i: int) -> None:
            async for out in streams[i]:
                outputs[i].append(out)

        consumer = asyncio.ensure_future(asyncio.gather(*(consume(i) for i in range(len(streams)))))
        watcher = asyncio.ensure_future(wait_disconnect(http))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
                consumer.add_done_callback(_retrieve)  # a cancelled gather's error, or asyncio logs it
                self._abort_unfinished(streams)
        return outputs if consumer.done() and not consumer.cancelled() else None

    @staticmethod
    async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The choices' outputs as they come, tagged with the choice index."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

        async def pump(i: int) -> None:
            async for out in streams[i]:
                await queue.put((i, out))

        pumps = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
        try:
            left = len(streams)
            while left:
                i, out = await queue.get()
                left -= out.finished
                yield i, out
        finally:
            for task in pumps:
                task.cancel()

    async def _stream(self, fmt: "_Format", request_id: str, streams: list[RequestStream],
                      include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        extra = {"usage": None} if include_usage else {}
        lasts: dict[int, RequestOutput] = {}
        try:
            if fmt.chat:
                for i in range(len(streams)):
                    yield sse(fmt.chunk(request_id, created, {"role": "assistant", "content": ""}, None, None, i)
                              | extra)
            offsets = [0] * len(streams)
            calls = [ToolCallStream(fmt.tools) if fmt.tools is not None else None for _ in streams]
            async for i, out in self._merged(streams):
                if out.error:
                    status = 503 if out.finish_reason == "shutdown" else 500
                    yield sse(error_body(out.error, status, code=out.finish_reason))
                    break
                lp, offsets[i] = fmt.logprobs(out.new_token_ids, out.new_logprobs, offsets[i])
                if out.finished:
                    lasts[i] = out
                if calls[i] is not None:  # text becomes content and tool-call deltas; the last chunk ends it
                    deltas = calls[i].feed(out.text_delta)
                    made = False
                    if out.finished:
                        tail, made = calls[i].finish()
                        deltas += tail
                    for d in deltas:
                        yield sse(fmt.chunk(request_id, created, d, None, None, i) | extra)
                    if lp is not None and not out.finished:
                        yield sse(fmt.chunk(request_id, created, {}, lp, None, i) | extra)
                    if not out.finished:
                        continue
                    reason = "tool_calls" if made and out.finish_reason == "stop" else out.finish_reason
                    last_chunk = fmt.chunk(request_id, created, {}, lp, reason, i)
                elif out.finished:
                    last_chunk = fmt.chunk(request_id, created, fmt.delta(out.text_delta), lp, out.finish_reason, i)
                else:
                    if out.text_delta or lp is not None:
                        yield sse(fmt.chunk(request_id, created, fmt.delta(out.text_delta), lp, None, i) | extra)
                    continue
                yield sse(last_chunk | extra | {"iterserve": timings(out.times)})
                if include_usage and len(lasts) == len(streams):  # after the last choice's end
                    yield sse(fmt.chunk(request_id, created, None, None, None) | {"usage": usage(list(lasts.values()))})
            yield sse("[DONE]")
        finally:
            self._abort_unfinished(streams)


class _Format:
    """What differs between the two endpoints' response shapes."""

    def __init__(self, chat: bool, serving: OpenAIServing, tools: ToolMode | None = None) -> None:
        self.chat = chat
        self.tools = tools  # chat with tools offered: the text is parsed into tool calls
        self.model = serving.settings.served_model_name
        self.token_text = serving.token_text
        self.id_prefix = "chatcmpl" if chat else "cmpl"

    def delta(self, text: str):
        return {"content": text} if self.chat else text

    def chunk(self, request_id: str, created: int, delta, logprobs, finish_reason, index: int = 0) -> dict:
        """delta None: a usage-only chunk (no choices)."""
        choices = [] if delta is None else [
            {"index": index, **({"delta": delta} if self.chat else {"text": delta}),
             "logprobs": logprobs, "finish_reason": finish_reason}]
        return {"id": request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": created, "model": self.model, "choices": choices}

    def response(self, request_id: str, lasts: list[RequestOutput], choices: list[tuple[list[int], list]],
                 want_lp: bool) -> dict:
        """lasts: each choice's final output; choices: each choice's token ids and logprobs."""
        out = []
        for i, (last, (ids, lps)) in enumerate(zip(lasts, choices)):
            lp = self.logprobs(ids, lps, 0)[0] if want_lp else None
            choice = ({"message": {"role": "assistant", "content": last.output_text}} if self.chat
                      else {"text": last.output_text})
            reason = last.finish_reason
            if self.tools is not None:
                content, calls = parse_tool_calls(last.output_text, self.tools)
                choice = {"message": {"role": "assistant", "content": content,
                                      **({"tool_calls": calls} if calls else {})}}
                if calls and reason == "stop":
                    reason = "tool_calls"
            out.append({"index": i, **choice, "logprobs": lp, "finish_reason": reason})
        return {"id": request_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": out,
                "usage": usage(lasts), "iterserve": timings(lasts[0].times)}

    def logprobs(self, ids: list[int], lps: list, offset: int) -> tuple[dict | None, int]:
        """OpenAI's logprobs object for these tokens; the completions format needs text offsets."""
        if not lps:
            return None, offset
        entries = []
        for tid, (lp, top) in zip(ids, lps):
            text = self.token_text(tid)
            entries.append((text, max(lp, MIN_LOGPROB), [(self.token_text(i), max(v, MIN_LOGPROB)) for i, v in top]))
        if self.chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                 "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())}
                                                  for s, v in top]} for t, lp, top in entries]}, offset
        offsets = []
        for t, _, _ in entries:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [dict(top) for _, _, top in entries], "text_offset": offsets}, offset
