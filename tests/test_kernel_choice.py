"""Kernel choice by measurement (platform/kernel_choice.py): the chooser follows the clock, not the
CPU's flags, and its cached table comes back for the same machine and model and not for another."""
from __future__ import annotations

import math
import time

import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.engine import LLMEngine
from iterserve.platform import kernel_choice as kc
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_linear import CpuLinear, gguf_int8_amx, prepack_available, tiled_gemm_vectorised


def _sleepy(seconds: float):
    def make(rows: int):
        return lambda: time.sleep(seconds)
    return make


def test_measure_picks_the_faster_of_two_candidates():
    fast, slow = _sleepy(0.0005), _sleepy(0.003)
    assert kc.pick_fastest(kc.measure({"a": slow, "b": fast}, [1, 2])) == "b"
    assert kc.pick_fastest(kc.measure({"a": fast, "b": slow}, [1, 2])) == "a"


def test_a_candidate_far_behind_is_not_timed_further():
    times = kc.measure({"fast": _sleepy(0.0005), "slow": _sleepy(0.01)}, [1, 2, 4])
    assert times["slow"][1] > times["fast"][1] and times["slow"][4] == float("inf")


def test_the_others_are_not_timed_where_the_twin_is_surely_ahead():
    """After the first bucket a twin under 1/SURE_MARGIN of the others' fastest first-bucket time runs
    that step size whatever they would take there: they are not timed (inf); from the first bucket
    where it is not that far ahead, they are timed at it and every larger one."""
    def growing(per_row: float):
        def make(rows: int):
            return lambda: time.sleep(per_row * rows)
        return make
    times = kc.measure({"layout": _sleepy(0.006), "twin": growing(0.001)}, [1, 2, 4, 8],
                       give_up={"twin": kc.TWIN_GIVE_UP}, twin="twin")  # as choose_kernels asks
    assert all(math.isfinite(times["twin"][b]) for b in (1, 2, 4, 8))
    assert math.isfinite(times["layout"][1]) and times["layout"][2] == math.inf
    assert math.isfinite(times["layout"][4]) and math.isfinite(times["layout"][8])
    # without a twin named, every live candidate is timed at every bucket
    plain = kc.measure({"layout": _sleepy(0.006), "twin": growing(0.001)}, [1, 2], give_up={"twin": kc.TWIN_GIVE_UP})
    assert math.isfinite(plain["layout"][2])


def test_the_layout_is_chosen_by_the_step_sizes_it_runs():
    """A layout runs the steps above its twin's cut-over, so it is chosen by its times there, not by
    the sizes the twin takes; with no twin, by every size."""
    base = {"a": {1: 1.0, 2: 1.0, 64: 3.0}, "b": {1: 2.0, 2: 2.0, 64: 2.0}}
    assert kc.layout_and_cutover(base, {1: 0.1, 2: 0.2, 64: 5.0}) == ("b", 2)
    assert kc.pick_fastest(base) == "a"  # over every size, as it was chosen before
    assert kc.layout_and_cutover(base, None) == ("a", 0)
    # the twin ahead everywhere: the layout by the largest size timed (it runs only past the table)
    assert kc.layout_and_cutover(base, {1: 0.1, 2: 0.1, 64: 0.1}) == ("b", 64)
    skipped = {"a": {1: 1.0, 2: math.inf, 64: 3.0}, "b": {1: 2.0, 2: math.inf, 64: 2.0}}
    assert kc.layout_and_cutover(skipped, {1: 0.1, 2: 0.2, 64: 5.0}) == ("b", 2)


def test_amx_cutover_runs_through_sizes_where_only_the_twin_was_timed():
    inf = math.inf
    assert kc.amx_cutover({1: 2.0, 2: 1.0, 4: 0.5}, {1: 1.0, 2: 1.5, 4: 1.0}) == 2
    # 2-64 untimed (the twin runs them): AMX won at 512 and lost at 1, so it takes 2 and up
    amx, avx = {1: 2.0, 2: inf, 64: inf, 512: 1.0}, {1: 1.0, 2: inf, 64: inf, 512: 3.0}
    assert kc.amx_cutover(amx, avx) == 2
    assert kc.amx_cutover({**amx, 1: 0.5}, avx) == 1
    assert kc.amx_cutover({**amx, 512: 4.0}, avx) == 0
    # AMX lost at every size timed, all below AMX_MIN_ROWS: never timed where it leads, the fixed rule
    only_small = {1: 2.0, 2: 2.0, 4: inf, 16: inf}
    assert kc.amx_cutover(only_small, {1: 1.0, 2: 1.0, 4: inf, 16: inf}) == kc.AMX_MIN_ROWS


