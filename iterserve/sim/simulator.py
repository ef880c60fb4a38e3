"""Discrete-event capacity simulator driving the engine's own scheduler and block pool.

Only the forward pass is replaced: each step's duration comes from a step-time model
(`sim/step_model.py`) evaluated on the very `SchedulerOutput` that the real `Scheduler` or
`StaticScheduler` produced over a real `BlockPool`. Everything else follows `LLMEngine.step`:
computed tokens advance, a token is sampled when a request has caught up with its tokens, stop
conditions are `Request.check_stop_token`, finished requests go back to `scheduler.finish`, which
frees their blocks at once (continuous) or when the batch ends (static). Preemptions, chunked
prefill, admission and queueing are therefore the engine's, not a re-implementation of them.

Events, in time order: arrivals (routed to one of `replicas` independent engines by a `Router`),
ends of steps, and static batching's partial-batch timeouts. Output lengths are the workload's
(as `bench serve --ignore-eos` forces them). What a server costs besides the forward passes is
charged when the profile has it (`sim/overhead.py`): a request reaches the scheduler its arrival
term after it was sent; a step that admits requests starts its forward pass their admission cost
later; after each forward pass the engine spends the gap term before it can schedule again; the
client sees the first token and the response's end the first-token / finish terms after the step
that sampled them. Times in the report are the client's (from the request's send time).

Speculative decoding (`spec_acceptance` with a config's `speculative_config`, sim/speculative.py):
between steps each running request about to decode gets drafts (`Request.spec_token_ids`, none
above disable_by_batch_size running requests), which the real scheduler fits to the step's budget
and free blocks as it does the engine's; a verify row of drafts + 1 tokens is priced by the step
model like a prompt chunk of that length over its context; at the step's end the row keeps its
accepted drafts' KV, emits accepted + 1 tokens at once and gives back the rejected drafts' blocks,
as the engine does. Without a speculative config nothing changes.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from iterserve.bench.client import RequestRecord, RunResult
from iterserve.bench.sketch import DEFAULT_RELATIVE_ERROR
from iterserve.bench.streaming_result import StreamingResult
from iterserve.bench.conversation import ConversationFraming, ConversationOptions
from iterserve.bench.timeline import Timeline
from iterserve.bench.workload import RequestSpec, sample_lengths
from iterserve.config import EngineConfig, with_step_budget
from iterserve.core.block_pool import BlockPool
from iterserve.core.scheduler import SchedulerBase, SchedulerOutput
from iterserve.core.selector import build_scheduler
from iterserve.engine import LLMEngine
from iterserve.request import Request, RequestRejected
from iterserve.routing import POLICIES
from iterserve.sampling import SamplingParams
from iterserve.sim.profile import Profile
from iterserve.sim.overhead import NO_OVERHEAD, ServerOverhead
from iterserve.sim.router import Router, make_router
from iterserve.sim.lora import LoRAPolicy, SimResidency
from iterserve.sim.speculative import SpecPolicy
from iterserve.sim.step_model import step_features

SchedulerFactory = Callable[[EngineConfig, BlockPool, int], SchedulerBase]


SYSTEM_PROMPT_ID = 1  # the shared system prompt's tokens; each request's own part starts with its own id
DISTINCT_SYSTEM_PROMPT_IDS = 3_000_000  # + c: conversation c's own system prompt starts with it


def prompt_ids(spec: RequestSpec) -> list[int]:
    """Token ids for a simulated prompt. The scheduler reads their number, and with prefix caching
    their blocks' hash chain: the shared-prefix workload's system prompt is the same ids for every
    request; each request's own part starts with an id of its own, so no two share a block beyond
    the system prompt, as the bench's prompts do not (each starts at a different place in its text)."""
    return ([SYSTEM_PROMPT_ID] * spec.system_prompt_len + [2 + spec.index % 1_000_000]
            + [0] * (spec.input_len - 1))


