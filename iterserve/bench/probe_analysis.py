"""The probe's verdict from client-side timings alone: continuous, static or serial batching.

Two observations decide it, both read off each request's (sent, first token, last token):

- *join*: a request sent while another one was generating, with plenty of that one's generation
  still to come. A continuous (iteration-level) scheduler starts it at the next step, so its first
  token comes long before the other one ends; a static (request-level) batcher and a serial server
  make it wait until the running batch has finished.
- *overlap*: requests that were in the server together (queued or running). A server that batches
  at all, statically or continuously, generates some of them at the same time; a serial server
  never has two generation intervals overlapping.

Then: no overlap -> serial; overlap and joins -> continuous; overlap but no joins -> static. The
confidence multiplies the two observations' agreement, each smoothed by its sample count
((k + 0.5) / (n + 1)), so three of three agreeing is not certainty.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

VERDICTS = ("continuous", "static", "serial")


@dataclass
class Timing:
    """One request as the client saw it; times in seconds from the probe's start."""

    name: str  # "long", "short-1", "burst-3", ...
    phase: str  # "calibrate", "overlap" or "burst"
    sent: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    max_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.first is not None and self.end is not None and not self.error

    @property
    def ttft(self) -> float:
        assert self.first is not None
        return self.first - self.sent

    @property
    def gen_time(self) -> float:
        assert self.first is not None and self.end is not None
        return self.end - self.first


@dataclass
class Tolerances:
    """Time slack for deciding what counts as 'before' and 'overlapping', from the solo speed."""

    tpot: float  # seconds per output token, one request alone
    ttft: float  # time to first token, one request alone

    @property
    def jitter(self) -> float:
        """Client-side observation noise: a few token times, at least 20 ms."""
        return max(0.02, 3 * self.tpot)

    @property
    def join_margin(self) -> float:
        """How much of another request's generation must remain for a join to be expected."""
        return max(0.15, 4 * self.ttft, 10 * self.tpot) + self.jitter


@dataclass
class Verdict:
    verdict: str  # one of VERDICTS, or "unknown" when the timings cannot tell
    confidence: float
    evidence: list[str]
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _overlap(a: Timing, b: Timing) -> float:
    """Seconds during which both were generating (negative: a gap between them)."""
    return min(a.end, b.end) - max(a.first, b.first)  # type: ignore[type-var,operator]


def _copresent(a: Timing, b: Timing, tol: Tolerances) -> bool:
    """Both were in the server together long enough that a batching server could pair them."""
    return max(a.sent, b.sent) < min(a.end, b.end) - tol.jitter  # type: ignore[operator]


def _generated_together(a: Timing, b: Timing) -> bool:
    """Generation intervals overlap by at least half of the shorter one (not a hand-over)."""
    shorter = min(a.gen_time, b.gen_time)
    return _overlap(a, b) > max(0.002, 0.5 * shorter)


def join_observations(done: Sequence[Timing], tol: Tolerances) -> list[dict[str, Any]]:
    """For each request sent while others were generating with time to spare: did it join them?"""
    out = []
    for x in done:
        busy = [b for b in done if b is not x and b.first < x.sent  # type: ignore[operator]
                and b.end - x.sent > tol.join_margin]  # type: ignore[operator]
        if not busy:
            continue
        batch_end = max(b.end for b in busy)  # type: ignore[type-var]
        out.append({"name": x.name, "sent": x.sent, "ttft": x.ttft, "first": x.first, "end": x.end,
                    "busy": [b.name for b in busy], "batch_end": batch_end,
                    "joined": x.first < batch_end - tol.jitter,  # type: ignore[operator]
                    "after_batch_end": x.first - batch_end,  # type: ignore[operator]
                    "finished_before": batch_end - x.end})  # type: ignore[operator]
    return out


def overlap_observations(done: Sequence[Timing], tol: Tolerances) -> dict[str, Any]:
    """Per request that shared the server with another: did it ever generate alongside one?"""
    copresent_names, together_names = set(), set()
    pairs = together_pairs = 0
    for i, a in enumerate(done):
        for b in done[i + 1:]:
            if not _copresent(a, b, tol):
                continue
            pairs += 1
            copresent_names |= {a.name, b.name}
            if _generated_together(a, b):
                together_pairs += 1
                together_names |= {a.name, b.name}
    return {"copresent_requests": len(copresent_names), "overlapping_requests": len(together_names),
            "copresent_pairs": pairs, "overlapping_pairs": together_pairs}