def test_a_call_far_behind_at_its_warm_up_is_not_timed_again():
    """A call over 10 ms whose warm-up took more than GIVE_UP times the rivals' fastest keeps its
    warm-up as its time; the others are timed after their warm-ups as before."""
    calls: dict[str, int] = {"fast": 0, "slow": 0, "other": 0}

    def counted(name: str, seconds: float):
        def call():
            calls[name] += 1
            time.sleep(seconds)
        return call
    best = kc.time_round_robin({"fast": counted("fast", 0.012), "slow": counted("slow", 0.02),
                                "other": counted("other", 0.2)}, rivals=["fast", "slow"])
    assert calls == {"fast": 2, "slow": 2, "other": 1} and best["other"] >= 0.2
    assert 0.012 <= best["fast"] < best["slow"] < best["other"]


def test_twin_cutover_is_the_last_bucket_where_the_twin_led_throughout():
    base = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    assert kc.twin_cutover({1: 0.5, 2: 0.8, 4: 1.2, 8: 0.9}, base) == 2  # 8 does not count: 4 lost
    assert kc.twin_cutover({1: 1.5, 2: 0.5, 4: 0.5, 8: 0.5}, base) == 0


def _slowed(layout: str, seconds: float, real=kc.linear_candidates):
    """kc.linear_candidates with `layout` made artificially slow (a sleep before each call), where it
    is a candidate."""
    def candidates(lins, layouts, twin, *more):
        out = real(lins, layouts, twin, *more)
        if layout in out:
            make = out[layout]
            out[layout] = lambda rows: (lambda f: (lambda: (time.sleep(seconds), f())))(make(rows))
        return out
    return candidates


def _request(**kw) -> kc.ChoiceRequest:
    return kc.ChoiceRequest(shapes=[("proj", 64, 128)], buckets=[1, 2], dtype=torch.bfloat16, **kw)


@pytest.mark.skipif(not (tiled_gemm_vectorised(load_cpu_kernels()) and prepack_available()),
                    reason="needs both our AVX512-BF16 GEMM and oneDNN bf16")
@pytest.mark.parametrize("slow,expected", [("tiled", "onednn"), ("onednn", "tiled")])
def test_choose_kernels_takes_the_other_layout_when_one_is_made_slow(monkeypatch, tmp_path, slow, expected):
    monkeypatch.setattr(kc, "layout_candidates", lambda in_features, kernels, dtype=None: ["tiled", "onednn"])
    monkeypatch.setattr(kc, "linear_candidates", _slowed(slow, 0.005))
    choice = kc.choose_kernels(_request(), load_cpu_kernels(), remeasure=True, folder=tmp_path)
    assert choice.plan("proj", 64, 128).layout == expected
    assert choice.source == "measured" and choice.seconds > 0


def test_cache_round_trips_and_misses_on_another_key(monkeypatch, tmp_path):
    kernels = load_cpu_kernels()
    first = kc.choose_kernels(_request(), kernels, folder=tmp_path)
    assert first.source == "measured" and len(list(tmp_path.glob("*.json"))) == 1
    again = kc.choose_kernels(_request(), kernels, folder=tmp_path)
    assert again.source == "cache" and again.summary()["linears"] == first.summary()["linears"]
    assert again.linears == first.linears  # every figure comes back, inf and int buckets included
    # another key (model shape, torch version, CPU): measured anew, in a file of its own
    other = kc.choose_kernels(kc.ChoiceRequest(shapes=[("proj", 32, 128)], buckets=[1, 2], dtype=torch.bfloat16),
                              kernels, folder=tmp_path)
    assert other.source == "measured"
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert kc.choose_kernels(_request(), kernels, folder=tmp_path).source == "measured"
    monkeypatch.undo()
    monkeypatch.setattr(kc, "cpu_model_name", lambda: "Another CPU")
    assert kc.load_cached(kc.choice_key([("proj", 64, 128)], [1, 2], torch.bfloat16, {}), tmp_path) is None
    monkeypatch.undo()
    assert kc.choose_kernels(_request(), kernels, folder=tmp_path).source == "cache"
    assert kc.choose_kernels(_request(), kernels, remeasure=True, folder=tmp_path).source == "measured"


