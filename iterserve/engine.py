"""LLMEngine: add_request / abort_request / step (the offline `LLM` API is in llm.py).

One step: the scheduler picks what to compute, the runner computes it and samples, then the engine
appends tokens, checks stop conditions, and hands finished requests back to the scheduler, which
releases them with their blocks at once or later (static batching holds them until the batch
ends). Every step leaves a StepRecord: the one measurement that feeds the scheduling log, metrics
and utilisation timelines. Device-specific set-up (dtype, kernels, weight layouts, KV sizing) is
the platform's (platform/selector.py), chosen once here.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jinja2
import torch

from iterserve.config import EngineConfig, ModelConfig, with_step_budget
from iterserve.core.block_pool import BlockPool
from iterserve.core.kv_groups import describe_groups, kv_cache_groups
from iterserve.core.scheduler import SchedulerBase, SchedulerOutput
from iterserve.core.selector import build_scheduler
from iterserve.lora.adapter import LoRAAdapter, LoRAError
from iterserve.lora.layers import install_lora_hooks
from iterserve.lora.manager import LoRAInUse, LoRAManager
from iterserve.memory import (MemoryPlan, MemoryReport, available_memory, kv_cache_bytes, model_tensors, skip_reason,
                              weight_bytes, workspace_estimate)
from iterserve.model.loader import ModelNotFound, ModelSource, load_model, model_config, resolve_model
from iterserve.model.weight_estimate import estimate_weight_bytes
from iterserve.platform.base import kv_blocks_for_budget, kv_bytes_per_block, user_cache_dir
from iterserve.platform.selector import get_platform, resolve_device
from iterserve.pooling import PoolingConfig, resolve_pooling
from iterserve.pooling import finish as finish_pooling
from iterserve.request import Request, RequestOutput, RequestRejected, RequestStatus
from iterserve.runner import ModelRunner
from iterserve.sampling import SamplingParams
from iterserve.spec_decode.controller import SpecController
from iterserve.structured.manager import StructuredOutputConfig, StructuredOutputManager
from iterserve.structured.params import StructuredOutputError

log = logging.getLogger("iterserve.engine")
sched_log = logging.getLogger("iterserve.scheduler")


@dataclass
class StepRecord:
    step: int
    start: float  # time.monotonic()
    duration: float  # seconds spent in the forward pass and sampling
    batch_size: int  # sequences computed this step, padding members included
    num_padding: int
    num_running: int
    num_waiting: int
    prefill_tokens: int
    decode_tokens: int
    kv_used_blocks: int
    kv_total_blocks: int
    kv_tokens: int
    preempted: list[str] = field(default_factory=list)
    finished: list[tuple[str, int]] = field(default_factory=list)  # (request id, blocks freed)
    admitted: list[tuple[str, int]] = field(default_factory=list)  # (request id, prefix-cache hit tokens)
    prefix_cache_queries: int = 0  # tokens looked up at this step's admissions
    prefix_cache_hits: int = 0  # of those, tokens found cached
    decode_kv_tokens: int = 0  # context lengths of the single-token rows, summed (SchedulerOutput.attended_kv)
    prefill_kv_tokens: int = 0  # sum over prompt chunks of chunk length x context length
    decode_kv_shared_tokens: int = 0  # of decode_kv_tokens, those in blocks another row read too
    prefill_cached_kv_tokens: int = 0  # of prefill_kv_tokens, chunk length x tokens cached before it
    # speculative decoding: rows that verified drafts, draft tokens verified, drafts accepted (each
    # such row also yields one token of the target's own; decode_tokens counts every verified row
    # position), and the seconds spent proposing the next step's drafts (inside `duration`)
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_propose_seconds: float = 0.0
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # [i]: rows that accepted draft i

    def log_line(self) -> str:
        line = (f"step {self.step} | running {self.num_running} waiting {self.num_waiting} "
                f"batch {self.batch_size}" + (f" (padding {self.num_padding})" if self.num_padding else "")
                + f" | prefill {self.prefill_tokens} decode {self.decode_tokens} tok"
                f" | kv {self.kv_used_blocks}/{self.kv_total_blocks} blocks | {self.duration * 1e3:.1f} ms")
        if self.spec_num_drafts:
            line += (f" | spec {self.spec_num_drafts} rows drafted {self.spec_draft_tokens}"
                     f" accepted {self.spec_accepted_tokens}")
        for rid, cached in self.admitted:
            line += f" | admitted {rid} cached {cached} tok"
        for rid in self.preempted:
            line += f" | preempted {rid}"
        for rid, freed in self.finished:
            line += f" | finished {rid} freed {freed} blocks"
        return line


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None) -> None:
        """`loaded` = (model, ModelConfig, tokenizer) lets tests share one model between engines;
        such a model keeps its weights' device, dtype and layout."""
        param = next(loaded[0].parameters(), None) if loaded is not None else None
        device = param.device if param is not None else resolve_device(config.device)
        self.config = config = with_step_budget(config, device.type)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        t0 = time.perf_counter()
        if loaded is None:
            # a wrong model or length fails now, before the platform builds kernels or weights load
            src = resolve_model(config.model)
            planned_cfg = model_config(src)
            max_len = self._max_model_len(planned_cfg)
            self.platform = get_platform(config, device)
            self._check_memory(src, planned_cfg)  # refuses a model that cannot fit, before it loads
            model, mcfg, tokenizer, src = load_model(config.model, self.platform.dtype, str(self.platform.device),
                                                     max_positions=max_len,
                                                     block_types=self.platform.gguf_block_types())
            self.platform.prepare_model(model, src)
        else:
            if config.batch_invariant:
                raise ValueError("batch_invariant lays the weights out itself: let the engine load the model "
                                 "(no `loaded=`)")
            model, mcfg, tokenizer = loaded
            self.platform = get_platform(config, *((param.device, param.dtype) if param is not None else ()))
        self.device, self.dtype = self.platform.device, self.platform.dtype
        self.model, self.model_config, self.tokenizer = model, mcfg, tokenizer
        self.load_seconds = time.perf_counter() - t0
        self.max_model_len = self._max_model_len(mcfg)
        if self.max_model_len > getattr(model, "max_positions", self.max_model_len):
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the {model.max_positions} positions "
                             "the model's RoPE tables were built for (load_model's max_positions)")
        self.max_input_len = config.max_input_len or self.max_model_len
        self.max_output_len = config.max_output_len or self.max_model_len
        num_blocks = self.platform.num_kv_blocks(mcfg, self._profile_run)
        self.kv_groups = kv_cache_groups(mcfg)
        self.pool = BlockPool(num_blocks, config.block_size, enable_caching=config.prefix_caching,
                              group_windows=self.kv_groups.windows)
        self.scheduler: SchedulerBase = build_scheduler(config, self.pool, self.max_model_len)
        self.runner = self._new_runner(num_blocks)
        self.lora = self._init_lora()
        if config.compile:
            self._compile_model()
        self.memory = self._memory_report(num_blocks)
        log.info("%s", self.memory.log_line())
        log.info("KV cache (%s): %d blocks of %d tokens (%.0f MiB) in %s; fits %d sequences of max_model_len %d",
                 self.platform.kv_cache.name, num_blocks, config.block_size,
                 num_blocks * kv_bytes_per_block(mcfg, config.block_size, self.platform.kv_cache, self.kv_groups) / 2**20,
                 describe_groups(self.kv_groups), self.max_num_sequences(), self.max_model_len)
        self.structured = StructuredOutputManager(
            tokenizer, mcfg.vocab_size, mcfg.eos_token_ids,
            StructuredOutputConfig(any_whitespace=config.structured_outputs_any_whitespace,
                                   allow_additional_properties=config.structured_outputs_allow_additional_properties,
                                   bound_numbers=config.structured_outputs_bound_numbers))
        self.pooling = self._resolve_pooling()
        self.spec = SpecController(config.speculative_config, self._build_proposer(),
                                   predictions=config.batching == "continuous")
        self._compiling: dict[str, tuple[Request, object]] = {}  # waiting for their grammar
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self.records: deque[StepRecord] = deque(maxlen=4096)
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self._pending: list[RequestOutput] = []  # outputs of aborts, returned by the next step
        self._ids = itertools.count()
        self._prefix_cache_seen = (0, 0)  # the scheduler's counters at the last StepRecord
        self.start_time = time.monotonic()

    def _check_memory(self, src: ModelSource, mcfg: ModelConfig) -> None:
        """Before loading: the weights (estimated from the checkpoint's headers), the KV cache asked
        for and the workspace against the memory available; InsufficientMemory (a ValueError: `serve`
        exits with the message) when they do not fit, unless --skip-memory-check."""
        reason = skip_reason(self.platform.device)
        if reason is not None:
            log.info("memory check skipped: %s", reason)
            return
        dtype, cfg = self.platform.dtype, self.config
        kv = self.platform.kv_cache
        kv_cache = kv_blocks_for_budget(cfg, mcfg, kv) * kv_bytes_per_block(mcfg, cfg.block_size, kv)
        blocks = self.platform.gguf_block_types()  # a GGUF's weights the loader keeps as their blocks
        plan = MemoryPlan(weights=estimate_weight_bytes(src, dtype, blocks), kv_cache=kv_cache,
                          workspace=workspace_estimate(cfg, mcfg, dtype), available=available_memory())
        if cfg.skip_memory_check:
            if not plan.fits:
                log.warning("memory check skipped (--skip-memory-check): %s", plan.refusal())
            return
        plan.check()

    def _memory_report(self, num_blocks: int) -> MemoryReport:
        """What the loaded engine holds (weights as measured, each storage once; the KV cache's
        tensors; the workspace estimate): for the start-up log, /v1/scheduler and /metrics."""
        resident, mapped = weight_bytes(model_tensors(self.model))
        return MemoryReport(weights_resident=resident, weights_mapped=mapped,
                            kv_cache=kv_cache_bytes(self.runner.kv_caches), num_kv_blocks=num_blocks,
                            block_size=self.config.block_size, layers_per_block=self.kv_groups.group_size,
                            workspace_estimate=workspace_estimate(self.config, self.model_config, self.dtype),
                            available=available_memory())

    def _build_proposer(self):
        """The drafting method of --speculative-config, or None."""
        cfg = self.config.speculative_config
        if cfg is None:
            return None
        if cfg.method == "ngram":
            from iterserve.spec_decode.ngram import NgramProposer
            return NgramProposer.from_config(cfg)
        if cfg.method == "suffix":
            from iterserve.spec_decode.suffix import SuffixProposer
            return SuffixProposer.from_config(cfg)
        from iterserve.spec_decode.draft_model import DraftModelProposer
        return DraftModelProposer.load(cfg, self.platform, self.model_config, self.config.block_size,
                                       self.tokenizer, self.max_model_len)

    def _init_lora(self) -> LoRAManager | None:
        """--enable-lora: the adapter slots, the projections' hooks (installed once per model: they
        read the step's LoRA batch, so engines sharing a model share them) and --lora-modules."""
        cfg = self.config
        if not cfg.enable_lora:
            return None
        lora = LoRAManager(self.model_config, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras,
                           self.device, self.dtype, self.platform.lora_sgmv)
        if getattr(self.model, "_lora_hooks", None) is None:
            self.model._lora_hooks = install_lora_hooks(self.model)
        for name, path in cfg.lora_modules.items():
            try:
                lora.add(lora.load(name, path))
            except LoRAError as e:
                raise ValueError(f"--lora-modules {name}: {e}") from None
        self.scheduler.lora = self.runner.lora = lora
        log.info("LoRA: %d adapter(s) (%s), %d resident slot(s) of rank %d", len(lora.names()),
                 ", ".join(lora.names()) or "none yet", cfg.max_loras, cfg.max_lora_rank)
        return lora

    def add_lora(self, adapter: LoRAAdapter) -> None:
        """Registers an adapter read and checked by `self.lora.load` (which may run off the engine
        thread); call it on the engine thread. LoRAError when the name is taken."""
        if self.lora is None:
            raise LoRAError("LoRA is not enabled on this server (--enable-lora)")
        self.lora.add(adapter)

    def remove_lora(self, name: str) -> None:
        """Unloads an adapter; LoRAInUse while a request (waiting, running or compiling its grammar)
        runs under it, LoRAError when there is no such adapter. Call it on the engine thread."""
        if self.lora is None or name not in self.lora:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
        users = [rid for rid, r in self.requests.items() if r.lora_name == name and not r.is_finished]
        if users:
            raise LoRAInUse(f"LoRA adapter {name!r} is in use by {len(users)} request(s): unload it when they "
                            "have finished")
        self.lora.remove(name)

    def _max_model_len(self, mcfg: ModelConfig) -> int:
        max_len = self.config.max_model_len or min(mcfg.max_position_embeddings, 4096)
        if max_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's {mcfg.max_position_embeddings} positions")
        return max_len

    def _resolve_pooling(self) -> PoolingConfig:
        """How embedding requests pool (pooling.py): --pooling, else the model folder's own config."""
        try:
            src = resolve_model(self.config.model)
        except ModelNotFound:  # a model handed in by a test under another name
            src = None
        folder = src.folder if src is not None and src.kind == "hf" else None
        pooling = resolve_pooling(self.config.pooling, folder)
        if pooling.error:
            log.warning("embeddings are off: %s", pooling.error)
        else:
            log.info("embeddings: %s pooling (%s)%s", pooling.method, pooling.source,
                     ", matryoshka dimensions" if pooling.matryoshka else "")
        return pooling

    def _compile_model(self) -> None:
        if not hasattr(self.model, "compile_decoder"):
            raise ValueError(f"compile: {type(self.model).__name__} has no compile_decoder()")
        # inductor's FX graph and AOT autograd caches (on by default) in the user's cache, not /tmp,
        # so a restart, even after a reboot, loads the compiled graphs instead of compiling them
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(user_cache_dir() / "inductor"))
        t0 = time.perf_counter()
        self.model.compile_decoder()
        self.runner.warm_up()
        log.info("compiled the decoder stack in %.1f s", time.perf_counter() - t0)

    def _new_runner(self, num_blocks: int) -> ModelRunner:
        return ModelRunner(self.model, self.model_config, num_blocks, self.config.block_size, self.device,
                           self.dtype, self.platform.attention, kv_cache_groups(self.model_config),
                           kv_cache=self.platform.kv_cache, argmax=self.platform.argmax)

    def max_num_sequences(self) -> int:
        """How many sequences of max_model_len the KV cache holds at once (decoding their last
        token): full groups hold every block, windowed groups only the window's."""
        return self.pool.num_usable_blocks // self.pool.blocks_per_sequence(self.max_model_len)

    def _profile_run(self) -> None:
        """The largest step the engine schedules (a prefill at the token budget), on a cache of
        just the blocks it needs: what a platform that measures its memory runs."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        self._new_runner(n // self.config.block_size + 1).profile_run(n)

    def resolved_config(self) -> dict[str, Any]:
        """The switches as this engine resolved them (device, dtype, kernels, limits, KV blocks):
        what /v1/scheduler reports next to the EngineConfig."""
        return {**self.platform.resolved(), "architecture": self.model_config.architecture,
                "sliding_window": self.model_config.sliding_window if self.model_config.has_windows else None,
                "max_model_len": self.max_model_len,
                "max_input_len": self.max_input_len, "max_output_len": self.max_output_len,
                "num_kv_blocks": self.pool.num_blocks, "enable_prefix_caching": self.pool.enable_caching,
                "kv_cache_groups": [{"window": g.window, "layers": list(g.layers)} for g in self.kv_groups.groups],
                "max_num_sequences": self.max_num_sequences(),
                "lora": self.lora.info() if self.lora is not None else None,
                "model_load": getattr(self.model, "load_info", None),
                "speculative_config": (dataclasses.asdict(self.config.speculative_config)
                                       if self.config.speculative_config is not None else None)}

    # ---- requests --------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | None = None, messages: list[dict] | None = None,
                      tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
        """chat_template_kwargs: extra variables for the chat template (vLLM's request field, e.g.
        Qwen3's enable_thinking); the server refuses the names apply_chat_template itself takes."""
        tok = self.tokenizer
        if messages is not None:
            if not messages:
                raise RequestRejected("messages must not be empty")
            if not getattr(tok, "chat_template", None):
                raise RequestRejected("this model has no chat template: send a plain prompt")
            try:
                text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                              **(chat_template_kwargs or {}))
            except jinja2.TemplateError as exc:  # the template's own refusal (Gemma 2: no system role)
                raise RequestRejected(f"the model's chat template refused these messages: {exc}") from None
            return tok.encode(text, add_special_tokens=False)
        if not prompt:
            raise RequestRejected("prompt must not be empty")
        return tok.encode(prompt)

    def add_request(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                    request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                    messages: list[dict] | None = None, priority: int = 0,
                    arrival_time: float | None = None, prefix_leader: str | None = None) -> Request:
        """Validates and queues a request; raises RequestRejected with a clear reason.

        prefix_leader: id of parallel sampling's first sequence, whose prompt blocks this one (same
        prompt) waits for and shares instead of computing them again."""
        params = params or SamplingParams()
        if params.pooling is not None:
            params = self.pooling_params(params)
        if prompt_token_ids is None:
            prompt_token_ids = self.encode_prompt(prompt, messages)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        self.check_limits(len(prompt_token_ids), params)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise RequestRejected(f"token id {bad[0]} is outside the vocabulary (0..{self.model_config.vocab_size - 1})")
        if self.config.max_waiting is not None and self.scheduler.num_waiting >= self.config.max_waiting:
            raise RequestRejected(f"the waiting queue is full ({self.config.max_waiting} requests): retry later",
                                  status_code=503)
        req = Request(request_id, prompt_token_ids, params, self.model_config.eos_token_ids,
                      priority=priority, arrival_time=arrival_time, prompt=prompt)
        req.prefix_leader = self.requests.get(prefix_leader) if prefix_leader else None
        if req.lora_name is not None:
            if self.lora is None or req.lora_name not in self.lora:
                raise RequestRejected(f"model {req.lora_name!r} does not exist"
                                      + ("" if self.lora is not None else " (LoRA is not enabled)"), status_code=404)
            req.cache_key = self.lora.cache_key(req.lora_name)
        need = self.scheduler.max_blocks_per_request(req)
        if need > self.pool.num_usable_blocks:
            raise RequestRejected(f"request needs {need} KV blocks but the whole cache has "
                                  f"{self.pool.num_usable_blocks}: shorten it or raise the KV cache size")
        bad = [t for t in params.logit_bias or () if t >= self.model_config.vocab_size]
        if bad:
            raise RequestRejected(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                                  f"(0..{self.model_config.vocab_size - 1})")
        self.requests[request_id] = req
        if req.lora_name is not None:
            self.lora.stats.requests[req.lora_name] += 1
            self.lora.stats.prompt_tokens[req.lora_name] += req.num_prompt_tokens
        if params.structured_outputs is not None:
            future = self.structured.compile(params.structured_outputs)
            if not future.done():  # the step goes on; the request joins the scheduler when it is ready
                self._compiling[request_id] = (req, future)
                return req
            try:
                req.grammar = self.structured.new_grammar(future.result())
            except StructuredOutputError as e:
                del self.requests[request_id]
                raise RequestRejected(str(e)) from None
        self.scheduler.add_request(req)
        return req

    def _admit_compiled(self, outputs: list[RequestOutput]) -> None:
        """Requests whose grammar finished compiling join the scheduler; a failed one ends alone."""
        for rid, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            try:
                req.grammar = self.structured.new_grammar(future.result())
            except StructuredOutputError as e:
                req.status = RequestStatus.FINISHED_ERROR
                req.times.finished = time.monotonic()
                self.requests.pop(rid, None)
                out = self._output(req, [], [], finished=True)
                out.error = str(e)
                outputs.append(out)
                continue
            self.scheduler.add_request(req)

    def pooling_params(self, params: SamplingParams) -> SamplingParams:
        """An embedding request's params with the engine's pooling method; RequestRejected when the
        model cannot serve it."""
        if self.pooling.method is None:
            raise RequestRejected(f"this server cannot compute embeddings for its model: {self.pooling.error}")
        why = self.pooling.check_dimensions(params.pooling.dimensions, self.model_config.hidden_size)
        if why is not None:
            raise RequestRejected(why)
        if params.pooling.method is None:
            params = dataclasses.replace(params, pooling=dataclasses.replace(params.pooling,
                                                                             method=self.pooling.method))
        return params

    def check_limits(self, num_prompt: int, params: SamplingParams) -> None:
        if num_prompt == 0:
            raise RequestRejected("prompt must not be empty")
        if num_prompt > self.max_input_len:
            raise RequestRejected(f"prompt has {num_prompt} tokens, more than max_input_len {self.max_input_len}")
        if params.pooling is not None:  # generates nothing: only the prompt must fit
            if num_prompt > self.max_model_len:
                raise RequestRejected(f"prompt has {num_prompt} tokens, more than max_model_len {self.max_model_len}")
            return
        if params.max_tokens > self.max_output_len:
            raise RequestRejected(f"max_tokens {params.max_tokens} exceeds max_output_len {self.max_output_len}")
        if num_prompt + params.max_tokens > self.max_model_len:
            raise RequestRejected(f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = "
                                  f"{num_prompt + params.max_tokens} exceeds max_model_len {self.max_model_len}")

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                      error: str | None = None) -> bool:
        """Ends a request early: the client went away (abort), or `error` says why (status error or
        shutdown). Its final output comes with the next step (or abort_all)."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        if self._compiling.pop(request_id, None) is not None:
            req.status = status
            req.error = error
            self._release([(req, 0)], time.monotonic(), self._pending, finished_ids=None)
            return True
        released = self.scheduler.abort_request(request_id)
        req.status = status
        req.error = error
        self._release(released or [], time.monotonic(), self._pending, finished_ids=None)
        return True

    def abort_all(self, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                  error: str | None = None) -> list[RequestOutput]:
        """Aborts every request; returns their final outputs (and any not yet returned)."""
        for rid in list(self.requests):
            try:
                self.abort_request(rid, status, error)
            except Exception:  # noqa: BLE001 - after a failed step the state may be odd: free what we can
                log.exception("abort of %s failed", rid)
                self.requests.pop(rid, None)
        outputs, self._pending = self._pending, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or bool(self._compiling)

    def next_deadline(self) -> float | None:
        """When an engine whose last step did nothing may have work again without a new request
        (time.monotonic()), or None; the scheduler says (a static batch's timeout)."""
        return self.scheduler.next_deadline()

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step. If scheduling or the forward pass raises, the outputs of requests that had
        already ended (aborts) are kept for the next call rather than lost with the exception; an
        error in one request's own processing (detokenisation, stop strings) ends only that request."""
        outputs, self._pending = self._pending, []
        try:
            if self._compiling:
                self._admit_compiled(outputs)
            now = time.monotonic()
            sched = self.scheduler.schedule(now)
            for req, why in sched.failed:  # ended alone: the step goes on without it
                req.status, req.error = RequestStatus.FINISHED_ERROR, why
                self._release([(req, 0)], now, outputs, finished_ids=None)
            if not sched.scheduled:
                return outputs
            t0 = time.perf_counter()
            results = self.runner.execute(sched)
        except BaseException:
            self._pending = outputs + self._pending
            raise
        duration = time.perf_counter() - t0
        now = time.monotonic()
        finished: list[tuple[str, int]] = []
        for res in results:
            req = res.scheduled.request
            req.num_computed_tokens += res.scheduled.num_tokens
            if res.spec is not None:  # only the accepted drafts' KV counts; the rest is overwritten later
                req.num_computed_tokens -= len(res.scheduled.spec_token_ids) - res.spec.num_accepted
            if res.prompt_logprobs:
                req.prompt_logprobs.extend(res.prompt_logprobs)
            if res.pooled is not None:
                req.add_pooled(*res.pooled)
            if req.is_pooling:  # an embedding request ends as soon as its prompt is computed
                if not req.is_finished and req.num_computed_tokens >= req.num_prompt_tokens:
                    self._finish_pooling(req, now, outputs, finished)
                continue
            if res.token_id is None or req.is_finished:  # mid-prompt chunk, or a member held after it stopped
                continue
            try:
                self._process_token(req, res, now, outputs, finished)
            except Exception as e:  # noqa: BLE001 - this request's problem: end it, not the step
                log.exception("processing the new token of %s failed; ending that request", req.request_id)
                self.abort_request(req.request_id, RequestStatus.FINISHED_ERROR,
                                   f"internal error processing the output ({type(e).__name__}); the request was ended")
        t1 = time.perf_counter()
        self._after_verification(results)
        propose_s = time.perf_counter() - t1
        self._record(sched, duration + propose_s, finished, now, results, propose_s)
        if self._pending:  # requests ended by an error above: their final outputs go out with this step
            outputs.extend(self._pending)
            self._pending = []
        return outputs

    def _process_token(self, req: Request, res, now: float, outputs: list[RequestOutput], finished) -> None:
        """Appends the step's token (or a verified row's accepted drafts and the token after them)
        one at a time, each checked against the stop conditions: what follows a stop is dropped."""
        if res.spec is None:
            tokens, lps = [res.token_id], [res.logprob]
        else:
            tokens, lps = res.spec.token_ids, res.spec_logprobs
            req.spec_num_drafts += 1
            req.spec_draft_tokens += len(res.scheduled.spec_token_ids)
            req.spec_accepted_tokens += res.spec.num_accepted
        status, n = None, 0
        for tok, lp in zip(tokens, lps):
            req.append_token(tok, now)
            if req.lora_name is not None:
                self.lora.stats.generation_tokens[req.lora_name] += 1
            if lp is not None:
                req.logprobs.append(lp)
            n += 1
            status = req.check_stop_token(self.max_model_len)
            req.detokenize_step(self.tokenizer)
            if req.check_stop_strings():
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                break
        new = (tokens[:n], [lp for lp in lps[:n] if lp is not None])
        if status is None:
            outputs.append(self._output(req, *new))
            return
        req.status = status
        released = self.scheduler.finish(req)
        if not any(r is req for r, _ in released):  # held by the scheduler (until its batch ends)
            outputs.append(self._output(req, *new, finished=False))
        else:
            req.times.finished = now
        self._release(released, now, outputs, finished, new_tokens={req.request_id: new})

    def _after_verification(self, results) -> None:
        """Speculative decoding between steps: rows that verified drafts give back the blocks of
        rejected ones, the controller learns what was accepted, and the next step's drafts are
        proposed (their time counts in the step's)."""
        spec = self.spec
        if not spec.enabled and (spec.predictor is None
                                 or not any(r.scheduled.request.prediction_token_ids for r in results)):
            return
        for res in results:
            req = res.scheduled.request
            if req.status is not RequestStatus.RUNNING or res.token_id is None:
                continue
            if res.spec is not None:
                self.scheduler.trim_unverified(req)
            spec.verified(req, len(res.scheduled.spec_token_ids), res.spec.num_accepted if res.spec else 0)
        # a thinking request's forced tokens and answer-only grammar are applied to undrafted rows only
        spec.propose([r for r in self.scheduler.running if r.thinking is None or r.thinking.allows_drafts])

    def _finish_pooling(self, req: Request, now: float, outputs: list[RequestOutput], finished) -> None:
        lo, hi = req.pool_range
        req.embedding = finish_pooling(req.pool_sum, hi - lo, req.params.pooling)
        req.status = RequestStatus.FINISHED_STOPPED
        released = self.scheduler.finish(req)  # continuous: its blocks are free now
        self._release(released, now, outputs, finished)

    def _release(self, released, now, outputs, finished_ids, new_tokens=None) -> None:
        for r, freed in released:
            r.times.finished = r.times.finished or now
            if finished_ids is not None:
                finished_ids.append((r.request_id, freed))
            toks, lps = (new_tokens or {}).get(r.request_id, ([], []))
            outputs.append(self._output(r, toks, lps, finished=True))
            self.requests.pop(r.request_id, None)
            self.spec.finished(r)

    def _output(self, req: Request, new_ids: list[int], logprobs: list, finished: bool = False) -> RequestOutput:
        prompt_lps = None
        if (req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent
                and len(req.prompt_logprobs) == req.num_prompt_tokens):
            prompt_lps, req.prompt_logprobs_sent = list(req.prompt_logprobs), True
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_ids, text_delta=req.take_text_delta(),
            finished=finished, finish_reason=req.finish_reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            times=req.times, new_logprobs=list(logprobs),
            output_text=req.output_text, error=req.error if finished else None,
            prompt_logprobs=prompt_lps, embedding=req.embedding if finished else None,
            spec_num_drafts=req.spec_num_drafts, spec_draft_tokens=req.spec_draft_tokens,
            spec_accepted_tokens=req.spec_accepted_tokens, stop_reason=req.stop_reason if finished else None,
        )

    def _record(self, sched: SchedulerOutput, duration: float, finished, now: float, results=(),
                propose_s: float = 0.0) -> None:
        self.step_count += 1
        usage = self.pool.usage()
        queries, hits = self.scheduler.prefix_cache_queries, self.scheduler.prefix_cache_hits
        prev_queries, prev_hits = self._prefix_cache_seen
        self._prefix_cache_seen = (queries, hits)
        decode_kv, prefill_kv = sched.attended_kv()
        rec = StepRecord(
            step=self.step_count, start=now - duration, duration=duration,
            batch_size=len(sched.scheduled), num_padding=sched.num_padding,
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            prefill_tokens=sched.num_prefill_tokens, decode_tokens=sched.num_decode_tokens,
            kv_used_blocks=usage.used_blocks, kv_total_blocks=usage.total_blocks,
            kv_tokens=usage.tokens_stored,
            preempted=[r.request_id for r in sched.preempted], finished=finished,
            admitted=list(sched.admitted), prefix_cache_queries=queries - prev_queries,
            prefix_cache_hits=hits - prev_hits, decode_kv_tokens=decode_kv, prefill_kv_tokens=prefill_kv,
            decode_kv_shared_tokens=sched.shared_decode_kv(self.config.block_size, self.pool.null_block),
            prefill_cached_kv_tokens=sched.cached_prefill_kv(),
            spec_propose_seconds=propose_s,
        )
        for res in results:
            if res.spec is not None:
                rec.spec_num_drafts += 1
                rec.spec_draft_tokens += len(res.scheduled.spec_token_ids)
                rec.spec_accepted_tokens += res.spec.num_accepted
                if len(rec.spec_accepted_per_pos) < len(res.scheduled.spec_token_ids):
                    rec.spec_accepted_per_pos.extend([0] * (len(res.scheduled.spec_token_ids)
                                                            - len(rec.spec_accepted_per_pos)))
                for i in range(res.spec.num_accepted):
                    rec.spec_accepted_per_pos[i] += 1
        self.records.append(rec)
        if self.config.log_scheduler:
            sched_log.info(rec.log_line())
        elif sched_log.isEnabledFor(logging.DEBUG):
            sched_log.debug(rec.log_line())
        for fn in self.step_listeners:
            fn(rec)