class SimEngine:
    """One engine replica: the real scheduler over a real block pool, on a simulated clock."""

    def __init__(self, config: EngineConfig, profile: Profile, index: int = 0,
                 make_scheduler: SchedulerFactory = build_scheduler, keep_steps: bool = True,
                 spec: SpecPolicy | None = None, lora: LoRAPolicy | None = None) -> None:
        self.config = config = with_step_budget(config, profile.device_type)
        self.spec = spec  # speculative decoding's drafting and acceptance; None: off
        self.lora = lora  # adapters: which requests carry one, their rows' price; None: off
        self.index = index
        self.step_model = profile.step_model
        self.moe = profile.moe  # an MoE model's routing: each step's expected distinct experts
        self.overhead = profile.overhead
        self.max_model_len = config.max_model_len or profile.max_model_len
        self.max_input_len = config.max_input_len or self.max_model_len
        self.max_output_len = config.max_output_len or self.max_model_len
        self.pool = BlockPool(profile.num_kv_blocks(config), config.block_size, enable_caching=config.prefix_caching,
                              group_windows=profile.kv_groups().windows)
        self.scheduler = make_scheduler(config, self.pool, self.max_model_len)
        if lora is not None:  # the engine's residency rule over --max-loras slots, without weights
            from iterserve.lora.slots import SlotTable
            self.scheduler.lora = SimResidency(SlotTable(config.max_loras))
        self.in_flight: SchedulerOutput | None = None
        self.step_start = 0.0  # the forward pass's start (after admissions)
        self.run_end = 0.0  # and end (the engine's bookkeeping gap follows)
        self.wake_at: float | None = None  # a pending static-batch timeout
        self.keep_steps = keep_steps
        self.steps: list[dict[str, Any]] = []
        self.num_steps = 0
        self.busy_s = 0.0
        self.batch_seq_s = 0.0  # sum of batch size x step time (for the mean batch)
        self.num_preempted = 0
        self.spec_num_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0

    # the engine's own request checks, on this replica's limits
    check_limits = LLMEngine.check_limits

    @property
    def load(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting

    def add(self, spec: RequestSpec, params: SamplingParams, ids: list[int] | None = None,
            at: float | None = None) -> Request:
        """Queues a request as `LLMEngine.add_request` would; raises RequestRejected likewise.
        `ids`: the prompt's token ids where they matter (a conversation's history), else prompt_ids;
        `at`: when it reaches the engine (default: its send time)."""
        ids = prompt_ids(spec) if ids is None else ids
        self.check_limits(len(ids), params)
        cfg = self.config
        if cfg.max_waiting is not None and self.scheduler.num_waiting >= cfg.max_waiting:
            raise RequestRejected(f"the waiting queue is full ({cfg.max_waiting} requests): retry later", 503)
        req = Request(f"r{spec.index}", ids, params, arrival_time=spec.arrival_s if at is None else at)
        if self.lora is not None:  # as the engine sets them from the request's `model`
            req.lora_name = self.lora.adapter_of(spec.index)
            req.cache_key = req.lora_name
        need = self.scheduler.max_blocks_per_request(req)
        if need > self.pool.num_usable_blocks:
            raise RequestRejected(f"request needs {need} KV blocks but the whole cache has "
                                  f"{self.pool.num_usable_blocks}")
        self.scheduler.add_request(req)
        return req

    def start_step(self, now: float) -> float | None:
        """Schedules the next step at `now`; returns when it ends, or None when there is nothing to do."""
        sched = self.scheduler.schedule(now)
        if sched.is_empty:
            return None
        oh = self.overhead
        self.step_start = now + oh.admit_s * len(sched.admitted)
        features = step_features(sched, self.config.block_size, self.pool.null_block, self.moe)
        self.run_end = self.step_start + self.step_model.predict(features)
        if self.lora is not None:
            self.run_end += self.lora.price(sched)
        self.in_flight = sched
        self.num_preempted += len(sched.preempted)
        return self.run_end + oh.gap(len(sched.scheduled))

    def _propose(self) -> None:
        """Between steps, as the engine's proposer: drafts for each running request whose next step
        is a decode (within its remaining max_tokens and max_model_len); none when more requests run
        than disable_by_batch_size. The scheduler fits them to the step's budget and free blocks."""
        spec = self.spec
        assert spec is not None
        running = self.scheduler.running
        if not spec.active(len(running)):
            return
        for req in running:
            if req.num_tokens - req.num_computed_tokens != 1 or not req.num_output_tokens:
                continue
            room = min(req.params.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1)
            d = spec.drafts(room)
            if d:
                req.spec_token_ids = [0] * d

    def end_step(self) -> list[Request]:
        """Applies the step in flight as `LLMEngine.step` does, at its forward pass's end; returns
        the requests released."""
        sched, self.in_flight = self.in_flight, None
        now = self.run_end
        assert sched is not None
        released: list[Request] = []
        num_drafts = draft_tokens = accepted_step = 0
        verified: list[Request] = []
        for s in sched.scheduled:
            req = s.request
            new_tokens = 1
            req.num_computed_tokens += s.num_tokens
            d = len(s.spec_token_ids)
            if d and self.spec is not None:  # a verify row keeps the KV of its last token and its accepted drafts
                m = self.spec.accepted(d)
                req.num_computed_tokens -= d - m
                new_tokens += m
                num_drafts, draft_tokens, accepted_step = num_drafts + 1, draft_tokens + d, accepted_step + m
                verified.append(req)
            if not s.sample or req.is_finished:  # mid-prompt chunk, or a member held after it stopped
                continue
            status = None
            for _ in range(new_tokens):
                req.append_token(0, now)
                status = req.check_stop_token(self.max_model_len)
                if status is not None:
                    break
            if status is None:
                continue
            req.status = status
            for r, _ in self.scheduler.finish(req):
                r.times.finished = now
                released.append(r)
        if self.spec is not None:
            for req in verified:  # the rejected drafts' blocks go back, as the engine's trim
                if not req.is_finished:
                    self.scheduler.trim_unverified(req)
            self._propose()
        duration = now - self.step_start
        self.spec_num_drafts += num_drafts
        self.spec_draft_tokens += draft_tokens
        self.spec_accepted_tokens += accepted_step
        self.num_steps += 1
        self.busy_s += duration
        batch = len(sched.scheduled)
        self.batch_seq_s += batch * duration
        if self.keep_steps:
            padding = sched.num_padding
            usage = self.pool.usage()
            rec = {
                "step": self.num_steps, "t": self.step_start, "t_run": self.step_start, "duration": duration,
                "batch_size": batch, "num_padding": padding, "num_running": self.scheduler.num_running,
                "num_waiting": self.scheduler.num_waiting, "prefill_tokens": sched.num_prefill_tokens,
                "decode_tokens": sched.num_decode_tokens, "kv_used_blocks": usage.used_blocks,
                "kv_total_blocks": usage.total_blocks, "kv_tokens": usage.tokens_stored,
                "num_preempted": len(sched.preempted), "num_finished": len(released)}
            if self.spec is not None:
                rec.update(spec_num_drafts=num_drafts, spec_draft_tokens=draft_tokens,
                           spec_accepted_tokens=accepted_step)
            self.steps.append(rec)
        return released

    def timeline(self) -> Timeline:
        cfg = {**self.config.__dict__, "max_model_len": self.max_model_len, "num_kv_blocks": self.pool.num_blocks}
        return Timeline(self.config.batching, self.steps, [], 0.0, 0.0, cfg)


# ---------------------------------------------------------------- multi-turn conversations

@dataclass
class ConversationPlan:
    """One conversation of the multi-turn workload, as token counts and times (no text)."""

    index: int
    start_s: float
    system_prompt_len: int
    user_lens: list[int]
    output_lens: list[int]
    think_s: list[float]
    system_prompt_id: int = SYSTEM_PROMPT_ID  # the id its system prompt starts with (one per prompt)
    framing: ConversationFraming = ConversationFraming()  # tokens around each part of the real prompt

    def system_prompt_ids(self) -> list[int]:
        """Conversations of one system prompt share all its blocks; distinct ones none (first id differs)."""
        return [self.system_prompt_id] + [SYSTEM_PROMPT_ID] * (self.system_prompt_len + self.framing.system - 1)

    def user_len(self, turn: int) -> int:
        return self.user_lens[turn] + self.framing.user

    def answer_len(self, generated: int) -> int:
        """Tokens an answer of `generated` tokens adds to the next prompt (sent back as text, framed)."""
        return generated + self.framing.answer


def conversation_plans(opts: ConversationOptions, framing: ConversationFraming = ConversationFraming()
                       ) -> list[ConversationPlan]:
    """The conversations `build_conversations` makes from the same options: the same draws in the
    same order (starts, user lengths, answer lengths, think times), so simulated and real runs of
    one seed are the same conversations. `framing` (`bench.conversation.conversation_framing`):
    the tokens the flattened prompts carry besides those lengths, so each simulated prompt is as
    long as the real one (without it, about 6% short on the default workload)."""
    rng = np.random.default_rng(opts.seed)
    n, t = opts.num_conversations, opts.turns
    starts = np.sort(rng.uniform(0.0, opts.stagger_s, n)) if opts.stagger_s else np.zeros(n)
    user_lens = sample_lengths(opts.user_len, n * t, rng, "user_len").reshape(n, t)
    out_lens = sample_lengths(opts.output_len, n * t, rng, "output_len").reshape(n, t)
    thinks = rng.exponential(opts.think_time_s, (n, t)) if opts.think_time_s else np.zeros((n, t))
    shared = opts.system_prompts == "shared"
    return [ConversationPlan(c, float(starts[c]), opts.system_prompt_len, [int(x) for x in user_lens[c]],
                             [int(x) for x in out_lens[c]], [float(x) for x in thinks[c]],
                             SYSTEM_PROMPT_ID if shared else DISTINCT_SYSTEM_PROMPT_IDS + c, framing) for c in range(n)]


# ---------------------------------------------------------------- the run

@dataclass
class SimRun:
    """What a simulation produced: the load client's view (same JSON as `bench serve`) and each
    replica's engine timeline."""

    result: RunResult | StreamingResult
    timelines: list[Timeline]
    stats: dict[str, Any] = field(default_factory=dict)


def _record(spec: RequestSpec, req: Request | None, error: str = "", keep_itl: bool = True,
            overhead: ServerOverhead = NO_OVERHEAD) -> RequestRecord:
    """The client's view: from the send time (spec.arrival_s), the server's overheads included."""
    rec = RequestRecord(spec.index, spec.arrival_s, spec.input_len, spec.output_len, sent_at_s=spec.arrival_s)
    if req is None:
        rec.error, rec.end_at_s = error, spec.arrival_s
        return rec
    t = req.times
    rec.end_at_s = t.finished + overhead.finish_s
    rec.e2e_s = rec.end_at_s - spec.arrival_s
    rec.ttft_s = t.first_token + overhead.first_token_s - spec.arrival_s
    rec.queue_time_s = t.queue_time
    rec.output_tokens = req.num_output_tokens
    rec.prompt_tokens = req.num_prompt_tokens
    if rec.output_tokens > 1:
        rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)
    if keep_itl:
        tt = t.token_times
        rec.itl_s = [b - a for a, b in zip(tt, tt[1:])]
    rec.success = True
    return rec


