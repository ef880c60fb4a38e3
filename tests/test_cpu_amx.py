"""Our bf16 GEMM on AMX tiles (csrc/gemm_bf16.cpp's bf16_gemm_amx), fed from the tiled layout's weights:
the float32 product rounded once, at every ragged row and output count; steps below the cut-over
take the AVX-512 path bit for bit; the kernel chooser times the two paths and sets the cut-over per
shape; batch_invariant keeps AMX off. The kernel tests run where the CPU has AMX and Linux lends its
tile state; the chooser's logic runs wherever our tiled GEMM does."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from iterserve.config import EngineConfig
from iterserve.engine import LLMEngine
from iterserve.platform import kernel_choice as kc
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_linear import CpuLinear, prepack_available, tiled_gemm_amx, tiled_gemm_vectorised

kernels = load_cpu_kernels()
needs_amx = pytest.mark.skipif(not tiled_gemm_amx(kernels), reason="no AMX here, or Linux did not lend its tile state")
needs_tiled = pytest.mark.skipif(not tiled_gemm_vectorised(kernels), reason="our bf16 GEMM is not vectorised here")


@needs_amx
@pytest.mark.parametrize("n,k", [(96, 64), (100, 576), (49, 1536), (16, 32), (3072, 576)])
def test_amx_path_is_the_float32_product_rounded_once(n, k):
    """Row counts around the 16-row A tiles and the 32-row blocks (padded with zero rows), output
    counts that leave a ragged tile or an odd number of tiles, K from one 32-input step to 48."""
    torch.manual_seed(n + k)
    lin = nn.Linear(k, n, bias=True).bfloat16()
    amx = CpuLinear(lin, layout="tiled", amx_min_rows=1)
    for rows in (1, 15, 16, 17, 31, 32, 33, 97):
        x = torch.randn(rows, k).bfloat16()
        ref = x.float() @ lin.weight.float().t()
        out = amx(x).float() - lin.bias.float()
        # bf16 output rounding (2^-9 relative) plus float32 summation order; bias added in bf16
        torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=2e-2, msg=f"rows {rows}")


@needs_amx
def test_amx_cut_over_sends_small_steps_to_the_avx512_path():
    """Below amx_min_rows the result is the AVX-512 kernel's bit for bit, from it the AMX path's; a K
    that is no multiple of 32 never takes AMX."""
    torch.manual_seed(1)
    lin = nn.Linear(576, 200, bias=False).bfloat16()
    avx, amx = CpuLinear(lin, layout="tiled"), CpuLinear(lin, layout="tiled", amx_min_rows=1)
    cut = CpuLinear(lin, layout="tiled", amx_min_rows=16)
    for rows in (1, 8, 15, 16, 40):
        x = torch.randn(rows, 576).bfloat16()
        assert torch.equal(cut(x), (amx if rows >= 16 else avx)(x)), rows
    odd = nn.Linear(34, 20, bias=False).bfloat16()
    x = torch.randn(40, 34).bfloat16()
    assert torch.equal(CpuLinear(odd, layout="tiled", amx_min_rows=1)(x), CpuLinear(odd, layout="tiled")(x))
    assert CpuLinear(lin, layout="onednn", amx_min_rows=16).amx_min_rows == 0  # only the tiled layout has the path


@needs_amx
def test_amx_and_onednn_layouts_interleave_in_one_thread():
    """oneDNN configures AMX tiles for its own kernels too: calls of the two, one after the other on the
    same threads, each keep their numbers (each kernel loads its tile configuration per call)."""
    if not prepack_available():
        pytest.skip("no oneDNN bf16")
    torch.manual_seed(2)
    lin = nn.Linear(576, 960, bias=False).bfloat16()
    ours, theirs = CpuLinear(lin, layout="tiled", amx_min_rows=1), CpuLinear(lin, layout="onednn")
    x = torch.randn(64, 576).bfloat16()
    want_ours, want_theirs = ours(x), theirs(x)
    for _ in range(3):
        assert torch.equal(theirs(x), want_theirs) and torch.equal(ours(x), want_ours)


def test_amx_cutover_is_the_first_bucket_of_an_unbroken_win_to_the_largest():
    avx = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 64: 1.0}
    assert kc.amx_cutover({1: 2.0, 2: 2.0, 4: 0.9, 8: 0.5, 64: 0.3}, avx) == 4
    assert kc.amx_cutover({1: 0.5, 2: 2.0, 4: 0.9, 8: 0.5, 64: 0.3}, avx) == 4  # a win below a loss does not count
    assert kc.amx_cutover({1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0, 64: 1.1}, avx) == 0
    assert kc.amx_cutover({1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0, 64: 0.2}, {**avx, 64: float("inf")}) == 64


@needs_tiled
def test_chooser_sets_the_tiled_layouts_amx_cut_over_where_amx_wins(monkeypatch, tmp_path):
    """AMX made slow below 4 rows and the AVX-512 path from 4: the tiled layout is chosen with its AMX
    cut-over at 4, the twin is judged against the merged times, and the engine's plan carries it."""
    real = kc.linear_candidates

    def candidates(lins, layouts, twin, *more):
        out = real(lins, layouts, twin, *more)

        def slow_when(name, test):
            if name not in out:  # (no AMX candidate when the request leaves it out)
                return
            make = out[name]
            out[name] = lambda rows: (lambda f: (lambda: (time.sleep(0.004) if test(rows) else None, f())))(make(rows))
        slow_when(kc.AMX, lambda rows: rows < 4)
        slow_when("tiled", lambda rows: rows >= 4)
        slow_when("onednn", lambda rows: True)
        return out

    monkeypatch.setattr(kc, "layout_candidates", lambda in_features, kernels, dtype=None: ["tiled", "onednn"])
    monkeypatch.setattr(kc, "amx_candidate", lambda in_features, kernels: [kc.AMX])  # timed on any host
    monkeypatch.setattr(kc, "linear_candidates", candidates)
    req = kc.ChoiceRequest(shapes=[("proj", 64, 128)], buckets=[1, 2, 4, 8], dtype=torch.bfloat16, amx=True)
    choice = kc.choose_kernels(req, kernels, remeasure=True, folder=tmp_path)
    plan = choice.plan("proj", 64, 128)
    assert plan.layout == "tiled" and plan.amx_min_rows == 4
    assert "tiled+amx>=4" in choice.brief() and choice.summary()["linears"]["proj:64x128"]["amx_min_rows"] == 4
    again = kc.choose_kernels(req, kernels, folder=tmp_path)  # read back from the cache
    assert again.source == "cache" and again.plan("proj", 64, 128).amx_min_rows == 4
    off = kc.choose_kernels(kc.ChoiceRequest(shapes=req.shapes, buckets=req.buckets, dtype=req.dtype), kernels,
                            remeasure=True, folder=tmp_path)  # EngineConfig.cpu_amx off: not timed
    assert kc.AMX not in off.plan("proj", 64, 128).ms and off.plan("proj", 64, 128).amx_min_rows == 0


@needs_tiled
def test_batch_invariant_engine_keeps_amx_off(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", batch_invariant=True,
                                 kv_cache_memory="16MiB"))
    mods = [m for m in eng.model.modules() if isinstance(m, CpuLinear)]
    assert mods and all(m.layout == "tiled" and m.amx_min_rows == 0 for m in mods)


@needs_amx
@pytest.mark.parametrize("cpu_amx", [True, False])
def test_forced_tiled_unmeasured_engine_runs_amx_from_the_fixed_cut(tiny_model_dir, cpu_amx):
    from iterserve.platform.cpu import AMX_MIN_ROWS

    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", bf16_gemm="tiled",
                                 measure_kernels=False, kv_cache_memory="16MiB", cpu_amx=cpu_amx))
    mods = [m for m in eng.model.modules() if isinstance(m, CpuLinear) and m.layout == "tiled"]
    assert mods and {m.amx_min_rows for m in mods} == {AMX_MIN_ROWS if cpu_amx else 0}
