"""Prometheus metrics under `iterserve:*` names, and the same series under vLLM's `vllm:*` names.

The vLLM twins (on by default, --no-vllm-metrics turns them off) let vLLM's Grafana dashboards and
routers that scrape `vllm:*` read iterserve unchanged; where vLLM renamed a series between versions
(gpu_cache_usage_perc -> kv_cache_usage_perc) both names are exported. Gauges read the
AsyncEngine's latest published state at scrape time; counters and histograms are fed by the
AsyncEngine's listeners: one StepRecord per engine step, one final RequestOutput per request, one
call per failed step; and by the HTTP layer, one call per rejected request. The registry is
private to the server so that several servers can live in one process (tests).

Outcomes are counted apart: `request_success_total{finished_reason}` for stop / length / abort (the
client went away), `request_failure_total{reason}` for error (the engine failed the request) and
shutdown (the server stopped before it finished), `request_rejected_total{status_code}` for
requests refused before admission.

Speculative decoding is counted as vLLM counts it, from the step records: verify rows with drafts
(`spec_decode_num_drafts`), drafts verified and accepted, and acceptances per draft position (the
acceptance rate is accepted / draft tokens, the mean accepted length 1 + accepted / drafts). The
series exist whether or not the server was started with a speculative config, since a request's
own `prediction` can draft without one; they stay at zero when nothing drafts. Per finished request
that drafted, `request_spec_acceptance_rate` observes its own accepted / draft tokens, which shows
whether a few requests (repetitive code edits) or all of them gain.

Memory (`memory_*_bytes`: weights resident and mapped, KV cache, workspace estimate) is the engine's
start-up MemoryReport (iterserve/memory.py); the memory available is read at scrape time.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from iterserve.engine import StepRecord
from iterserve.memory import MemoryReport, available_memory
from iterserve.request import RequestOutput
from iterserve.server.async_engine import AsyncEngine
from iterserve.server.lora_metrics import LoRACollector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)
RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
FAILURE_REASONS = ("error", "shutdown")
REJECTION_STATUSES = (400, 401, 404, 413, 503)  # shown at zero from the start; others appear when seen
CONFIG_INFO_KEYS = ("batching", "step_limit", "max_num_seqs", "max_batch_size", "max_num_batched_tokens", "block_size",
                    "num_kv_blocks", "max_model_len", "device", "dtype", "decode_attention", "bf16_gemm",
                    "quantization", "compile")


class _Twins:
    """One series under several names: every update goes to all of them."""

    def __init__(self, metrics: list) -> None:
        self.metrics = metrics

    def labels(self, *values) -> "_Twins":
        return _Twins([m.labels(*values) for m in self.metrics])

    def inc(self, amount: float = 1) -> None:
        for m in self.metrics:
            m.inc(amount)

    def observe(self, value: float) -> None:
        for m in self.metrics:
            m.observe(value)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str, vllm_names: bool = True, info: dict | None = None) -> None:
        disable_created_metrics()  # process-wide; the *_created series only add noise, as vLLM found
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, labels = self.registry, ["model_name"]

        def names(name: str, vllm: tuple[str, ...] | bool) -> list[str]:
            twins = ((name,) if vllm is True else vllm or ()) if vllm_names else ()
            return [f"iterserve:{name}"] + [f"vllm:{v}" for v in twins]

        def gauge(name: str, doc: str, fn, vllm: tuple[str, ...] | bool = False) -> None:
            for full in names(name, vllm):
                Gauge(full, doc, labels, registry=reg).labels(model_name).set_function(fn)

        def counter(name: str, doc: str, vllm: tuple[str, ...] | bool = False, extra: tuple[str, ...] = ()):
            family = _Twins([Counter(n, doc, labels + list(extra), registry=reg) for n in names(name, vllm)])
            return family if extra else family.labels(model_name)

        def histogram(name: str, doc: str, buckets, vllm: tuple[str, ...] | bool = False):
            return _Twins([Histogram(n, doc, labels, buckets=buckets, registry=reg)
                           for n in names(name, vllm)]).labels(model_name)

        gauge("num_requests_running", "Requests in the running batch.", lambda: engine.state.running, True)
        gauge("num_requests_waiting", "Requests waiting to be scheduled.", lambda: engine.state.waiting, True)
        gauge("kv_cache_usage_perc", "KV cache usage: share of blocks in use (1 = full).",
              lambda: engine.state.kv.usage, ("kv_cache_usage_perc", "gpu_cache_usage_perc"))
        gauge("engine_busy_fraction", f"Share of the last {engine.busy_window_s:.0f} s spent in engine steps.",
              engine.busy_fraction)
        if info is not None:  # vLLM's *_config_info: a constant 1 whose labels carry the configuration
            keys = [k for k in CONFIG_INFO_KEYS if k in info]
            Gauge("iterserve:engine_config_info", "Engine configuration (labels); the value is always 1.",
                  labels + keys, registry=reg).labels(model_name, *(str(info[k]) for k in keys)).set(1)
        memory = getattr(engine.engine, "memory", None)
        if memory is not None:  # measured once at start-up (memory.MemoryReport)
            self._memory_gauges(memory)
        self.preemptions = counter("num_preemptions", "Preemptions (recompute) since start.", True)
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prefix cache queries, in tokens (prompt tokens looked up at admission).", True)
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in tokens (found cached).", True)
        gauge("num_recomputed_tokens", "Tokens computed again after preemptions since start.",
              lambda: engine.state.num_recomputed_tokens)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.", True)
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.", True)
        self.steps = counter("engine_steps", "Engine steps (forward passes) since start.")
        self.step_failures = counter("engine_step_failures", "Engine steps that raised an error.")
        self.success = counter("request_success", "Finished requests by finish reason (stop, length; "
                               "abort = the client went away).", True, ("finished_reason",))
        self.failure = counter("request_failure", "Accepted requests that could not finish, by reason "
                               "(error: the engine failed it; shutdown: the server stopped first).",
                               extra=("reason",))
        self.rejected = counter("request_rejected", "Requests refused before admission, by HTTP status.",
                                extra=("status_code",))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS, True)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens, "
                             "one observation per token.", TPOT_BUCKETS, ("inter_token_latency_seconds",
                                                                           "time_per_output_token_seconds"))
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Mean time between output tokens of one request.", TPOT_BUCKETS, True)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS, True)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS, True)
        self.batch_size = histogram("batch_size", "Sequences computed per engine step.", BATCH_BUCKETS)
        self.step_time = histogram("step_duration_seconds", "Wall time of one engine step.", TPOT_BUCKETS)
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative decoding: verify rows with at least one "
                                   "draft token.", True)
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens "
                                         "verified.", True)
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens "
                                     "accepted.", True)
        self.spec_per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: verify rows "
                                    "that accepted their draft at this position (0 = the first draft).", True,
                                    ("position",))
        self.spec_request_rate = histogram("request_spec_acceptance_rate", "Per finished request that drafted: "
                                           "its draft tokens accepted / verified.", RATE_BUCKETS)
        spec = getattr(engine.engine.config, "speculative_config", None)
        for pos in range(spec.num_speculative_tokens if spec is not None else 0):  # at zero from the start
            self.spec_per_pos.labels(model_name, str(pos))
        for reason in FAILURE_REASONS:  # present at zero, so that a dashboard can tell "none" from "unknown"
            self.failure.labels(model_name, reason)
        for status in REJECTION_STATUSES:
            self.rejected.labels(model_name, str(status))
        if getattr(engine.engine, "lora", None) is not None:  # --enable-lora: per adapter series
            reg.register(LoRACollector(engine.engine, model_name, vllm_names))
        engine.step_listeners.append(self.on_step)
        engine.finish_listeners.append(self.on_finish)
        engine.failure_listeners.append(self.on_step_failure)

    def _memory_gauges(self, memory: MemoryReport) -> None:
        """Bytes of weights (resident, and mapped from a file), KV cache and workspace (an estimate),
        as the engine reported them at start-up; and the memory available now, read at scrape time."""
        reg, name = self.registry, self.model_name
        weights = Gauge("iterserve:memory_weights_bytes", "Bytes of model weights: resident (anonymous memory) "
                        "or mapped (pages of a file's memory map).", ["model_name", "kind"], registry=reg)
        weights.labels(name, "resident").set(memory.weights_resident)
        weights.labels(name, "mapped").set(memory.weights_mapped)
        Gauge("iterserve:memory_kv_cache_bytes", "Bytes of the KV cache's allocated blocks.", ["model_name"],
              registry=reg).labels(name).set(memory.kv_cache)
        Gauge("iterserve:memory_workspace_bytes", "Estimated bytes of one step's activations and logits.",
              ["model_name"], registry=reg).labels(name).set(memory.workspace_estimate)
        if memory.available is not None:
            Gauge("iterserve:memory_available_bytes", "Memory available to this process now (MemAvailable, "
                  "capped by the cgroup's limit).", ["model_name"], registry=reg).labels(name).set_function(
                      lambda: available_memory() or 0)

    def on_step(self, rec: StepRecord) -> None:
        self.steps.inc()
        self.batch_size.observe(rec.batch_size)
        self.step_time.observe(rec.duration)
        if rec.preempted:
            self.preemptions.inc(len(rec.preempted))
        if rec.prefix_cache_queries:
            self.prefix_cache_queries.inc(rec.prefix_cache_queries)
            self.prefix_cache_hits.inc(rec.prefix_cache_hits)
        if rec.spec_num_drafts:
            self.spec_drafts.inc(rec.spec_num_drafts)
            self.spec_draft_tokens.inc(rec.spec_draft_tokens)
            self.spec_accepted.inc(rec.spec_accepted_tokens)
            for pos, n in enumerate(rec.spec_accepted_per_pos):
                if n:
                    self.spec_per_pos.labels(self.model_name, str(pos)).inc(n)

    def on_step_failure(self) -> None:
        self.step_failures.inc()

    def on_rejected(self, status_code: int) -> None:
        self.rejected.labels(self.model_name, str(status_code)).inc()

    def on_finish(self, out: RequestOutput) -> None:
        t = out.times
        reason = out.finish_reason or "abort"
        if reason in FAILURE_REASONS:
            self.failure.labels(self.model_name, reason).inc()
        else:
            self.success.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.generation_tokens.inc(out.num_output_tokens)
        if out.spec_draft_tokens:
            self.spec_request_rate.observe(out.spec_accepted_tokens / out.spec_draft_tokens)
        for hist, value in ((self.ttft, t.ttft), (self.e2e, t.e2e), (self.queue, t.queue_time)):
            if value is not None:
                hist.observe(value)
        for earlier, later in zip(t.token_times, t.token_times[1:]):
            self.itl.observe(later - earlier)
        if out.num_output_tokens > 1 and t.first_token is not None and t.last_token is not None:
            self.tpot.observe((t.last_token - t.first_token) / (out.num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