def arrivals_in_order(specs: Iterable[RequestSpec], reach: Callable[[RequestSpec], float]) -> Iterator[
        tuple[float, int, RequestSpec]]:
    """(time it reaches the engine, index, spec), in the order the engines see requests.

    A list is sorted whole (as ever). Anything else is consumed lazily and must come in send order
    (the lazy workloads do): a request reaches the engine its arrival overhead after it is sent, so
    requests are held in a small heap only until a later send shows none can overtake them."""
    if isinstance(specs, Sequence):
        yield from sorted((reach(s), s.index, s) for s in specs)
        return
    pending: list[tuple[float, int, RequestSpec]] = []
    last = -math.inf
    for spec in specs:
        if spec.arrival_s < last:
            raise ValueError(f"a lazy workload must come in send order: request {spec.index} is sent at "
                             f"{spec.arrival_s} s, after one sent at {last} s (pass a list to have it sorted)")
        last = spec.arrival_s
        while pending and pending[0][0] < last:  # reach >= send: nothing sent from now on comes earlier
            yield heapq.heappop(pending)
        heapq.heappush(pending, (reach(spec), spec.index, spec))
    while pending:
        yield heapq.heappop(pending)


def sweep_lag(oh: ServerOverhead, config: EngineConfig, max_model_len: int) -> float:
    """How far before the clock a send or an end not yet known can still lie: a request reaches the
    engine its arrival term after its send (prompts no longer than the model accepts), and its end
    is stamped at its step's forward-pass end plus the finish term, while the event that reveals it
    comes the step's gap later. The streaming summary's concurrency sweep holds events that long."""
    seqs = max(config.max_num_seqs, config.max_batch_size)
    arrival = max(oh.to_arrival(0), oh.to_arrival(max_model_len))
    gap = max(oh.gap(0), oh.gap(seqs))
    return max(arrival, 0.0) + max(gap, 0.0) + max(-oh.finish_s, 0.0)


