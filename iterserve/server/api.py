"""The FastAPI app: routes, OpenAI-style errors, the guards (middleware.py), lifespan of the engine thread.

`build_app(async_engine, settings)` wires an AsyncEngine (not yet started) into an app; the
lifespan starts its thread and stops it after the server has drained. `build_api` is the API
itself, shared with the Ray Serve ingress (serve_ray/ingress.py), which adds its own health,
metrics and scheduler routes over its replicas. Every error, including
FastAPI's own validation errors (422 by default) and unknown routes, is answered in OpenAI's
JSON error format with the status OpenAI would use, except on Anthropic's Messages API routes
(/v1/messages...: anthropic_messages.py), which answer in Anthropic's. Nothing in an answer names a
file path, and with --api-key nothing but /health and the dashboard's page (no data: it asks for the
key) answers without the key.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import asdict

import anyio
from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from iterserve.engine import StepRecord
from iterserve.request import RequestOutput, RequestRejected
from iterserve.server.anthropic_messages import count_tokens, create_message
from iterserve.server.anthropic_protocol import CountTokensRequest, MessagesRequest, anthropic_error_body
from iterserve.server.async_engine import AsyncEngine, SpecTotals
from iterserve.server.dashboard import PAGE_PATHS, SchedulerStream, StreamConfig, add_dashboard, engine_info
from iterserve.server.engine_ticks import EngineTicks
from iterserve.server.metrics import ServerMetrics
from iterserve.server.middleware import (ApiKeyMiddleware, BodyLimitMiddleware, HostCheckMiddleware,
                                         RejectionCounterMiddleware, error_response)
from iterserve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       EmbeddingRequest, LoadLoRAAdapterRequest, ResponsesRequest, TokenizeRequest,
                                       UnloadLoRAAdapterRequest, error_body, validation_message)
from iterserve.server.reasoning.request import template_kwargs
from iterserve.server.serving import OpenAIServing, ServerSettings, message_chars

access_log = logging.getLogger("iterserve.access")
log = logging.getLogger("iterserve.server")

ERROR_RESPONSES = {code: {"description": desc, "content": {"application/json": {"example": error_body(desc, code)}}}
                   for code, desc in ((400, "invalid request"), (401, "missing or wrong API key"),
                                      (404, "unknown model"), (413, "request body too large"),
                                      (503, "waiting queue full or shutting down: retry later"))}
ANTHROPIC_ERROR_RESPONSES = {
    code: {"description": desc, "content": {"application/json": {"example": anthropic_error_body(desc, code)}}}
    for code, desc in ((400, "invalid request"), (401, "missing or wrong API key (x-api-key or Bearer)"),
                       (404, "unknown model"), (413, "request body too large"),
                       (503, "waiting queue full or shutting down: retry later"))}


def log_finished(out: RequestOutput) -> None:
    t = out.times

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    access_log.info("request_id=%s prompt_tokens=%d output_tokens=%d queue_time=%s ttft=%s e2e=%s finish_reason=%s",
                    out.request_id, out.num_prompt_tokens, out.num_output_tokens, s(t.queue_time), s(t.ttft),
                    s(t.e2e), out.finish_reason)


def model_name(model: str) -> str:
    """The model as answers may show it: a folder or file name, never its path on this machine."""
    return os.path.basename(os.path.normpath(model)) if os.sep in model else model


def step_dict(rec: StepRecord, start_time: float) -> dict:
    return {"step": rec.step, "t": rec.start - start_time, "duration": rec.duration, "batch_size": rec.batch_size,
            "num_padding": rec.num_padding, "num_running": rec.num_running, "num_waiting": rec.num_waiting,
            "prefill_tokens": rec.prefill_tokens, "decode_tokens": rec.decode_tokens,
            "kv_used_blocks": rec.kv_used_blocks, "kv_total_blocks": rec.kv_total_blocks, "kv_tokens": rec.kv_tokens,
            "num_preempted": len(rec.preempted), "num_finished": len(rec.finished),
            "decode_kv_tokens": rec.decode_kv_tokens, "prefill_kv_tokens": rec.prefill_kv_tokens,
            "decode_kv_shared_tokens": rec.decode_kv_shared_tokens,
            "prefill_cached_kv_tokens": rec.prefill_cached_kv_tokens,
            "spec_num_drafts": rec.spec_num_drafts, "spec_draft_tokens": rec.spec_draft_tokens,
            "spec_accepted_tokens": rec.spec_accepted_tokens, "spec_propose_seconds": rec.spec_propose_seconds,
            "spec_accepted_per_pos": list(rec.spec_accepted_per_pos),
            "admitted": [{"request_id": rid, "cached_tokens": n} for rid, n in rec.admitted]}


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The single-process server: the API over one local engine, plus its health, metrics,
    scheduler and dashboard."""
    llm = engine.engine
    info = engine_info(llm, settings.served_model_name, model_name(llm.config.model))
    metrics = ServerMetrics(engine, settings.served_model_name, vllm_names=settings.vllm_metrics, info=info)
    engine.finish_listeners.append(log_finished)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with anyio.create_task_group():  # loads anyio's backend now, not inside the first stream
            pass
        engine.start()
        yield
        await engine.stop()

    app = build_api(OpenAIServing(engine, settings), settings, metrics.on_rejected, lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    stream_config = StreamConfig()
    add_dashboard(app, SchedulerStream(EngineTicks(engine, info, stream_config.latency_window_s), stream_config))

    @app.get("/health")
    async def health():
        reason = engine.health()
        if reason is not None:
            return error_response(reason, 503, headers={"Retry-After": str(settings.retry_after_s)})
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/scheduler")
    async def scheduler(since_step: int | None = Query(None, ge=0, description="only steps after this one")):
        return scheduler_state(engine, info, since_step)

    return app


def scheduler_state(engine: AsyncEngine, info: dict, since_step: int | None = None) -> dict:
    """What /v1/scheduler answers: the live batch, KV cache, prefix cache, speculative decoding (its
    config, None when off, and totals since start), configuration (`info`), memory (bytes of weights,
    KV cache and workspace as measured at start-up: memory.MemoryReport) and recent steps."""
    llm = engine.engine
    state, cfg = engine.state, llm.config
    kv = state.kv
    return {
        "batching": cfg.batching, "running": state.running, "waiting": state.waiting,
        "kv_cache": {"used_blocks": kv.used_blocks, "total_blocks": kv.total_blocks, "usage": kv.usage,
                     "tokens_stored": kv.tokens_stored, "internal_fragmentation": kv.internal_fragmentation},
        "busy_fraction": engine.busy_fraction(), "uptime_s": time.monotonic() - llm.start_time,
        "step": state.step_count, "num_preemptions_total": state.num_preemptions_total,
        "num_recomputed_tokens_total": state.num_recomputed_tokens,
        "prefix_cache": {"enabled": llm.pool.enable_caching, "queries": state.prefix_cache_queries,
                         "hits": state.prefix_cache_hits, "hit_rate": state.prefix_cache_hit_rate,
                         "cached_free_blocks": kv.cached_free_blocks},
        "speculative": speculative_state(cfg.speculative_config, state.spec),
        "config": info,
        "lora": llm.lora.info() if getattr(llm, "lora", None) is not None else None,
        "memory": llm.memory.to_dict() if getattr(llm, "memory", None) is not None else None,
        "steps": [step_dict(r, llm.start_time) for r in engine.recent_steps(since_step)],
    }


def speculative_state(config, totals: SpecTotals) -> dict:
    """/v1/scheduler's `speculative` section: the server's config (None: off, though a request's own
    `prediction` can still draft) and the totals (acceptance_rate = accepted / draft tokens,
    mean_accepted_length = 1 + accepted / verify rows with drafts: tokens per verify row)."""
    return {"config": asdict(config) if config is not None else None, **totals.to_dict()}


def build_api(serving: OpenAIServing, settings: ServerSettings, count_rejected: Callable[[int], None],
              lifespan) -> FastAPI:
    """The OpenAI-compatible API (guards, errors, generation, models, tokenize) over `serving`, whose
    engine is either the local AsyncEngine or the Ray ingress's remote one (serve_ray/): both
    servers are built from this one function. The caller adds /health, /metrics and /v1/scheduler."""
    llm, engine = serving.llm, serving.engine
    created = int(time.time())
    app = FastAPI(title="iterserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server over a continuous-batching engine")
    # add_middleware puts each one outside those added before: the last added runs first
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_key:
        open_paths = ("/health", *PAGE_PATHS) + (("/metrics",) if settings.metrics_without_key else ())
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, open_paths=open_paths)
    if settings.allowed_hosts and "*" not in settings.allowed_hosts:
        app.add_middleware(HostCheckMiddleware, allowed=settings.allowed_hosts)
    app.add_middleware(RejectionCounterMiddleware, count=count_rejected)
    app.state.settings = settings

    # ---- errors ---------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc.message, exc.status_code, exc.param, exc.code, exc.headers, path=request.url.path)

    @app.exception_handler(RequestRejected)
    async def on_rejected(request: Request, exc: RequestRejected):
        headers = {"Retry-After": str(settings.retry_after_s)} if exc.status_code == 503 else None
        return error_response(str(exc), exc.status_code, headers=headers, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        return error_response(message, 400, param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code, headers=getattr(exc, "headers", None),
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(f"internal server error: {type(exc).__name__}", 500, path=request.url.path)

    # ---- generation -----------------------------------------------------------------------------------
    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completion(body, request)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    @app.post("/v1/responses", responses=ERROR_RESPONSES)
    async def responses(body: ResponsesRequest, request: Request):
        return await serving.responses(body, request)

    response_id = Path(max_length=256, description="a stored response's id")

    @app.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def get_response(response_id: str = response_id,
                           stream: bool | None = Query(None, description="not supported: replays need a "
                                                                         "background response")):
        if stream:
            raise APIError("stream is not supported by this server on GET /v1/responses/{id}", param="stream",
                           code="unsupported_field")
        return serving.get_response(response_id)

    @app.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def delete_response(response_id: str = response_id):
        return serving.delete_response(response_id)

    # ---- Anthropic's Messages API (anthropic_messages.py: the chat path; errors in Anthropic's shape) ----
    @app.post("/v1/messages", responses=ANTHROPIC_ERROR_RESPONSES)
    async def messages(body: MessagesRequest, request: Request):
        return await create_message(serving, body, request)

    @app.post("/v1/messages/count_tokens", responses=ANTHROPIC_ERROR_RESPONSES)
    async def messages_count_tokens(body: CountTokensRequest):
        return await count_tokens(serving, body)

    @app.post("/v1/embeddings", responses=ERROR_RESPONSES)
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await serving.embeddings(body, request)

    # ---- the rest ---------------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        base = {"id": settings.served_model_name, "object": "model", "created": created, "owned_by": "iterserve",
                "root": model_name(llm.config.model), "parent": None, "max_model_len": llm.max_model_len}
        lora = serving.lora
        adapters = [{**base, "id": name, "root": name, "parent": settings.served_model_name}
                    for name in (lora.names() if lora is not None else [])]
        return {"object": "list", "data": [base, *adapters]}

    # ---- LoRA adapters (vLLM's endpoints and answers; behind the API key like every route) -------------
    @app.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        await serving.load_lora_adapter(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses={**ERROR_RESPONSES, 409: {"description": "adapter in use"}})
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        await serving.unload_lora_adapter(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt or messages")
        if body.messages is not None:
            if not body.messages:
                raise APIError("messages must not be empty", param="messages")
            serving.check_text_length(message_chars(body.messages), llm.max_model_len, "messages", "messages")
            # the chat route's template variables (the server's default, the body's own), so counts agree
            ids = await serving.encode_chat(body.messages, chat_template_kwargs=template_kwargs(
                settings.default_chat_template_kwargs, body.chat_template_kwargs))
        else:
            serving.check_text_length(len(body.prompt), llm.max_model_len, "prompt", "prompt")
            ids = await engine.encode(prompt=body.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        vocab = llm.model_config.vocab_size

        def decode() -> str:  # off the event loop: a long list takes long enough to stall every stream
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
            return llm.tokenizer.decode(body.tokens)

        return {"prompt": await asyncio.to_thread(decode)}

    def openapi() -> dict:
        """FastAPI documents a 422 for every body; this server answers 400 instead, as OpenAI does."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    if op.get("responses", {}).pop("422", None) is not None:
                        op["responses"].setdefault("400", ERROR_RESPONSES[400])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app