def waves(group: Sequence[Timing], tol: Tolerances) -> list[list[Timing]]:
    """Requests grouped by when their first token came: a new wave after a gap of a few steps."""
    ordered = sorted(group, key=lambda t: t.first)  # type: ignore[arg-type,return-value]
    out: list[list[Timing]] = []
    for t in ordered:
        gap_ok = out and t.first - out[-1][-1].first <= tol.jitter  # type: ignore[operator]
        if gap_ok:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def serial_order(done: Sequence[Timing], tol: Tolerances) -> tuple[int, int]:
    """(requests that started only after the previous one ended, requests after the first)."""
    ordered = sorted(done, key=lambda t: t.first)  # type: ignore[arg-type,return-value]
    handovers = sum(1 for a, b in zip(ordered, ordered[1:]) if b.first >= a.end - tol.jitter)  # type: ignore[operator]
    return handovers, max(0, len(ordered) - 1)


def _smoothed(k: int, n: int) -> float:
    return (k + 0.5) / (n + 1)


def _fmt_s(x: float) -> str:
    return f"{x:.2f} s" if abs(x) < 10 else f"{x:.1f} s"


def _range_s(values: Sequence[float]) -> str:
    lo, hi = min(values), max(values)
    return _fmt_s(lo) if abs(hi - lo) < 0.005 else f"{lo:.2f}-{_fmt_s(hi)}"


def classify(timings: Sequence[Timing], tpot: float, ttft: float) -> Verdict:
    """The verdict, its confidence and the evidence in words, from the timings of one probe run.

    `tpot` and `ttft` are the server's solo speed (one request alone), which scale the tolerances.
    Calibration requests (phase "calibrate") ran alone and are left out.
    """
    tol = Tolerances(tpot=max(tpot, 1e-4), ttft=max(ttft, 1e-4))
    done = [t for t in timings if t.ok and t.phase != "calibrate"]
    failed = [t for t in timings if not t.ok and t.phase != "calibrate"]
    joins = join_observations(done, tol)
    ov = overlap_observations(done, tol)
    n_join, n_cand = sum(j["joined"] for j in joins), len(joins)
    p_join = _smoothed(n_join, n_cand)
    p_overlap = _smoothed(ov["overlapping_requests"], ov["copresent_requests"])
    stats: dict[str, Any] = {"joins": joins, "join_candidates": n_cand, "joined": n_join,
                             "p_join": p_join, "p_overlap": p_overlap, **ov,
                             "tolerances": {"jitter": tol.jitter, "join_margin": tol.join_margin},
                             "failed": len(failed)}
    evidence: list[str] = []
    if failed:
        evidence.append(f"{len(failed)} request(s) failed and were left out "
                        f"(first error: {failed[0].error[:120] or 'no tokens'})")
    if ov["copresent_requests"] == 0 and n_cand == 0:
        evidence.append("no two requests were ever in the server together, so the timings cannot tell")
        return Verdict("unknown", 0.0, evidence, stats)

    evidence += _join_evidence(joins)
    evidence += _overlap_evidence(ov)
    burst = [t for t in done if t.phase == "burst"]
    if burst:
        evidence += _burst_evidence(burst, tol)
    handovers, steps = serial_order(done, tol)
    stats["serial_handovers"] = [handovers, steps]

    if p_overlap < 0.5:
        verdict = "serial"
        conf = (1 - p_overlap) * ((1 - p_join) if n_cand else 1.0)
        evidence.append(f"completion was strictly serial: {handovers} of {steps} requests started only "
                        f"after the previous one had finished")
    elif n_cand and p_join >= 0.5:
        verdict, conf = "continuous", p_join * p_overlap
    else:
        verdict = "static"
        conf = (1 - p_join) * p_overlap if n_cand else 0.5 * p_overlap
        if not n_cand:
            evidence.append("no request arrived while another was generating, so joining was not tested")
    tpots = [t.gen_time / (t.tokens - 1) for t in done if t.tokens > 1]
    if tpots:
        ratio = float(np.median(tpots)) / tol.tpot
        stats["tpot_under_load_ratio"] = ratio
        evidence.append(f"per-token time under load was {ratio:.1f}x the solo speed "
                        f"({np.median(tpots) * 1e3:.1f} ms vs {tol.tpot * 1e3:.1f} ms)")
    return Verdict(verdict, round(float(conf), 2), evidence, stats)