def test_a_damaged_cache_file_is_measured_again(tmp_path):
    kernels = load_cpu_kernels()
    kc.choose_kernels(_request(), kernels, folder=tmp_path)
    next(tmp_path.glob("*.json")).write_text("{not json")
    assert kc.choose_kernels(_request(), kernels, folder=tmp_path).source == "measured"


@pytest.mark.skipif(not prepack_available(), reason="needs oneDNN bf16")
def test_engine_lays_out_each_projection_as_measured(tiny_model_dir, monkeypatch, tmp_path):
    """The engine's start-up measures (cache under XDG_CACHE_HOME), applies the table to every
    projection, and reports it in its resolved config (what /v1/scheduler and benchmarks show);
    a second start reads it back; --bf16-gemm still forces a layout."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = dict(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory="16MiB", measure_kernels=True,
               max_num_seqs=4)
    eng = LLMEngine(EngineConfig(**cfg))
    resolved = eng.resolved_config()["kernel_choice"]
    assert resolved["source"] == "measured" and resolved["buckets"] == [1, 2, 4, 64]
    choice = eng.platform.kernel_choice
    for name, mod in eng.model.named_modules():
        if isinstance(mod, CpuLinear):
            role = "head" if name == "lm_head" else "proj"
            assert mod.layout == choice.plan(role, mod.out_features, mod.in_features).layout, name
    assert list((tmp_path / "iterserve" / "kernel_choice").glob("*.json"))
    assert LLMEngine(EngineConfig(**cfg)).resolved_config()["kernel_choice"]["source"] == "cache"
    forced = LLMEngine(EngineConfig(**cfg, bf16_gemm="float32"))
    assert {c.layout for c in forced.platform.kernel_choice.linears.values()} == {"float32"}
    assert all(m.layout == "float32" for m in forced.model.modules() if isinstance(m, CpuLinear))
    off = LLMEngine(EngineConfig(**{**cfg, "measure_kernels": False}))
    assert off.platform.kernel_choice is None and "CPU flags" in off.resolved_config()["kernel_choice"]


@pytest.mark.skipif(not (load_cpu_kernels() and load_cpu_kernels().gguf_gemm_int8_supported()),
                    reason="gguf_gemm's int8 activations need the AVX2 build")
def test_int8_twins_are_timed_at_a_prompt_chunk_and_may_run_every_step(monkeypatch, tmp_path):
    """gguf_activations=int8: a K-quant twin is timed on int8 activations, at the decode buckets and at
    INT8_PREFILL_ROWS; ahead of the layout at every one it runs every step, else up to where it led;
    the request is cached apart from the int16 one."""
    kernels = load_cpu_kernels()
    req = dict(shapes=[("proj", 64, 256, "q4_k:64")], buckets=[1, 2], dtype=torch.float32, blocks=True)
    ran = []
    real = kc.linear_candidates

    def spying(lins, layouts, twin, spec="", blocks=False, int8=False, int8_amx=False):
        out = real(lins, layouts, twin, spec, blocks, int8, int8_amx)
        ran.append(int8 + int8_amx)
        make = out["float32"]
        out["float32"] = lambda rows: (lambda f: (lambda: (time.sleep(0.004), f())))(make(rows))
        return out

    monkeypatch.setattr(kc, "linear_candidates", spying)
    choice = kc.choose_kernels(kc.ChoiceRequest(**req, int8=True), kernels, folder=tmp_path)
    plan = choice.linears[kc.linear_key("proj", 64, 256, "q4_k:64")]
    assert ran == [True] and kc.INT8_PREFILL_ROWS in plan.ms["q4_k"]
    assert plan.twin_max_tokens == kc.EVERY_ROW and "q4_k at every step" in plan.describe()
    int16 = kc.choose_kernels(kc.ChoiceRequest(**req), kernels, folder=tmp_path)
    assert int16.source == "measured" and ran == [True, False]
    assert kc.INT8_PREFILL_ROWS not in int16.linears[kc.linear_key("proj", 64, 256, "q4_k:64")].ms["q4_k"]
    assert int16.linears[kc.linear_key("proj", 64, 256, "q4_k:64")].twin_max_tokens < kc.EVERY_ROW
    # with AMX allowed, the int8 twin is timed as it will run: its steps of 16+ rows on AMX-INT8 tiles
    kc.choose_kernels(kc.ChoiceRequest(**req, int8=True, amx=True), kernels, folder=tmp_path)
    assert ran[2] == 1 + gguf_int8_amx(kernels)


@pytest.mark.skipif(not (load_cpu_kernels() and load_cpu_kernels().gguf_gemm_int8_supported()),
                    reason="gguf_gemm's int8 activations need the AVX2 build")
def test_int8_except_down_times_the_down_shapes_on_int16(monkeypatch, tmp_path):
    """gguf_activations=int8-except-down: the shapes only down projections have (down_only_shapes) are
    timed on int16 activations, as they run; the others on int8; cached apart from plain int8."""
    kernels = load_cpu_kernels()
    down, other = ("proj", 64, 512, "q4_k:64"), ("proj", 64, 256, "q4_k:64")
    req = dict(shapes=[other, down], buckets=[1, 2], dtype=torch.float32, blocks=True, int8=True)
    ran = []
    real = kc.linear_candidates

    def spying(lins, layouts, twin, spec="", blocks=False, int8=False, int8_amx=False):
        ran.append((lins[0].in_features, int8))
        return real(lins, layouts, twin, spec, blocks, int8, int8_amx)

    monkeypatch.setattr(kc, "linear_candidates", spying)
    mixed = kc.choose_kernels(kc.ChoiceRequest(**req, int16_shapes=[down]), kernels, folder=tmp_path)
    assert ran == [(256, True), (512, False)]
    assert kc.INT8_PREFILL_ROWS not in mixed.linears[kc.linear_key(*down)].ms["q4_k"]
    assert kc.choose_kernels(kc.ChoiceRequest(**req), kernels, folder=tmp_path).source == "measured"
    assert ran[2:] == [(256, True), (512, True)]

    model = torch.nn.Module()  # down_only_shapes goes by module name; a shape shared with another module is not one
    model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
    for layer in model.layers:
        layer.mlp = torch.nn.Module()
        layer.mlp.down_proj, layer.mlp.up_proj = torch.nn.Linear(512, 64), torch.nn.Linear(256, 64)
    assert kc.down_only_shapes(model, torch.float32) == [("proj", 64, 512)]
    model.layers[1].mlp.other = torch.nn.Linear(512, 64)  # the down shape, not a down projection
    assert kc.down_only_shapes(model, torch.float32) == []


def test_measuring_leaves_no_panel_scratch_in_the_measuring_thread(tmp_path):
    """The candidates read from GGUF blocks dequantise panels into a per-thread scratch (cpu_linear's
    blocks_gemm). The kernel choice measures in the thread that starts the engine, which a server
    never steps in, so once it has timed them it drops that thread's scratch: a first start kept
    8 MiB of them for good (docs/profile.md)."""
    from iterserve.platform import cpu_linear

    kernels = load_cpu_kernels()
    x = torch.randn(64, 256)
    shards = cpu_linear.random_shards("q4_k:64", 256)
    buf, meta = cpu_linear.pack_gguf_twin(shards, 256)
    cpu_linear.blocks_gemm(x, buf, meta, 64, "float32")  # the scratch a panel leaves behind
    assert cpu_linear._panels.by_dtype
    req = kc.ChoiceRequest(shapes=[("proj", 64, 256, "q4_k:64")], buckets=[1, 2], dtype=torch.float32, blocks=True)
    choice = kc.choose_kernels(req, kernels, folder=tmp_path)
    assert choice.source == "measured" and choice.linears[kc.linear_key("proj", 64, 256, "q4_k:64")].ms["float32"]
    assert cpu_linear._panels.by_dtype == {}
