"""AsyncEngine: the engine's step loop in one dedicated thread, fed and read from asyncio, watched.

Why one thread that owns the engine: LLMEngine is not thread-safe, and its steps must never wait
for HTTP work (parsing, tokenising, writing sockets). HTTP handlers hand new requests and aborts to
the thread through a command list; the thread applies them between steps, so an abort takes effect
within one step. Each step's outputs go back to the event loop in one `call_soon_threadsafe`, which
puts them on per-request asyncio queues. When there is nothing to do the thread sleeps on a
condition, until the scheduler's next deadline if it has one (a static batch's timeout).

Why a watchdog: an accepted request must end with its output or a clear error, never hang, and
/health must say when the engine cannot serve. A step that raises fails the requests in flight and
the loop goes on; `max_consecutive_failures` failed steps in a row (a sticky device fault) or any
BaseException (a Rust panic from the tokenizer, ...) declare the engine dead: the thread fails every
open request in a `finally` and exits. A step that runs past `step_timeout` (a deadlocked kernel
pool, a GPU hang) is seen from the event loop, which fails the open requests itself, since the
engine thread cannot.

Shutdown drains: `drain()` stops admitting (503), lets running requests finish for up to its
timeout, then aborts the rest with finish reason "shutdown".
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from iterserve.core.block_pool import BlockUsage
from iterserve.engine import LLMEngine, StepRecord
from iterserve.memory import release_free_heap
from iterserve.request import RequestOutput, RequestRejected, RequestStatus, RequestTimes
from iterserve.sampling import SamplingParams

T = TypeVar("T")

log = logging.getLogger("iterserve.server")

# An engine idle this long hands the C heap's freed pages back (memory.release_free_heap). Not at
# once: the next prompt re-faults them, which made a 512-token 1B prompt right after a trim 1.31 s
# against 1.25 s (docs/profile.md), a cost that back-to-back requests should not pay.
IDLE_RELEASE_S = 1.0
NO_PROGRESS_POLL_S = 0.01  # unfinished work but nothing schedulable (should not happen; never spin)
WATCHDOG_PERIOD_S = 0.25
STEP_FAILED = "internal error in the engine step; the request was aborted"


@dataclass(frozen=True)
class EngineState:
    """What the engine looked like after its latest step or command; replaced, never mutated."""

    running: int
    waiting: int
    kv: BlockUsage
    step_count: int
    num_preemptions_total: int
    num_recomputed_tokens: int = 0  # tokens computed again after preemptions
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache (vLLM's name)
    prefix_cache_hits: int = 0  # of those, tokens found cached

    spec: "SpecTotals" = field(default_factory=lambda: SpecTotals())  # speculative decoding since start

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None


@dataclass(frozen=True)
class SpecTotals:
    """Speculative decoding's running totals, summed from the step records (the scheduler keeps
    none: a step's verify rows are all the record says). num_drafts: verify rows with at least one
    draft; draft_tokens: drafts verified; accepted_tokens: drafts accepted; accepted_per_pos[i]: rows
    that accepted their draft at position i (vLLM's per-position counter)."""

    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    def add(self, rec: StepRecord) -> "SpecTotals":
        """These totals with one more step's; self when the step verified no draft (the usual case)."""
        if not rec.spec_num_drafts and not rec.spec_draft_tokens:
            return self
        per_pos = list(self.accepted_per_pos) + [0] * (len(rec.spec_accepted_per_pos) - len(self.accepted_per_pos))
        for i, n in enumerate(rec.spec_accepted_per_pos):
            per_pos[i] += n
        return SpecTotals(self.num_drafts + rec.spec_num_drafts, self.draft_tokens + rec.spec_draft_tokens,
                          self.accepted_tokens + rec.spec_accepted_tokens, tuple(per_pos))

    @property
    def acceptance_rate(self) -> float | None:
        """Drafts accepted per draft verified (vLLM's "draft acceptance rate"); None before any."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verify row yields on average: its accepted drafts plus the target's own token."""
        return 1 + self.accepted_tokens / self.num_drafts if self.num_drafts else None

    def to_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length, "accepted_per_pos": list(self.accepted_per_pos)}


