"""Workloads: when each benchmark request arrives and how long its prompt and its output are.

Arrivals are open loop: the client sends each request at its `arrival_s` whatever the server is
doing, so a server that falls behind shows it as queueing delay instead of quietly lowering the
offered load (what a closed loop of N workers would do).

Synthetic generators share the length keywords of `LengthOptions`: `input_len` / `output_len` are
a fixed int or an inclusive `(lo, hi)` uniform range; `max_input_len` / `max_output_len` clamp
(the trace replay takes the two clamps too). Every length is at least 1.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import re
from importlib import resources
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypedDict, Unpack

import numpy as np

from iterserve.bench.common import one_line

LenSpec = int | tuple[int, int]
DEFAULT_NUM_REQUESTS = 200
SEED_RATE = 1 / 0.300  # docs/seed-case.md: one request every 300 ms on average, peaks of 20/s


class WorkloadError(ValueError):
    """A workload that cannot be built (bad trace or parameters); the message is one line."""


@dataclass
class RequestSpec:
    """One request to send: when (seconds after the run starts) and how many tokens in and out."""

    index: int
    arrival_s: float
    input_len: int
    output_len: int
    prompt: str = ""
    system_prompt: str = ""  # shared-prefix workload: one system prompt sent before every prompt
    system_prompt_len: int = 0  # its tokens (build_prompts writes it)


class LengthOptions(TypedDict, total=False):
    input_len: LenSpec
    output_len: LenSpec
    max_input_len: int | None
    max_output_len: int | None


# ---------------------------------------------------------------- lazy workloads

STREAM_CHUNK = 65_536  # a lazy workload draws this many requests at a time
Chunk = tuple[np.ndarray, np.ndarray, np.ndarray]  # arrivals, input lengths, output lengths


class Workload:
    """A workload that yields its requests lazily, in arrival order, `chunk` draws at a time.

    Why: a day of traffic at 1,000 req/s is 86 M requests; as a list that is tens of GB, so the
    simulator consumes this instead and holds only the requests in flight. Iterating again replays
    the same requests (each pass re-seeds), and `len` is known without drawing. Each chunk draws its
    arrivals, then its input lengths, then its output lengths from one generator: with one chunk
    (chunk >= num_requests) that is exactly the order the eager generators have always drawn in,
    so `list(workload)` is then the eager workload of the same seed; with smaller chunks the draws
    interleave, so a long lazy workload is the same process but not the same requests.
    """

    def __init__(self, num_requests: int, chunks: Callable[[], Iterator[Chunk]], system_prompt_len: int = 0,
                 max_input_len: int | None = None, max_output_len: int | None = None) -> None:
        self.num_requests = num_requests
        self.chunks = chunks
        self.system_prompt_len = system_prompt_len
        self.max_input_len = max_input_len
        self.max_output_len = max_output_len

    def __len__(self) -> int:
        return self.num_requests

    def __iter__(self) -> Iterator[RequestSpec]:
        index = itertools.count()
        for arrivals, input_lens, output_lens in self.chunks():
            ins = np.clip(input_lens, 1, self.max_input_len or None)
            outs = np.clip(output_lens, 1, self.max_output_len or None)
            for a, x, y in zip(arrivals.tolist(), ins.tolist(), outs.tolist()):  # one spec at a time
                yield RequestSpec(next(index), a, x, y, system_prompt_len=self.system_prompt_len)


def _chunk_sizes(n: int, chunk: int) -> Iterator[int]:
    for first in range(0, n, chunk):
        yield min(chunk, n - first)


def _draw_lengths(k: int, rng: np.random.Generator, lengths: LengthOptions) -> tuple[np.ndarray, np.ndarray]:
    return (sample_lengths(lengths.get("input_len", 128), k, rng, "input_len"),
            sample_lengths(lengths.get("output_len", 128), k, rng, "output_len"))


def _workload(n: int, lengths: LengthOptions, chunks: Callable[[], Iterator[Chunk]],
              system_prompt_len: int = 0) -> Workload:
    """Checks the length keywords now (errors at build time, not mid-simulation) and wraps `chunks`."""
    unknown = set(lengths) - set(LengthOptions.__annotations__)
    if unknown:
        raise TypeError(f"unknown workload keyword(s): {', '.join(sorted(unknown))}")
    _draw_lengths(0, _rng(0), lengths)  # validates the (lo, hi) specs
    return Workload(n, chunks, system_prompt_len, lengths.get("max_input_len"), lengths.get("max_output_len"))


# ---------------------------------------------------------------- synthetic arrival processes
# Each process is a lazy `*_stream`; the eager form is its one-chunk list (the same draws as ever).

def poisson_stream(num_requests: int, rate: float, *, seed: int = 0, chunk: int = STREAM_CHUNK,
                   **lengths: Unpack[LengthOptions]) -> Workload:
    """Poisson arrivals: exponential gaps with mean 1/rate (memoryless, the textbook load)."""
    return gamma_stream(num_requests, rate, burstiness=1.0, seed=seed, chunk=chunk, **lengths)


def gamma_stream(num_requests: int, rate: float, burstiness: float = 1.0, *, seed: int = 0,
                 chunk: int = STREAM_CHUNK, **lengths: Unpack[LengthOptions]) -> Workload:
    """Gamma gaps with shape=burstiness and mean 1/rate, as `vllm bench serve` does.

    burstiness 1 is Poisson; below 1 the gaps' coefficient of variation 1/sqrt(burstiness) grows,
    so requests come in clumps; above 1 they are more regular.
    """
    shape = _positive(burstiness, "burstiness")
    scale = 1.0 / (_positive(rate, "rate") * shape)
    n = _count(num_requests)

    def chunks() -> Iterator[Chunk]:
        rng, t = _rng(seed), 0.0
        for k in _chunk_sizes(n, chunk):
            arrivals = t + np.cumsum(rng.gamma(shape, scale, k))
            t = float(arrivals[-1])
            yield (arrivals, *_draw_lengths(k, rng, lengths))
    return _workload(n, lengths, chunks)


def bursty_stream(num_requests: int, base_rate: float = SEED_RATE, peak_rate: float = 20.0,
                  burst_every_s: float = 10.0, burst_len_s: float = 2.0, *, seed: int = 0,
                  chunk: int = STREAM_CHUNK, **lengths: Unpack[LengthOptions]) -> Workload:
    """Poisson at `base_rate` with bursts at `peak_rate` during [k*burst_every_s, +burst_len_s).

    The defaults are the chat bot case's traffic (docs/seed-case.md: 300 ms mean gap, peaks of
    20 req/s). Built by thinning: draw candidates at the peak rate and keep each with probability
    rate(t)/peak, which gives an exact non-homogeneous Poisson process (accepted candidates past a
    chunk's end start the next chunk, so chunking keeps the process exact).
    """
    n = _count(num_requests)
    if base_rate < 0 or peak_rate <= 0:
        raise WorkloadError(f"bursty needs base_rate >= 0 and peak_rate > 0 (got {base_rate}, {peak_rate})")
    if not 0 < burst_len_s <= burst_every_s:
        raise WorkloadError(f"bursty needs 0 < burst_len_s <= burst_every_s (got {burst_len_s}, {burst_every_s})")
    lam_max = max(base_rate, peak_rate)

    def chunks() -> Iterator[Chunk]:
        rng, t, carry = _rng(seed), 0.0, np.empty(0)
        for k in _chunk_sizes(n, chunk):
            kept, total = [carry], carry.size
            while total < k:
                candidates = t + np.cumsum(rng.exponential(1.0 / lam_max, max(256, 2 * (k - total))))
                t = float(candidates[-1])
                rate = np.where(in_burst(candidates, burst_every_s, burst_len_s), peak_rate, base_rate)
                accepted = candidates[rng.random(candidates.size) * lam_max < rate]
                kept.append(accepted)
                total += accepted.size
            both = np.concatenate(kept)
            carry = both[k:]
            yield (both[:k], *_draw_lengths(k, rng, lengths))
    return _workload(n, lengths, chunks)


def in_burst(t: np.ndarray | float, burst_every_s: float, burst_len_s: float) -> np.ndarray:
    """Whether time(s) t fall inside a burst window of `bursty` (also what tests measure by)."""
    return np.mod(t, burst_every_s) < burst_len_s


def constant_stream(num_requests: int, rate: float, *, seed: int = 0, chunk: int = STREAM_CHUNK,
                    **lengths: Unpack[LengthOptions]) -> Workload:
    """Evenly spaced arrivals from t=0: the load without randomness, for clean comparisons."""
    n, rate = _count(num_requests), _positive(rate, "rate")

    def chunks() -> Iterator[Chunk]:
        rng, first = _rng(seed), 0
        for k in _chunk_sizes(n, chunk):
            yield (np.arange(first, first + k) / rate, *_draw_lengths(k, rng, lengths))
            first += k
    return _workload(n, lengths, chunks)


def all_at_once_stream(num_requests: int, *, seed: int = 0, chunk: int = STREAM_CHUNK,
                       **lengths: Unpack[LengthOptions]) -> Workload:
    """Every request at t=0: measures peak throughput (the offline / max-batch case)."""
    n = _count(num_requests)

    def chunks() -> Iterator[Chunk]:
        rng = _rng(seed)
        for k in _chunk_sizes(n, chunk):
            yield (np.zeros(k), *_draw_lengths(k, rng, lengths))
    return _workload(n, lengths, chunks)


def shared_prefix_stream(num_requests: int, rate: float, system_prompt_len: int = 400, *, seed: int = 0,
                         chunk: int = STREAM_CHUNK, **lengths: Unpack[LengthOptions]) -> Workload:
    """Poisson arrivals whose prompts all start with one system prompt of system_prompt_len
    tokens (input_len is each request's own part after it): many users of one application."""
    if system_prompt_len < 1:
        raise WorkloadError(f"system_prompt_len must be >= 1, got {system_prompt_len}")
    workload = poisson_stream(num_requests, rate, seed=seed, chunk=chunk, **lengths)
    workload.system_prompt_len = int(system_prompt_len)
    return workload


def eager(stream: Callable[..., Workload]) -> Callable[..., list[RequestSpec]]:
    """The list form of a `*_stream` process: one chunk, so the draws are the eager ones of old."""
    def build(*args: Any, **kwargs: Any) -> list[RequestSpec]:
        workload = stream(*args, **kwargs, chunk=1 << 62)
        return list(workload)
    build.__name__ = stream.__name__.removesuffix("_stream")
    build.__doc__ = stream.__doc__
    return build


poisson = eager(poisson_stream)
gamma = eager(gamma_stream)
bursty = eager(bursty_stream)
constant = eager(constant_stream)
all_at_once = eager(all_at_once_stream)
shared_prefix = eager(shared_prefix_stream)


def sample_lengths(spec: LenSpec, n: int, rng: np.random.Generator, name: str) -> np.ndarray:
    if isinstance(spec, (int, np.integer)):
        return np.full(n, int(spec))
    try:
        lo, hi = (int(v) for v in spec)
    except (TypeError, ValueError):
        raise WorkloadError(f"{name} must be an int or a (lo, hi) pair, got {spec!r}") from None
    if lo > hi:
        raise WorkloadError(f"{name} range {lo}:{hi} has lo > hi")
    return rng.integers(lo, hi + 1, n)


def _specs(arrivals: np.ndarray, input_lens: np.ndarray, output_lens: np.ndarray,
           max_input_len: int | None, max_output_len: int | None) -> list[RequestSpec]:
    ins = np.clip(input_lens, 1, max_input_len or None)
    outs = np.clip(output_lens, 1, max_output_len or None)
    return [RequestSpec(i, float(a), int(x), int(y))
            for i, (a, x, y) in enumerate(zip(arrivals, ins, outs))]


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _positive(value: float, name: str) -> float:
    if not value > 0:
        raise WorkloadError(f"{name} must be > 0, got {value}")
    return float(value)


def _count(num_requests: int) -> int:
    if num_requests is None or int(num_requests) < 1:
        raise WorkloadError(f"num_requests must be >= 1, got {num_requests}")
    return int(num_requests)


# ---------------------------------------------------------------- trace replay

_TIME_COLUMNS = ("timestamp", "arrival_s", "arrival_time", "time")
_INPUT_COLUMNS = ("contexttokens", "input_len", "input_tokens", "prompt_tokens", "prompt_len")
_OUTPUT_COLUMNS = ("generatedtokens", "output_len", "output_tokens", "completion_tokens")
_FRACTION = re.compile(r"^(.*\d:\d\d)\.(\d+)(.*)$")


def trace(path: str | Path, time_scale: float = 1.0, *, start: int = 0,
          num_requests: int | None = None, max_input_len: int | None = None,
          max_output_len: int | None = None) -> list[RequestSpec]:
    """Replay a CSV or JSONL trace of (timestamp, input tokens, output tokens), in file order.

    arrival_s = (t - t0) * time_scale, t0 the earliest selected timestamp (the first row of a
    sorted trace): time_scale 0.5 replays twice as fast, 2 half as fast. `start` skips rows,
    `num_requests` caps them. Reads Azure's 2023 `TIMESTAMP,ContextTokens,GeneratedTokens` and
    generic columns (timestamp|arrival_s|time, input_len|input_tokens|prompt_tokens,
    output_len|output_tokens); timestamps are seconds or ISO dates with any fraction digits.
    """
    if time_scale < 0:
        raise WorkloadError(f"time_scale must be >= 0, got {time_scale}")
    if start < 0:
        raise WorkloadError(f"trace start must be >= 0, got {start}")
    stop = None if num_requests is None else start + _count(num_requests)
    times, ins, outs = (np.array(c) for c in zip(*_trace_cells(Path(path), start, stop)))
    return _specs((times - times.min()) * time_scale, ins, outs, max_input_len, max_output_len)


def trace_stream(path: str | Path, time_scale: float = 1.0, *, start: int = 0,
                 num_requests: int | None = None, max_input_len: int | None = None,
                 max_output_len: int | None = None, chunk: int = STREAM_CHUNK) -> Workload | list[RequestSpec]:
    """`trace`'s requests, read lazily: one streaming pass checks every cell and finds t0, the
    count and whether the rows are in time order; each iteration then re-reads the file `chunk`
    rows at a time. A trace whose rows are not in time order cannot be replayed lazily in arrival
    order, so it comes back as `trace`'s list sorted by arrival (its indices are still the rows')."""
    if time_scale < 0:
        raise WorkloadError(f"time_scale must be >= 0, got {time_scale}")
    if start < 0:
        raise WorkloadError(f"trace start must be >= 0, got {start}")
    stop = None if num_requests is None else start + _count(num_requests)
    t0, count, ordered, last = math.inf, 0, True, -math.inf
    for t, _, _ in _trace_cells(Path(path), start, stop):
        t0, count, ordered, last = min(t0, t), count + 1, ordered and t >= last, t
    if not ordered:
        return sorted(trace(path, time_scale, start=start, num_requests=num_requests, max_input_len=max_input_len,
                            max_output_len=max_output_len), key=lambda spec: (spec.arrival_s, spec.index))

    def chunks() -> Iterator[Chunk]:
        cells = _trace_cells(Path(path), start, stop)
        while rows := list(itertools.islice(cells, chunk)):
            times, ins, outs = np.array(rows).T
            yield (times - t0) * time_scale, ins.astype(int), outs.astype(int)
    return Workload(count, chunks, 0, max_input_len, max_output_len)


def _trace_cells(path: Path, start: int, stop: int | None) -> Iterator[tuple[float, int, int]]:
    """(time, input tokens, output tokens) of rows [start, stop), streamed; errors as `trace`'s."""
    rows = _stream_rows(path)
    columns = next(rows)
    time_col = _column(columns, _TIME_COLUMNS, "timestamp", path)
    in_col = _column(columns, _INPUT_COLUMNS, "input token", path)
    out_col = _column(columns, _OUTPUT_COLUMNS, "output token", path)
    seen = 0
    for n, row in enumerate(itertools.islice(rows, start, stop), start + 1):
        seen += 1
        yield (_cell(row, time_col, n, path, _parse_time), int(_cell(row, in_col, n, path, _parse_count)),
               int(_cell(row, out_col, n, path, _parse_count)))
    if not seen:
        total = sum(1 for _ in _stream_rows(path)) - 1  # the error path only: count by reading again
        raise WorkloadError(f"trace {path}: no rows from row {start} on (it has {total})")


def _stream_rows(path: Path) -> Iterator[Any]:
    """Yields the column names, then each row as a dict, reading as it goes: JSON lines if the file
    starts with {, a JSON array (read whole: it cannot be streamed) if with [, else CSV."""
    if not path.exists():
        raise WorkloadError(f"trace file not found: {path}")
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            head = ""
            while not head and (block := f.read(4096)):
                head = block.lstrip()[:1]
            if not head:
                raise WorkloadError(f"trace {path} is empty")
            f.seek(0)
            if head == "[":
                rows = json.load(f)
                if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                    raise WorkloadError(f"trace {path}: JSON rows must be objects")
                yield list(rows[0]) if rows else []
                yield from rows
                return
            if head == "{":
                lines = (json.loads(line) for line in f if line.strip())
                first = next(lines)
                if not isinstance(first, dict):
                    raise WorkloadError(f"trace {path}: JSON rows must be objects")
                yield list(first)
                yield first
                for row in lines:
                    if not isinstance(row, dict):
                        raise WorkloadError(f"trace {path}: JSON rows must be objects")
                    yield row
                return
            reader = csv.DictReader(f)
            yield [c.strip() for c in reader.fieldnames or []]
            yield from reader
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"cannot read trace {path}: {one_line(e)}") from None
    except (json.JSONDecodeError, csv.Error) as e:
        raise WorkloadError(f"cannot parse trace {path}: {one_line(e)}") from None


def _column(columns: Sequence[str], wanted: Sequence[str], what: str, path: str | Path) -> str:
    by_lower = {c.strip().lower(): c for c in columns}
    for name in wanted:
        if name in by_lower:
            return by_lower[name]
    raise WorkloadError(f"trace {path}: no {what} column (one of {', '.join(wanted)}); "
                        f"columns found: {', '.join(columns) or 'none'}")


def _cell(row: dict[str, Any], column: str, rownum: int, path: str | Path,
          parse: Callable[[Any], float]) -> float:
    value = row.get(column)
    try:
        return parse(value)
    except (TypeError, ValueError):
        raise WorkloadError(f"trace {path} row {rownum}: bad {column} value {value!r}") from None


def _parse_count(value: Any) -> int:
    return int(float(value))


def _parse_time(value: Any) -> float:
    """Seconds as a number, or an ISO date; the fraction is parsed apart so 7+ digits are fine."""
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    fraction = 0.0
    match = _FRACTION.match(text)
    if match:
        text, fraction = match[1] + match[3], float("0." + match[2])
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp() + fraction


# ---------------------------------------------------------------- dispatch

_GENERATORS: dict[str, Callable[..., list[RequestSpec]]] = {
    "poisson": poisson, "gamma": gamma, "bursty": bursty, "constant": constant,
    "all-at-once": all_at_once, "all_at_once": all_at_once, "trace": trace,
    "shared-prefix": shared_prefix,
}
# multi-turn is not a list of independent requests (each turn waits for the previous answer):
# bench/conversation.py runs it
WORKLOADS = ("poisson", "gamma", "bursty", "constant", "all-at-once", "trace", "shared-prefix", "multi-turn")


_STREAMS: dict[str, Callable[..., Workload | list[RequestSpec]]] = {
    "poisson": poisson_stream, "gamma": gamma_stream, "bursty": bursty_stream, "constant": constant_stream,
    "all-at-once": all_at_once_stream, "all_at_once": all_at_once_stream, "trace": trace_stream,
    "shared-prefix": shared_prefix_stream,
}


def make_workload(kind: str, **kwargs: Any) -> list[RequestSpec]:
    """Build a workload by name; kwargs are the generator's own (see each function)."""
    try:
        generator = _GENERATORS[kind]
    except KeyError:
        raise WorkloadError(f"unknown workload {kind!r} (one of {', '.join(WORKLOADS)})") from None
    return generator(**kwargs)


# ---------------------------------------------------------------- prompts

# Public domain: the openings of Jane Austen's "Pride and Prejudice" (1813) and Herman Melville's
# "Moby-Dick" (1851). Real prose tokenizes like real prompts do, unlike random token ids.
_PROSE = (resources.files(__package__) / "prose.txt").read_text(encoding="utf-8")
WORDS_PER_TOKEN = 0.75
_GOLDEN = 0.6180339887498949  # offsets index * golden ratio spread prompts evenly over the text


def build_prompts(specs: Sequence[RequestSpec], tokenizer: Any = None) -> Sequence[RequestSpec]:
    """Fill each spec's `prompt` with prose of exactly `input_len` tokens of `tokenizer`.

    Each request starts at a different place in the text, so prompts differ (no accidental
    prefix-cache hits). Without a tokenizer, ~0.75 words per token approximates the length.
    `tokenizer` is a `transformers` tokenizer; special tokens (BOS, chat template) are not counted.
    """
    source = prose_source(tokenizer)
    for spec in specs:
        spec.prompt = source.text(spec.input_len, int(spec.index * _GOLDEN * source.size))
        if spec.system_prompt_len:  # the same text for every request: from offset 0
            spec.system_prompt = source.text(spec.system_prompt_len, 0)
    return specs


def prose_source(tokenizer: Any = None) -> "_TokenText | _WordText":
    """Cuts prose of n tokens from an offset: `.text(n, offset)`, `.size` (the text's length)."""
    return _TokenText(tokenizer) if tokenizer is not None else _WordText()


def _cyclic(items: Sequence[Any], start: int, n: int) -> list[Any]:
    """n items from `start`, wrapping around, so any length can be cut from a short text."""
    size = len(items)
    return [items[(start + i) % size] for i in range(n)]


class _WordText:
    def __init__(self) -> None:
        self.words = _PROSE.split()
        self.size = len(self.words)

    def text(self, n_tokens: int, offset: int) -> str:
        return " ".join(_cyclic(self.words, offset, max(1, round(n_tokens * WORDS_PER_TOKEN))))


class _TokenText:
    """Cuts token windows and re-encodes until the text round-trips to exactly n tokens.

    Decoding then encoding can merge or split tokens at the cut, so a plain decode(ids[:n]) is
    often off by one; a few rounds of trim / top-up fix that (the trick vLLM's random dataset uses).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids = self._encode(_PROSE + "\n")
        self.size = len(self.ids)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, n_tokens: int, offset: int) -> str:
        best = ""
        for shift in range(4):  # a different cut point when one will not converge
            text, ok = self._fit(n_tokens, offset + shift)
            if ok:
                return text
            best = best or text
        return best

    def _fit(self, n: int, offset: int) -> tuple[str, bool]:
        ids = _cyclic(self.ids, offset, n)
        used = n
        for _ in range(8):
            text = self.tokenizer.decode(ids)
            ids = self._encode(text)
            if len(ids) == n:
                return text, True
            if len(ids) > n:
                ids = ids[:n]
            else:
                missing = n - len(ids)
                ids = ids + _cyclic(self.ids, offset + used, missing)
                used += missing
        return self.tokenizer.decode(ids[:n]), False


# ---------------------------------------------------------------- command line

def len_arg(text: str) -> LenSpec:
    """`128` or `64:512` (inclusive uniform range)."""
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {text!r}") from None
    if len(parts) == 1 and parts[0] >= 1:
        return parts[0]
    if len(parts) == 2 and 1 <= parts[0] <= parts[1]:
        return parts[0], parts[1]
    raise argparse.ArgumentTypeError(f"expected N or LO:HI with 1 <= LO <= HI, got {text!r}")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload flags, shared by every bench command that sends traffic."""
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default=None,
                   help="arrival process (default: trace when --trace is given, else poisson)")
    g.add_argument("--rate", type=float, default=SEED_RATE,
                   help="requests/s; the base rate for bursty (default 3.33: a 300 ms mean gap)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: 1 = Poisson, < 1 burstier (default 1)")
    g.add_argument("--peak-rate", type=float, default=20.0, help="bursty: rate inside bursts")
    g.add_argument("--burst-every", type=float, default=10.0, metavar="S",
                   help="bursty: a burst starts every S seconds")
    g.add_argument("--burst-len", type=float, default=2.0, metavar="S",
                   help="bursty: each burst lasts S seconds")
    g.add_argument("--trace", metavar="PATH", help="CSV/JSONL trace to replay")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="trace: arrival = (t - t0) * SCALE; 0.5 replays twice as fast")
    g.add_argument("--trace-start", type=int, default=0, metavar="ROW", help="trace: rows to skip")
    g.add_argument("--num-requests", type=int, default=None,
                   help=f"default {DEFAULT_NUM_REQUESTS}, or the whole trace")
    g.add_argument("--input-len", type=len_arg, default=128, metavar="N|LO:HI",
                   help="prompt tokens (synthetic workloads)")
    g.add_argument("--output-len", type=len_arg, default=128, metavar="N|LO:HI",
                   help="output tokens (synthetic workloads)")
    g.add_argument("--max-input-len", type=int, default=None, help="clamp prompt lengths")
    g.add_argument("--max-output-len", type=int, default=None, help="clamp output lengths")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--system-prompt-len", type=int, default=400, metavar="N",
                   help="shared-prefix and multi-turn: tokens of the system prompt every request shares")
    m = parser.add_argument_group("multi-turn workload (--workload multi-turn)")
    m.add_argument("--conversations", type=int, default=8, metavar="N", help="concurrent conversations")
    m.add_argument("--turns", type=int, default=6, help="turns per conversation")
    m.add_argument("--system-prompts", choices=("shared", "distinct"), default="shared",
                   help="shared: every conversation starts with one system prompt; distinct: each its own "
                        "(conversations then share no prefix, only their own history)")
    m.add_argument("--user-len", type=len_arg, default=(32, 96), metavar="N|LO:HI",
                   help="tokens of each new user message (answers are --output-len)")
    m.add_argument("--think-time", type=float, default=1.0, metavar="S",
                   help="mean pause (exponential) between an answer and the next turn")
    m.add_argument("--stagger", type=float, default=2.0, metavar="S",
                   help="conversations start uniformly spread over the first S seconds")


