"""`iterserve probe`: does an OpenAI-compatible server batch continuously, statically, or not at all?

A black-box experiment, timed on the client:
1. warm-up and calibration: one request alone gives the server's solo TTFT and time per token,
   which scale everything else (a fast server gets a longer "long" request);
2. overlap: one long generation (forced length with `ignore_eos`, or a prompt asking for a long
   answer where the server refuses the field) and, while it generates, short requests at 20, 40,
   60 and 80 % of its expected duration;
3. burst: requests of mixed lengths sent at once.
`probe_analysis.classify` reads the verdict off the timings. Where the server reports its running
requests (iterserve's /v1/scheduler, or a Prometheus gauge in /metrics), those counts are polled
during the run as a second witness. The load is bounded: 15 requests, one time limit.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from iterserve.bench.client import (ClientError, RequestRecord, add_target_server_args, api_root, request_body,
                                    resolve_served_model, stream_request)
from iterserve.bench.common import one_line, pyplot
from iterserve.bench.probe_analysis import Timing, Verdict, Witness, classify, combine
from iterserve.bench.summary import run_info, write_json
from iterserve.bench.workload import RequestSpec

SHORT_AT = (0.2, 0.4, 0.6, 0.8)  # when the shorts go out, as fractions of the long one's duration
BURST_MULT = (1, 4, 2, 1, 4, 1, 2, 1)  # burst lengths, in multiples of the short length
RUNNING_GAUGES = ("iterserve:num_requests_running", "vllm:num_requests_running",
                  "llamacpp:requests_processing")
LONG_PROMPT = ("Write a very long and detailed story about a ship's voyage around the world, "
               "describing every port, every storm and every sailor. Do not stop early.")
SHORT_PROMPT = "Request {i}: name a colour."


@dataclass
class Plan:
    """The experiment's sizes, scaled from the solo speed."""

    ttft: float
    tpot: float
    long_tokens: int
    short_tokens: int
    burst_tokens: list[int]
    ignore_eos: bool

    @property
    def long_seconds(self) -> float:
        return self.ttft + (self.long_tokens - 1) * self.tpot