class RequestStream:
    """The outputs of one request, in order, ending with the one whose `finished` is True."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False  # the consumer has read the last output
        self.closed = False  # the last output has been queued (by the engine or the watchdog)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            out = await self.queue.get()
            self.finished = out.finished
            yield out


class BusyWindow:
    """Share of the last `window_s` seconds spent inside engine steps (forward + sampling)."""

    def __init__(self, window_s: float, since: float) -> None:
        self.window_s = window_s
        self.since = since
        self._steps: deque[tuple[float, float]] = deque()  # (start, end), time.monotonic()

    def add(self, start: float, duration: float) -> None:
        self._steps.append((start, start + duration))

    def fraction(self, now: float) -> float:
        lo = now - self.window_s
        while self._steps and self._steps[0][1] <= lo:
            self._steps.popleft()
        busy = sum(min(end, now) - max(start, lo) for start, end in self._steps)
        span = min(self.window_s, now - self.since)
        return max(0.0, min(1.0, busy / span)) if span > 0 else 0.0


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    stream: RequestStream
    admitted: asyncio.Future
    prefix_leader: str | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[], None]


@dataclass
class _StopAdmitting:
    """Shutdown has begun: refuse new requests, let running ones go on."""


@dataclass
class _Drain:
    """Shutdown's deadline passed: abort everything in flight."""


def error_output(request_id: str, message: str, reason: str = "error") -> RequestOutput:
    return RequestOutput(request_id, [], "", True, reason, 0, 0, RequestTimes(time.monotonic()), error=message)


# FLOP/s a slow host (2 cores, AVX2, under load) still reaches in a prefill's GEMMs: a 2-core Zen 3 ran an
# 8B Q4_K_M's prefill at ~130 GFLOP/s alone and under 100 with a test suite beside it (a 2048-token step
# took 286 s and was failed as hung at 1e11), so a margin of 4x below what it reached alone
SLOWEST_FLOPS = 3e10


def longest_step_s(engine: LLMEngine) -> float:
    """What the largest step this engine can schedule (max_num_batched_tokens of prefill) may take on
    a slow host: 2 FLOPs per weight per token at SLOWEST_FLOPS. The step timeout is never shorter, so
    a long prompt chunk of an 8B model on two cores (70-290 s seen) is not taken for a hung kernel."""
    body, _ = engine.model_config.param_counts()
    return 2.0 * body * engine.config.max_num_batched_tokens / SLOWEST_FLOPS


