"""Prometheus metrics, named like vLLM's with an `iterserve:` prefix so dashboards carry over.

Gauges read the AsyncEngine's latest published state at scrape time; counters and histograms are
fed by the two listeners the AsyncEngine offers: one StepRecord per engine step (batch size,
preemptions) and one final RequestOutput per request (tokens, latencies, finish reason). The
registry is private to the server so that several servers can live in one process (tests).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from iterserve.engine import StepRecord
from iterserve.request import RequestOutput
from iterserve.server.async_engine import AsyncEngine

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        disable_created_metrics()  # process-wide; the *_created series only add noise, as vLLM found
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str, fn) -> None:
            Gauge(f"iterserve:{name}", doc, labels, registry=reg).labels(model_name).set_function(fn)

        def counter(name: str, doc: str):
            return Counter(f"iterserve:{name}", doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets):
            return Histogram(f"iterserve:{name}", doc, labels, buckets=buckets, registry=reg).labels(model_name)

        gauge("num_requests_running", "Requests in the running batch.", lambda: engine.state.running)
        gauge("num_requests_waiting", "Requests waiting to be scheduled.", lambda: engine.state.waiting)
        gauge("kv_cache_usage_perc", "KV cache usage: share of blocks in use (1 = full).", lambda: engine.state.kv.usage)
        gauge("engine_busy_fraction", f"Share of the last {engine.busy_window_s:.0f} s spent in engine steps.",
              engine.busy_fraction)
        self.preemptions = counter("num_preemptions", "Preemptions (recompute) since start.")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prefix cache queries, in tokens (prompt tokens looked up at admission).")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in tokens (found cached).")
        gauge("num_recomputed_tokens", "Tokens computed again after preemptions since start.",
              lambda: engine.state.num_recomputed_tokens)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.steps = counter("engine_steps", "Engine steps (forward passes) since start.")
        self.success = Counter("iterserve:request_success", "Finished requests by finish reason.",
                               labels + ["finished_reason"], registry=reg)
        self.model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time between output tokens of one request.", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.batch_size = histogram("batch_size", "Sequences computed per engine step.", BATCH_BUCKETS)
        self.step_time = histogram("step_duration_seconds", "Wall time of one engine step.", TPOT_BUCKETS)
        engine.step_listeners.append(self.on_step)
        engine.finish_listeners.append(self.on_finish)

    def on_step(self, rec: StepRecord) -> None:
        self.steps.inc()
        self.batch_size.observe(rec.batch_size)
        self.step_time.observe(rec.duration)
        if rec.preempted:
            self.preemptions.inc(len(rec.preempted))
        if rec.prefix_cache_queries:
            self.prefix_cache_queries.inc(rec.prefix_cache_queries)
            self.prefix_cache_hits.inc(rec.prefix_cache_hits)

    def on_finish(self, out: RequestOutput) -> None:
        t = out.times
        self.success.labels(self.model_name, out.finish_reason or "abort").inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.generation_tokens.inc(out.num_output_tokens)
        for hist, value in ((self.ttft, t.ttft), (self.e2e, t.e2e), (self.queue, t.queue_time)):
            if value is not None:
                hist.observe(value)
        if out.num_output_tokens > 1 and t.first_token is not None and t.last_token is not None:
            self.tpot.observe((t.last_token - t.first_token) / (out.num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
