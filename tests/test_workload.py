"""Workload generators: stated rates and burstiness, trace replay, prompts of exact token length."""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from iterserve.bench import workload as wl
from iterserve.bench.workload import WorkloadError

AZURE = Path(__file__).resolve().parents[2] / "shared/traces/azure_llm_2023_conv.csv"
N = 2000


def arrivals(specs: list[wl.RequestSpec]) -> np.ndarray:
    return np.array([s.arrival_s for s in specs])


def rate_of(specs: list[wl.RequestSpec]) -> float:
    return len(specs) / arrivals(specs)[-1]


def gap_cv(specs: list[wl.RequestSpec]) -> float:
    gaps = np.diff(np.concatenate([[0.0], arrivals(specs)]))
    return float(gaps.std() / gaps.mean())


@pytest.mark.parametrize("rate", [0.5, 3.3, 20.0])
def test_poisson_mean_rate_and_unit_cv(rate: float) -> None:
    specs = wl.poisson(N, rate, seed=1)
    assert len(specs) == N and [s.index for s in specs] == list(range(N))
    assert rate_of(specs) == pytest.approx(rate, rel=0.1)
    assert gap_cv(specs) == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 1.0, 4.0])
def test_gamma_cv_is_one_over_sqrt_burstiness(burstiness: float) -> None:
    specs = wl.gamma(N, 4.0, burstiness, seed=2)
    assert rate_of(specs) == pytest.approx(4.0, rel=0.1)
    assert gap_cv(specs) == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)


