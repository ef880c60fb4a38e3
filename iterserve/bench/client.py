"""Open-loop load client for any OpenAI-compatible server (iterserve, vLLM, llama.cpp, ...).

Each request goes out at its scheduled arrival whether or not earlier ones have finished, streams
its tokens, and gets a `RequestRecord` of what the client saw: TTFT, inter-token gaps, end-to-end
latency, and the server's queue time when the server reports one. `RunResult` summarises a run:
throughput, latency percentiles, peak concurrency and goodput under SLOs (DistServe's definition:
completed requests per second that meet every per-request SLO).

Units: records hold seconds (`*_s`, times relative to the run start); summaries hold milliseconds
(`*_ms`) for latencies, as people read them.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence, TextIO

import httpx
import numpy as np
from tqdm import tqdm

from iterserve.bench.common import latency_stats_ms, one_line
from iterserve.bench.workload import RequestSpec, build_prompts

CONNECT_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 30.0
GRACE_S = 600.0  # default run bound: the last arrival plus this


class ClientError(Exception):
    """The run cannot start (server unreachable, no model, bad SLO); the message is one line."""


@dataclass
class RequestRecord:
    """What the client observed for one request; times in seconds, `*_at_s` relative to run start."""

    index: int
    scheduled_s: float
    input_len: int
    max_tokens: int
    sent_at_s: float | None = None
    end_at_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    queue_time_s: float | None = None
    success: bool = False
    error: str = ""
    conversation: int | None = None  # multi-turn workload: which conversation, which turn (0 first)
    turn: int | None = None


# ---------------------------------------------------------------- SLOs

_SLO_METRICS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s", "queue_time": "queue_time_s"}
_SLO_RE = re.compile(r"^([a-z][a-z0-9_]*?)(?:_p(\d+(?:\.\d+)?))?[=:]([0-9]*\.?[0-9]+)(us|ms|s)?$")
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}  # a bare number is ms, as in vLLM


@dataclass(frozen=True)
class Slo:
    """A latency bound every request must meet; `percentile` also checks the run's pXX."""

    metric: str
    threshold_s: float
    percentile: float | None = None
    text: str = ""

    def value(self, record: RequestRecord) -> float | None:
        value = getattr(record, _SLO_METRICS[self.metric])
        if value is None and self.metric == "tpot" and record.success:
            return 0.0  # one output token has no time per output token to exceed
        return value

    def met_by(self, record: RequestRecord) -> bool:
        """Missing values (e.g. no queue time reported) count as not met: unverified is not good."""
        value = self.value(record)
        return record.success and value is not None and value <= self.threshold_s


def parse_slo(text: str) -> Slo:
    """`ttft=500ms`, `tpot=50ms`, `e2e_p95=2s`, `queue_time_p99=1s`; a bare number is ms."""
    match = _SLO_RE.match(text.strip().lower().replace(" ", ""))
    if not match or match[1] not in _SLO_METRICS:
        raise ClientError(f"bad --slo {text!r}: want METRIC[_pXX]=VALUE[us|ms|s] with METRIC one "
                          f"of {', '.join(_SLO_METRICS)}")
    percentile = float(match[2]) if match[2] else None
    if percentile is not None and not 0 < percentile <= 100:
        raise ClientError(f"bad --slo {text!r}: percentile must be in (0, 100]")
    return Slo(match[1], float(match[3]) * _UNITS[match[4]], percentile, text.strip())


# ---------------------------------------------------------------- results

