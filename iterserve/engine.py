"""LLMEngine (add_request / abort_request / step) and the offline `LLM.generate` API.

One step: the scheduler picks what to compute, the runner computes it and samples, then the engine
appends tokens, checks stop conditions, and hands finished requests back to the scheduler, which
frees their blocks at once (continuous) or at the end of the batch (static). Every step leaves a
StepRecord: the one measurement that feeds the scheduling log, metrics and utilisation timelines.
"""
from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from iterserve.config import EngineConfig, parse_size
from iterserve.core.block_pool import BlockPool
from iterserve.core.scheduler import Scheduler, SchedulerBase
from iterserve.core.static import StaticScheduler
from iterserve.cpu_info import cpu_flags
from iterserve.model.loader import is_four_bit_checkpoint, load_model
from iterserve.model.cpu_kernels import load_cpu_kernels
from iterserve.model.cpu_linear import (bf16_linears_available, four_bit_max_tokens, int4_kernel_available,
                                        optimize_cpu_linears, tiled_bf16_available)
from iterserve.request import Request, RequestOutput, RequestRejected, RequestStatus
from iterserve.runner import ModelRunner, kv_bytes_per_block
from iterserve.sampling import SamplingParams

log = logging.getLogger("iterserve.engine")
sched_log = logging.getLogger("iterserve.scheduler")