def _join_evidence(joins: Sequence[dict[str, Any]]) -> list[str]:
    if not joins:
        return []
    joined = [j for j in joins if j["joined"]]
    waited = [j for j in joins if not j["joined"]]
    n = len(joins)
    lines = []
    if joined:
        early = [j["finished_before"] for j in joined if j["finished_before"] > 0]
        text = (f"{len(joined)} of {n} requests sent while another was generating started at once "
                f"(TTFT {_range_s([j['ttft'] for j in joined])})")
        if early:
            text += (f"; {len(early)} finished {_range_s(early)} before the one already running: "
                     "TTFT did not wait for it")
        lines.append(text)
    if waited:
        after = [j["after_batch_end"] for j in waited]
        text = (f"{len(waited)} of {n} requests sent while another was generating waited for what was "
                f"running: first token {_range_s(after)} after it ended (TTFT "
                f"{_range_s([j['ttft'] for j in waited])})")
        if len(waited) >= 2:
            order = sorted(waited, key=lambda j: j["sent"])
            if order[-1]["ttft"] < order[0]["ttft"]:
                text += ", shrinking as they arrived later: TTFT tracks the batch's end (saw-tooth)"
        lines.append(text)
    return lines


def _overlap_evidence(ov: dict[str, Any]) -> list[str]:
    n, k = ov["copresent_requests"], ov["overlapping_requests"]
    if not n:
        return []
    if k == 0:
        return [f"no two requests ever generated at the same time: 0 of {n} requests that were in "
                "the server together overlapped in generation"]
    return [f"{k} of {n} requests that were in the server together generated alongside another "
            f"({ov['overlapping_pairs']} of {ov['copresent_pairs']} pairs)"]


def _burst_evidence(burst: Sequence[Timing], tol: Tolerances) -> list[str]:
    groups = waves(burst, tol)
    sizes = ", ".join(str(len(g)) for g in groups)
    text = f"burst of {len(burst)} sent at once: first tokens came in {len(groups)} wave(s) ({sizes})"
    if len(groups) > 1:
        # static: each wave starts when the previous wave's slowest member ends
        gaps = [min(t.first for t in g) - max(t.end for t in prev)  # type: ignore[type-var,operator]
                for prev, g in zip(groups, groups[1:])]
        waited_slowest = sum(1 for gap in gaps if -tol.jitter <= gap)
        text += (f"; {waited_slowest} of {len(gaps)} later waves began only after the previous wave's "
                 f"slowest request finished")
    return [text]


# ---------------------------------------------------------------- second witness: the server's own count

@dataclass
class Witness:
    """The running-request count the server reported over the probe (e.g. /v1/scheduler, /metrics)."""

    source: str  # where the counts came from, in words
    samples: list[tuple[float, int]] = field(default_factory=list)  # (probe time s, running)

    def max_between(self, start: float, end: float) -> int | None:
        values = [n for t, n in self.samples if start <= t <= end]
        return max(values) if values else None


def witness_verdict(witness: Witness, timings: Sequence[Timing]) -> tuple[str | None, str]:
    """What the server's running count says on its own, and that in words.

    Looks at the middle 80 % of the longest overlap-phase request's generation (so clock offsets
    between client and server do not matter): a continuous server runs the short requests
    alongside it (count >= 2), a static or serial one keeps it alone; and at the whole run: a
    serial server never reports more than one.
    """
    done = [t for t in timings if t.ok and t.phase != "calibrate"]
    if not witness.samples or not done:
        return None, f"{witness.source}: no samples"
    overall = max(n for _, n in witness.samples)
    text = f"{witness.source}: running requests up to {overall} over the run"
    long = max((t for t in done if t.phase == "overlap"), key=lambda t: t.gen_time, default=None)
    during = None
    if long is not None:
        pad = 0.1 * long.gen_time
        during = witness.max_between(long.first + pad, long.end - pad)  # type: ignore[operator]
        if during is not None:
            text += f", up to {during} while the long request generated"
    if overall <= 1:
        kind: str | None = "serial"
    elif during is None:
        kind = None
    else:
        kind = "continuous" if during >= 2 else "static"
    return kind, text + (f": consistent with {kind}" if kind else "")


def combine(v: Verdict, witness: Witness | None, timings: Sequence[Timing]) -> Verdict:
    """Adds the witness to the evidence: agreement halves the doubt, disagreement cuts confidence."""
    if witness is None or v.verdict == "unknown":
        return v
    kind, text = witness_verdict(witness, timings)
    v.stats["witness"] = {"source": witness.source, "verdict": kind, "samples": len(witness.samples)}
    if kind is None:
        v.evidence.append(text)
    elif kind == v.verdict:
        v.confidence = round(1 - (1 - v.confidence) / 2, 2)
        v.evidence.append(text + " (agrees)")
    else:
        v.confidence = round(v.confidence * 0.6, 2)
        v.evidence.append(text + f" (DISAGREES with the timings, which say {v.verdict})")
    return v
