"""OpenAI completions, chat completions, responses and embeddings over the AsyncEngine.

A body becomes token ids (tokenised off the event loop) and SamplingParams; the engine admits the
request or says why not before any byte of the response is sent; then the outputs become either
SSE chunks or one JSON response. Parallel sampling (`n` > 1) is n engine requests over the same
prompt: the first computes the prompt, the others wait for its blocks in the prefix cache and share
them (each computes only the prompt's last, partial block); with a seed, choice i uses seed + i, as
vLLM does. Usage counts the prompt once and sums the completions, as OpenAI does. A client that goes away (stream cancelled, or a disconnect seen
while a non-streaming request waits) aborts its request, which frees its KV blocks at the next
step boundary.

The Responses API (responses.py) is a chat request with another answer shape; embeddings are
engine requests that pool their prompt instead of generating (pooling.py), one per input, admitted
all or none as parallel samples are.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from iterserve.lora.adapter import LoRAError
from iterserve.lora.manager import LoRAInUse
from iterserve.pooling import PoolingParams
from iterserve.request import RequestOutput, RequestRejected, RequestTimes
from iterserve.sampling import SamplingParams
from iterserve.server.async_engine import AsyncEngine, RequestStream
from iterserve.server.protocol import (RESPONSES_UNSUPPORTED_FIELDS, APIError, ChatCompletionRequest, ChatMessage,
                                       CompletionRequest, EmbeddingRequest, GenerationRequest, ResponsesRequest,
                                       error_body, unsupported_field)
from iterserve.server.responses import (DEFAULT_STORE_BYTES, DEFAULT_STORE_TTL_S, ResponsesFormat, ResponseStore,
                                        to_chat_request)
from iterserve.server.reasoning import get_parser
from iterserve.server.reasoning.request import RequestReasoning, request_reasoning, template_kwargs
from iterserve.server.tool_calls import ToolCallStream, ToolMode, parse_tool_calls, prompt_messages, template_has_tools
from iterserve.server.tool_parsers import resolve_parser
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
    # the Responses API's store of finished responses (responses.py): bytes kept, and their lifetime
    responses_store_bytes: int = DEFAULT_STORE_BYTES
    responses_store_ttl_s: float = DEFAULT_STORE_TTL_S
    # vLLM's --tool-call-parser: which format tool_choice "auto" reads (tool_parsers/); None: the one
    # the chat template writes, else hermes
    tool_call_parser: str | None = None
    # reasoning models (server/reasoning/): the parser's --reasoning-parser name, the template variables
    # every chat request starts from, and the default thinking budget (-1: unlimited)
    reasoning_parser: str | None = None
    default_chat_template_kwargs: dict | None = None
    reasoning_budget: int = -1


def max_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: text longer than n times this cannot fit in n
    tokens, so it can be refused without tokenising it (a 100 MB prompt would otherwise cost
    gigabytes before its 400). Byte-level BPE vocab strings have one character per byte, so their
    length bounds the decoded text's length."""
    return max(1, max(len(t) for t in tokenizer.get_vocab()))


