"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples.

Besides the sampled rows, a step may ask the model for the logits of prompt positions (a request
that wants its prompt's logprobs: each position's log-softmax at the next prompt token) and for the
final hidden states of prompt positions (an embedding request: pooling.py); both come out of the
same forward pass as the sampled logits, and neither goes through the sampler or the constraints.

It owns the KV cache tensors and the sampler. Everything it needs about a step comes in the
scheduler's output (each request's block tables, start position and input ids), so it never reads
the block pool; the device, dtype and attention backend come from the platform, chosen once when
the engine starts.

KV cache groups (core/kv_groups.py): the cache is `group_size` tensor pairs, layer j of every group
using pair j, and each group's rows get their own block tables and slots, so the step has one
AttentionMetadata per group and each layer reads its group's (the forward context maps them).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from iterserve.attention.backend import AttentionBackend
from iterserve.attention.forward_context import forward_context
from iterserve.attention.kv_cache_dtype import KVCacheFormat, format_of_dtype
from iterserve.attention.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata
from iterserve.config import ModelConfig
from iterserve.core.kv_groups import KVCacheGroups, single_group
from iterserve.core.scheduler import ScheduledRequest, SchedulerOutput
from iterserve.lora.layers import LoRABatch
from iterserve.memory import zeros_in_large_pages
from iterserve.rejection_sampler import Verified, verify_drafts
from iterserve.request import Request
from iterserve.sampling import Sampler, SamplingParams, first_argmax
from iterserve.structured.grammar import RequestGrammar
from iterserve.structured.logits import TokenConstraints, allocate_bitmask
from iterserve.thinking_gate import apply_forced, forced_tokens, step_grammar

log = logging.getLogger("iterserve.runner")


class _FixedMask:
    """A grammar's mask computed ahead (at a draft's position), offered where TokenConstraints
    expects a grammar."""

    def __init__(self, words: torch.Tensor) -> None:
        self.words = words

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.words


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)


@dataclass
class StepInputs:
    """One step's model inputs, in the flat order `prepare` chose."""
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metas: list[AttentionMetadata]  # one per KV cache group
    logits_indices: torch.Tensor  # flat rows whose logits are sampled
    sampled: list[int]  # index into sched.scheduled of each sampled request, in the same order
    last_index: list[int]  # flat row of each scheduled request's last token this step
    # prompt logprobs: (index into sched.scheduled, flat rows, the prompt token each row predicts)
    prompt_rows: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    # pooling: (index into sched.scheduled, flat rows, the prompt position pooled up to after them)
    pooled_rows: list[tuple[int, list[int], int]] = field(default_factory=list)
    lora: LoRABatch | None = None  # the rows of each adapter slot; None when no row has one


