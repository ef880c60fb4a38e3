"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples.

It owns the KV cache tensors and the sampler. Everything it needs about a step comes in the
scheduler's output (each request's block table, start position and input ids), so it never reads
the block pool; the device, dtype and attention backend come from the platform, chosen once when
the engine starts.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from iterserve.attention.backend import AttentionBackend
from iterserve.attention.forward_context import forward_context
from iterserve.attention.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata
from iterserve.config import ModelConfig
from iterserve.core.scheduler import ScheduledRequest, SchedulerOutput
from iterserve.request import Request
from iterserve.sampling import Sampler, SamplingParams
from iterserve.structured.logits import TokenConstraints

log = logging.getLogger("iterserve.runner")


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)


@dataclass
class StepInputs:
    """One step's model inputs, in the flat order `prepare` chose."""
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # flat rows whose logits are sampled
    sampled: list[int]  # index into sched.scheduled of each sampled row, in the same order
    last_index: list[int]  # flat row of each scheduled request's last token this step


@dataclass
class StepResult:
    scheduled: ScheduledRequest
    token_id: int | None  # None: a prefill chunk that did not reach the end of the prompt
    logprob: tuple | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, attention: AttentionBackend) -> None:
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.attention = attention
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]
        self.sampler = Sampler(cfg.vocab_size)
        self.constraints = TokenConstraints(cfg.vocab_size)

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """Lays the step out as the attention expects: single-token rows first, then prefill
        chunks; each group keeps the scheduler's order."""
        bs = self.block_size
        rows = sorted(range(len(sched.scheduled)), key=lambda i: sched.scheduled[i].num_tokens > 1)
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_index = [0] * len(rows)
        logits_idx: list[int] = []
        sampled: list[int] = []
        dec_tables, dec_ctx, pre_tables, pre_q, pre_ctx = [], [], [], [], []
        for i in rows:
            s = sched.scheduled[i]
            n, start, table = s.num_tokens, s.start, s.block_table
            tokens.extend(s.token_ids)
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                dec_tables.append(table)
                dec_ctx.append(start + 1)
            else:
                pre_tables.append(table)
                pre_q.append(n)
                pre_ctx.append(start + n)
            last_index[i] = len(tokens) - 1
            if s.sample:
                logits_idx.append(len(tokens) - 1)
                sampled.append(i)
        dev = self.device
        decode = prefill = None
        if dec_tables:
            decode = DecodeMetadata(block_tables=_pad_tables(dec_tables, dev),
                                    context_lens=torch.tensor(dec_ctx, dtype=torch.long, device=dev),
                                    max_context_len=max(dec_ctx))
        if pre_tables:
            prefill = PrefillMetadata(block_tables=_pad_tables(pre_tables, dev), query_lens=pre_q,
                                      context_lens=pre_ctx)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                                 num_decode_tokens=len(dec_tables), decode=decode, prefill=prefill)
        return StepInputs(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=dev),
            sampled=sampled,
            last_index=last_index,
        )

    @contextmanager
    def step_context(self, meta: AttentionMetadata) -> Iterator[None]:
        """The forward context every layer's attention reads (attention/forward_context.py)."""
        with forward_context(meta, self.kv_caches, self.attention):
            yield

    def compute_logits(self, inp: StepInputs, logits_indices: torch.Tensor) -> torch.Tensor:
        """Runs the model on a prepared step; logits [len(logits_indices), vocab]."""
        with self.step_context(inp.meta):
            return self.model(inp.input_ids, inp.positions, logits_indices)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Runs the model on dummy decode steps of 1 and 2 tokens, so a compiled model compiles
        now, not in the first request's step (torch.compile makes one graph for a single token and
        one for any larger count). Call it before any request holds KV blocks: their K/V go to
        slot 0 of block 0, which is rewritten before it is read."""
        for n in (1, 2):
            def zeros() -> torch.Tensor:  # a new tensor each: aliased inputs would be a guard of their own
                return torch.zeros(n, dtype=torch.long, device=self.device)

            decode = DecodeMetadata(block_tables=zeros().view(n, 1), context_lens=zeros() + 1, max_context_len=1)
            meta = AttentionMetadata(slot_mapping=zeros(), num_decode_tokens=n, decode=decode, prefill=None)
            with self.step_context(meta):
                self.model(zeros(), zeros(), torch.arange(n, device=self.device))

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """One prefill of `num_tokens` dummy tokens in blocks 0.., the largest step the engine
        schedules: what a platform measures to size the KV cache. Needs that many blocks."""
        dummy = Request("__profile__", [0] * num_tokens, SamplingParams(max_tokens=1, temperature=0))
        table = list(range(-(-num_tokens // self.block_size)))
        self.execute(SchedulerOutput([ScheduledRequest(dummy, num_tokens, 0, table, dummy.prompt_token_ids,
                                                       sample=True)]))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[StepResult]:
        inp = self.prepare(sched)
        logits = self.compute_logits(inp, inp.logits_indices)
        sampled = inp.sampled
        rows = [sched.scheduled[i] for i in sampled]
        reqs = [s.request for s in rows]
        live = [not s.padding for s in rows]  # static batching's padding rows are sampled, never used
        logits = self.constraints.apply(logits, [r.grammar if ok else None for r, ok in zip(reqs, live)],
                                        [r.params.logit_bias if ok else None for r, ok in zip(reqs, live)])
        penal = any(r.params.has_penalties for r in reqs)
        sample = self.sampler(
            logits, [r.params for r in reqs],
            [r.all_token_ids if penal else [] for r in reqs],
            [r.num_prompt_tokens for r in reqs],
            [r.generator for r in reqs],
        )
        results = [StepResult(s, None) for s in sched.scheduled]
        for row, i in enumerate(sampled):
            results[i].token_id = sample.token_ids[row]
            results[i].logprob = sample.logprobs[row]
        return results