def timings(t: RequestTimes) -> dict:
    """The `iterserve` key: server-side seconds a client cannot see for itself."""
    return t.summary()


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
        self.responses_store = ResponseStore(settings.responses_store_bytes, settings.responses_store_ttl_s)
        self.tool_parser, self.tool_parser_special = resolve_parser(settings.tool_call_parser, tok)
        self.reasoning_parser = get_parser(settings.reasoning_parser) if settings.reasoning_parser else None

    def check_text_length(self, num_chars: int, max_tokens: int, what: str, param: str) -> None:
        """Refuses text that cannot fit in max_tokens tokens, before any tokenisation."""
        if num_chars > max_tokens * self.max_token_chars:
            raise APIError(f"{what} has {num_chars} characters: more than {max_tokens} tokens can hold "
                           f"(at most {self.max_token_chars} characters per token)", param=param)

    # ---- validation ---------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.served_model_name and self.lora_name(name) is None:
            raise APIError(f"model {name!r} does not exist; this server serves "
                           f"{self.settings.served_model_name!r}" + self._adapters_phrase(), 404, param="model",
                           code="model_not_found")

    # ---- LoRA adapters (lora/): a request names its adapter in `model`, as in vLLM ------------------
    @property
    def lora(self):
        """The engine's LoRAManager, or None (LoRA off, or the Ray ingress, whose replicas hold it)."""
        return getattr(self.llm, "lora", None)

    def lora_name(self, model: str | None) -> str | None:
        """The adapter a request's `model` names, or None for the base model."""
        lora = self.lora
        if model is None or model == self.settings.served_model_name or lora is None:
            return None
        return model if model in lora else None

    def _adapters_phrase(self) -> str:
        names = self.lora.names() if self.lora is not None else []
        return f" and the LoRA adapters {', '.join(repr(n) for n in names)}" if names else ""

    def _lora_enabled(self):
        if self.lora is None or not hasattr(self.engine, "run_in_engine_thread"):
            raise APIError("LoRA adapters are not enabled on this server (start it with --enable-lora; "
                           "not available with --replicas)", 400, code="lora_not_enabled")
        return self.lora

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Reads and checks the adapter off the engine thread, then registers it on it: a bad adapter
        is a 400 and changes nothing."""
        lora = self._lora_enabled()
        if name == self.settings.served_model_name:
            raise APIError(f"{name!r} is the base model's name", param="lora_name")
        if name in lora:
            raise APIError(f"a LoRA adapter named {name!r} is already loaded: unload it first", param="lora_name")
        try:
            adapter = await asyncio.to_thread(lora.load, name, path)
            await self.engine.run_in_engine_thread(lambda: self.llm.add_lora(adapter))
        except LoRAError as e:
            raise APIError(f"LoRA adapter {name!r} cannot be loaded: {e}", param="lora_path",
                           code="invalid_lora_adapter") from None

    async def unload_lora_adapter(self, name: str) -> None:
        """Refused with 409 while a request (waiting or running) runs under the adapter."""
        lora = self._lora_enabled()
        if name not in lora:
            raise APIError(f"no LoRA adapter named {name!r} is loaded", 404, param="lora_name",
                           code="lora_not_found")
        try:
            await self.engine.run_in_engine_thread(lambda: self.llm.remove_lora(name))
        except LoRAInUse as e:
            raise APIError(str(e), 409, param="lora_name", code="lora_in_use") from None
        except LoRAError as e:
            raise APIError(str(e), 404, param="lora_name", code="lora_not_found") from None

    @staticmethod
    def check_supported(body: GenerationRequest) -> None:
        error = unsupported_field(body)
        if error is not None:
            raise error

    def sampling_params(self, body: GenerationRequest, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None,
                        prompt_logprobs: int | None = None, thinking=None) -> SamplingParams:
        given = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                                "stop_token_ids", "presence_penalty", "frequency_penalty",
                                                "repetition_penalty") if getattr(body, k) is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, ignore_eos=bool(body.ignore_eos),
                                  structured_outputs=structured, logit_bias=self.logit_bias(body),
                                  prompt_logprobs=prompt_logprobs, prediction_token_ids=self.prediction(body),
                                  lora_name=self.lora_name(body.model), thinking=thinking,
                                  **given)
        except ValueError as e:
            raise APIError(str(e), param="logit_bias" if "logit_bias" in str(e) else None) from None

    def prediction(self, body: GenerationRequest) -> list[int] | None:
        """OpenAI's `prediction`, as tokens: speculative decoding drafts from it (spec_decode/controller.py)."""
        if body.prediction is None or not body.prediction.text:
            return None
        return self.llm.tokenizer.encode(body.prediction.text, add_special_tokens=False)

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
        echo_lp = body.logprobs if body.echo else None  # echo + logprobs: the prompt's logprobs too
        params = self.sampling_params(body, max_tokens, body.logprobs, structured,
                                      prompt_logprobs=_max_k(echo_lp, body.prompt_logprobs))
        await self.compile_grammar(structured, param)
        fmt = _Format(False, self, prompt_ids=ids, echo=bool(body.echo), echo_text=text, echo_logprobs=echo_lp,
                      prompt_logprobs=body.prompt_logprobs)
        return await self._generate(fmt, body, http, ids, params, arrival)

    async def chat(self, body: ChatCompletionRequest, http: Request):
        arrival = time.monotonic()
        tools, ids, params, reasoning = await self.chat_inputs(body)
        fmt = _Format(True, self, tools if tools.active else None, prompt_ids=ids,
                      prompt_logprobs=body.prompt_logprobs, reasoning=reasoning)
        return await self._generate(fmt, body, http, ids, params, arrival)

    async def chat_inputs(self, body: ChatCompletionRequest) -> tuple[ToolMode, list[int], SamplingParams,
                                                                      RequestReasoning]:
        """A chat body's checks, tools, prompt ids, sampling parameters and reasoning settings (the
        Responses API's too)."""
        self.check_model(body.model)
        self.check_supported(body)
        if not body.messages:
            raise APIError("messages must not be empty", param="messages")
        self.check_text_length(message_chars(body.messages), self.llm.max_input_len, "messages", "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
        tools = ToolMode.from_body(body, self.tool_parser)
        structured, param = structured_outputs_from(body)
        forced = tools.structured_outputs()
        if forced is not None:
            if structured is not None:
                raise APIError(f'tool_choice "required" or a named function forces the output; drop {param}',
                               param=param)
            structured, param = forced, "tools"
        kwargs = template_kwargs(self.settings.default_chat_template_kwargs, body.chat_template_kwargs)
        ids = await self.encode_chat(body.messages, tools, kwargs)
        reasoning = request_reasoning(self.reasoning_parser, self.llm.tokenizer, ids, body.thinking_token_budget,
                                      self.settings.reasoning_budget, structured is not None, body.include_reasoning)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(
            1, min(self.llm.max_output_len, self.llm.max_model_len - len(ids)))
        params = self.sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                                      structured, prompt_logprobs=body.prompt_logprobs, thinking=reasoning.spec)
        if tools.choice == "auto" and self.tool_parser_special:  # the parser reads special tokens
            params.skip_special_tokens = False
        await self.compile_grammar(structured, param)
        return tools, ids, params, reasoning

    async def responses(self, body: ResponsesRequest, http: Request):
        """POST /v1/responses: the chat path (chat_inputs, _generate) with the Responses API's answer."""
        arrival = time.monotonic()
        self.check_model(body.model)
        error = unsupported_field(body, RESPONSES_UNSUPPORTED_FIELDS)
        if error is not None:
            raise error
        history: list[dict] = []
        if body.previous_response_id is not None:
            stored = self.responses_store.get(body.previous_response_id)
            if stored is None:
                raise APIError(f"previous response {body.previous_response_id!r} not found (never stored, "
                               "deleted, or dropped from the bounded store)", 404, param="previous_response_id",
                               code="not_found")
            history = stored.conversation
        chat, conversation = to_chat_request(body, history)
        tools, ids, params, reasoning = await self.chat_inputs(chat)
        return await self._generate(ResponsesFormat(self, body, chat, tools, conversation, reasoning), chat, http,
                                    ids, params, arrival)

    def get_response(self, response_id: str) -> dict:
        stored = self.responses_store.get(response_id)
        if stored is None:
            raise APIError(f"response {response_id!r} not found", 404, param="response_id", code="not_found")
        return stored.response

    def delete_response(self, response_id: str) -> dict:
        if not self.responses_store.delete(response_id):
            raise APIError(f"response {response_id!r} not found", 404, param="response_id", code="not_found")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def embeddings(self, body: EmbeddingRequest, http: Request):
        """POST /v1/embeddings: one pooling request per input, admitted together (or none)."""
        arrival = time.monotonic()
        self.check_model(body.model)
        pooling = getattr(self.llm, "pooling", None)  # the engine's (the Ray ingress's replicas check their own)
        if pooling is not None:
            if pooling.method is None:
                raise APIError(f"this server cannot compute embeddings for its model: {pooling.error}")
            why = pooling.check_dimensions(body.dimensions, self.llm.model_config.hidden_size)
            if why is not None:
                raise APIError(why, param="dimensions")
        prompts = await self._embedding_prompts(body.input)
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=PoolingParams(dimensions=body.dimensions),
                                lora_name=self.lora_name(body.model))
        vocab = self.llm.model_config.vocab_size
        for i, ids in enumerate(prompts):
            where = "input" if len(prompts) == 1 else f"input[{i}]"
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(f"{where}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param="input")
            try:
                self.llm.check_limits(len(ids), params)
            except RequestRejected as e:
                raise APIError(f"{where}: {e}", param="input") from None
        request_id = f"embd-{uuid.uuid4().hex}"
        streams = await self._add_requests([(f"{request_id}-{i}", ids, params, None) for i, ids in enumerate(prompts)],
                                           body.priority or 0, arrival)
        http.state.admitted = True
        outputs = await self._collect(streams, http)
        if outputs is None:
            return JSONResponse(error_body("client disconnected", 400), status_code=400)
        lasts = [outs[-1] for outs in outputs]
        failed = next((o for o in lasts if o.error or o.embedding is None), None)
        if failed is not None:
            failed.error = failed.error or "the request ended without an embedding"
            return self.failed(failed)
        base64_out = body.encoding_format == "base64"
        data = [{"object": "embedding", "index": i,
                 "embedding": (base64.b64encode(np.asarray(o.embedding, dtype="<f4").tobytes()).decode()
                               if base64_out else o.embedding)} for i, o in enumerate(lasts)]
        n = sum(o.num_prompt_tokens for o in lasts)
        return JSONResponse({"object": "list", "data": data, "model": self.settings.served_model_name,
                             "usage": {"prompt_tokens": n, "total_tokens": n}},
                            headers={"X-Request-Id": request_id})

    async def _embedding_prompts(self, given) -> list[list[int]]:
        """`input` (a string, strings, token ids, lists of token ids) as token id lists."""
        if isinstance(given, str):
            given = [given]
        if not given:
            raise APIError("input must not be empty", param="input")
        if isinstance(given[0], int):
            given = [given]
        prompts = []
        for i, one in enumerate(given):
            where = "input" if len(given) == 1 else f"input[{i}]"
            if not one:
                raise APIError(f"{where} must not be empty", param="input")
            if isinstance(one, str):
                self.check_text_length(len(one), self.llm.max_input_len, where, "input")
                prompts.append(await self.engine.encode(prompt=one))
            else:
                prompts.append(list(one))
        return prompts

    async def encode_chat(self, messages: list[ChatMessage], tools: ToolMode | None = None,
                          chat_template_kwargs: dict | None = None) -> list[int]:
        tools = tools or ToolMode([], "none")
        native = template_has_tools(getattr(self.llm.tokenizer, "chat_template", None))
        try:
            return await self.engine.encode(messages=prompt_messages(messages, tools, native),
                                            tools=tools.template_tools() if native else None,
                                            chat_template_kwargs=chat_template_kwargs)
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
    async def _generate(self, fmt: "_Format | ResponsesFormat", body: GenerationRequest, http: Request,
                        ids: list[int], params: SamplingParams, arrival: float):
        request_id = fmt.new_id()
        if params.lora_name is not None and hasattr(fmt, "model"):  # answers name the adapter, as vLLM's
            fmt.model = params.lora_name
        streams = await self._add_choices(request_id, ids, params, body.n or 1, body.priority or 0, arrival)
        http.state.admitted = True  # from here on an error is a failure, not a rejection (metrics)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(fmt.stream(request_id, streams, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})
        outputs = await self._collect(streams, http)
        if outputs is None:  # the client is gone; nobody reads this
            return JSONResponse(error_body("client disconnected", 400), status_code=400)
        lasts = [outs[-1] for outs in outputs]
        failed = next((o for o in lasts if o.error), None)
        if failed is not None:
            return self.failed(failed)
        choices = [([t for o in outs for t in o.new_token_ids], [lp for o in outs for lp in o.new_logprobs],
                    next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None))
                   for outs in outputs]
        return JSONResponse(fmt.response(request_id, lasts, choices, params.logprobs is not None),
                            headers={"X-Request-Id": request_id})

    async def _add_choices(self, request_id: str, ids: list[int], params: SamplingParams, n: int,
                           priority: int, arrival: float) -> list[RequestStream]:
        """One engine request per choice, all admitted or none; choice i > 0 shares choice 0's prompt."""
        if n == 1:
            return await self._add_requests([(request_id, ids, params, None)], priority, arrival)
        return await self._add_requests(
            [(f"{request_id}-{i}", ids,
              params if params.seed is None else dataclasses.replace(params, seed=(params.seed + i) % 2**64),
              f"{request_id}-0" if i else None) for i in range(n)], priority, arrival)

    async def _add_requests(self, items: list[tuple[str, list[int], SamplingParams, str | None]], priority: int,
                            arrival: float) -> list[RequestStream]:
        """Engine requests (id, prompt ids, params, prefix leader), all admitted or none (a refusal
        aborts those added)."""
        streams: list[RequestStream] = []
        try:
            for rid, ids, params, leader in items:
                streams.append(await self.engine.add_request(rid, ids, params, priority=priority,
                                                             arrival_time=arrival, prefix_leader=leader))
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
            thinking = [fmt.reasoning.parser.stream() if fmt.reasoning.parser is not None else None for _ in streams]
            started = [False] * len(streams)
            async for i, out in self._merged(streams):
                if out.error:
                    status = 503 if out.finish_reason == "shutdown" else 500
                    yield sse(error_body(out.error, status, code=out.finish_reason))
                    break
                if not started[i]:  # the first chunk of a choice: the echoed prompt, the prompt logprobs
                    started[i] = True
                    first, offsets[i] = fmt.first_chunk(request_id, created, out.prompt_logprobs, i)
                    if first is not None:
                        yield sse(first | extra)
                lp, offsets[i] = fmt.logprobs(out.new_token_ids, out.new_logprobs, offsets[i])
                if out.finished:
                    lasts[i] = out
                text = out.text_delta
                if thinking[i] is not None:  # the thinking goes out as reasoning deltas; the rest is the answer
                    reasoning, text = thinking[i].feed(text)
                    if out.finished:
                        more_reasoning, more_text = thinking[i].finish()
                        reasoning, text = reasoning + more_reasoning, text + more_text
                    if reasoning and fmt.reasoning.include:
                        yield sse(fmt.chunk(request_id, created, reasoning_delta(reasoning), None, None, i) | extra)
                if calls[i] is not None:  # text becomes content and tool-call deltas; the last chunk ends it
                    deltas = calls[i].feed(text)
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
                    last_chunk = fmt.chunk(request_id, created, fmt.delta(text), lp, out.finish_reason, i)
                else:
                    if text or lp is not None:
                        yield sse(fmt.chunk(request_id, created, fmt.delta(text), lp, None, i) | extra)
                    continue
                yield sse(last_chunk | extra | {"iterserve": timings(out.times)})
                if include_usage and len(lasts) == len(streams):  # after the last choice's end
                    yield sse(fmt.chunk(request_id, created, None, None, None) | {"usage": usage(list(lasts.values()))})
            yield sse("[DONE]")
        finally:
            self._abort_unfinished(streams)