def test_bursty_is_faster_inside_bursts() -> None:
    every, length, base, peak = 10.0, 2.0, 10 / 3, 20.0
    t = arrivals(wl.bursty(N, base, peak, every, length, seed=3))
    assert np.all(np.diff(t) >= 0)
    horizon = t[-1]
    burst_time = (horizon // every) * length + min(horizon % every, length)
    inside = wl.in_burst(t, every, length)
    assert inside.sum() / burst_time == pytest.approx(peak, rel=0.1)
    assert (~inside).sum() / (horizon - burst_time) == pytest.approx(base, rel=0.1)


def test_constant_and_all_at_once() -> None:
    assert np.allclose(np.diff(arrivals(wl.constant(50, 4.0))), 0.25)
    assert arrivals(wl.constant(50, 4.0))[0] == 0.0
    assert not arrivals(wl.all_at_once(20)).any()


def test_lengths_fixed_ranges_and_clamps() -> None:
    fixed = wl.poisson(100, 1.0, input_len=17, output_len=5)
    assert {(s.input_len, s.output_len) for s in fixed} == {(17, 5)}
    ranged = wl.constant(N, 1.0, input_len=(10, 20), output_len=(1, 3), seed=4)
    ins = np.array([s.input_len for s in ranged])
    assert ins.min() == 10 and ins.max() == 20 and ins.mean() == pytest.approx(15, rel=0.05)
    clamped = wl.all_at_once(50, input_len=(1, 5000), output_len=0, max_input_len=1024)
    assert max(s.input_len for s in clamped) == 1024
    assert {s.output_len for s in clamped} == {1}


def test_seed_makes_workloads_reproducible() -> None:
    same = [wl.gamma(200, 2.0, 0.5, seed=7, input_len=(1, 99)) for _ in range(2)]
    assert same[0] == same[1]
    assert same[0] != wl.gamma(200, 2.0, 0.5, seed=8, input_len=(1, 99))


def test_bad_parameters_raise_workload_error() -> None:
    for call in (lambda: wl.poisson(10, 0.0), lambda: wl.poisson(0, 1.0),
                 lambda: wl.gamma(10, 1.0, -1), lambda: wl.bursty(10, 1, 5, 2.0, 3.0),
                 lambda: wl.constant(10, 1.0, input_len=(9, 3)),
                 lambda: wl.make_workload("zipf", num_requests=3)):
        with pytest.raises(WorkloadError):
            call()
    with pytest.raises(TypeError, match="input_lenn"):
        wl.poisson(10, 1.0, input_lenn=3)  # type: ignore[call-arg]


# ---------------------------------------------------------------- traces

def _azure_rows(start: int, count: int) -> list[dict[str, str]]:
    with AZURE.open() as f:
        return list(csv.DictReader(f))[start:start + count]


def _azure_time(text: str) -> float:
    """An independent parse: strptime's %f takes at most 6 digits, so cut the 7th."""
    day, frac = text.split(".")
    return datetime.strptime(f"{day}.{frac[:6]}", "%Y-%m-%d %H:%M:%S.%f").timestamp() \
        + float("0." + frac) - float("0." + frac[:6])


@pytest.mark.skipif(not AZURE.exists(), reason="shared Azure trace not present")
def test_azure_trace_keeps_order_and_scales_gaps() -> None:
    specs = wl.trace(AZURE, time_scale=0.5, start=100, num_requests=500,
                     max_input_len=1024, max_output_len=256)
    rows = _azure_rows(100, 500)
    assert len(specs) == 500 and specs[0].arrival_s == 0.0
    assert [s.input_len for s in specs] == [min(int(r["ContextTokens"]), 1024) for r in rows]
    assert [s.output_len for s in specs] == [max(1, min(int(r["GeneratedTokens"]), 256))
                                             for r in rows]
    times = np.array([_azure_time(r["TIMESTAMP"]) for r in rows])
    assert np.allclose(np.diff(arrivals(specs)), np.diff(times) * 0.5, atol=1e-5)


@pytest.mark.skipif(not AZURE.exists(), reason="shared Azure trace not present")
def test_azure_trace_whole_file_rate() -> None:
    specs = wl.trace(AZURE)
    assert len(specs) == 19366
    assert rate_of(specs) == pytest.approx(5.5, rel=0.05)  # the README's mean rate


def test_generic_csv_and_jsonl_traces(tmp_path: Path) -> None:
    generic = tmp_path / "t.csv"
    generic.write_text("arrival_s,input_tokens,output_tokens\n10,5,6\n10.5,7,8\n12,9,0\n")
    specs = wl.trace(generic, time_scale=2.0)
    assert [(s.arrival_s, s.input_len, s.output_len) for s in specs] == [
        (0.0, 5, 6), (1.0, 7, 8), (4.0, 9, 1)]
    lines = [{"timestamp": "2024-01-01T00:00:00Z", "prompt_tokens": 3, "output_len": 4},
             {"timestamp": "2024-01-01T00:00:01.250Z", "prompt_tokens": 5, "output_len": 6}]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert [(s.arrival_s, s.input_len) for s in wl.trace(jsonl)] == [(0.0, 3), (1.25, 5)]


@pytest.mark.parametrize("content, message", [
    (None, "not found"),
    ("when,a,b\n1,2,3\n", "columns found: when, a, b"),
    ("timestamp,input_len,output_len\nnoon,2,3\n", "row 1: bad timestamp value 'noon'"),
    ("", "is empty"),
    ("{not json\n", "cannot parse trace"),
])
def test_trace_errors_are_one_line(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "trace.csv"
    if content is not None:
        path.write_text(content)
    with pytest.raises(WorkloadError) as info:
        wl.trace(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_trace_directory_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot read trace"):
        wl.trace(tmp_path)


# ---------------------------------------------------------------- prompts

@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE trained in memory: realistic merges, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([wl._PROSE], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_build_prompts_hits_exact_token_counts(tokenizer) -> None:
    lengths = [1, 2, 5, 31, 256, 1024, 4000]  # 4000 is longer than the text: it wraps around
    specs = [wl.RequestSpec(i, 0.0, n, 1) for i, n in enumerate(lengths * 3)]
    wl.build_prompts(specs, tokenizer)
    assert [len(tokenizer.encode(s.prompt, add_special_tokens=False)) for s in specs] \
        == [s.input_len for s in specs]
    assert len({s.prompt for s in specs}) == len(specs)


def test_build_prompts_without_tokenizer_uses_words() -> None:
    specs = wl.build_prompts(wl.all_at_once(5, input_len=400))
    assert all(len(s.prompt.split()) == 300 for s in specs)
    assert len({s.prompt for s in specs}) == 5


# ---------------------------------------------------------------- command-line flags

def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    wl.add_workload_args(parser)
    return parser.parse_args(argv)


def test_workload_from_args() -> None:
    specs = wl.workload_from_args(_parse("--workload", "bursty", "--num-requests", "50",
                                         "--input-len", "10:20", "--output-len", "7"))
    assert len(specs) == 50 and all(10 <= s.input_len <= 20 and s.output_len == 7 for s in specs)
    assert len(wl.workload_from_args(_parse())) == wl.DEFAULT_NUM_REQUESTS
    assert wl.describe_workload(_parse("--trace", "x.csv"))["kind"] == "trace"
    with pytest.raises(WorkloadError, match="needs --trace"):
        wl.workload_from_args(_parse("--workload", "trace"))
    with pytest.raises(SystemExit):
        _parse("--input-len", "20:10")


# ---------------------------------------------------------------- lazy workloads

def _digest(specs: list[wl.RequestSpec]) -> str:
    rows = [(s.index, s.arrival_s, s.input_len, s.output_len, s.system_prompt_len) for s in specs]
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


LENS = {"input_len": (16, 512), "output_len": (8, 128)}


def test_eager_workloads_draw_what_they_always_drew() -> None:
    """Digests of the eager generators' output taken before the lazy forms existed (numpy's
    Generator draws are stable across its releases; if a numpy upgrade changes one, re-take them)."""
    assert _digest(wl.poisson(3000, 20.0, seed=3, **LENS)) == "00b716f93b8ea4d0"
    assert _digest(wl.gamma(3000, 20.0, 0.5, seed=3, **LENS)) == "cce098e73f81367b"
    assert _digest(wl.bursty(3000, seed=4, **LENS)) == "65c16bd34c1bd4a6"
    assert _digest(wl.constant(500, 7.0, seed=3, **LENS)) == "ba43beb3fb71aed3"
    assert _digest(wl.all_at_once(50, seed=3, input_len=(1, 9), output_len=9, max_input_len=4)) == "ebc30ef789781d9b"
    assert _digest(wl.shared_prefix(300, 5.0, 100, seed=2)) == "4f0ff1bef339aaaf"


STREAMS = [
    (wl.poisson_stream, wl.poisson, (20.0,), {}),
    (wl.gamma_stream, wl.gamma, (20.0, 0.5), {}),
    (wl.bursty_stream, wl.bursty, (), {}),
    (wl.constant_stream, wl.constant, (7.0,), {}),
    (wl.shared_prefix_stream, wl.shared_prefix, (5.0, 100), {}),
]


@pytest.mark.parametrize("stream, eager, args, kwargs", STREAMS)
def test_lazy_workload_is_the_eager_one_within_a_chunk(stream, eager, args, kwargs) -> None:
    lazy = stream(3000, *args, seed=5, **LENS, **kwargs)
    assert len(lazy) == 3000
    assert list(lazy) == eager(3000, *args, seed=5, **LENS, **kwargs) == list(lazy)  # re-iterable


@pytest.mark.parametrize("stream, eager, args, kwargs", STREAMS)
def test_lazy_workload_in_small_chunks_is_the_same_process(stream, eager, args, kwargs) -> None:
    lazy = list(stream(6000, *args, seed=5, chunk=500, **LENS, **kwargs))
    whole = eager(6000, *args, seed=5, **LENS, **kwargs)
    assert [s.index for s in lazy] == list(range(6000))
    assert np.all(np.diff(arrivals(lazy)) >= 0)
    assert rate_of(lazy) == pytest.approx(rate_of(whole), rel=0.08)
    assert np.mean([s.input_len for s in lazy]) == pytest.approx(np.mean([s.input_len for s in whole]), rel=0.05)
    assert {s.system_prompt_len for s in lazy} == {s.system_prompt_len for s in whole}


def test_lazy_workload_checks_its_parameters_when_built() -> None:
    with pytest.raises(WorkloadError, match="lo > hi"):
        wl.poisson_stream(10, 1.0, input_len=(9, 3))
    with pytest.raises(TypeError, match="unknown workload keyword"):
        wl.gamma_stream(10, 1.0, inputlen=3)
    with pytest.raises(WorkloadError, match="rate"):
        wl.constant_stream(10, 0.0)


def test_trace_stream_is_the_trace_read_lazily(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    rows = [(1.5 + 0.25 * i, 10 + i, 3 + i % 4) for i in range(50)]
    path.write_text("time,input_len,output_len\n" + "".join(f"{t},{x},{y}\n" for t, x, y in rows))
    lazy = wl.trace_stream(path, 2.0, start=5, num_requests=30, max_input_len=30, chunk=7)
    assert len(lazy) == 30
    assert list(lazy) == wl.trace(path, 2.0, start=5, num_requests=30, max_input_len=30)
    shuffled = tmp_path / "s.jsonl"
    shuffled.write_text('{"time": 3, "input_len": 5, "output_len": 2}\n{"time": 1, "input_len": 3, "output_len": 2}\n')
    out_of_order = wl.trace_stream(shuffled)
    assert [(s.index, s.arrival_s) for s in out_of_order] == [(1, 0.0), (0, 2.0)]  # sorted, rows' indices
    bad = tmp_path / "bad.csv"
    bad.write_text("time,input_len,output_len\n1,2,3\n2,x,3\n")
    with pytest.raises(WorkloadError, match="row 2: bad input_len"):
        wl.trace_stream(bad)  # every cell is checked when it is built, not mid-replay
