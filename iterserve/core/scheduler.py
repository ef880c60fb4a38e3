"""Iteration-level (continuous batching) scheduler, in the style of vLLM v1.

Each call to `schedule()` spends a token budget over the running requests first (decodes before
prefill chunks, so one long prompt never stalls every decode), then admits waiting requests while
sequences, budget and KV blocks allow. When blocks run out it preempts by recompute: the victim
(lowest priority, then newest) gives back all its blocks, keeps its generated tokens, and goes back
to the waiting queue to be recomputed later with identical output.

Prefix caching: on admission (and re-admission after preemption) the longest run of the request's
full blocks already in the pool's cache is shared by reference, and its computed tokens start
after them; at least the last token is always computed (its logits give the next token), and so is
every position whose logits (prompt logprobs) or hidden state (pooling) a request still needs. Blocks
are registered in the cache once their KV is computed, i.e. at the step after they were scheduled.

No preemption thrash: a prefill chunk that does not fit in the free blocks shrinks to what fits
instead of preempting (it preempts only a request the policy ranks below itself, and only when not
even one token fits); a request that was preempted is re-admitted only when all the blocks it needs
to reach its next token are free, not one chunk's worth that the next step would take back.

KV cache groups (core/kv_groups.py): every group's blocks are counted together, and before each step
a running request's windowed groups give back the blocks its next query can no longer see
(`BlockPool.remove_skipped_blocks`), so decodes and chunks of a windowed model mostly recycle blocks.

The static batcher (core/static.py) implements the same interface, and everything that differs
between the two is declared on it (`SchedulerBase`): when an idle engine should wake up
(`next_deadline`), whether a finished request is released at once or held (`finish`), and which
rows are padding (`ScheduledRequest.padding`). The engine, the runner and the server never ask
which one they drive.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from iterserve.config import EngineConfig
from iterserve.core.block_hash import hash_block_chain
from iterserve.core.block_pool import BlockPool
from iterserve.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step, with all the runner needs to lay it out (as vLLM v1's
    scheduler output): the runner reads neither the block pool nor the request's progress."""
    request: Request
    num_tokens: int  # tokens computed for it this step
    start: int  # position of the first of them (the tokens before it are in the KV cache)
    block_table: list[int]  # the request's KV blocks in order (the pool's own list: read it this step)
    token_ids: list[int]  # the num_tokens input ids
    sample: bool  # the step reaches the request's last known token: sample the next one
    padding: bool = False  # static batching: a finished member still computed; its sample is dropped
    # speculative decoding: draft tokens verified after the request's last token (token_ids ends
    # with them); every position is sampled and the longest accepted run is kept (rejection_sampler.py)
    spec_token_ids: list[int] = field(default_factory=list)
    # one block table per KV cache group (core/kv_groups.py), block_table being group 0's; empty:
    # block_table serves every group (one group, or a dummy step whose blocks are all the same)
    block_tables: list[list[int]] = field(default_factory=list)

    def group_tables(self, num_groups: int) -> list[list[int]]:
        """The request's table of each of num_groups KV cache groups."""
        return self.block_tables or [self.block_table] * num_groups


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[tuple[str, int]] = field(default_factory=list)  # (request id, prefix-cache hit tokens)
    failed: list[tuple[Request, str]] = field(default_factory=list)  # waiting requests that cannot run, and why

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.num_tokens > 1 and not s.spec_token_ids)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of decoding rows: one each, plus the drafts a speculating row verifies."""
        return sum(s.num_tokens for s in self.scheduled if s.num_tokens == 1 or s.spec_token_ids)

    @property
    def num_padding(self) -> int:
        return sum(s.padding for s in self.scheduled)

    def attended_kv(self) -> tuple[int, int]:
        """What attention reads this step, which its time grows with: (the single-token rows'
        context lengths summed, the sum over prompt chunks of chunk length x context length).
        Each row attends to its `start` cached tokens plus its own new ones. Step records carry
        both, so a step-time model can be checked on a server's own steps."""
        decode = prefill = 0
        for s in self.scheduled:
            ctx = s.start + s.num_tokens
            if s.num_tokens == 1:
                decode += ctx
            else:
                prefill += s.num_tokens * ctx
        return decode, prefill

    def cached_prefill_kv(self) -> int:
        """Of attended_kv's second number, the part a prompt chunk reads from tokens cached before it
        (chunk length x start, summed): the chunk's causal half over its own tokens skips half its
        matrix, a later chunk's reads of its whole cached context skip nothing."""
        return sum(s.num_tokens * s.start for s in self.scheduled if s.num_tokens > 1)

    def shared_decode_kv(self, block_size: int, null_block: int | None = None) -> int:
        """Of the single-token rows' attended tokens (attended_kv's first number), those in KV blocks
        that an earlier row of this step also reads: prefix caching's shared blocks. A block read
        again in the same step is still in the CPU's caches, so a decode step over rows that share a
        long system prompt runs faster than one over distinct blocks (measured: 10-35% at 8-32 rows
        sharing 400 tokens); step records carry the count so a step model can price both. Shared
        blocks are always full and lead the table (hash-chained prefixes), so rows whose first block
        nobody else has are skipped without walking their tables. Group 0's tables are read (a full
        group's, when the model has full layers); a windowed group's freed entries all name the null
        block (null_block: BlockPool.null_block), which counts as shared by no one."""
        rows = [s for s in self.scheduled if s.num_tokens == 1 and s.block_table]
        if len(rows) < 2:
            return 0
        firsts: dict[int, int] = {}
        for s in rows:
            firsts[s.block_table[0]] = firsts.get(s.block_table[0], 0) + 1
        seen: set[int] = set()
        shared = 0
        for s in rows:
            if firsts[s.block_table[0]] < 2 or s.block_table[0] == null_block:
                continue
            n = -(-(s.start + 1) // block_size)  # blocks this row attends to
            j = 0
            while j < n and s.block_table[j] in seen and s.block_table[j] != null_block:
                shared += min(block_size, s.start + 1 - j * block_size)
                j += 1
            seen.update(s.block_table[j:n])
        return shared

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.failed


class WaitingQueue:
    """Requests ordered by the policy: fcfs by arrival; priority by (priority, arrival)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._items: list[tuple[tuple, Request]] = []
        self._seq = itertools.count()

    def key(self, req: Request) -> tuple:
        base = (req.times.arrival, req.request_id)
        return ((req.priority,) + base) if self.policy == "priority" else base

    def push(self, req: Request) -> None:
        bisect.insort(self._items, (self.key(req), req), key=lambda it: it[0])

    def peek(self) -> Request:
        return self._items[0][1]

    def pop(self) -> Request:
        return self._items.pop(0)[1]

    def remove(self, request_id: str) -> Request | None:
        for i, (_, r) in enumerate(self._items):
            if r.request_id == request_id:
                return self._items.pop(i)[1]
        return None

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return (r for _, r in self._items)


class SchedulerBase:
    """What both batching modes share: the waiting queue, the running set, the block pool."""

    def __init__(self, config: EngineConfig, pool: BlockPool, max_model_len: int) -> None:
        self.config = config
        self.pool = pool
        self.max_model_len = max_model_len
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        self.num_recomputed_tokens = 0  # tokens computed again after a preemption (cache misses)
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache at admissions (vLLM's name)
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self.lora = None  # lora.manager.LoRAManager with --enable-lora (the engine sets it): adapter slots

    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.push(req)

    def abort_request(self, request_id: str) -> list[tuple[Request, int]] | None:
        """Aborts a waiting or running request. Returns the requests released now with the blocks
        each freed (as `finish`), or None when the id is unknown."""
        req = self.waiting.remove(request_id)
        if req is not None:
            return [(req, 0)]
        for r in self.running:
            if r.request_id == request_id:
                return self.finish(r)
        return None

    def _drop_running(self, req: Request) -> int:
        self.running.remove(req)
        return self._free_blocks(req)

    def _update_block_hashes(self, req: Request) -> list[bytes]:
        """Extends the request's hash chain over its full blocks (prompt and generated tokens)."""
        if self.pool.enable_caching and len(req.block_hashes) < req.num_tokens // self.pool.block_size:
            req.block_hashes = hash_block_chain(req.all_token_ids, self.pool.block_size, extra_key=req.cache_key,
                                                parent_hashes=req.block_hashes)
        return req.block_hashes

    def _cache_computed(self, req: Request) -> None:
        """Registers the request's blocks whose KV is computed, so others can share them."""
        if self.pool.enable_caching:
            self.pool.cache_blocks(req.request_id, self._update_block_hashes(req), req.num_computed_tokens)

    def _free_blocks(self, req: Request) -> int:
        self._cache_computed(req)  # what it computed stays reusable after it leaves
        return self.pool.free(req.request_id)

    def trim_unverified(self, req: Request) -> int:
        """After a step that verified drafts: gives back the blocks only rejected drafts used (the
        request keeps what its verified tokens and the next one need); returns how many."""
        return self.pool.truncate(req.request_id, req.num_computed_tokens + 1)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish(self, req: Request) -> list[tuple[Request, int]]:
        """The engine saw req stop. Returns the requests released now with the blocks each freed:
        req itself at once (continuous), or nothing while its batch runs on (static, which then
        computes it as padding and releases the whole batch when its last member stops)."""
        raise NotImplementedError

    def schedule(self, now: float) -> SchedulerOutput:
        raise NotImplementedError

    def next_deadline(self) -> float | None:
        """When, with no new request, `schedule` may next have work although the last call had none
        (time.monotonic()); None: only a new request or a finished step changes anything."""
        return None

    def _scheduled(self, req: Request, n: int, drafts: list[int] | None = None) -> ScheduledRequest:
        """`n` more tokens of `req`, which already holds the blocks for them; with drafts, its last
        token and n - 1 drafts after it."""
        start = req.num_computed_tokens
        tables = self.pool.group_tables[req.request_id]
        many = tables if len(tables) > 1 else []
        if drafts:
            return ScheduledRequest(req, n, start, tables[0], req.token_slice(start, 1) + drafts, sample=True,
                                    spec_token_ids=drafts, block_tables=many)
        return ScheduledRequest(req, n, start, tables[0], req.token_slice(start, n),
                                sample=start + n == req.num_tokens, block_tables=many)

    def max_blocks_per_request(self, req: Request) -> int:
        """Blocks the request needs at least (for rejecting what can never fit): its whole length in
        full groups, its window in windowed ones (a prefill chunk shrinks to what is free)."""
        return self.pool.blocks_per_sequence(min(req.max_total_tokens, self.max_model_len))


class Scheduler(SchedulerBase):
    """Continuous batching: membership of the batch is decided anew at every step."""

    def __init__(self, config: EngineConfig, pool: BlockPool, max_model_len: int) -> None:
        if config.max_num_batched_tokens is None:  # the device's default is chosen above the scheduler
            raise ValueError("the scheduler needs a token budget: config.with_step_budget(config, device) first")
        super().__init__(config, pool, max_model_len)

    def _victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=self._rank)

    def _rank(self, req: Request) -> tuple:
        """Higher ranks are preempted first: lowest priority (policy 'priority'), then newest."""
        if self.config.scheduling_policy == "priority":
            return (req.priority, req.times.arrival, req.request_id)
        return (req.times.arrival, req.request_id)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._free_blocks(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_before_preemption = req.num_computed_tokens
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.push(req)
        out.preempted.append(req)

    def _fit(self, req: Request) -> int:
        """Tokens the request can compute now without taking blocks from anyone."""
        return self.pool.fit_tokens(req.request_id, req.num_computed_tokens)

    def schedule(self, now: float) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        for req in self.running:  # last step's KV is written: share its full blocks from now on
            self._cache_computed(req)
            # windowed groups give back what the next query no longer sees (before anyone allocates)
            self.pool.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
        budget = cfg.max_num_batched_tokens
        # decodes first, then prefill chunks; stable, so arrival order holds within each group
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        scheduled_ids: set[str] = set()
        for req in order:
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts: list[int] = []
            if n == 1 and req.spec_token_ids:  # drafts take budget and free blocks, never preempt anyone
                drafts = req.spec_token_ids[:max(0, min(budget, self._fit(req)) - 1)]
                n += len(drafts)
            req.spec_token_ids = []
            if n > 1 and not drafts:  # a prefill chunk shrinks to the free blocks rather than preempting
                n = min(n, self._fit(req))
                while n < 1:
                    lower = [r for r in self.running if r.request_id not in scheduled_ids
                             and r is not req and self._rank(r) > self._rank(req)]
                    if not lower:
                        break
                    self._preempt(self._victim(lower), out)
                    n = min(req.num_tokens - req.num_computed_tokens, budget, self._fit(req))
                if n < 1:
                    continue  # waits for blocks; those ranked above it keep going
            while not self.pool.allocate(req.request_id, req.num_computed_tokens + n):
                candidates = [r for r in self.running if r.request_id not in scheduled_ids]
                victim = self._victim(candidates)
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is RequestStatus.PREEMPTED:
                continue
            out.scheduled.append(self._scheduled(req, n, drafts))
            scheduled_ids.add(req.request_id)
            budget -= n

        # admit waiting requests (not in a step that had to preempt: memory is tight)
        if not out.preempted:
            self._admit(now, budget, out)
        return out

    def _waits_for_leader(self, req: Request) -> bool:
        """A parallel-sampling sibling waits until its leader's prompt blocks are cached."""
        lead = req.prefix_leader
        return (self.pool.enable_caching and lead is not None and lead.status is RequestStatus.RUNNING
                and lead.num_computed_tokens < lead.num_prompt_tokens)

    def _lora_slot_ready(self, req: Request) -> bool:
        """Makes the request's adapter resident (a free slot, or the least recently used one no
        running request uses); False when every slot is in use: it waits, as it waits for blocks."""
        busy = {r.lora_name for r in self.running if r.lora_name}
        return self.lora.ensure_resident(req.lora_name, busy)

    def _admit(self, now: float, budget: int, out: SchedulerOutput) -> None:
        cfg, bs = self.config, self.pool.block_size
        slot_blocked = False  # an adapter request ahead waits for a slot: no adapter request passes it
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                break
            if self._waits_for_leader(req):
                continue
            if req.lora_name is not None and self.lora is not None:
                try:
                    ready = not slot_blocked and self._lora_slot_ready(req)
                except Exception as e:  # noqa: BLE001 - its adapter's folder went bad: only it fails
                    self.waiting.remove(req.request_id)
                    out.failed.append((req, f"LoRA adapter {req.lora_name!r} could not be loaded: {e}"))
                    continue
                if not ready:
                    slot_blocked = True
                    continue  # base-model requests behind it still go: they need no slot
            hashes = self._update_block_hashes(req)
            cached = self.pool.find_cached_prefix(hashes[: req.max_cached_tokens() // bs])
            num_cached = len(cached[0]) * bs
            n = min(req.num_tokens - num_cached, budget)
            # a preempted request takes all the blocks it needs to reach its next token at once
            # (or waits for them): one chunk's worth would be taken back by the next step
            reserve = req.num_tokens + 1 if req.num_preemptions else 0
            if not self.pool.allocate(req.request_id, num_cached + n, cached, num_cached, reserve):
                if self.running:
                    break  # head of line waits for blocks: keeps the policy's order fair
                # nothing runs to give blocks back: the first chunk shrinks to what is free (a windowed
                # model's whole first chunk may need more than a sequence holds once it decodes)
                n = min(n, self.pool.fit_tokens(req.request_id, num_cached, cached))
                if n < 1 or not self.pool.allocate(req.request_id, num_cached + n, cached, num_cached):
                    break
            self.waiting.remove(req.request_id)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            req.num_cached_tokens = num_cached
            if self.pool.enable_caching:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_cached
            if req.num_preemptions:
                self.num_recomputed_tokens += max(0, req.num_computed_before_preemption - num_cached)
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, n))
            out.admitted.append((req.request_id, num_cached))
            budget -= n

    def finish(self, req: Request) -> list[tuple[Request, int]]:
        return [(req, self._drop_running(req))] if req in self.running else [(req, 0)]