def reasoning_delta(text: str) -> dict:
    """A chat delta of thinking, under both names vLLM has used (`reasoning_content`, `reasoning`)."""
    return {"reasoning_content": text, "reasoning": text}


def _max_k(*ks: int | None) -> int | None:
    given = [k for k in ks if k is not None]
    return max(given) if given else None


class _Format:
    """What differs between the two endpoints' response shapes.

    echo (completions): the prompt's text before the completion's, and with logprobs the prompt's
    tokens before the completion's, the first with a null logprob (OpenAI's legacy format, what
    lm-evaluation-harness reads). prompt_logprobs (vLLM's): a list per choice, one entry per prompt
    token, null for the first, else {token id: {logprob, rank, decoded_token}} for the prompt token
    and the top k; on chat responses at the top level, as vLLM puts it."""

    def __init__(self, chat: bool, serving: OpenAIServing, tools: ToolMode | None = None,
                 prompt_ids: list[int] | None = None, echo: bool = False, echo_text: str | None = None,
                 echo_logprobs: int | None = None, prompt_logprobs: int | None = None,
                 reasoning: RequestReasoning | None = None) -> None:
        self.chat = chat
        self.reasoning = reasoning or RequestReasoning()  # chat with --reasoning-parser: thinking split off
        self.serving = serving
        self.tools = tools  # chat with tools offered: the text is parsed into tool calls
        self.model = serving.settings.served_model_name
        self.token_text = serving.token_text
        self.id_prefix = "chatcmpl" if chat else "cmpl"
        self.prompt_ids = prompt_ids or []
        self.echo = echo
        self._echo_text = echo_text
        self.echo_logprobs = echo_logprobs
        self.prompt_logprobs = prompt_logprobs

    def new_id(self) -> str:
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    def stream(self, request_id: str, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[str]:
        return self.serving._stream(self, request_id, streams, include_usage)

    @functools.cached_property
    def echo_text(self) -> str:
        """The prompt as echoed: as sent, or decoded when it came as token ids."""
        if self._echo_text is not None:
            return self._echo_text
        return self.serving.llm.tokenizer.decode(self.prompt_ids)

    def vllm_prompt_logprobs(self, prompt_lps: list | None) -> list | None:
        if self.prompt_logprobs is None or prompt_lps is None:
            return None
        out: list = [None]
        for tid, entry in zip(self.prompt_ids[1:], prompt_lps[1:]):
            lp, rank, top = entry
            d = {str(i): {"logprob": max(v, MIN_LOGPROB), "rank": r + 1, "decoded_token": self.token_text(i)}
                 for r, (i, v) in enumerate(top[: self.prompt_logprobs])}
            d[str(tid)] = {"logprob": max(lp, MIN_LOGPROB), "rank": rank, "decoded_token": self.token_text(tid)}
            out.append(d)
        return out

    def echo_logprobs_obj(self, prompt_lps: list | None) -> tuple[dict | None, int]:
        """The prompt's part of a completions logprobs object (echo + logprobs), and its text length."""
        if self.echo_logprobs is None or prompt_lps is None:
            return None, 0
        tokens, lps, tops, offsets, offset = [], [], [], [], 0
        for tid, entry in zip(self.prompt_ids, prompt_lps):
            text = self.token_text(tid)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if entry is None:
                lps.append(None)
                tops.append(None)
                continue
            lp, _, top = entry
            lps.append(max(lp, MIN_LOGPROB))
            tops.append({self.token_text(i): max(v, MIN_LOGPROB) for i, v in top[: self.echo_logprobs]})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def first_chunk(self, request_id: str, created: int, prompt_lps: list | None,
                    index: int) -> tuple[dict | None, int]:
        """A stream's chunk before a choice's first tokens: the echoed prompt (completions) and the
        prompt logprobs; None when there is neither. Also the text offset the next logprobs start at."""
        if not self.echo and self.prompt_logprobs is None:
            return None, 0
        lp, offset = self.echo_logprobs_obj(prompt_lps)
        chunk = self.chunk(request_id, created, self.echo_text if self.echo else ("" if not self.chat else {}),
                           lp, None, index)
        vllm = self.vllm_prompt_logprobs(prompt_lps)
        if vllm is not None:
            if self.chat:
                chunk["prompt_logprobs"] = vllm
            else:
                chunk["choices"][0]["prompt_logprobs"] = vllm
        return chunk, offset

    def delta(self, text: str):
        return {"content": text} if self.chat else text

    def chunk(self, request_id: str, created: int, delta, logprobs, finish_reason, index: int = 0) -> dict:
        """delta None: a usage-only chunk (no choices)."""
        choices = [] if delta is None else [
            {"index": index, **({"delta": delta} if self.chat else {"text": delta}),
             "logprobs": logprobs, "finish_reason": finish_reason}]
        return {"id": request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": created, "model": self.model, "choices": choices}

    def response(self, request_id: str, lasts: list[RequestOutput], choices: list[tuple[list[int], list, list]],
                 want_lp: bool) -> dict:
        """lasts: each choice's final output; choices: each choice's token ids, logprobs and prompt logprobs."""
        out = []
        for i, (last, (ids, lps, prompt_lps)) in enumerate(zip(lasts, choices)):
            echo_lp, offset = self.echo_logprobs_obj(prompt_lps) if self.echo else (None, 0)
            lp = self.logprobs(ids, lps, offset)[0] if want_lp else None
            if echo_lp is not None:
                lp = echo_lp if lp is None else {k: echo_lp[k] + lp[k] for k in echo_lp}
            choice = ({"message": {"role": "assistant", "content": last.output_text}} if self.chat
                      else {"text": (self.echo_text if self.echo else "") + last.output_text})
            reason = last.finish_reason
            text, thought = last.output_text, {}
            if self.reasoning.parser is not None:  # the thinking split off, under both of vLLM's names
                reasoning, text = self.reasoning.parser.split(text)
                reasoning = reasoning if self.reasoning.include else None
                thought = {"reasoning_content": reasoning, "reasoning": reasoning}
                choice = {"message": {"role": "assistant", "content": text, **thought}}
            if self.tools is not None:
                content, calls = parse_tool_calls(text or "", self.tools)
                choice = {"message": {"role": "assistant", "content": content, **thought,
                                      **({"tool_calls": calls} if calls else {})}}
                if calls and reason == "stop":
                    reason = "tool_calls"
            out.append({"index": i, **choice, "logprobs": lp, "finish_reason": reason})
            if self.prompt_logprobs is not None and not self.chat:
                out[-1]["prompt_logprobs"] = self.vllm_prompt_logprobs(prompt_lps)
        body = {"id": request_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": out,
                "usage": usage(lasts), "iterserve": timings(lasts[0].times)}
        if self.prompt_logprobs is not None and self.chat:
            body["prompt_logprobs"] = self.vllm_prompt_logprobs(choices[0][2])
        return body

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
