"""A small draft model with the target's vocabulary (vLLM's method "draft_model"), run by the
engine's own code: a ModelRunner over its own BlockPool and KV cache, no prefix caching.

Drafts are greedy (the argmax of the draft's logits, whatever the request's temperature), so the
draft distribution q is a point mass and the target's acceptance rule stays exact.

The draft's KV cache lags the request: per request it holds the first `computed` tokens. A
proposal catches every row up in one batched step (a new row's whole prompt, an old row's
accepted tokens), then runs k - 1 batched single-token steps on its own drafts. The target then
accepts a prefix of them; the draft's KV stays valid up to the longest prefix of what it was fed
that still equals the request's tokens, and the positions past it are simply overwritten later.
The draft never fails or preempts the target: a row its pool has no room for gets no drafts.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from iterserve.config import ModelConfig, parse_size
from iterserve.core.block_pool import BlockPool
from iterserve.core.scheduler import ScheduledRequest, SchedulerOutput
from iterserve.request import Request
from iterserve.runner import ModelRunner
from iterserve.spec_decode.proposer import Proposer

log = logging.getLogger("iterserve.spec_decode.draft_model")


def check_vocab(draft_cfg: ModelConfig, target_cfg: ModelConfig, draft_tokenizer=None,
                target_tokenizer=None) -> None:
    """Refuses a draft whose token ids mean other tokens than the target's: its drafts would be
    verified against the wrong ids (never wrong output, but nearly never accepted)."""
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocab_size {draft_cfg.vocab_size} differs from "
                         f"the target's {target_cfg.vocab_size}: a draft model must share the target's vocabulary")
    if draft_tokenizer is not None and target_tokenizer is not None:
        if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise ValueError("speculative_config: the draft model's tokenizer maps tokens to other ids than the "
                             "target's: a draft model must share the target's vocabulary")


@dataclass
class _Row:
    computed: int = 0  # the draft's KV holds positions 0 .. computed - 1
    base: int = 0  # positions below base were the request's own tokens when fed
    fed: list[int] = field(default_factory=list)  # drafts fed at positions base, base + 1, ...


class DraftModelProposer(Proposer):
    def __init__(self, runner: ModelRunner, pool: BlockPool, max_positions: int | None = None) -> None:
        if pool.enable_caching:
            raise ValueError("the draft model's pool takes no prefix caching")
        self.runner, self.pool = runner, pool
        self.max_positions = max_positions or getattr(runner.model, "max_positions", None)
        self._rows: dict[str, _Row] = {}

    @classmethod
    def load(cls, spec, platform, target_cfg: ModelConfig, block_size: int, target_tokenizer=None,
             max_model_len: int | None = None) -> DraftModelProposer:
        """Loads spec.model as the engine loads its target (same platform: dtype, device, weight
        layout, attention) with a KV pool of spec.draft_kv_cache_memory bytes. The vocabulary is
        checked from the config before any weight is read."""
        from iterserve.model.loader import load_model, model_config, resolve_model
        from iterserve.core.kv_groups import single_group
        from iterserve.platform.base import kv_bytes_per_block

        src = resolve_model(spec.model)
        check_vocab(model_config(src), target_cfg)
        max_pos = min(max_model_len or target_cfg.max_position_embeddings,
                      model_config(src).max_position_embeddings)
        model, cfg, tokenizer, src = load_model(spec.model, platform.dtype, str(platform.device),
                                                max_positions=max_pos, block_types=platform.gguf_block_types())
        check_vocab(cfg, target_cfg, tokenizer, target_tokenizer)
        platform.prepare_model(model, src)
        # one group: the draft's pool keeps every block (its proposer never frees windowed ones)
        per_block = kv_bytes_per_block(cfg, block_size, platform.kv_cache, single_group(cfg))
        num_blocks = parse_size(spec.draft_kv_cache_memory) // per_block
        if num_blocks < 1:
            raise ValueError(f"speculative_config: draft_kv_cache_memory {spec.draft_kv_cache_memory} holds no "
                             f"KV block of the draft model ({per_block} bytes each)")
        log.info("draft model %s: KV pool of %d blocks of %d tokens (%.0f MiB)", src.name, num_blocks,
                 block_size, num_blocks * per_block / 2**20)
        runner = ModelRunner(model, cfg, num_blocks, block_size, platform.device, platform.dtype,
                             platform.attention, kv_cache=platform.kv_cache, argmax=platform.argmax)
        return cls(runner, BlockPool(num_blocks, block_size), max_pos)

    # ---- bookkeeping ----------------------------------------------------------------------------
    def num_computed(self, request_id: str) -> int:
        """Tokens of the request the draft's KV holds (for tests and the dashboard)."""
        row = self._rows.get(request_id)
        return row.computed if row is not None else 0

    @staticmethod
    def _reconcile(row: _Row, req: Request) -> None:
        """Rolls the draft's KV back to the longest prefix of what it was fed that still equals the
        request's tokens."""
        if row.fed:
            same = 0
            for i, t in enumerate(row.fed):
                if row.base + i >= req.num_tokens or req.token_at(row.base + i) != t:
                    break
                same += 1
            row.computed = row.base + same
            row.fed = []
        row.computed = min(row.computed, req.num_tokens)
        row.base = row.computed

    def verified(self, req: Request) -> None:
        row = self._rows.get(req.request_id)
        if row is not None:
            self._reconcile(row, req)

    def finished(self, req: Request) -> None:
        self._rows.pop(req.request_id, None)
        if req.request_id in self.pool.tables:
            self.pool.free(req.request_id)

    # ---- drafting -------------------------------------------------------------------------------
    def _greedy(self, scheduled: list[ScheduledRequest]) -> list[int]:
        """One batched forward pass; the argmax at each row's last token."""
        runner = self.runner
        inp = runner.prepare(SchedulerOutput(scheduled))
        logits = runner.compute_logits(inp, torch.tensor(inp.last_index, dtype=torch.long, device=runner.device))
        return logits.argmax(dim=-1).tolist()

    def _step(self, req: Request, start: int, token_ids: list[int]) -> ScheduledRequest:
        # padding=True: the runner lays out no prompt-logprob or pooling rows for it; the draft only
        # reads each row's last logits
        return ScheduledRequest(req, len(token_ids), start, self.pool.tables[req.request_id], token_ids,
                                sample=True, padding=True)

    @torch.inference_mode()
    def propose(self, items: list[tuple[Request, int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in items]
        live: list[tuple[int, Request, int, _Row]] = []  # (index into items, request, k, row)
        for i, (req, k) in enumerate(items):
            n = req.num_tokens
            if self.max_positions is not None:
                k = min(k, self.max_positions - n + 1)  # the last draft fed sits at position n + k - 2
            if k < 1 or n < 1:
                continue
            row = self._rows.setdefault(req.request_id, _Row())
            self._reconcile(row, req)
            if not self.pool.allocate(req.request_id, n + k - 1):
                continue  # no room this step: no drafts, and the target carries on
            row.computed = min(row.computed, n - 1)  # at least one token in, for its logits
            live.append((i, req, k, row))
        if not live:
            return drafts
        # catch-up: each row computes what its KV lacks and drafts its first token
        firsts = self._greedy([self._step(req, row.computed,
                                          req.token_slice(row.computed, req.num_tokens - row.computed))
                               for _, req, _, row in live])
        for (i, req, _, row), t in zip(live, firsts):
            row.computed = row.base = req.num_tokens
            row.fed = []
            drafts[i].append(t)
        # then one token a step on its own drafts; rows with a smaller k stop early
        while True:
            live = [x for x in live if len(drafts[x[0]]) < x[2]]
            if not live:
                return drafts
            nexts = self._greedy([self._step(req, row.computed, [drafts[i][-1]]) for i, req, _, row in live])
            for (i, _, _, row), t in zip(live, nexts):
                row.fed.append(drafts[i][-1])
                row.computed += 1
                drafts[i].append(t)
