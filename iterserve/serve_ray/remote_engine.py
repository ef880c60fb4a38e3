"""The ingress's engine: what OpenAIServing needs of an AsyncEngine, over replicas behind a Serve handle.

OpenAIServing (server/serving.py) validates, tokenises and formats; it calls `encode`,
`add_request` and `abort` of its engine and reads limits and the tokenizer from `engine.engine`.
Here `engine.engine` is a FrontEngine (the tokenizer, loaded in the ingress, and the replicas'
limits) and `add_request` opens a streaming call to a replica chosen by the router.

Failures: a replica that dies before the request produced any output (before admission, or admitted
but nothing generated yet) is retried on another replica, up to `max_retries` times; one that dies
after output was sent ends the request with a clear error (the client sees an error, never a hang
or a silently cut answer).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle

from iterserve.engine import LLMEngine
from iterserve.model.loader import load_tokenizer, resolve_model
from iterserve.request import RequestOutput, RequestRejected, RequestTimes
from iterserve.sampling import SamplingParams
from iterserve.serve_ray.replica import Admission, EngineInfo
from iterserve.structured.manager import StructuredOutputConfig, StructuredOutputManager

log = logging.getLogger("iterserve.serve_ray")


@dataclass(frozen=True)
class FrontModelConfig:
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class FrontEngine:
    """The engine as the API layer sees it, without a model: tokenizer, limits, grammar compiler.

    encode_prompt and check_limits are LLMEngine's own (they read only the tokenizer and limits), so
    the ingress tokenises and refuses exactly as an engine would."""

    encode_prompt = LLMEngine.encode_prompt
    check_limits = LLMEngine.check_limits

    def __init__(self, info: EngineInfo) -> None:
        self.config = info.config
        self.tokenizer = load_tokenizer(resolve_model(info.config.model))
        self.model_config = FrontModelConfig(info.vocab_size, info.eos_token_ids)
        self.max_model_len, self.max_input_len, self.max_output_len = (
            info.max_model_len, info.max_input_len, info.max_output_len)
        cfg = info.config  # compiled as the replicas compile (a grammar the ingress accepts, they accept)
        self.structured = StructuredOutputManager(
            self.tokenizer, info.vocab_size, info.eos_token_ids,
            StructuredOutputConfig(any_whitespace=cfg.structured_outputs_any_whitespace,
                                   allow_additional_properties=cfg.structured_outputs_allow_additional_properties,
                                   bound_numbers=cfg.structured_outputs_bound_numbers))


class RemoteStream:
    """A RequestStream whose outputs come from a replica; re-sent elsewhere if that replica dies
    before anything was delivered."""

    def __init__(self, remote: "RemoteEngine", request_id: str, call: tuple) -> None:
        self.remote, self.request_id, self.call = remote, request_id, call
        self.finished = False
        self.replica = ""
        self.gen = None
        self.delivered = False

    async def open(self) -> None:
        """Sends the request to a replica and waits for its admission (raises RequestRejected)."""
        for attempt in range(self.remote.max_retries + 1):
            self.gen = self.remote.handle.options(stream=True).generate.remote(*self.call)
            try:
                admission: Admission = await self.gen.__anext__()
            except RayError as e:
                if attempt == self.remote.max_retries:
                    raise RequestRejected(f"no engine replica could take the request: {e.__class__.__name__}",
                                          status_code=503) from None
                log.warning("replica failed before admitting %s (%s); retrying", self.request_id,
                            e.__class__.__name__)
                continue
            if admission.error is not None:
                raise RequestRejected(admission.error, status_code=admission.status_code)
            self.replica = admission.replica
            return

    def cancel(self) -> None:
        if self.gen is not None and not self.finished:
            self.gen.cancel()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        retries = self.remote.max_retries
        while not self.finished:
            try:
                batch = await self.gen.__anext__()
            except StopAsyncIteration:
                yield self._failed("the engine replica ended the stream early")
                return
            except RayError as e:
                if not self.delivered and retries > 0:
                    retries -= 1
                    log.warning("replica %s died before %s produced output; retrying", self.replica,
                                self.request_id)
                    try:
                        await self.open()
                        continue
                    except RequestRejected as again:
                        yield self._failed(str(again))
                        return
                yield self._failed(f"the engine replica serving this request failed ({e.__class__.__name__}); "
                                   "the answer is incomplete")
                return
            for out in batch:
                self.delivered = self.delivered or bool(out.new_token_ids)
                self.finished = out.finished
                if self.finished:
                    self.remote.forget(self.request_id)
                yield out

    def _failed(self, message: str) -> RequestOutput:
        self.finished = True
        self.remote.forget(self.request_id)
        return RequestOutput(self.request_id, [], "", True, "error", 0, 0, RequestTimes(time.monotonic()),
                             error=message)


class RemoteEngine:
    """AsyncEngine's request interface over a deployment handle of EngineReplica."""

    def __init__(self, handle: DeploymentHandle, info: EngineInfo, max_retries: int = 1) -> None:
        self.handle = handle
        self.engine = FrontEngine(info)
        self.max_retries = max_retries
        self._streams: dict[str, RemoteStream] = {}
        self.shutting_down = False

    async def encode(self, prompt: str | None = None, messages: list[dict] | None = None,
                     tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
        try:
            return await asyncio.to_thread(self.engine.encode_prompt, prompt, messages, tools,
                                           chat_template_kwargs)
        except UnicodeError as e:
            raise RequestRejected(f"the text cannot be tokenised: {e}") from None

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          priority: int = 0, arrival_time: float | None = None,
                          prefix_leader: str | None = None) -> RemoteStream:
        if self.shutting_down:
            raise RequestRejected("the server is shutting down", status_code=503)
        self.engine.check_limits(len(prompt_token_ids), params)
        waited = time.monotonic() - arrival_time if arrival_time is not None else 0.0
        stream = RemoteStream(self, request_id, (request_id, prompt_token_ids, params, priority, waited,
                                                 prefix_leader))
        self._streams[request_id] = stream
        try:
            await stream.open()
        except BaseException:
            self._streams.pop(request_id, None)
            stream.cancel()
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Cancels the replica call: Serve cancels the replica's generator, which aborts the request."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