@dataclass
class StepRecord:
    step: int
    start: float  # time.monotonic()
    duration: float  # seconds spent in the forward pass and sampling
    batch_size: int  # sequences computed this step (static: includes padding members)
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

    def log_line(self) -> str:
        line = (f"step {self.step} | running {self.num_running} waiting {self.num_waiting} "
                f"batch {self.batch_size}" + (f" (padding {self.num_padding})" if self.num_padding else "")
                + f" | prefill {self.prefill_tokens} decode {self.decode_tokens} tok"
                f" | kv {self.kv_used_blocks}/{self.kv_total_blocks} blocks | {self.duration * 1e3:.1f} ms")
        for rid in self.preempted:
            line += f" | preempted {rid}"
        for rid, freed in self.finished:
            line += f" | finished {rid} freed {freed} blocks"
        return line


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """bfloat16 GEMMs beat float32 only with native bf16 instructions (AVX512-BF16 or AMX): here a
    batch-16 decode step ran 2.3x faster in bf16; without them torch emulates bf16 and is slower."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def resolve_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    dev = config.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev)
    names = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" or cpu_has_fast_bf16() else torch.float32
    elif config.dtype in names:
        dtype = names[config.dtype]
    else:
        raise ValueError(f"unknown dtype {config.dtype!r}: use auto, float32, bfloat16 or float16")
    return device, dtype


Q8_HEAD_MAX_TOKENS = 4  # sampled rows; the Q8_0 LM head loses to bf16 from 8 (model/cpu_linear.py)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None) -> None:
        """`loaded` = (model, ModelConfig, tokenizer) lets tests share one model between engines."""
        self.config = config
        self.int4_max_tokens = 0
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device, self.dtype = resolve_device_dtype(config)
        t0 = time.perf_counter()
        if loaded is None:
            model, mcfg, tokenizer, src = load_model(config.model, self.dtype, str(self.device))
            self._optimize_cpu_linears(model, src)
        else:
            model, mcfg, tokenizer = loaded
            param = next(model.parameters(), None)  # a shared model decides its own device and dtype
            if param is not None:
                self.device, self.dtype = param.device, param.dtype
        self.model, self.model_config, self.tokenizer = model, mcfg, tokenizer
        self.load_seconds = time.perf_counter() - t0
        self.max_model_len = config.max_model_len or min(mcfg.max_position_embeddings, 4096)
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"{mcfg.max_position_embeddings} positions")
        self.max_input_len = config.max_input_len or self.max_model_len
        self.max_output_len = config.max_output_len or self.max_model_len
        num_blocks = self._num_kv_blocks()
        self.pool = BlockPool(num_blocks, config.block_size)
        sched_cls = StaticScheduler if config.batching == "static" else Scheduler
        self.scheduler: SchedulerBase = sched_cls(config, self.pool, self.max_model_len)
        self.runner = ModelRunner(model, mcfg, self.pool, self.device, self.dtype)
        if config.compile:
            self._compile_model()
        fits = num_blocks // self.pool.blocks_for(self.max_model_len)
        log.info("KV cache: %d blocks of %d tokens (%.0f MiB); fits %d sequences of max_model_len %d",
                 num_blocks, config.block_size,
                 num_blocks * kv_bytes_per_block(mcfg, config.block_size, self.dtype) / 2**20,
                 fits, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self.records: deque[StepRecord] = deque(maxlen=4096)
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self._pending: list[RequestOutput] = []  # outputs of aborts, returned by the next step
        self._ids = itertools.count()
        self.start_time = time.monotonic()

    def _optimize_cpu_linears(self, model, src) -> None:
        """On CPU in bf16: weights laid out once for a bf16 GEMM (ours, or oneDNN's), and
        (quantization) a 4-bit twin of the projections and a Q8_0 twin of the LM head for steps of few tokens, where decoding is bound
        by reading weights (see model/cpu_linear.py). The head's twin needs the C++ CPU kernels."""
        q = self.config.quantization
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or not bf16_linears_available():
            if q == "int4":
                raise ValueError("quantization=int4 needs a CPU bfloat16 run (oneDNN bf16 and torch's CPU int4 kernel)")
            return
        use_int4 = q == "int4" or (q == "auto" and int4_kernel_available() and is_four_bit_checkpoint(src))
        self.int4_max_tokens = four_bit_max_tokens() if use_int4 else 0
        q8_head = Q8_HEAD_MAX_TOKENS if use_int4 and load_cpu_kernels() is not None else 0
        n = optimize_cpu_linears(model, self.int4_max_tokens, q8_head)
        log.info("CPU bf16: %d projections laid out for %s%s%s", n,
                 "our tiled bf16 GEMM" if tiled_bf16_available() else "oneDNN",
                 f", 4-bit twin for steps of <= {self.int4_max_tokens} tokens" if use_int4 else "",
                 f", Q8_0 LM head for <= {q8_head} sampled rows" if q8_head else "")

    def _compile_model(self) -> None:
        if not hasattr(self.model, "compile_decoder"):
            raise ValueError(f"compile: {type(self.model).__name__} has no compile_decoder()")
        t0 = time.perf_counter()
        self.model.compile_decoder()
        self.runner.warm_up()
        log.info("compiled the decoder stack in %.1f s", time.perf_counter() - t0)

    # ---- capacity --------------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        cfg, mcfg = self.config, self.model_config
        per_block = kv_bytes_per_block(mcfg, cfg.block_size, self.dtype)
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if self.device.type == "cuda":
            return self._profile_cuda_blocks(per_block)
        return max(1, parse_size(cfg.kv_cache_memory) // per_block)

    def _profile_cuda_blocks(self, per_block: int) -> int:
        """vLLM's recipe: run a warm-up forward at the token budget with a tiny cache, measure the
        peak, and give what --gpu-memory-utilization leaves to KV blocks."""
        from iterserve.core.scheduler import ScheduledRequest, SchedulerOutput

        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        probe_pool = BlockPool(self.config.num_kv_blocks or (n // self.config.block_size + 1),
                               self.config.block_size)
        runner = ModelRunner(self.model, self.model_config, probe_pool, self.device, self.dtype)
        dummy = Request("__profile__", [0] * n, SamplingParams(max_tokens=1, temperature=0))
        probe_pool.allocate(dummy.request_id, n)
        torch.cuda.reset_peak_memory_stats()
        runner.execute(SchedulerOutput([ScheduledRequest(dummy, n)]))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del runner
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        avail = total * self.config.gpu_memory_utilization - peak
        if avail < per_block:
            raise RuntimeError(f"no GPU memory left for the KV cache at gpu_memory_utilization="
                               f"{self.config.gpu_memory_utilization} (peak {peak / 2**30:.1f} GiB)")
        return int(avail // per_block)

    # ---- requests --------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        tok = self.tokenizer
        if messages is not None:
            if not messages:
                raise RequestRejected("messages must not be empty")
            if not getattr(tok, "chat_template", None):
                raise RequestRejected("this model has no chat template: send a plain prompt")
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return tok.encode(text, add_special_tokens=False)
        if not prompt:
            raise RequestRejected("prompt must not be empty")
        return tok.encode(prompt)

    def add_request(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                    request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                    messages: list[dict] | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> Request:
        """Validates and queues a request; raises RequestRejected with a clear reason."""
        params = params or SamplingParams()
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
        need = self.scheduler.max_blocks_per_request(req)
        if need > self.pool.num_blocks:
            raise RequestRejected(f"request needs {need} KV blocks but the whole cache has "
                                  f"{self.pool.num_blocks}: shorten it or raise the KV cache size")
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        return req

    def check_limits(self, num_prompt: int, params: SamplingParams) -> None:
        if num_prompt == 0:
            raise RequestRejected("prompt must not be empty")
        if num_prompt > self.max_input_len:
            raise RequestRejected(f"prompt has {num_prompt} tokens, more than max_input_len {self.max_input_len}")
        if params.max_tokens > self.max_output_len:
            raise RequestRejected(f"max_tokens {params.max_tokens} exceeds max_output_len {self.max_output_len}")
        if num_prompt + params.max_tokens > self.max_model_len:
            raise RequestRejected(f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = "
                                  f"{num_prompt + params.max_tokens} exceeds max_model_len {self.max_model_len}")

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        released = self.scheduler.abort_request(request_id)
        req.status = RequestStatus.FINISHED_ABORTED
        self._release(released or [], time.monotonic(), self._pending, finished_ids=None)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        now = time.monotonic()
        sched = self.scheduler.schedule(now)
        if sched.is_empty:
            return outputs
        t0 = time.perf_counter()
        results = self.runner.execute(sched)
        duration = time.perf_counter() - t0
        now = time.monotonic()
        finished: list[tuple[str, int]] = []
        for res in results:
            req = res.scheduled.request
            if res.scheduled.padding:
                req.num_computed_tokens += 1
                continue
            req.num_computed_tokens += res.scheduled.num_tokens
            if res.token_id is None:
                continue
            req.append_token(res.token_id, now)
            if res.logprob is not None:
                req.logprobs.append(res.logprob)
            status = req.check_stop_token(self.max_model_len)
            req.detokenize_step(self.tokenizer)
            if req.check_stop_strings():
                status = RequestStatus.FINISHED_STOPPED
            if status is None:
                outputs.append(self._output(req, [res.token_id], res.logprob))
                continue
            req.status = status
            released = self.scheduler.finish(req)
            if not any(r is req for r, _ in released):  # static: held until its batch ends
                outputs.append(self._output(req, [res.token_id], res.logprob, finished=False))
            else:
                req.times.finished = now
            self._release(released, now, outputs, finished, new_tokens={req.request_id: res})
        self._record(sched, duration, finished, now)
        return outputs

    def _release(self, released, now, outputs, finished_ids, new_tokens=None) -> None:
        for r, freed in released:
            r.times.finished = r.times.finished or now
            if finished_ids is not None:
                finished_ids.append((r.request_id, freed))
            res = (new_tokens or {}).get(r.request_id)
            toks = [res.token_id] if res is not None else []
            outputs.append(self._output(r, toks, res.logprob if res is not None else None, finished=True))
            self.requests.pop(r.request_id, None)

    def _output(self, req: Request, new_ids: list[int], logprob, finished: bool = False) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_ids, text_delta=req.take_text_delta(),
            finished=finished, finish_reason=req.finish_reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            times=req.times, new_logprobs=[logprob] if logprob is not None else [],
            output_text=req.output_text,
        )

    def _record(self, sched, duration: float, finished, now: float) -> None:
        self.step_count += 1
        usage = self.pool.usage()
        rec = StepRecord(
            step=self.step_count, start=now - duration, duration=duration,
            batch_size=len(sched.scheduled), num_padding=sum(s.padding for s in sched.scheduled),
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            prefill_tokens=sched.num_prefill_tokens, decode_tokens=sched.num_decode_tokens,
            kv_used_blocks=usage.used_blocks, kv_total_blocks=usage.total_blocks,
            kv_tokens=usage.tokens_stored,
            preempted=[r.request_id for r in sched.preempted], finished=finished,
        )
        self.records.append(rec)
        if self.config.log_scheduler:
            sched_log.info(rec.log_line())
        elif sched_log.isEnabledFor(logging.DEBUG):
            sched_log.debug(rec.log_line())
        for fn in self.step_listeners:
            fn(rec)


@dataclass
class CompletionResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    times: object
    logprobs: list = field(default_factory=list)


class LLM:
    """Offline batch generation: `LLM(model="smollm2-135m").generate(prompts, params)`."""

    def __init__(self, model: str = "smollm2-135m", loaded=None, config: EngineConfig | None = None,
                 **engine_kwargs) -> None:
        self.engine = LLMEngine(config or EngineConfig(model=model, **engine_kwargs), loaded=loaded)

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priorities: list[int] | None = None) -> list[CompletionResult]:
        """Each prompt is a string, a list of token ids, or {"messages": [...]} for chat."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = []
        for i, (p, sp) in enumerate(zip(prompts, params_list)):
            kw = {"priority": priorities[i]} if priorities else {}
            if isinstance(p, dict):
                req = self.engine.add_request(params=sp, messages=p["messages"], **kw)
            elif isinstance(p, list):
                req = self.engine.add_request(params=sp, prompt_token_ids=p, **kw)
            else:
                req = self.engine.add_request(p, sp, **kw)
            ids.append(req.request_id)
        return self.run_until_done(ids, use_tqdm)

    def run_until_done(self, ids: list[str], use_tqdm: bool = False) -> list[CompletionResult]:
        from tqdm.auto import tqdm

        reqs = {i: self.engine.requests[i] for i in ids}
        done: dict[str, CompletionResult] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in reqs:
                    r = reqs[out.request_id]
                    done[out.request_id] = CompletionResult(
                        r.request_id, r.output_text, list(r.output_token_ids), r.finish_reason,
                        r.num_prompt_tokens, r.num_output_tokens, r.times, r.logprobs)
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
