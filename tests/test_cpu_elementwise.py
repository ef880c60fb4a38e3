"""The C++ element-wise kernels (iterserve/csrc/elementwise.cpp `silu_and_mul`, `rope`,
`add_rms_norm`; platform/cpu_elementwise.py, platform/cpu_norm.py) against the model's torch forms:
torch's bits, in bf16 and float32. SiLU takes SLEEF's expf_u10 formula, the one torch's vectorised
silu calls (every bf16 input checked); torch's own scalar tail (a row's last width % 64 bf16 or
% 32 float32 columns) calls std::exp instead, so there the float32 result may move by an ulp. RoPE
over the fused QKV output's view and over separate q and k, full and partial rotary, GQA head
counts. The residual add + norm gives the add's and the norm kernel's bits. `permute_columns` gives
torch.gather's values. The platform swaps the
modules, and the engine's tokens and logprobs are unchanged. The kernel tests run on the native build and,
on an AVX-512 host, the AVX2 one too (conftest's kernel_variant)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from iterserve.config import ModelConfig
from iterserve.model.layers import MLP, Attention, RMSNorm, apply_rope
from iterserve.platform.cpu_elementwise import CpuAttention, CpuMLP, use_cpu_elementwise
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_linear import tiled_gemm_vectorised
from iterserve.platform.cpu_norm import CpuRMSNorm

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU kernels did not build here (see the log)")

DTYPES = [torch.bfloat16, torch.float32]


def silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """On one thread: torch splits a parallel op's elements evenly, wherever that falls in a row, and
    the piece before a split point ends in its scalar tail."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gate, up = x.split(x.shape[1] // 2, dim=-1)
        return F.silu(gate) * up
    finally:
        torch.set_num_threads(threads)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, any NaN equal to any NaN."""
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return bool(((a.view(ints) == b.view(ints)) | (a.isnan() & b.isnan())).all())


def test_silu_same_bits_for_every_bf16_input(variant_kernels):
    gate = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(1, -1)
    x = torch.cat([gate, torch.ones_like(gate)], dim=1)  # up = 1: the output is the rounded SiLU itself
    assert same_bits(variant_kernels.silu_and_mul(x), silu_mul_torch(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 64 * 7, 1000, 13])
def test_silu_and_mul_matches_torch(dtype, width, variant_kernels):
    g = torch.Generator().manual_seed(width)
    for rows in (1, 3, 37, 300):
        x = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)
        x[0, :4] = torch.tensor([0.0, -0.0, 120.0, -120.0])  # exp's range ends
        want, got = silu_mul_torch(x), variant_kernels.silu_and_mul(x)
        assert got.dtype == dtype and got.shape == (rows, width) and got.is_contiguous()
        if width % 64 == 0:
            assert same_bits(got, want), f"{rows} rows"
        elif dtype == torch.float32:  # torch's scalar tail: std::exp, an ulp of difference at most
            torch.testing.assert_close(got, want, rtol=2 ** -22, atol=1e-38)
        else:
            assert (got != want).float().mean().item() <= 1e-3
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-38)


def test_silu_and_mul_takes_strided_rows_and_each_row_alike():
    wide = (torch.randn(300, 3 * 1536) * 3).bfloat16()
    x = wide[:, :2 * 1536]  # rows 3F apart, as a view of a wider buffer
    full = kernels.silu_and_mul(x)
    assert same_bits(full, silu_mul_torch(x))
    assert torch.equal(kernels.silu_and_mul(x[5:6]), full[5:6])  # one row inline, the same bits as in a pool run


def rope_tables(rows: int, rd: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 32768, (rows,), generator=g).double()
    ang = pos[:, None] * 10000.0 ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().float().to(dtype), emb.sin().float().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, rotary_dim", [(9, 3, 64, 64), (32, 8, 128, 128), (24, 8, 128, 96),
                                                                   (4, 2, 64, 32), (3, 1, 80, 80), (2, 2, 64, 40)])
def test_rope_matches_torch(dtype, heads, kv_heads, head_dim, rotary_dim, variant_kernels):
    g = torch.Generator().manual_seed(head_dim + rotary_dim)
    for rows in (1, 3, 37, 300):
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
        qk = qkv[:, :(heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)  # q and k: one view
        cos, sin = rope_tables(rows, rotary_dim, dtype, rows)
        got = variant_kernels.rope(qk, cos, sin)
        assert got.dtype == dtype and got.shape == qk.shape and got.is_contiguous()
        assert same_bits(got, apply_rope(qk, cos, sin)), f"{rows} rows"
        k = qk[:, heads:]  # heads strided apart too (the qk-norm path's separate tensors are contiguous)
        assert same_bits(variant_kernels.rope(k, cos, sin), apply_rope(k, cos, sin))
        q = qk[:, :heads].contiguous()
        assert same_bits(variant_kernels.rope(q, cos, sin), apply_rope(q, cos, sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_permute_columns_is_torch_gather(dtype, variant_kernels):
    """CpuLinear.out_order's copy: out[t, j] = y[t, order[j]], torch.gather's values bit for bit, from no
    rows to a prompt chunk's 512 (which runs on the pool), rows strided as a view leaves them; an order
    that is not a permutation's length or range, or another index dtype, is refused."""
    g = torch.Generator().manual_seed(0)
    N = 3072
    order = torch.randperm(N, generator=g)
    for rows in (0, 1, 3, 16, 512):
        y = torch.randn(rows, N + 7, generator=g).to(dtype)[:, 3:N + 3]
        want = torch.gather(y, -1, order.expand(rows, N))
        got = variant_kernels.permute_columns(y, order)
        assert got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
    y = torch.randn(2, 6).to(dtype)
    with pytest.raises(RuntimeError, match="outside 0 .. 5"):
        variant_kernels.permute_columns(y, torch.tensor([0, 1, 2, 3, 4, 6]))
    with pytest.raises(RuntimeError, match="order must be"):
        variant_kernels.permute_columns(y, torch.arange(5))
    with pytest.raises(RuntimeError, match="order must be"):
        variant_kernels.permute_columns(y, torch.arange(6, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="2- or 4-byte"):
        variant_kernels.permute_columns(y.double(), torch.arange(6))


@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm_is_the_add_then_the_norm_kernel(unit_offset):
    ref = RMSNorm(576, 1e-5, unit_offset)
    ref.weight.data = (torch.randn(576) * 0.3 + (0 if unit_offset else 1)).bfloat16()
    ours = CpuRMSNorm(ref)
    for rows in (1, 3, 37, 300):
        x, a = (torch.randn(rows, 576) * 3).bfloat16(), (torch.randn(rows, 576) * 3).bfloat16()
        with torch.no_grad():
            s, h = ours.add_and_norm(x, a)
            want_s, want_h = ref.add_and_norm(x, a)
            assert torch.equal(s, want_s) and torch.equal(h, ours(want_s))
            # against torch's own norm: the kernel's sum-of-squares order (tests/test_cpu_norm.py)
            assert (h != want_h).float().mean().item() <= 1e-3


def tiny_config(**kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_layers": 1,
                          "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, **kw})


def test_modules_fall_back_to_torch_where_the_kernels_do_not_apply():
    mlp = CpuMLP(MLP(tiny_config()))
    x = torch.randn(5, 192).half()
    assert torch.equal(mlp.act_and_mul(x), MLP.act_and_mul(mlp, x))  # float16: torch's path
    attn = CpuAttention(Attention(tiny_config(), 0))
    qk = torch.randn(3, 6, 16).bfloat16()
    cos, sin = rope_tables(3, 16, torch.float32, 0)  # float32 tables for bf16 x: torch's mixed-dtype math
    assert torch.equal(attn.rope(qk, cos, sin), apply_rope(qk, cos, sin))


def test_use_cpu_elementwise_swaps_dense_mlps_and_attention():
    model = torch.nn.ModuleDict({"silu": MLP(tiny_config()), "gelu": MLP(tiny_config(hidden_act="gelu_pytorch_tanh")),
                                 "attn": Attention(tiny_config(), 0), "norm": torch.nn.LayerNorm(4)})
    assert use_cpu_elementwise(model) == 3
    assert type(model["silu"]) is CpuMLP and type(model["gelu"]) is CpuMLP and type(model["attn"]) is CpuAttention
    x = torch.randn(5, 192).bfloat16()  # GELU keeps torch's act_and_mul; SiLU's is the kernel's
    assert torch.equal(model["gelu"].act_and_mul(x), MLP.act_and_mul(model["gelu"], x))
    assert model["silu"].gate_up_proj is not None and dict(model["silu"].named_parameters()).keys() == \
        dict(MLP(tiny_config()).named_parameters()).keys()


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_output_unchanged(dtype, monkeypatch):
    from iterserve.llm import LLM
    from iterserve.sampling import SamplingParams

    llm = LLM("smollm2-135m", dtype=dtype, kv_cache_memory="64MiB", max_model_len=512,
              enable_prefix_caching=False)  # a hit would change the float32 GEMMs' row counts
    model = llm.engine.model
    n = llm.engine.model_config.num_layers
    assert sum(type(m) is CpuMLP for m in model.modules()) == n
    assert sum(type(m) is CpuAttention for m in model.modules()) == n
    prompts = ["The capital of France is", "def fibonacci(n):\n   " * 12]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)
    fused = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(CpuMLP, "act_and_mul", MLP.act_and_mul)
    monkeypatch.setattr(CpuAttention, "rope", Attention.rope)
    monkeypatch.setattr(CpuRMSNorm, "add_and_norm", RMSNorm.add_and_norm)
    plain = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@pytest.mark.real_model
@pytest.mark.skipif(not tiled_gemm_vectorised(kernels), reason="runs our tiled bf16 GEMM (AVX512-BF16), whose rows "
                    "round alike at every row count; oneDNN's and MKL's round a row by the call's row count")
def test_a_long_prompt_runs_its_mlp_in_slices_with_the_same_bits(monkeypatch):
    """A prompt chunk over MLP_SLICE_ROWS rows runs the MLP a slice at a time (the step's largest
    buffers, a slice's size), and every prompt position's logprob and the tokens stay the same bits
    as with the chunk's MLP in one piece, on GEMMs whose rows do not depend on the row count."""
    from iterserve.llm import LLM
    from iterserve.platform import cpu_elementwise
    from iterserve.sampling import SamplingParams

    llm = LLM("smollm2-135m", dtype="bfloat16", bf16_gemm="tiled", kv_cache_memory="64MiB", max_model_len=2048,
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    prompt = list(range(100, 100 + 1200))  # 1200 tokens: one chunk of 2 full slices and a part
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=0)
    rows: list[int] = []
    forward = MLP.forward
    monkeypatch.setattr(MLP, "forward", lambda self, x: rows.append(x.shape[0]) or forward(self, x))
    sliced = llm.generate([prompt], params, use_tqdm=False)[0]
    assert max(rows) == cpu_elementwise.MLP_SLICE_ROWS and 1200 - 2 * cpu_elementwise.MLP_SLICE_ROWS in rows
    rows.clear()
    monkeypatch.setattr(cpu_elementwise, "MLP_SLICE_ROWS", 4096)
    whole = llm.generate([prompt], params, use_tqdm=False)[0]
    assert max(rows) == 1200
    assert sliced.token_ids == whole.token_ids and sliced.logprobs == whole.logprobs
    assert sliced.prompt_logprobs == whole.prompt_logprobs