def describe_workload(args: argparse.Namespace) -> dict[str, Any]:
    """The workload settings that matter for `args.workload`, for result files and their readers."""
    kind = args.workload or ("trace" if args.trace else "poisson")
    clamps = {"max_input_len": args.max_input_len, "max_output_len": args.max_output_len}
    if kind == "trace":
        if not args.trace:
            raise WorkloadError("--workload trace needs --trace PATH")
        return {"kind": kind, "path": args.trace, "time_scale": args.time_scale,
                "start": args.trace_start, "num_requests": args.num_requests, **clamps}
    if kind == "multi-turn":
        return {"kind": kind, "num_conversations": args.conversations, "turns": args.turns,
                "system_prompt_len": args.system_prompt_len, "system_prompts": args.system_prompts,
                "user_len": args.user_len,
                "output_len": args.output_len, "think_time_s": args.think_time,
                "stagger_s": args.stagger, "seed": args.seed}
    per_kind = {
        "poisson": {"rate": args.rate},
        "shared-prefix": {"rate": args.rate, "system_prompt_len": args.system_prompt_len},
        "gamma": {"rate": args.rate, "burstiness": args.burstiness},
        "bursty": {"base_rate": args.rate, "peak_rate": args.peak_rate,
                   "burst_every_s": args.burst_every, "burst_len_s": args.burst_len},
        "constant": {"rate": args.rate},
        "all-at-once": {},
    }[kind]
    return {"kind": kind, "num_requests": args.num_requests or DEFAULT_NUM_REQUESTS,
            "seed": args.seed, "input_len": args.input_len, "output_len": args.output_len,
            **per_kind, **clamps}


def workload_from_args(args: argparse.Namespace) -> list[RequestSpec]:
    """The workload that `add_workload_args` flags describe."""
    params = describe_workload(args)
    if params["kind"] == "multi-turn":
        raise WorkloadError("--workload multi-turn is a set of conversations, not a request list: "
                            "use `iterserve bench serve --workload multi-turn`")
    return make_workload(params.pop("kind"), **params)


def workload_stream_from_args(args: argparse.Namespace) -> Workload | list[RequestSpec]:
    """`workload_from_args`' workload, lazily (the simulator's: it holds only requests in flight).
    Up to `STREAM_CHUNK` requests it is the very same requests; beyond, the same process drawn in
    chunks (see `Workload`)."""
    params = describe_workload(args)
    kind = params.pop("kind")
    if kind == "multi-turn":
        raise WorkloadError("--workload multi-turn is a set of conversations, not a request list")
    return _STREAMS[kind](**params)
