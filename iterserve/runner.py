"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples.

It owns the device, the KV cache tensors and the sampler: the one place where CPU and CUDA differ.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from iterserve.config import ModelConfig
from iterserve.core.block_pool import BlockPool
from iterserve.core.scheduler import ScheduledRequest, SchedulerOutput
from iterserve.model.attention import AttentionMetadata
from iterserve.sampling import Sampler

log = logging.getLogger("iterserve.runner")


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


@dataclass
class StepResult:
    scheduled: ScheduledRequest
    token_id: int | None  # None: a prefill chunk that did not reach the end of the prompt
    logprob: tuple | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, pool: BlockPool,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.cfg = cfg
        self.pool = pool
        self.device = device
        self.dtype = dtype
        shape = (pool.num_blocks, pool.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]
        self.sampler = Sampler(cfg.vocab_size)

    def _prepare(self, sched: SchedulerOutput):
        bs = self.pool.block_size
        tokens: list[int] = []
        positions: list[int] = []
        token_seq: list[int] = []
        token_qpos: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        logits_idx: list[int] = []
        sampled: list[int] = []  # index into sched.scheduled of rows that get a token
        tables = []
        for i, s in enumerate(sched.scheduled):
            req, n = s.request, s.num_tokens
            start = req.num_computed_tokens
            table = self.pool.tables[req.request_id]
            if s.padding:  # keep computing the finished member's slot, as a static batcher would
                ids = [req.all_token_ids[-1]]
                start = min(start, len(table) * bs - 1)  # stay inside its reservation
            else:
                ids = [req.token_at(j) for j in range(start, start + n)]
            tokens.extend(ids)
            positions.extend(range(start, start + n))
            token_seq.extend([i] * n)
            token_qpos.extend(range(n))
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(table)
            if s.padding or start + n == req.num_tokens:
                logits_idx.append(len(tokens) - 1)
                sampled.append(i)
        max_blocks = max(len(t) for t in tables)
        table_t = torch.zeros((len(tables), max_blocks), dtype=torch.long)
        for i, t in enumerate(tables):
            table_t[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        pos_t = torch.tensor(positions, dtype=torch.long)
        seq_t = torch.tensor(token_seq, dtype=torch.long)
        slots = table_t[seq_t, pos_t // bs] * bs + pos_t % bs
        qloc = torch.zeros(len(query_lens) + 1, dtype=torch.long)
        qloc[1:] = torch.tensor(query_lens).cumsum(0)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev),
            block_tables=table_t.to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.long, device=dev),
            query_lens=query_lens,
            query_start_loc=qloc.to(dev),
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            token_seq=seq_t.to(dev),
            token_qpos=torch.tensor(token_qpos, dtype=torch.long, device=dev),
        )
        input_ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        return input_ids, pos_t.to(dev), meta, torch.tensor(logits_idx, dtype=torch.long, device=dev), sampled

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[StepResult]:
        input_ids, positions, meta, logits_idx, sampled = self._prepare(sched)
        logits = self.model(input_ids, positions, self.kv_caches, meta, logits_idx)
        rows = [sched.scheduled[i] for i in sampled]
        reqs = [s.request for s in rows]
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