def spec_stats(engines: Sequence[SimEngine]) -> dict[str, Any]:
    """The simulated replicas' speculative totals, in /v1/scheduler's `speculative` terms."""
    spec = engines[0].spec
    assert spec is not None
    rows = sum(e.spec_num_drafts for e in engines)
    drafted = sum(e.spec_draft_tokens for e in engines)
    accepted = sum(e.spec_accepted_tokens for e in engines)
    return {"num_speculative_tokens": spec.num_speculative_tokens, "acceptance": spec.acceptance,
            "draft_fraction": spec.draft_fraction, "disable_by_batch_size": spec.disable_by_batch_size,
            "num_drafts": rows, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": 1 + accepted / rows if rows else None}


def simulate(specs: Iterable[RequestSpec], config: EngineConfig, profile: Profile, replicas: int = 1,
             router: str | Router = "round-robin", make_scheduler: SchedulerFactory = build_scheduler,
             keep_steps: bool = True, keep_itl: bool = True, slos: Sequence = (),
             sample_replicas: int | None = None, conversations: Sequence[ConversationPlan] = (),
             streaming_summary: bool = False, relative_error: float = DEFAULT_RELATIVE_ERROR,
             spec_acceptance: float | None = None, spec_draft_fraction: float = 1.0,
             lora: LoRAPolicy | None = None) -> SimRun:
    """Runs the workload through `replicas` simulated engines; deterministic for the same inputs.

    specs: a list (sorted here), or an iterable in send order (a lazy `bench.workload.Workload`),
    consumed as the simulated clock reaches each request, so only requests in flight are held.
    streaming_summary: keep no per-request record; the result is a `StreamingResult` (exact counts,
    means and peak concurrency, percentiles from sketches within `relative_error`), so memory stays
    bounded however long the workload: what a day of traffic needs.

    conversations: multi-turn chats (closed loop within each, as bench/conversation.py runs them):
    a turn arrives its think time after the previous answer ended, its prompt the previous prompt
    and answer plus the new user message, so the prefix cache sees the history grow. The answer's
    ids are new ones, never the ids the engine generated: clients send the answer back as text and
    its re-tokenisation does not reproduce the generated ids (measured on SmolLM2's tokenizer: the
    next turn's prompt agreed with prompt + generated ids up to the end of the previous prompt and
    no further, in every turn tried), so only the previous prompt's blocks can hit.

    sample_replicas=k (round-robin only) simulates just the first k replicas with exactly the
    requests round-robin sends them: round-robin never looks at the replicas' state, so their
    results are exact, and the rest, fed the same kind of traffic, behave alike. This is how a
    large fleet's traffic fits in minutes: the cost is per simulated request.

    spec_acceptance: with `config.speculative_config`, the per-token acceptance probability alpha of
    its drafts (sim/speculative.py; `alpha_from_totals` turns a server's measured totals into one),
    and spec_draft_fraction the share of decode rows that draft at all. A speculative config needs
    it: the simulator cannot guess how often drafts are right.

    lora: requests under LoRA adapters (sim/lora.py): which carry one, what their rows add to a
    step, and residency in config.max_loras slots by the engine's own rule."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    spec_cfg = getattr(config, "speculative_config", None)
    if spec_cfg is not None and spec_acceptance is None:
        raise ValueError("a speculative config needs an acceptance probability to simulate (spec_acceptance, "
                         "--spec-acceptance): the share of drafts the workload's text lets through")

    def spec_policy(index: int) -> SpecPolicy | None:
        if spec_cfg is None:
            return None
        return SpecPolicy(spec_cfg.num_speculative_tokens, float(spec_acceptance), spec_cfg.disable_by_batch_size,
                          spec_draft_fraction, seed=config.seed * 1_000_003 + index)
    if isinstance(router, str):
        if router not in POLICIES:
            raise ValueError(f"unknown router {router!r}: one of {', '.join(POLICIES)}")
        router = make_router(router, config.block_size)
    wall0 = time.perf_counter()
    oh = profile.overhead

    def reach(spec: RequestSpec, prompt_tokens: int) -> float:
        """When a request sent at spec.arrival_s reaches the scheduler."""
        return spec.arrival_s + oh.to_arrival(prompt_tokens)

    offered = 0
    replicas_total = replicas
    sampled = sample_replicas if sample_replicas is not None else replicas

    def arrivals() -> Iterator[tuple[float, int, RequestSpec]]:
        """The requests the simulated replicas get, in the order they reach them (counted as offered)."""
        nonlocal offered
        for j, item in enumerate(arrivals_in_order(specs, lambda s: reach(s, s.system_prompt_len + s.input_len))):
            offered = j + 1
            if j % replicas_total < sampled:
                yield item

    if sample_replicas is not None:
        if conversations:
            raise ValueError("sample_replicas needs requests that do not depend on each other (no conversations)")
        if router.name != "round-robin" or not 1 <= sample_replicas <= replicas:
            raise ValueError("sample_replicas needs the round-robin router and 1 <= sample_replicas <= replicas")
    if conversations and not isinstance(specs, Sequence):
        raise ValueError("conversations go with a list of requests (their turns are numbered after them)")
    order = arrivals()
    if sample_replicas is not None:
        router, replicas = make_router("round-robin", config.block_size), sample_replicas
    engines = [SimEngine(config, profile, i, make_scheduler, keep_steps, spec_policy(i), lora) for i in range(replicas)]
    params_for: dict[int, SamplingParams] = {}  # one SamplingParams per output length (they are immutable here)
    spec_of: dict[str, RequestSpec] = {}
    records: list[RequestRecord] = []
    summary = StreamingResult("simulated", profile.model, "completions", list(slos), relative_error=relative_error,
                              keep_itl=keep_itl) if streaming_summary else None
    sink = summary.add if summary is not None else records.append
    num_records = 0

    def keep(record: RequestRecord) -> None:
        """Hands a finished (or refused) request's record to the result, and counts it."""
        nonlocal num_records
        num_records += 1
        sink(record)
    lag = sweep_lag(oh, config, max(e.max_model_len for e in engines))
    events: list[tuple[float, int, int, bool]] = []  # (time, seq, replica, is_step_end)
    seq = itertools.count()

    def kick(e: SimEngine, now: float) -> None:
        """An idle engine starts its next step now, or sets a wake-up for a static batch's timeout."""
        end = e.start_step(now)
        if end is not None:
            heapq.heappush(events, (end, next(seq), e.index, True))
            return
        deadline = e.scheduler.next_deadline()
        if deadline is not None:
            # 1 ns past it, so the scheduler's own "waited long enough" test sees it passed
            wake = max(deadline, now) + 1e-9
            if e.wake_at is None or wake < e.wake_at:
                e.wake_at = wake
                heapq.heappush(events, (wake, next(seq), e.index, False))

    # conversation turns: (arrival, seq, spec, prompt ids, (conversation, turn)), pushed as answers end
    turns: list[tuple[float, int, RequestSpec, list[int], tuple[ConversationPlan, int]]] = []
    turn_of: dict[str, tuple[ConversationPlan, int]] = {}
    next_index = itertools.count(max((s.index for s in specs), default=-1) + 1 if conversations else 0)

    def push_turn(conv: ConversationPlan, turn: int, at: float, history: list[int]) -> None:
        ids = history + [2 + next(turn_ids)] + [0] * (conv.user_len(turn) - 1)
        spec = RequestSpec(next(next_index), at, len(ids), conv.output_lens[turn])
        heapq.heappush(turns, (reach(spec, len(ids)), next(seq), spec, ids, (conv, turn)))

    turn_ids = itertools.count(2_000_000)  # ids of user messages: distinct from prompt_ids' own parts
    answer_ids = itertools.count(4_000_000)  # first id of each answer sent back: never a generated id
    for conv in conversations:
        push_turn(conv, 0, conv.start_s, conv.system_prompt_ids())

    upcoming = next(order, None)
    now = 0.0
    while upcoming is not None or turns or events:
        t_next = min(upcoming[0] if upcoming is not None else math.inf, turns[0][0] if turns else math.inf)
        if t_next < math.inf and (not events or t_next <= events[0][0]):
            ids = conv_turn = None
            if upcoming is not None and upcoming[0] == t_next:
                spec = upcoming[2]
                upcoming = next(order, None)
            else:
                _, _, spec, ids, conv_turn = heapq.heappop(turns)
            now = t_next
            if ids is None:
                ids = prompt_ids(spec)
            e = engines[router.route(ids, engines)]
            params = params_for.get(spec.output_len)
            if params is None:
                params = params_for[spec.output_len] = SamplingParams(max_tokens=spec.output_len, temperature=0.0,
                                                                      ignore_eos=True)
            try:
                req = e.add(spec, params, ids, at=now)
            except RequestRejected as err:
                keep(_record(spec, None, f"HTTP {err.status_code}: {err}"))
                continue  # a conversation whose turn is refused ends there
            spec_of[req.request_id] = spec
            if summary is not None:
                summary.sent(spec.arrival_s)
            if conv_turn is not None:
                turn_of[req.request_id] = conv_turn
            if e.in_flight is None:
                kick(e, now)
            continue
        now, _, idx, is_step_end = heapq.heappop(events)
        e = engines[idx]
        if is_step_end:
            for req in e.end_step():
                keep(_record(spec_of.pop(req.request_id), req, keep_itl=keep_itl, overhead=oh))
                conv_turn = turn_of.pop(req.request_id, None)
                if conv_turn is not None and conv_turn[1] + 1 < len(conv_turn[0].user_lens):
                    conv, turn = conv_turn
                    answered = req.times.finished + oh.finish_s  # the client has the whole answer
                    answer = [next(answer_ids)] + [0] * (conv.answer_len(len(req.output_token_ids)) - 1)  # as text
                    push_turn(conv, turn + 1, answered + conv.think_s[turn], req.prompt_token_ids + answer)
            kick(e, now)
            if summary is not None:
                summary.advance(now - lag)
        elif e.wake_at == now:  # else stale: a step started (or an earlier wake-up came) meanwhile
            e.wake_at = None
            if e.in_flight is None:
                kick(e, now)
    for rid, spec in spec_of.items():  # nothing may vanish: say so if the engines stalled
        keep(_record(spec, None, f"simulation ended with {rid} unfinished (engine stalled)"))
    records.sort(key=lambda r: r.index)
    if summary is not None:
        duration = summary.last_end_s
        summary.finish(duration)
    else:
        duration = max((r.end_at_s for r in records if r.end_at_s is not None), default=0.0)
    wall = time.perf_counter() - wall0
    stats = {
        "replicas": replicas_total, "simulated_replicas": replicas, "router": router.name, "wall_s": wall,
        "requests": num_records, "offered_requests": offered + sum(len(c.user_lens) for c in conversations),
        "steps": sum(e.num_steps for e in engines),
        "simulated_s": duration, "speedup": duration / wall if wall > 0 else math.inf,
        "requests_per_wall_s": num_records / wall if wall > 0 else math.inf,
        "busy_fraction": [e.busy_s / duration if duration else 0.0 for e in engines],
        "mean_batch_size": [e.batch_seq_s / e.busy_s if e.busy_s else 0.0 for e in engines],
        "preemptions": sum(e.num_preempted for e in engines),
        "prefix_cache_queries": sum(e.scheduler.prefix_cache_queries for e in engines),
        "prefix_cache_hits": sum(e.scheduler.prefix_cache_hits for e in engines),
        "num_kv_blocks": engines[0].pool.num_blocks,
        "speculative": spec_stats(engines) if spec_cfg is not None else None,
        "lora_loads": sum(e.scheduler.lora.loads for e in engines) if lora is not None else None,
        "profile": profile.describe(), "estimate": profile.estimate,
    }
    result: RunResult | StreamingResult
    if summary is not None:
        result, summary.meta = summary, {"simulated": stats}
    else:
        result = RunResult("simulated", profile.model, "completions", duration, records, list(slos),
                           meta={"simulated": stats})
    return SimRun(result, [e.timeline() for e in engines], stats)