@dataclass
class AsyncEngine:
    engine: LLMEngine
    busy_window_s: float = 10.0
    history: int = 4096  # step records kept for /v1/scheduler
    warmup: bool = True  # one short generation in the engine thread before it reports ready
    # a step running longer makes /health 503 and fails open requests; raised to longest_step_s where that is longer
    step_timeout: float | None = 60.0
    max_consecutive_failures: int = 3  # failed steps in a row that declare the engine dead
    step_listeners: list[Callable[[StepRecord], None]] = field(default_factory=list)  # engine thread
    finish_listeners: list[Callable[[RequestOutput], None]] = field(default_factory=list)  # loop thread
    failure_listeners: list[Callable[[], None]] = field(default_factory=list)  # engine thread, per failed step

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._commands: list = []
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._open: dict[str, RequestStream] = {}  # loop thread only: admitted, last output not yet queued
        self._watchdog: asyncio.Task | None = None
        self._drain_task: asyncio.Task | None = None
        self._draining = False
        self._progressed = False
        self._lock = threading.Lock()  # guards steps and busy
        self.steps: deque[StepRecord] = deque(maxlen=self.history)
        self.spec = SpecTotals()  # engine thread: summed in _on_step, published with the state
        self.busy = BusyWindow(self.busy_window_s, self.engine.start_time)
        self.shutting_down = False  # loop-side view, for fast 503s
        self.dead_reason: str | None = None  # set once, by the engine thread, when it stops serving for good
        self.step_started: float | None = None  # time.monotonic() of the step in progress (engine thread)
        self.consecutive_failures = 0
        self.ready = threading.Event()  # set once warmed up; /health answers 200 from then on
        if self.step_timeout is not None:
            self.step_timeout = max(self.step_timeout, longest_step_s(self.engine))
        self.state = self._take_state()
        self.engine.step_listeners.append(self._on_step)

    # ---- lifecycle (event loop side) ----------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="iterserve-engine", daemon=True)
        self._thread.start()
        self._watchdog = self._loop.create_task(self._watch())

    async def stop(self) -> None:
        """Aborts what is left and joins the engine thread (unless it hangs in a step)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._thread is not None and self.hung_for() is None:
            await asyncio.to_thread(self._thread.join)
        self._fail_open("the server stopped before the request finished", "shutdown")

    def begin_shutdown(self) -> None:
        """Safe from a signal handler: takes no lock, only schedules the refusal on the loop."""
        self.shutting_down = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._submit, _StopAdmitting())

    def begin_drain(self, timeout: float, on_done: Callable[[], None]) -> None:
        """Safe from a signal handler: starts `drain(timeout)` on the loop, then calls on_done."""
        self.shutting_down = True
        if self._loop is None or self._loop.is_closed():
            on_done()
            return

        def start() -> None:
            self._drain_task = asyncio.ensure_future(self.drain(timeout))
            self._drain_task.add_done_callback(lambda _: on_done())

        self._loop.call_soon_threadsafe(start)

    def abort_in_flight(self) -> None:
        """Safe from a signal handler: aborts every request now (finish reason "shutdown")."""
        self.shutting_down = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._submit, _Drain())

    async def drain(self, timeout: float) -> None:
        """Stops admitting, waits up to `timeout` s for the open requests to finish, aborts the rest
        (finish reason "shutdown") and waits until they have their final output."""
        self.begin_shutdown()
        deadline = time.monotonic() + timeout
        if self._open:
            log.info("draining: %d request(s) in flight, up to %.0f s", len(self._open), timeout)
        while self._open and time.monotonic() < deadline and self.alive:
            await asyncio.sleep(0.05)
        if self._open:
            log.info("drain timeout: aborting %d request(s)", len(self._open))
            self._submit(_Drain())
            end = time.monotonic() + 5.0
            while self._open and time.monotonic() < end and self.alive and self.hung_for() is None:
                await asyncio.sleep(0.02)
            self._fail_open("the server shut down before the request finished", "shutdown")

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    def hung_for(self) -> float | None:
        """Seconds the current step has run, when that is longer than step_timeout."""
        started = self.step_started
        if started is None or self.step_timeout is None:
            return None
        running = time.monotonic() - started
        return running if running > self.step_timeout else None

    def health(self) -> str | None:
        """None when the engine can serve; otherwise why not (what /health answers with its 503)."""
        if self.dead_reason is not None:
            return f"the engine is dead: {self.dead_reason}"
        if self._thread is None or not self.ready.is_set():
            return "the engine is starting"
        if not self._thread.is_alive():
            return "the engine thread has stopped"
        hung = self.hung_for()
        if hung is not None:
            return f"an engine step has been running for {hung:.0f} s (--step-timeout {self.step_timeout:g})"
        if self.shutting_down:
            return "the server is shutting down"
        return None

    # ---- requests (event loop side) -----------------------------------------------------------------
    async def encode(self, prompt: str | None = None, messages: list[dict] | None = None,
                     tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
        """Tokenises off the loop and off the engine thread."""
        try:
            return await asyncio.to_thread(self.engine.encode_prompt, prompt, messages, tools,
                                           chat_template_kwargs)
        except UnicodeError as e:  # e.g. a lone surrogate escaped in the JSON
            raise RequestRejected(f"the text cannot be tokenised: {e}") from None

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          priority: int = 0, arrival_time: float | None = None,
                          prefix_leader: str | None = None) -> RequestStream:
        """Returns once the engine has accepted the request; raises RequestRejected otherwise, so
        the caller can answer with an error before any streaming starts. prefix_leader: see
        LLMEngine.add_request (parallel sampling)."""
        if self.shutting_down:
            raise RequestRejected("the server is shutting down", status_code=503)
        if not self.alive or self.hung_for() is not None:  # (still warming up is fine: it queues)
            raise RequestRejected(self.health() or "the engine is not running", status_code=503)
        self.engine.check_limits(len(prompt_token_ids), params)  # reads config only: thread-safe
        stream = RequestStream(request_id)
        admitted = asyncio.get_running_loop().create_future()
        self._submit(_Add(request_id, prompt_token_ids, params, priority,
                          arrival_time if arrival_time is not None else time.monotonic(), stream, admitted,
                          prefix_leader))
        try:
            await admitted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        if not stream.closed:
            self._open[request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        self._submit(_Abort(request_id))

    def call_in_engine_thread(self, fn: Callable[[], None]) -> None:
        """Runs `fn` on the engine thread before its next step, waking it if idle: the one place
        where the engine's own structures (e.g. the block tables) can be read consistently."""
        self._submit(_Call(fn))

    async def run_in_engine_thread(self, fn: Callable[[], T]) -> T:
        """Runs `fn` on the engine thread between steps and returns its result (or raises its
        exception) here: for changes to the engine's own structures (LoRA adapters)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def call() -> None:
            try:
                result, error = fn(), None
            except Exception as e:  # noqa: BLE001 - handed back to the caller
                result, error = None, e
            loop.call_soon_threadsafe(lambda: fut.done() or (fut.set_exception(error) if error is not None
                                                              else fut.set_result(result)))

        if not self.alive:
            raise RequestRejected(self.health() or "the engine is not running", status_code=503)
        self.call_in_engine_thread(call)
        return await fut

    def _submit(self, cmd) -> None:
        with self._cond:
            self._commands.append(cmd)
            self._cond.notify()

    def recent_steps(self, since_step: int | None = None, limit: int = 100) -> list[StepRecord]:
        with self._lock:
            steps = list(self.steps)
        if since_step is None:
            return steps[-limit:]
        return [s for s in steps if s.step > since_step]

    def busy_fraction(self) -> float:
        with self._lock:
            return self.busy.fraction(time.monotonic())

    # ---- the watchdog (event loop side) ----------------------------------------------------------------
    async def _watch(self) -> None:
        """Fails the open requests when a step hangs past step_timeout or the engine thread has died
        without delivering their end (it always tries, in a finally)."""
        reported = False
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            hung = self.hung_for()
            if hung is not None:
                if not reported:
                    log.error("engine step running for %.1f s (> step_timeout %g s): failing %d open request(s)",
                              hung, self.step_timeout, len(self._open))
                    reported = True
                for rid in list(self._open):
                    self.abort(rid)  # applied if the step ever returns
                self._fail_open(f"the engine step hung for more than {self.step_timeout:g} s; "
                                "the request was aborted", "error")
            else:
                if reported:
                    log.warning("the hung engine step returned")
                reported = False
            if self._thread is not None and not self._thread.is_alive() and self._open:
                self._fail_open(f"the engine stopped: {self.dead_reason or 'its thread exited'}", "error")

    def _fail_open(self, message: str, reason: str) -> None:
        pairs = [(stream, error_output(rid, message, reason)) for rid, stream in list(self._open.items())]
        self._deliver(pairs)

    # ---- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - a panic or exit must not leave clients waiting
            self.dead_reason = f"{type(e).__name__} in the engine thread"
            log.critical("engine thread died (%s); failing every open request", type(e).__name__, exc_info=True)
        finally:
            self.step_started = None
            if self.dead_reason is not None or not self._stop:
                self.dead_reason = self.dead_reason or "the engine thread exited"
                self._fail_streams(f"the engine stopped: {self.dead_reason}")
            log.info("engine loop stopped")

    def _serve(self) -> None:
        if self.warmup:  # in this thread: torch's per-thread set-up is part of what gets warmed
            t0 = time.perf_counter()
            self.engine.step_listeners.remove(self._on_step)
            try:
                warm_up(self.engine)
            finally:
                self.engine.step_listeners.append(self._on_step)
            log.info("warmed up in %.2f s", time.perf_counter() - t0)
        release_free_heap()  # what loading and warming up freed
        self.state = self._take_state()
        self.ready.set()
        log.info("engine loop started (%s batching)", self.engine.config.batching)
        stop = False
        stepped = False  # since the engine last handed freed memory back
        while not stop:
            with self._cond:
                timeout = self._idle_timeout()
                release = stepped and timeout is None  # idle: wake once more, to give memory back
                if release:
                    timeout = IDLE_RELEASE_S
                if not self._commands and not self._stop and timeout != 0:
                    self._cond.wait(timeout)
                commands, self._commands = self._commands, []
                stop = self._stop
            if release and not commands and not stop:
                stepped = False
                release_free_heap()  # the steps' freed activations go back to the OS
                continue
            outputs: list[RequestOutput] = []
            self._progressed = False
            try:
                self._apply(commands, outputs)
                if stop:
                    outputs.extend(self.engine.abort_all(RequestStatus.FINISHED_SHUTDOWN,
                                                         "the server stopped before the request finished"))
                elif self.engine.has_unfinished_requests():
                    before = self.engine.step_count
                    self.step_started = time.monotonic()
                    try:
                        outputs.extend(self.engine.step())
                    finally:
                        self.step_started = None
                    self._progressed = self.engine.step_count != before
                    stepped = True
                    self.consecutive_failures = 0
            except Exception:  # a bug or a device fault: fail the requests in flight, and go on
                self.consecutive_failures += 1
                log.exception("engine step failed (%d in a row); failing the requests in flight",
                              self.consecutive_failures)
                for fn in self.failure_listeners:
                    fn()
                outputs.extend(self.engine.abort_all(RequestStatus.FINISHED_ERROR, STEP_FAILED))
                if self.consecutive_failures >= self.max_consecutive_failures:
                    self.dead_reason = f"{self.consecutive_failures} engine steps failed in a row"
                    log.critical("%s: the engine stops serving", self.dead_reason)
                    stop = True
            self._publish(outputs)

    def _idle_timeout(self) -> float | None:
        """How long to sleep: None = until a command, 0 = not at all."""
        if not self.engine.has_unfinished_requests():
            return None
        if self._progressed:
            return 0
        deadline = self.engine.next_deadline()
        if deadline is not None:
            return max(1e-4, deadline - time.monotonic())
        return NO_PROGRESS_POLL_S

    def _apply(self, commands: list, outputs: list[RequestOutput]) -> None:
        for cmd in commands:
            if isinstance(cmd, _Add):
                self._admit(cmd)
            elif isinstance(cmd, _Abort):
                self.engine.abort_request(cmd.request_id)
            elif isinstance(cmd, _StopAdmitting):
                self._draining = True
            elif isinstance(cmd, _Drain):
                self._draining = True
                n = len(self.engine.requests)
                outputs.extend(self.engine.abort_all(RequestStatus.FINISHED_SHUTDOWN,
                                                     "the server shut down before the request finished"))
                if n:
                    log.info("aborted %d in-flight request(s) for shutdown", n)
            elif isinstance(cmd, _Call):
                try:
                    cmd.fn()
                except Exception:  # noqa: BLE001 - a monitor's bug must not stop the loop
                    log.exception("engine-thread call failed")

    def _admit(self, cmd: _Add) -> None:
        error: Exception | None = None
        if self._draining:
            error = RequestRejected("the server is shutting down", status_code=503)
        else:
            try:
                self.engine.add_request(params=cmd.params, request_id=cmd.request_id,
                                        prompt_token_ids=cmd.prompt_token_ids, priority=cmd.priority,
                                        arrival_time=cmd.arrival_time, prefix_leader=cmd.prefix_leader)
                self._streams[cmd.request_id] = cmd.stream
            except RequestRejected as e:
                error = e
            except Exception:  # noqa: BLE001 - a bad request must not stop the loop
                log.exception("add_request failed for %s", cmd.request_id)
                error = RequestRejected("internal error admitting the request", status_code=500)
        self._loop.call_soon_threadsafe(_settle, cmd.admitted, error)

    def _fail_streams(self, message: str) -> None:
        """From the dying engine thread: every stream it still owns gets an error as its end."""
        pairs = [(stream, error_output(rid, message)) for rid, stream in self._streams.items()]
        self._streams.clear()
        if pairs and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._deliver, pairs)
            except RuntimeError:  # the loop closed meanwhile: nobody is waiting any more
                pass

    def _publish(self, outputs: list[RequestOutput]) -> None:
        pairs = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            pairs.append((stream, out))
        self.state = self._take_state()
        if pairs:
            self._loop.call_soon_threadsafe(self._deliver, pairs)

    def _take_state(self) -> EngineState:
        sched = self.engine.scheduler
        return EngineState(running=sched.num_running, waiting=sched.num_waiting,
                           kv=self.engine.pool.usage(), step_count=self.engine.step_count,
                           num_preemptions_total=sched.num_preemptions_total,
                           num_recomputed_tokens=sched.num_recomputed_tokens,
                           prefix_cache_queries=sched.prefix_cache_queries,
                           prefix_cache_hits=sched.prefix_cache_hits, spec=self.spec)

    def _on_step(self, rec: StepRecord) -> None:
        with self._lock:
            self.steps.append(rec)
            self.busy.add(rec.start, rec.duration)
        self.spec = self.spec.add(rec)
        for fn in self.step_listeners:
            fn(rec)

    # ---- back on the event loop ---------------------------------------------------------------------
    def _deliver(self, pairs: list[tuple[RequestStream, RequestOutput]]) -> None:
        for stream, out in pairs:
            if stream.closed:  # already ended by the watchdog
                continue
            stream.queue.put_nowait(out)
            if out.finished:
                stream.closed = True
                self._open.pop(stream.request_id, None)
                for fn in self.finish_listeners:
                    try:
                        fn(out)
                    except Exception:  # noqa: BLE001 - metrics/logging must not break delivery
                        log.exception("finish listener failed")
def warm_up(engine: LLMEngine) -> None:
    """One short generation (a prefill and a decode step) and one tokenisation of each kind before
    serving, so that the first client does not pay one-time set-up costs (lazy kernel and
    tokenizer initialisation, hundreds of ms on CPU) in its TTFT. Runs before the engine thread.
    Not the structured outputs' llguidance tokenizer: a copy of the vocabulary's tables, 30-55 MiB
    for 49,152 tokens (docs/profile.md), that a server which never sees a constraint should not
    hold; the first constrained request builds it (about a second), as vLLM builds its grammar
    backend at its first."""
    ids = engine.encode_prompt("Warm up.")
    if getattr(engine.tokenizer, "chat_template", None):
        engine.encode_prompt(messages=[{"role": "user", "content": "Warm up."}])
    n = max(1, min(len(ids), engine.max_input_len, engine.max_model_len - 2))
    try:
        engine.add_request(params=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                           request_id="__warmup__", prompt_token_ids=ids[:n])
    except RequestRejected as e:
        log.warning("skipping warm-up: %s", e)
        return
    while engine.has_unfinished_requests():
        before = engine.step_count
        engine.step()
        if engine.step_count == before:  # nothing schedulable yet: sleep until the scheduler's deadline
            deadline = engine.next_deadline()
            time.sleep(NO_PROGRESS_POLL_S if deadline is None else max(0.0, deadline - time.monotonic()))


def _settle(fut: asyncio.Future, error: Exception | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