@dataclass
class StepResult:
    scheduled: ScheduledRequest
    token_id: int | None  # None: a prefill chunk that did not reach the end of the prompt
    logprob: tuple | None = None
    # a row that verified drafts: how many were accepted and the tokens it yields (the accepted
    # drafts, then one the target drew), each with its logprob entry (or None)
    spec: Verified | None = None
    spec_logprobs: list | None = None
    prompt_logprobs: list | None = None  # the next prompt tokens' (logprob, rank, top k), in order
    pooled: tuple[torch.Tensor, int] | None = None  # (float32 sum of hidden states, pooled up to)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, attention: AttentionBackend,
                 kv_groups: KVCacheGroups | None = None, kv_cache: KVCacheFormat | None = None,
                 argmax: Callable[[torch.Tensor], torch.Tensor] = first_argmax) -> None:
        """kv_groups: how the layers share block tables (None: one group of every layer, every block
        kept for the whole sequence, as a pool with one full group keeps them). kv_cache: the caches'
        format (--kv-cache-dtype, resolved by the platform); None: the model's dtype. argmax: the
        platform's greedy choice (Platform.argmax)."""
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.attention = attention
        self.kv_groups = kv_groups or single_group(cfg)
        self.kv_cache = kv_cache or format_of_dtype(dtype)
        shape = self.kv_cache.cache_shape(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        store = self.kv_cache.storage

        def zeros() -> torch.Tensor:  # on CPU in 2 MiB pages (memory.zeros_in_large_pages says why)
            if torch.device(device).type == "cpu":
                return zeros_in_large_pages(shape, store)
            return torch.zeros(shape, dtype=store, device=device)

        slots = [(zeros(), zeros()) for _ in range(self.kv_groups.group_size)]
        placement = [self.kv_groups.layer_slot(i) for i in range(cfg.num_layers)]
        self.layer_group = [g for g, _ in placement]  # which group's metadata each layer reads
        self.kv_caches = [slots[j] for _, j in placement]  # layer j of every group shares tensor pair j
        self.sampler = Sampler(cfg.vocab_size, argmax)
        self.constraints = TokenConstraints(cfg.vocab_size)
        self.lora = None  # lora.manager.LoRAManager with --enable-lora (the engine sets it)

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
        prompt_rows: list[tuple[int, list[int], list[int]]] = []
        pooled_rows: list[tuple[int, list[int], int]] = []
        num_groups = len(self.kv_groups.groups)
        slots = [[] for _ in range(num_groups)]
        dec_tables = [[] for _ in range(num_groups)]
        pre_tables = [[] for _ in range(num_groups)]
        dec_ctx, pre_q, pre_ctx = [], [], []
        row_slots: list[int] | None = None
        if self.lora is not None and any(sched.scheduled[i].request.lora_name for i in rows):
            row_slots = []
        for i in rows:
            s = sched.scheduled[i]
            n, start, tables = s.num_tokens, s.start, s.group_tables(num_groups)
            if row_slots is not None:
                name = s.request.lora_name
                row_slots.extend([self.lora.slot(name) if name else -1] * n)
            tokens.extend(s.token_ids)
            positions.extend(range(start, start + n))
            for g, table in enumerate(tables):
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
                (dec_tables if n == 1 else pre_tables)[g].append(table)
            if n == 1:
                dec_ctx.append(start + 1)
            else:
                pre_q.append(n)
                pre_ctx.append(start + n)
            last_index[i] = len(tokens) - 1
            first = len(tokens) - n  # flat row of position `start`
            req = s.request
            if not s.padding:
                lp_pos = req.prompt_logprob_rows(start, n)
                if lp_pos:
                    prompt_rows.append((i, [first + p - start for p in lp_pos],
                                        [req.prompt_token_ids[p + 1] for p in lp_pos]))
                pool_pos = req.pooled_rows(start, n)
                if pool_pos:
                    pooled_rows.append((i, [first + p - start for p in pool_pos], pool_pos.stop))
            if s.sample and not req.is_pooling:
                # a row verifying drafts is sampled at its last token and after each draft
                logits_idx.extend(range(len(tokens) - 1 - len(s.spec_token_ids), len(tokens)))
                sampled.append(i)
        dev = self.device
        metas = []
        dec_lens = torch.tensor(dec_ctx, dtype=torch.long, device=dev) if dec_ctx else None
        for g in range(num_groups):
            decode = prefill = None
            if dec_ctx:
                decode = DecodeMetadata(block_tables=_pad_tables(dec_tables[g], dev), context_lens=dec_lens,
                                        max_context_len=max(dec_ctx))
            if pre_q:
                prefill = PrefillMetadata(block_tables=_pad_tables(pre_tables[g], dev), query_lens=pre_q,
                                          context_lens=pre_ctx)
            metas.append(AttentionMetadata(slot_mapping=torch.tensor(slots[g], dtype=torch.long, device=dev),
                                           num_decode_tokens=len(dec_ctx), decode=decode, prefill=prefill))
        return StepInputs(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            metas=metas,
            logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=dev),
            sampled=sampled,
            last_index=last_index,
            prompt_rows=prompt_rows,
            pooled_rows=pooled_rows,
            lora=LoRABatch.build(row_slots, self.lora, dev) if row_slots is not None else None,
        )

    @contextmanager
    def step_context(self, metas: list[AttentionMetadata], lora: LoRABatch | None = None) -> Iterator[None]:
        """The forward context every layer's attention and LoRA hook reads (attention/forward_context.py).
        metas: one per KV cache group, or one that every group reads (a dummy step)."""
        layer_meta = [metas[g] for g in self.layer_group] if len(metas) > 1 else None
        with forward_context(metas[0], self.kv_caches, self.attention, lora, layer_meta):
            yield

    def compute_logits(self, inp: StepInputs, logits_indices: torch.Tensor) -> torch.Tensor:
        """Runs the model on a prepared step; logits [len(logits_indices), vocab]."""
        with self.step_context(inp.metas, inp.lora):
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
            with self.step_context([meta]):
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
        results = [StepResult(s, None) for s in sched.scheduled]
        extra = [r for _, rows, _ in inp.prompt_rows for r in rows]
        rows_idx = inp.logits_indices
        if extra:  # the prompt positions' logits come after the sampled rows'
            rows_idx = torch.cat([rows_idx, torch.tensor(extra, dtype=torch.long, device=self.device)])
        if inp.pooled_rows:
            hidden_idx = torch.tensor([r for _, rows, _ in inp.pooled_rows for r in rows], dtype=torch.long,
                                      device=self.device)
            with self.step_context(inp.metas, inp.lora):
                all_logits, hidden = self.model.forward_with_hidden(inp.input_ids, inp.positions, rows_idx,
                                                                    hidden_idx)
            self._pool(inp, hidden, results)
        else:
            all_logits = self.compute_logits(inp, rows_idx)
        num_sampled = len(inp.logits_indices)
        if extra:
            self._prompt_logprobs(inp, all_logits[num_sampled:], results)
        if num_sampled:
            self._sample(sched, inp, all_logits[:num_sampled], results)
        return results

    def _sample(self, sched: SchedulerOutput, inp: StepInputs, logits: torch.Tensor,
                results: list[StepResult]) -> None:
        sampled = inp.sampled
        rows = [sched.scheduled[i] for i in sampled]
        if any(s.spec_token_ids for s in rows):
            self._sample_with_drafts(rows, sampled, logits, results)
            return
        reqs = [s.request for s in rows]
        live = [not s.padding for s in rows]  # static batching's padding rows are sampled, never used
        logits = self.constraints.apply(logits, [step_grammar(r) if ok else None for r, ok in zip(reqs, live)],
                                        [r.params.logit_bias if ok else None for r, ok in zip(reqs, live)])
        logits = apply_forced(logits, forced_tokens(reqs, live))  # a spent thinking budget's end marker
        penal = any(r.params.has_penalties for r in reqs)
        sample = self.sampler(
            logits, [r.params for r in reqs],
            [r.all_token_ids if penal else [] for r in reqs],
            [r.num_prompt_tokens for r in reqs],
            [r.generator for r in reqs],
        )
        for row, i in enumerate(sampled):
            results[i].token_id = sample.token_ids[row]
            results[i].logprob = sample.logprobs[row]

    def _sample_with_drafts(self, rows: list[ScheduledRequest], sampled: list[int], logits: torch.Tensor,
                            results: list[StepResult]) -> None:
        """A step where some rows verify drafts: every logits row gets its own request's
        constraints as they stand after the drafts before it (grammar state, penalties' history);
        rows without drafts are sampled as always, the others verified (rejection_sampler.py)."""
        grammars, biases, params, histories, plens, kept = [], [], [], [], [], []
        for s in rows:
            req, drafts = s.request, s.spec_token_ids
            masks, n_ok = self._draft_masks(req.grammar, drafts) if req.grammar is not None and drafts \
                else ([step_grammar(req)] * (len(drafts) + 1), len(drafts))
            kept.append(n_ok)
            penal = req.params.has_penalties
            for j in range(len(drafts) + 1):
                grammars.append(masks[j])
                biases.append(req.params.logit_bias)
                params.append(req.params)
                histories.append(req.all_token_ids + drafts[:j] if penal else [])
                plens.append(req.num_prompt_tokens)
        logits = self.constraints.apply(logits, grammars, biases)
        # rows without drafts may be thinking (only answering requests draft): their forced tokens
        logits = apply_forced(logits, [f for s in rows for f in forced_tokens([s.request], [True])
                                       + [None] * len(s.spec_token_ids)])
        raw = logits.float()
        lo = 0
        plain = [r for r, s in enumerate(rows) if not s.spec_token_ids]
        starts = []
        for s in rows:
            starts.append(lo)
            lo += len(s.spec_token_ids) + 1
        if plain:
            idx = [starts[r] for r in plain]
            reqs = [rows[r].request for r in plain]
            sample = self.sampler(raw[idx], [q.params for q in reqs], [histories[i] for i in idx],
                                  [q.num_prompt_tokens for q in reqs], [q.generator for q in reqs])
            for j, r in enumerate(plain):
                results[sampled[r]].token_id = sample.token_ids[j]
                results[sampled[r]].logprob = sample.logprobs[j]
        argmax: list[int] | None = None
        for r, s in enumerate(rows):
            if not s.spec_token_ids:
                continue
            req, a, k = s.request, starts[r], kept[r]
            drafts = s.spec_token_ids[:k]
            if req.params.greedy and not req.params.has_penalties:
                # p is one-hot at the argmax: the rule is "accept while the draft is the argmax"
                argmax = self.sampler.argmax(raw).tolist() if argmax is None else argmax
                n_ok = next((j for j in range(k) if argmax[a + j] != drafts[j]), k)
                v = Verified(n_ok, drafts[:n_ok] + [argmax[a + n_ok]])
            else:
                sl = slice(a, a + k + 1)
                probs = self.sampler.target_probs(raw[sl], params[sl], histories[sl], plens[sl])
                u = self.sampler.uniforms(k + 1, [req.generator] * (k + 1), raw.device)
                v = verify_drafts(probs, drafts, u[:k], u[k:])
            lps = self.sampler.logprobs(raw[a:a + len(v.token_ids)], v.token_ids,
                                        [req.params] * len(v.token_ids)) \
                if req.params.logprobs is not None else [None] * len(v.token_ids)
            res = results[sampled[r]]
            res.token_id, res.logprob, res.spec, res.spec_logprobs = v.token_ids[0], lps[0], v, lps

    def _draft_masks(self, grammar: RequestGrammar, drafts: list[int]) -> tuple[list, int]:
        """The grammar's mask at the row's last token and after each draft it allows, and how many
        leading drafts it allows: a draft the grammar forbids, and all after it, are never
        verified (so never accepted). The matcher is rolled back to where it was."""
        bits = allocate_bitmask(len(drafts) + 1, self.cfg.vocab_size)
        ok = grammar.valid_prefix(drafts)
        grammar.fill_bitmask(bits, 0)
        for j in range(ok):
            grammar.accept_token(drafts[j])
            grammar.fill_bitmask(bits, j + 1)
        if ok:
            grammar.rollback(ok)
        masks = [_FixedMask(bits[min(j, ok)]) for j in range(len(drafts) + 1)]
        return masks, ok

    PROMPT_LOGPROB_ROWS = 256  # log-softmax over this many prompt rows at a time (each row is a vocab)

    def _prompt_logprobs(self, inp: StepInputs, logits: torch.Tensor, results: list[StepResult]) -> None:
        """Each prompt position's log-softmax at the prompt token that follows it (raw logits: no
        bias, no grammar), its rank in the distribution (1 = the most likely) and the top k."""
        targets = torch.tensor([t for _, _, toks in inp.prompt_rows for t in toks], dtype=torch.long,
                               device=logits.device)
        k = max(results[i].scheduled.request.params.prompt_logprobs for i, _, _ in inp.prompt_rows)
        chosen, ranks, top_v, top_i = [], [], [], []
        for lo in range(0, logits.shape[0], self.PROMPT_LOGPROB_ROWS):
            lp = logits[lo:lo + self.PROMPT_LOGPROB_ROWS].float().log_softmax(dim=-1)
            tgt = targets[lo:lo + self.PROMPT_LOGPROB_ROWS]
            picked = lp.gather(1, tgt.unsqueeze(1))
            chosen.append(picked.squeeze(1))
            ranks.append((lp > picked).sum(dim=1) + 1)
            if k:
                v, i = lp.topk(k, dim=-1)
                top_v.append(v)
                top_i.append(i)
        chosen_l, ranks_l = torch.cat(chosen).tolist(), torch.cat(ranks).tolist()
        top_vl = torch.cat(top_v).tolist() if k else None
        top_il = torch.cat(top_i).tolist() if k else None
        row = 0
        for i, rows, _ in inp.prompt_rows:
            kk = results[i].scheduled.request.params.prompt_logprobs
            entries = []
            for _ in rows:
                top = list(zip(top_il[row][:kk], top_vl[row][:kk])) if kk else []
                entries.append((chosen_l[row], ranks_l[row], top))
                row += 1
            results[i].prompt_logprobs = entries

    @staticmethod
    def _pool(inp: StepInputs, hidden: torch.Tensor, results: list[StepResult]) -> None:
        """Each embedding request's hidden states of this step, summed in float32 (pooling.py)."""
        row = 0
        for i, rows, upto in inp.pooled_rows:
            results[i].pooled = (hidden[row:row + len(rows)].float().sum(dim=0), upto)
            row += len(rows)