def make_plan(ttft: float, tpot: float, ignore_eos: bool, long_seconds: float = 3.0,
              min_long: int = 64, max_long: int = 1024) -> Plan:
    """Long enough (in tokens) that the long request lasts `long_seconds`; shorts ~1/10 of it."""
    long_tokens = int(min(max_long, max(min_long, math.ceil(long_seconds / max(tpot, 1e-4)))))
    short = int(min(16, max(8, long_tokens // 10)))
    return Plan(ttft, tpot, long_tokens, short, [short * m for m in BURST_MULT], ignore_eos)


@dataclass
class ProbeResult:
    base_url: str
    model: str
    plan: Plan | None
    timings: list[Timing]
    verdict: Verdict
    witness: Witness | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "model": self.model,
                "plan": asdict(self.plan) if self.plan else None,
                "verdict": self.verdict.to_dict(), "notes": self.notes,
                "timings": [asdict(t) for t in self.timings],
                "witness": asdict(self.witness) if self.witness else None}


class Prober:
    """Runs the experiment against one server; `await Prober(...).run()` -> ProbeResult."""

    def __init__(self, base_url: str, model: str | None = None, endpoint: str = "completions",
                 api_key: str | None = None, long_seconds: float = 3.0, max_long_tokens: int = 1024,
                 time_limit: float = 180.0, poll: bool = True,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.root = api_root(base_url)
        self.model = model
        self.chat = endpoint == "chat"
        self.path = "/v1/chat/completions" if self.chat else "/v1/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.long_seconds, self.max_long_tokens = long_seconds, max_long_tokens
        self.time_limit = time_limit
        self.poll = poll
        self.transport = transport  # tests substitute a simulated server
        self.timings: list[Timing] = []
        self.live: dict[str, RequestRecord] = {}
        self.notes: list[str] = []
        self.plan: Plan | None = None
        self.t0 = 0.0

    # ---- one request ----------------------------------------------------------------------------
    async def _send(self, http: httpx.AsyncClient, name: str, phase: str, prompt: str, max_tokens: int,
                    ignore_eos: bool) -> Timing:
        spec = RequestSpec(len(self.timings), 0.0, 0, max_tokens, prompt)
        rec = self.live[name] = RequestRecord(spec.index, 0.0, 0, max_tokens)
        body = request_body(spec, self.model or "", self.chat, ignore_eos, None)
        timing = Timing(name, phase, time.perf_counter() - self.t0, max_tokens=max_tokens)
        self.timings.append(timing)
        await stream_request(http, self.path, body, rec, self.t0)
        timing.sent = rec.sent_at_s if rec.sent_at_s is not None else timing.sent
        if rec.success and rec.ttft_s is not None:
            timing.first = timing.sent + rec.ttft_s
            timing.end = timing.first + sum(rec.itl_s)
            timing.tokens = rec.output_tokens
        else:
            timing.error = rec.error or "no tokens received"
        return timing

    def tokens_so_far(self, name: str) -> int:
        """Tokens streamed so far to a request in flight (the client's record grows as they come)."""
        rec = self.live.get(name)
        return 0 if rec is None or rec.ttft_s is None else 1 + len(rec.itl_s)

    # ---- phases ---------------------------------------------------------------------------------
    async def _calibrate(self, http: httpx.AsyncClient) -> Plan:
        """Solo speed: the faster of two lone requests (the first one of a fresh server is often slow)."""
        ignore_eos = True
        warm = await self._send(http, "warm-up", "calibrate", SHORT_PROMPT.format(i=0), 16, ignore_eos)
        if warm.error.startswith("HTTP 4"):
            self.notes.append(f"server refused ignore_eos ({warm.error[:80]}); using a prompt that "
                              "asks for a long answer instead")
            ignore_eos = False
            warm = await self._send(http, "warm-up", "calibrate", SHORT_PROMPT.format(i=0), 16, False)
        if not warm.ok:
            raise ClientError(f"warm-up request failed: {warm.error}")
        cal = await self._send(http, "calibrate", "calibrate", LONG_PROMPT, 32, ignore_eos)
        if not cal.ok or cal.tokens < 2:
            raise ClientError(f"calibration request failed: {cal.error or 'fewer than 2 tokens'}")
        if cal.tokens < 32:
            self.notes.append(f"calibration stopped after {cal.tokens} of 32 tokens: the server may "
                              "ignore ignore_eos, so lengths are not forced")
        solo = [t for t in (warm, cal) if t.tokens >= 4] or [cal]
        tpot = min(t.gen_time / (t.tokens - 1) for t in solo)
        plan = make_plan(min(t.ttft for t in solo), tpot, ignore_eos, self.long_seconds,
                         max_long=self.max_long_tokens)
        if plan.long_seconds < 0.8 * self.long_seconds:
            self.notes.append(f"long request capped at {plan.long_tokens} tokens (~{plan.long_seconds:.1f} s "
                              f"expected); raise --max-long-tokens for a longer one")
        return plan

    async def _overlap_phase(self, http: httpx.AsyncClient, plan: Plan) -> None:
        """Shorts go out when the long request has streamed 20, 40, 60, 80 % of its tokens: by its
        progress, not the clock, so a wrong speed estimate cannot make them miss it."""
        long = asyncio.ensure_future(self._send(http, "long", "overlap", LONG_PROMPT, plan.long_tokens,
                                                plan.ignore_eos))
        shorts = []
        for i, frac in enumerate(SHORT_AT, 1):
            while not long.done() and self.tokens_so_far("long") < max(1, frac * plan.long_tokens):
                await asyncio.sleep(0.005)
            if long.done():
                self.notes.append(f"the long request ended before short {i} was due; "
                                  f"{len(SHORT_AT) - i + 1} short request(s) not sent")
                break
            shorts.append(asyncio.ensure_future(self._send(
                http, f"short-{i}", "overlap", SHORT_PROMPT.format(i=i), plan.short_tokens, plan.ignore_eos)))
        await asyncio.gather(long, *shorts)

    async def _burst_phase(self, http: httpx.AsyncClient, plan: Plan) -> None:
        await asyncio.gather(*(self._send(http, f"burst-{i}", "burst", SHORT_PROMPT.format(i=10 + i), n,
                                          plan.ignore_eos)
                               for i, n in enumerate(plan.burst_tokens, 1)))

    # ---- the run --------------------------------------------------------------------------------
    async def run(self) -> ProbeResult:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=self.root, headers=self.headers, limits=limits,
                                     timeout=httpx.Timeout(None, connect=10.0), transport=self.transport) as http:
            self.model = await resolve_served_model(http, self.model)
            self.t0 = time.perf_counter()
            witness = await _detect_witness(http) if self.poll else None
            try:
                await asyncio.wait_for(self._experiment(http, witness), timeout=self.time_limit)
            except TimeoutError:
                self.notes.append(f"time limit of {self.time_limit:.0f} s reached; judged on what finished")
        if self.plan is None:
            verdict = Verdict("unknown", 0.0, ["calibration did not finish"])
        else:
            verdict = combine(classify(self.timings, self.plan.tpot, self.plan.ttft), witness, self.timings)
        return ProbeResult(self.root, self.model or "", self.plan, self.timings, verdict, witness, self.notes)

    async def _experiment(self, http: httpx.AsyncClient, witness: Witness | None) -> None:
        self.plan = await self._calibrate(http)
        poller = None
        if witness is not None:
            interval = min(0.1, max(0.02, self.plan.short_tokens * self.plan.tpot / 4))
            poller = asyncio.ensure_future(_poll_witness(http, witness, self.t0, interval))
        try:
            await self._overlap_phase(http, self.plan)
            await asyncio.sleep(max(0.2, 3 * self.plan.ttft))  # a clear gap between the phases
            await self._burst_phase(http, self.plan)
            await asyncio.sleep(0.1)  # the last counts
        finally:
            if poller is not None:
                poller.cancel()
                await asyncio.gather(poller, return_exceptions=True)


# ---------------------------------------------------------------- the second witness

async def _get_json(http: httpx.AsyncClient, path: str) -> dict[str, Any] | None:
    try:
        resp = await http.get(path, timeout=5.0)
        data = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def running_gauge(text: str) -> tuple[str, int] | None:
    """The first known running-requests gauge in a Prometheus exposition, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in RUNNING_GAUGES:
                    found[s.name] = found.get(s.name, 0.0) + s.value
    except ValueError:
        return None
    for name in RUNNING_GAUGES:
        if name in found:
            return name, int(round(found[name]))
    return None


async def _metrics_gauge(http: httpx.AsyncClient) -> tuple[str, int] | None:
    try:
        resp = await http.get("/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    return running_gauge(resp.text) if resp.status_code == 200 else None


async def _detect_witness(http: httpx.AsyncClient) -> Witness | None:
    sched = await _get_json(http, "/v1/scheduler")
    if sched is not None and "running" in sched:
        return Witness("/v1/scheduler steps" if "steps" in sched else "/v1/scheduler")
    gauge = await _metrics_gauge(http)
    return Witness(f"/metrics {gauge[0]}") if gauge else None


def _count(value: Any) -> int:
    return len(value) if isinstance(value, (list, tuple)) else int(value or 0)


async def _poll_witness(http: httpx.AsyncClient, witness: Witness, t0: float, interval: float) -> None:
    """Fills witness.samples until cancelled; iterserve's per-step records where it has them."""
    last_step: int | None = None  # newest step seen; the first poll only sets the starting point
    offset = None  # probe time minus server uptime, fixed at the first poll
    while True:
        before = time.perf_counter()
        if witness.source.startswith("/v1/scheduler"):
            query = f"?since_step={last_step}" if last_step is not None else ""
            data = await _get_json(http, "/v1/scheduler" + query)
            now = (before + time.perf_counter()) / 2 - t0
            if data is not None:
                uptime = data.get("uptime_s")
                if offset is None and isinstance(uptime, (int, float)):
                    offset = now - uptime
                steps = [s for s in data.get("steps") or [] if isinstance(s, dict) and "step" in s]
                new = [s for s in steps if last_step is not None and s["step"] > last_step]
                for s in new:
                    if offset is not None and "t" in s:
                        witness.samples.append((s["t"] + offset, _count(s.get("num_running", 0))))
                last_step = max([last_step or 0] + [int(s["step"]) for s in steps])
                if not new and "running" in data:
                    witness.samples.append((now, _count(data["running"])))
        else:
            gauge = await _metrics_gauge(http)
            if gauge is not None:
                witness.samples.append(((before + time.perf_counter()) / 2 - t0, gauge[1]))
        await asyncio.sleep(max(0.0, interval - (time.perf_counter() - before)))


# ---------------------------------------------------------------- output

def print_report(result: ProbeResult, file=None) -> None:
    out = file or sys.stdout
    p = result.plan
    print(f"probe: {result.base_url} (model {result.model})", file=out)
    if p:
        print(f"solo speed: TTFT {p.ttft * 1e3:.0f} ms, {p.tpot * 1e3:.1f} ms/token; long request "
              f"{p.long_tokens} tokens (~{p.long_seconds:.1f} s), {len(SHORT_AT)} short of {p.short_tokens}, "
              f"burst of {len(p.burst_tokens)} ({min(p.burst_tokens)}-{max(p.burst_tokens)} tokens)"
              f"{'' if p.ignore_eos else ', lengths not forced (no ignore_eos)'}", file=out)
    for note in result.notes:
        print(f"note: {note}", file=out)
    v = result.verdict
    print(f"verdict: {v.verdict}", file=out)
    print(f"confidence: {v.confidence:.2f}", file=out)
    print("evidence:", file=out)
    for line in v.evidence:
        print(f"  - {line}", file=out)


def plot_timeline(result: ProbeResult, path: str | Path) -> None:
    """Each request as a bar: sent -> first token (light), first -> last token (dark)."""
    plt = pyplot()
    rows = [t for t in result.timings if t.phase != "calibrate"]
    has_w = bool(result.witness and result.witness.samples)
    fig, axes = plt.subplots(2 if has_w else 1, 1, figsize=(10, 0.35 * len(rows) + 2.5 + 2 * has_w),
                             sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1] if has_w else [1]})
    ax = axes[0][0]
    colors = {"overlap": "tab:blue", "burst": "tab:orange"}
    for y, t in enumerate(rows):
        c = colors.get(t.phase, "tab:gray")
        if t.first is None:
            ax.plot([t.sent], [y], "x", color="red")
            continue
        ax.barh(y, t.first - t.sent, left=t.sent, color=c, alpha=0.25, height=0.6)
        ax.barh(y, t.end - t.first, left=t.first, color=c, height=0.6)  # type: ignore[operator]
    ax.set_yticks(range(len(rows)), [t.name for t in rows])
    ax.invert_yaxis()
    ax.set_title(f"probe {result.base_url}: verdict {result.verdict.verdict} "
                 f"(confidence {result.verdict.confidence:.2f})\nlight: waiting for first token, "
                 "dark: generating")
    if has_w:
        w = axes[1][0]
        ts, ns = zip(*sorted(result.witness.samples))  # type: ignore[union-attr]
        w.step(ts, ns, where="post", color="tab:green")
        w.set_ylabel("running\n(server)")
        w.set_title(result.witness.source, fontsize=9)  # type: ignore[union-attr]
    axes[-1][0].set_xlabel("seconds since probe start")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- command line