def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once, from the send / end times (ends first on ties)."""
    events = sorted([(r.sent_at_s, 1) for r in records if r.sent_at_s is not None]
                    + [(r.end_at_s, -1) for r in records
                       if r.sent_at_s is not None and r.end_at_s is not None])
    peak = running = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


@dataclass
class RunResult:
    """A finished run: every request's record plus the derived summary (`summary()`)."""

    base_url: str
    model: str
    endpoint: str
    duration_s: float
    records: list[RequestRecord]
    slos: list[Slo] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    started_at: float | None = None  # time.perf_counter() at the run's t0, to align other timelines

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.success]

    @property
    def completed(self) -> int:
        return len(self.ok)

    @property
    def failed(self) -> int:
        return len(self.records) - self.completed

    def _per_s(self, count: float) -> float:
        return count / self.duration_s if self.duration_s > 0 else 0.0

    def latency_stats(self) -> dict[str, dict[str, float | None]]:
        ok = self.ok
        pick = lambda name: [v for r in ok if (v := getattr(r, name)) is not None]  # noqa: E731
        return {"ttft_ms": latency_stats_ms(pick("ttft_s")), "tpot_ms": latency_stats_ms(pick("tpot_s")),
                "itl_ms": latency_stats_ms([gap for r in ok for gap in r.itl_s]),
                "e2e_ms": latency_stats_ms(pick("e2e_s")), "queue_time_ms": latency_stats_ms(pick("queue_time_s"))}

    def slo_report(self) -> dict[str, Any]:
        """Goodput (req/s meeting every SLO) and, per SLO, how many met it and the run's pXX."""
        good = [r for r in self.ok if all(slo.met_by(r) for slo in self.slos)]
        rows = []
        for slo in self.slos:
            row: dict[str, Any] = {"slo": slo.text, "metric": slo.metric,
                                   "threshold_ms": slo.threshold_s * 1e3,
                                   "requests_met": sum(slo.met_by(r) for r in self.ok)}
            if slo.percentile is not None:
                values = [v for r in self.ok if (v := slo.value(r)) is not None]
                value = float(np.percentile(values, slo.percentile)) if values else None
                row["percentile"] = slo.percentile
                row["run_value_ms"] = None if value is None else value * 1e3
                row["run_met"] = value is not None and value <= slo.threshold_s
            rows.append(row)
        return {"goodput": self._per_s(len(good)) if self.slos else None,
                "good_requests": len(good) if self.slos else None, "slos": rows}

    def summary(self) -> dict[str, Any]:
        ok = self.ok
        out_tokens = sum(r.output_tokens for r in ok)
        in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok)
        return {"completed": self.completed, "failed": self.failed, "duration_s": self.duration_s,
                "request_throughput": self._per_s(self.completed),
                "output_throughput": self._per_s(out_tokens),
                "total_token_throughput": self._per_s(in_tokens + out_tokens),
                "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
                "peak_concurrency": peak_concurrency(self.records),
                **self.latency_stats(), **self.slo_report()}

    def error_counts(self) -> collections.Counter[str]:
        """How many requests failed with each error message."""
        return collections.Counter(r.error for r in self.records if not r.success)

    def to_dict(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "model": self.model, "endpoint": self.endpoint,
                "meta": self.meta, "summary": self.summary(),
                "records": [dataclasses.asdict(r) for r in self.records]}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def print_table(result: RunResult, file: TextIO | None = None) -> None:
    """A console summary in the layout of `vllm bench serve`, so numbers are easy to put side by side."""
    out = file or sys.stdout
    s = result.summary()
    line = lambda label, value: print(f"{label:<36}{value:>14}", file=out)  # noqa: E731
    print(f"{' Serving benchmark ':=^50}", file=out)
    print(f"{result.model} @ {result.base_url} ({result.endpoint})", file=out)
    line("Successful requests:", s["completed"])
    line("Failed requests:", s["failed"])
    line("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    line("Peak concurrency:", s["peak_concurrency"])
    line("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    line("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    line("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    if s["goodput"] is not None:
        line("Goodput (req/s):", f"{s['goodput']:.2f}")
    cache = result.meta.get("prefix_cache")
    if cache:
        rate = cache["hit_rate"]
        line("Prefix cache hit rate (tokens):", "-" if rate is None else f"{rate:.1%}")
    spec = result.meta.get("spec_decode")
    if spec and spec.get("num_drafts"):
        line("Spec decode acceptance rate:", f"{spec['acceptance_rate']:.1%}")
        line("Spec decode mean accepted length:", f"{spec['mean_accepted_length']:.2f}")
    later = result.meta.get("later_turns")
    if later and later["count"]:
        line("Later-turn TTFT p50 / p95 (ms):", f"{later['ttft_p50_ms']:.0f} / {later['ttft_p95_ms']:.0f}")
    print(f"{' Latency (ms) ':-^50}", file=out)
    print(f"{'':<12}{'mean':>9}{'median':>9}{'p95':>10}{'p99':>10}", file=out)
    for label, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                       ("E2E", "e2e_ms"), ("Queue", "queue_time_ms")):
        st = s[key]
        cells = "".join(f"{_fmt(st[k]):>{w}}" for k, w in
                        (("mean", 9), ("median", 9), ("p95", 10), ("p99", 10)))
        print(f"{label:<12}{cells}", file=out)
    if s["slos"]:
        print(f"{' SLOs ':-^50}", file=out)
        for row in s["slos"]:
            text = f"{row['slo']:<20} met by {row['requests_met']}/{s['completed']}"
            if "run_met" in row:
                text += (f", run p{row['percentile']:g} {_fmt(row['run_value_ms'])} ms "
                         f"{'ok' if row['run_met'] else 'MISSED'}")
            print(text, file=out)
    errors = result.error_counts()
    for error, count in errors.most_common(3):
        print(f"error x{count}: {error[:120]}", file=out)
    print("=" * 50, file=out)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


# ---------------------------------------------------------------- the server's prefix cache

# vLLM's counter names (`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`, in tokens); iterserve
# exports the same under its own prefix. Prometheus text adds `_total` to counters.
_PREFIX_CACHE_RE = re.compile(r"^[A-Za-z_]+:prefix_cache_(queries|hits)(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$")


async def prefix_cache_counters(http: httpx.AsyncClient) -> dict[str, float] | None:
    """The server's prefix-cache query and hit token counters from /metrics; None when it has no
    such counters (or no /metrics), so any OpenAI server can still be benchmarked."""
    try:
        resp = await http.get("/metrics", timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    found: dict[str, float] = {}
    for line in resp.text.splitlines():
        if m := _PREFIX_CACHE_RE.match(line.strip()):
            found[m[1]] = found.get(m[1], 0.0) + float(m[2])
    return found if set(found) == {"queries", "hits"} else None


def prefix_cache_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """What the run itself queried and hit (counters are cumulative since the server started)."""
    if before is None or after is None:
        return None
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    return {"query_tokens": int(queries), "hit_tokens": int(hits),
            "hit_rate": hits / queries if queries > 0 else None}


# ---------------------------------------------------------------- the server's speculative decoding

# vLLM's spec-decode counters (iterserve exports the same under `iterserve:` too). One prefix is
# read, iterserve's where present, so the twins are not counted twice.
_SPEC_RE = re.compile(r"^([A-Za-z_]+):spec_decode_num_(drafts|draft_tokens|accepted_tokens)(?:_total)?"
                      r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)$")


def spec_decode_counters(text: str) -> dict[str, float] | None:
    """num_drafts, draft_tokens, accepted_tokens from /metrics text; None when the server exports
    no such counters (no speculative decoding there: llama.cpp, vLLM without a spec config)."""
    by_prefix: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if m := _SPEC_RE.match(line.strip()):
            found = by_prefix.setdefault(m[1], {})
            found[m[2]] = found.get(m[2], 0.0) + float(m[3])
    for prefix in ("iterserve", "vllm", *sorted(by_prefix)):
        found = by_prefix.get(prefix, {})
        if set(found) == {"drafts", "draft_tokens", "accepted_tokens"}:
            return {"num_drafts": found["drafts"], "draft_tokens": found["draft_tokens"],
                    "accepted_tokens": found["accepted_tokens"]}
    return None


async def metrics_text(http: httpx.AsyncClient) -> str:
    """The server's /metrics text, "" when it has none."""
    try:
        resp = await http.get("/metrics", timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError:
        return ""
    return resp.text if resp.status_code == 200 else ""


def spec_decode_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """The run's own drafts and acceptances: acceptance_rate = accepted / draft tokens, and
    mean_accepted_length = 1 + accepted / verify rows (tokens per verify row); None without counters."""
    if before is None or after is None:
        return None
    rows, drafted, accepted = (int(after[k] - before[k]) for k in ("num_drafts", "draft_tokens", "accepted_tokens"))
    return {"num_drafts": rows, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": 1 + accepted / rows if rows else None}


# ---------------------------------------------------------------- the run

def api_root(base_url: str) -> str:
    """`http://h:p`, `http://h:p/` and `http://h:p/v1` all mean the same server."""
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


def _describe(exc: BaseException) -> str:
    """The root cause in a few words: httpx says "All connection attempts failed" for a refusal."""
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    cause: BaseException | None = exc
    for _ in range(8):  # a bounded walk down the chain
        if cause is None:
            break
        if isinstance(cause, ConnectionRefusedError) or "refused" in str(cause).lower():
            return "connection refused"
        cause = cause.__cause__ or cause.__context__
    return one_line(exc)


async def resolve_served_model(http: httpx.AsyncClient, model: str | None) -> str:
    """Checks the server answers at all (a clear error beats N failed requests) and names the model."""
    url = f"{http.base_url}/v1/models"
    try:
        resp = await http.get("/v1/models", timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise ClientError(f"cannot reach {url}: {_describe(e)}") from None
    if model:
        return model
    try:
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ClientError(f"cannot read the model name from {url} ({one_line(e)}); "
                          "pass --model") from None


def request_body(spec: RequestSpec, model: str, chat: bool, ignore_eos: bool,
             extra_body: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": spec.output_len, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        system = [{"role": "system", "content": spec.system_prompt}] if spec.system_prompt else []
        body["messages"] = system + [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = f"{spec.system_prompt}\n\n{spec.prompt}" if spec.system_prompt else spec.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    return {**body, **(extra_body or {})}


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _queue_time(chunk: dict[str, Any]) -> float | None:
    """Seconds queued at the server: iterserve's `iterserve.queue_time`, or vLLM-style fields."""
    usage = chunk.get("usage") if isinstance(chunk.get("usage"), dict) else {}
    for holder in (chunk.get("iterserve"), chunk.get("metrics"), chunk, usage, usage.get("metrics")):
        if isinstance(holder, dict) and isinstance(holder.get("queue_time"), (int, float)):
            return float(holder["queue_time"])
    return None


async def stream_request(http: httpx.AsyncClient, path: str, body: dict[str, Any],
                         rec: RequestRecord, t0: float, text_sink: list[str] | None = None) -> None:
    """Sends one request and fills `rec`; only cancellation escapes, every failure is recorded.
    text_sink, when given, receives the streamed text pieces (a conversation's next turn needs them)."""
    sent = time.perf_counter()
    rec.sent_at_s = sent - t0
    last = sent
    chunks = 0
    usage: dict[str, Any] = {}
    try:
        async with http.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {' '.join(text.split())[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("error"):
                    rec.error = f"stream error: {one_line(Exception(chunk['error']))[:200]}"
                    return
                if text := _chunk_text(chunk):
                    if text_sink is not None:
                        text_sink.append(text)
                    if chunks == 0:
                        rec.ttft_s = now - sent
                    else:
                        rec.itl_s.append(now - last)
                    last, chunks = now, chunks + 1
                usage = chunk.get("usage") or usage
                queue_time = _queue_time(chunk)
                rec.queue_time_s = queue_time if queue_time is not None else rec.queue_time_s
        rec.e2e_s = time.perf_counter() - sent
        rec.output_tokens = int(usage.get("completion_tokens") or chunks)
        rec.prompt_tokens = usage.get("prompt_tokens")
        if rec.ttft_s is not None and rec.output_tokens > 1:
            rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)
        rec.success = True
    except asyncio.CancelledError:
        rec.error = "cancelled: run timeout"
        raise
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {_describe(e)}"
    except (ValueError, TypeError, AttributeError) as e:  # malformed stream chunk
        rec.error = f"bad stream data: {one_line(e)[:200]}"
    finally:
        rec.end_at_s = time.perf_counter() - t0


async def run_load(base_url: str, specs: Sequence[RequestSpec], model: str | None = None,
                   endpoint: str = "completions", api_key: str | None = None,
                   timeout_s: float | None = None, ignore_eos: bool = True, progress: bool = True,
                   extra_body: dict[str, Any] | None = None,
                   slos: Sequence[Slo | str] = ()) -> RunResult:
    """Sends `specs` at their arrival times (open loop) and records every request.

    endpoint is "completions" or "chat". timeout_s bounds the whole run (default: last arrival
    + 600 s); requests still running then are cancelled and counted failed, unsent ones too.
    Specs without a prompt get a word-approximated one. Raises ClientError if the server cannot
    be reached or the model not named; per-request failures never raise.
    """
    if endpoint not in ("completions", "chat"):
        raise ClientError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
    slo_list = [s if isinstance(s, Slo) else parse_slo(s) for s in slos]
    missing = [dataclasses.replace(s) for s in specs if not s.prompt]
    by_index = {s.index: s for s in build_prompts(missing)} if missing else {}
    specs = sorted((by_index.get(s.index, s) for s in specs), key=lambda s: s.arrival_s)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    root = api_root(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    bound = timeout_s if timeout_s is not None else max((s.arrival_s for s in specs), default=0) + GRACE_S
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # never queue here
    async with httpx.AsyncClient(base_url=root, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)) as http:
        model = await resolve_served_model(http, model)
        cache_before = await prefix_cache_counters(http)
        spec_before = spec_decode_counters(await metrics_text(http))
        records = [RequestRecord(s.index, s.arrival_s, s.input_len, s.output_len) for s in specs]
        tasks: list[asyncio.Task[None]] = []
        bar = tqdm(total=len(specs), disable=not progress, unit="req", desc="bench")
        t0 = time.perf_counter()

        async def dispatch() -> None:
            for spec, rec in zip(specs, records):
                delay = t0 + spec.arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(stream_request(
                    http, path, request_body(spec, model, endpoint == "chat", ignore_eos, extra_body),
                    rec, t0))
                task.add_done_callback(lambda _: bar.update(1))
                tasks.append(task)
            if tasks:
                await asyncio.wait(tasks)

        try:
            await asyncio.wait_for(dispatch(), timeout=bound)
        except TimeoutError:
            pending = [t for t in tasks if not t.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
        bar.close()
        cache_after = await prefix_cache_counters(http)
        spec_after = spec_decode_counters(await metrics_text(http))
    for rec in records:
        if rec.sent_at_s is None:
            rec.error = "not sent: run timeout"
    result = RunResult(root, model, endpoint, duration, sorted(records, key=lambda r: r.index),
                       slo_list, started_at=t0)
    result.meta["prefix_cache"] = prefix_cache_delta(cache_before, cache_after)
    spec = spec_decode_delta(spec_before, spec_after)
    if spec is not None:  # absent, not null, for a server without the counters: its JSON is as before
        result.meta["spec_decode"] = spec
    return result


def add_target_server_args(p) -> None:
    """The flags that name the OpenAI-compatible server a command talks to (bench serve, probe)."""
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key", help="sent as a Bearer token")
