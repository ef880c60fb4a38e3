"""RMSNorm through the C++ kernel (iterserve/csrc/norm.cpp `rms_norm`, platform/cpu_norm.py)
against the model's torch RMSNorm in bf16: the same bits (the sum of squares' order may move the
normalised x by one bf16 ulp, so the output, rounded again after the weight, by up to two; allowed
in a tiny fraction: seen with the scalar sum of a CPU without AVX-512), each row alike whatever the row count;
in float32 (AVX2-only CPUs run float32) within float32 rounding of torch's; and the platform swaps every
norm of a bf16 or float32 model. The kernel's bits on the native build and, on an AVX-512 host, the AVX2
one too (conftest's kernel_variant)."""
from __future__ import annotations

import pytest
import torch

from iterserve.model.layers import RMSNorm
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_norm import CpuRMSNorm, use_cpu_rms_norm

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU kernels did not build here (see the log)")


def norm_pair(dim: int, seed: int = 0) -> tuple[RMSNorm, CpuRMSNorm]:
    g = torch.Generator().manual_seed(seed)
    ref = RMSNorm(dim, 1e-5)
    ref.weight.data = (torch.randn(dim, generator=g) * 0.3 + 1).bfloat16()
    return ref, CpuRMSNorm(ref)


@pytest.mark.parametrize("dim", [576, 64, 100])
def test_same_bits_as_torch_rms_norm(dim, variant_kernels):
    """Native and AVX2 builds (the AVX2 one sums the squares in the plain loop's order: norm.cpp
    vectorises that sum on AVX-512 only)."""
    ref, ours = norm_pair(dim)
    g = torch.Generator().manual_seed(1)
    for rows in (1, 5, 16, 63, 64, 100, 1024):
        x = (torch.randn(rows, dim, generator=g) * 3).bfloat16()
        with torch.no_grad():
            want, got = ref(x), variant_kernels.rms_norm(x, ours.weight, ours.eps, ours.unit_offset)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        differ = want != got
        assert differ.float().mean().item() <= 1e-3, f"{rows} rows: {differ.sum().item()} outputs differ"
        if differ.any():  # one ulp of the normalised x, which the weight (up to ~2) can make two of the output's
            assert ((want.float() - got.float()).abs() <= want.float().abs() / 64).all()


def test_each_row_alike_at_any_row_count():
    _, ours = norm_pair(576)
    x = (torch.randn(300, 576) * 2).bfloat16()
    with torch.no_grad():
        full = ours(x)
        assert torch.equal(ours(x[:7]), full[:7])
        assert torch.equal(ours(x[250:251]), full[250:251])


@pytest.mark.parametrize("unit_offset", [False, True])
def test_float32_rows_within_rounding_of_torch(unit_offset, variant_kernels):
    """A float32 norm (and the residual add before it) is the kernel's too: the same formulas with no
    rounding to bf16, so within a few float32 ulps of torch's (only the sum of squares' order differs);
    the sum is torch's bit for bit; each row alike whatever the row count."""
    g = torch.Generator().manual_seed(2)
    ref = RMSNorm(576, 1e-6, unit_offset)
    ref.weight.data = torch.randn(576, generator=g) * 0.3 + (0 if unit_offset else 1)
    ours = CpuRMSNorm(ref)
    x, a = torch.randn(100, 576, generator=g) * 3, torch.randn(100, 576, generator=g)
    with torch.no_grad():
        got = variant_kernels.rms_norm(x, ours.weight, ours.eps, unit_offset)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref(x), rtol=2e-6, atol=2e-6)
        s, h = variant_kernels.add_rms_norm(x, a, ours.weight, ours.eps, unit_offset)
        want_s, want_h = ref.add_and_norm(x, a)
        assert torch.equal(s, want_s)
        torch.testing.assert_close(h, want_h, rtol=2e-6, atol=2e-6)
        assert torch.equal(variant_kernels.rms_norm(x[40:43], ours.weight, ours.eps, unit_offset), got[40:43])
        assert torch.equal(ours(x), load_cpu_kernels().rms_norm(x, ours.weight, ours.eps, unit_offset))


def test_mixed_dtypes_keep_the_torch_path():
    """A bf16 row through a float32 weight (or the reverse) is torch's, not the kernel's."""
    ref, ours = norm_pair(64)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_platform_swaps_every_norm(dtype):
    from iterserve.llm import LLM

    llm = LLM("smollm2-135m", dtype=dtype, kv_cache_memory="16MiB", max_model_len=256)
    norms = [m for m in llm.engine.model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * llm.engine.model_config.num_layers + 1
    assert all(type(m) is CpuRMSNorm for m in norms)
    assert use_cpu_rms_norm(torch.nn.Sequential(RMSNorm(8, 1e-5).half())) == 0  # float16 weights stay