def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("probe", help="tell whether a server batches continuously, statically or not at all",
                              description=__doc__.splitlines()[0])
    add_target_server_args(p)
    p.add_argument("--long-seconds", type=float, default=3.0,
                   help="how long the long request should last at solo speed (default 3)")
    p.add_argument("--max-long-tokens", type=int, default=1024, help="cap on the long request's length")
    p.add_argument("--time-limit", type=float, default=180.0, metavar="S",
                   help="bound on the whole probe (default 180 s)")
    p.add_argument("--no-witness", action="store_true", help="do not poll /v1/scheduler or /metrics")
    p.add_argument("--plot", metavar="PNG", help="save a timeline of every request")
    p.add_argument("--json", metavar="PATH",
                   help="write plan, timings, verdict and witness samples (15 requests: a few KB), with the "
                        "host, commit and command")
    p.set_defaults(func=cmd_probe)
    return p


def cmd_probe(args: argparse.Namespace) -> int:
    """0 with a verdict, 1 when the timings could not tell, 2 when the server cannot be probed."""
    if args.long_seconds <= 0 or args.time_limit <= 0 or args.max_long_tokens < 16:
        raise ValueError("--long-seconds and --time-limit must be > 0, --max-long-tokens >= 16")
    command = ["iterserve", *sys.argv[1:]] if sys.argv[1:2] == ["probe"] else None  # None: called in-process
    info = run_info(command)
    prober = Prober(args.base_url, args.model, args.endpoint, args.api_key, args.long_seconds,
                    args.max_long_tokens, args.time_limit, poll=not args.no_witness)
    try:
        result = asyncio.run(prober.run())
    except ClientError as e:
        raise ValueError(one_line(e)) from None
    print_report(result)
    if args.json:
        write_json(Path(args.json), {**info, **result.to_dict()})
    if args.plot:
        plot_timeline(result, args.plot)
    return 0 if result.verdict.verdict != "unknown" else 1
