"""Twins from a GGUF's own blocks (platform/cpu_linear.py, csrc/gemm_gguf.cpp's gguf_gemm): Q4_K, Q5_K,
Q6_K read as stored, Q8_0 / Q5_0 / Q5_1 / Q4_0 / Q4_1 repacked four blocks to a group.

- Exactness: the twin's storage dequantises (`dequantize_gguf_twin`) to gguf-py's `dequantize` of
  the blocks bit for bit, and converts back to the very bytes (`gguf_twin_blocks`). Blocks: random
  bytes with finite float16 scales (every level, scale and min pattern; gguf-py quantises no
  K-quant), and gguf-py's `quantize` for the types it writes.
- Accuracy: against float64 x @ dequant(w).T. The kernel quantises each activation row to int16,
  xq = round(x * 32767 / amax), so every input is off by at most amax / 65534; the integer sums are
  exact, so the result is off by at most amax / 65534 * sum |c| (c: the part of each weight the
  quantised input multiplies: the weight, less its block's min for the types with one, whose term
  uses the float32 sum of x, not quantised) plus float32 accumulation (2^-20 of sum |w x| here) and, for bf16
  activations, the output's rounding to bf16.
- Wiring: gguf_twins_of picks the modules, optimize_cpu_linears builds their twins (a fused
  projection with shards of different types), the engine times them (the table names the block
  types) and runs them for small steps.
"""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_linear import (GGUF_BLOCKS, KQUANTS, CpuLinear, dequantize_gguf_twin, gguf_twin_blocks,
                                           four_bit_max_tokens, gguf_twin_name, gguf_twin_spec, gguf_twins_of,
                                           optimize_cpu_linears, pack_gguf_twin, prepack_available, twin_modules)
from conftest import variant_skip_reason
from iterserve.platform.cpu import Q8_HEAD_MAX_TOKENS

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="the CPU kernels did not build here")

TYPES = list(GGUF_BLOCKS)  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K
SCALES = {"Q6_K": (208,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q4_1": (0, 2), "Q5_1": (0, 2)}  # float16 fields


class Shard:
    """What the loader hands over (model/gguf_file.py's QuantShard): a row range's blocks as stored."""

    def __init__(self, row_start: int, qtype: str, data: np.ndarray, cols: int) -> None:
        self.row_start, self.rows, self.cols, self.qtype, self.data = row_start, data.shape[0], cols, qtype, data


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0, any_scale: bool = False) -> np.ndarray:
    """[rows, cols / block * bytes] uint8: random bytes, float16 fields set to finite values (any
    finite bit pattern with any_scale, else 1e-4..3e-3: weights of a model's size)."""
    rng = np.random.default_rng(seed)
    _, block, size = GGUF_BLOCKS[qtype]
    b = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in SCALES.get(qtype, (0,)):
        if any_scale:
            bits = rng.integers(0, 1 << 16, (rows, cols // block), dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0x3FFF  # no inf / nan
            h = bits.view(np.float16)
        else:
            h = rng.uniform(1e-4, 3e-3, (rows, cols // block)).astype(np.float16)
        b[..., at:at + 2] = h.view(np.uint8).reshape(rows, cols // block, 2)
    return b.reshape(rows, -1)


def dequant(qtype: str, data: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])


def dot_part(qtype: str, data: np.ndarray) -> np.ndarray:
    """The weights the quantised activations multiply: dequantised with the mins zeroed."""
    data = data.copy()
    _, block, size = GGUF_BLOCKS[qtype]
    b = data.reshape(data.shape[0], -1, size)
    if qtype in ("Q4_K", "Q5_K", "Q4_1", "Q5_1"):
        b[..., 2:4] = 0  # dmin / m
    return dequant(qtype, data)


def sizes(qtype: str) -> list[int]:
    return [256, 768, 4096] if qtype in KQUANTS else [32, 96, 640, 4096]


@pytest.mark.parametrize("qtype", TYPES)
def test_twin_storage_is_the_files_blocks_bit_for_bit(qtype):
    """Odd row counts, K of one block up to 4096 (32-input types: K not a multiple of 128 too,
    whose last group is padded), any finite float16 scale; and gguf-py's own quantisation."""
    cases = [(k, random_blocks(qtype, 37, k, seed=k, any_scale=True)) for k in sizes(qtype)]
    if qtype not in KQUANTS:
        w = np.random.default_rng(1).standard_normal((21, 640)).astype(np.float32) * 0.05
        cases.append((640, gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])))
        cases.append((64, random_blocks(qtype, 8200, 64, seed=5, any_scale=True)))  # a head: packed in slices
    for k, data in cases:
        buf, meta = pack_gguf_twin([Shard(0, qtype, data, k)], k)
        got = dequantize_gguf_twin(buf, meta, k).numpy()
        want = dequant(qtype, data)
        assert got.shape == want.shape == (data.shape[0], k)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (qtype, k)
        (back_type, back), = gguf_twin_blocks(buf, meta, k)
        assert back_type == qtype and np.array_equal(back.numpy(), data), (qtype, k)
        if qtype not in KQUANTS:  # a permutation: the same bytes, another order (plus zero padding)
            assert buf.numel() == data.shape[0] * -(-k // 128) * 4 * GGUF_BLOCKS[qtype][2]


def _check_gemm(kernels, x: torch.Tensor, buf, meta, n: int, w: np.ndarray, c: np.ndarray) -> None:
    y = kernels.gguf_gemm(x, buf, meta, n).double()
    xd = x.double()
    ref = xd @ torch.from_numpy(w).double().t()
    act = xd.abs().amax(1, keepdim=True) / 65534 * torch.from_numpy(np.abs(c)).double().sum(1)
    acc = 2 ** -20 * (xd.abs() @ torch.from_numpy(np.abs(w)).double().t())
    out = ref.abs() * 2 ** -8 if x.dtype == torch.bfloat16 else 0
    excess = (y - ref).abs() - (act + acc + out + 1e-12)
    assert excess.max().item() <= 0, (x.shape, excess.max().item())


@pytest.mark.parametrize("qtype", TYPES)
def test_gemm_within_the_activation_quantisation_bound(qtype, kernel_variant, variant_kernels):
    """Every row count 1..16 (the kernel's row blocks 8 / 4 / 2 / 1 and their remainders), odd N,
    K from one block to 4096, float32 and bf16 activations; in the native build and the AVX2 one."""
    kernels = variant_kernels
    assert kernel_variant != "avx2" or kernels.gguf_gemm_isa() == "avx2"
    torch.manual_seed(0)
    for k in sizes(qtype):
        data = random_blocks(qtype, 37, k, seed=k)
        w, c = dequant(qtype, data), dot_part(qtype, data)
        buf, meta = pack_gguf_twin([Shard(0, qtype, data, k)], k)
        for rows in range(1, 17):
            x = torch.randn(rows, k) * torch.rand(1, k) * 3  # uneven input magnitudes
            _check_gemm(kernels, x, buf, meta, 37, w, c)
        _check_gemm(kernels, torch.randn(5, k).bfloat16(), buf, meta, 37, w, c)
        assert kernels.gguf_gemm(torch.zeros(0, k), buf, meta, 37).shape == (0, 37)


@pytest.mark.parametrize("k,types", [(16896, ("Q4_K", "Q6_K", "Q5_1")), (16480, ("Q8_0", "Q4_0"))])
def test_long_rows_summed_in_chunks_are_one_pass(k, types, kernel_variant, variant_kernels):
    """Past 16384 / MB inputs a block of MB rows runs over K in chunks that carry their float sums
    (8 rows: chunks of 2048; one row: 16384), so rows 1..9 and 16 at once or alone cross the chunk
    bounds at different places: the same bits, within the activations' bound of float64. K 16480:
    the x4 types' padded last group."""
    kernels = variant_kernels
    assert kernel_variant != "avx2" or kernels.gguf_gemm_isa() == "avx2"
    shards, start = [], 0
    for i, qtype in enumerate(types):
        shards.append(Shard(start, qtype, random_blocks(qtype, 7, k, seed=i), k))
        start += 7
    buf, meta = pack_gguf_twin(shards, k)
    w = np.concatenate([dequant(s.qtype, s.data) for s in shards])
    c = np.concatenate([dot_part(s.qtype, s.data) for s in shards])
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(k)) * 2
    full = kernels.gguf_gemm(x, buf, meta, start)
    _check_gemm(kernels, x, buf, meta, start, w, c)
    for m in range(1, 10):
        assert torch.equal(kernels.gguf_gemm(x[:m], buf, meta, start), full[:m]), m
    alone = torch.cat([kernels.gguf_gemm(x[i:i + 1], buf, meta, start) for i in range(16)])
    assert torch.equal(alone, full)


def test_the_error_is_that_of_the_activations_alone(kernel_variant, variant_kernels):
    """With activations already on the int16 grid (integers up to 32767 times one scale), the
    kernel's sums are exact: what is left is float32 rounding."""
    kernels = variant_kernels
    assert kernel_variant != "avx2" or kernels.gguf_gemm_isa() == "avx2"
    for qtype in ("Q4_K", "Q6_K", "Q8_0", "Q5_1"):
        data = random_blocks(qtype, 19, 512, seed=3)
        buf, meta = pack_gguf_twin([Shard(0, qtype, data, 512)], 512)
        xq = torch.randint(-32767, 32768, (3, 512)).float()
        xq[:, 0] = 32767
        x = xq * 2 ** -12
        y = kernels.gguf_gemm(x, buf, meta, 19).double()
        w = torch.from_numpy(dequant(qtype, data)).double()
        ref = x.double() @ w.t()
        assert ((y - ref).abs() <= 2 ** -19 * (x.double().abs() @ w.abs().t())).all(), qtype


def test_fused_projection_with_shards_of_different_types():
    """Q4_K_M's attention: q and k in Q4_K, v in Q6_K (and, where K is not a multiple of 256,
    Q5_0 with a Q8_0 v): each row range is computed from its own blocks into its slice."""
    kernels = load_cpu_kernels()
    for k, types in ((512, ["Q4_K", "Q4_K", "Q6_K"]), (640, ["Q5_0", "Q5_0", "Q8_0"])):
        rows = [40, 24, 24]
        starts = np.cumsum([0] + rows[:-1])
        shards = [Shard(int(s), t, random_blocks(t, r, k, seed=i), k)
                  for i, (s, t, r) in enumerate(zip(starts, types, rows))]
        n = sum(rows)
        assert gguf_twin_spec(shards[::-1]) == f"{types[0].lower()}:64+{types[2].lower()}:24"
        assert gguf_twin_name(gguf_twin_spec(shards)) == f"{types[0].lower()}+{types[2].lower()}"
        buf, meta = pack_gguf_twin(shards[::-1], k)  # any order: sorted by row_start
        w = np.concatenate([dequant(s.qtype, s.data) for s in shards])
        c = np.concatenate([dot_part(s.qtype, s.data) for s in shards])
        assert np.array_equal(dequantize_gguf_twin(buf, meta, k).numpy().view(np.uint32), w.view(np.uint32))
        for m in (1, 3, 8, 11):
            _check_gemm(kernels, torch.randn(m, k), buf, meta, n, w, c)
        lin = nn.Linear(k, n, bias=False)
        lin.weight.data = torch.from_numpy(w).bfloat16()
        # above the cut-over: oneDNN's prepacked bf16 weight where oneDNN runs bf16 (AVX-512), else
        # the float32 layout (AVX2-only CPUs): the twin below it is the same either way
        fast = CpuLinear(lin, "gguf", 4, shards=shards, layout="onednn" if prepack_available() else "float32")
        assert fast.twin_spec == gguf_twin_spec(shards)
        x = torch.randn(4, k).bfloat16()  # at the cut-over: the twin
        assert torch.equal(fast(x), kernels.gguf_gemm(x, buf, meta, n))
        x = torch.randn(5, k).bfloat16()  # above: the bf16 weight, bit for bit
        assert torch.equal(fast(x), CpuLinear(lin, layout=fast.layout)(x))
    with pytest.raises(ValueError, match="shards"):  # a gap in the rows
        CpuLinear(nn.Linear(512, 64), "gguf", 4, shards=[Shard(8, "Q4_K", random_blocks("Q4_K", 56, 512), 512)])
    with pytest.raises(RuntimeError, match="bytes a row"):
        kernels.gguf_gemm(torch.randn(1, 256), buf, meta, n)


def _tree(sources: dict, tied: bool = True) -> nn.Module:
    model = nn.Module()
    model.embed_tokens = nn.Embedding(96, 512)
    layer = nn.Module()
    layer.qkv_proj, layer.down_proj = nn.Linear(512, 64, bias=False), nn.Linear(512, 32, bias=False)
    model.layers = nn.ModuleList([layer])
    model.lm_head = nn.Linear(512, 96, bias=False)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    model.gguf_sources = sources
    return model.bfloat16()


def test_gguf_twins_of_picks_the_modules_the_kernel_reads():
    def shard(t, rows, start=0, cols=512):
        return Shard(start, t, random_blocks(t, rows, cols), cols)
    f16 = Shard(0, "F16", np.zeros((32, 1024), np.uint8), 512)  # a block type gguf_gemm does not read
    kquant = {"layers.0.qkv_proj": [shard("Q4_K", 48), shard("Q6_K", 16, 48)], "layers.0.down_proj": [f16],
              "embed_tokens": [shard("Q6_K", 96)]}
    twins = gguf_twins_of(_tree(kquant))
    assert {n: s for n, (s, _) in twins.items()} == {"layers.0.qkv_proj": "q4_k:48+q6_k:16", "lm_head": "q6_k:96"}
    assert "lm_head" not in gguf_twins_of(_tree(kquant, tied=False))  # an untied head needs blocks of its own
    # a Q4_0 / Q4_1 file keeps the min-max twins; no sources: nothing changes
    assert gguf_twins_of(_tree({"layers.0.qkv_proj": [shard("Q4_1", 64)], "embed_tokens": [shard("Q8_0", 96)]})) == {}
    assert gguf_twins_of(_tree({})) == {}
    model = _tree(kquant)
    n = optimize_cpu_linears(model, "onednn" if prepack_available() else "float32", 4, 4, load_cpu_kernels(),
                             gguf_twins={name: s for name, (_, s) in gguf_twins_of(model).items()})
    assert n == 3
    qkv, down, head = model.layers[0].qkv_proj, model.layers[0].down_proj, model.lm_head
    assert (qkv.twin, qkv.twin_spec, qkv.twin_max_tokens) == ("gguf", "q4_k:48+q6_k:16", 4)
    assert down.twin == "" and down.twin_max_tokens == 0  # F16: no twin (and no min-max 4-bit one)
    assert head.twin == "gguf" and head.weight is model.embed_tokens.weight  # the head keeps the shared weight


class _SourcesAdded:
    """load_model as the engine calls it, with gguf_sources added: random K-quant blocks for every
    projection (Q4_K, v rows and down in Q6_K, as Q4_K_M does) and Q8_0 for the tied head, and the
    model's weights replaced by their dequantised values."""

    def __init__(self, real):
        self.real = real

    def __call__(self, *args, **kwargs):
        model, cfg, tok, src = self.real(*args, **kwargs)
        sources = {}
        seed = 0
        for name, mod in model.named_modules():
            if not (isinstance(mod, nn.Linear) and name.startswith("layers.")):
                continue
            n, k = mod.out_features, mod.in_features
            if name.endswith("qkv_proj"):
                v = cfg.num_kv_heads * cfg.head_dim
                parts = [("Q4_K", n - v), ("Q6_K", v)]
            else:
                parts = [("Q6_K" if name.endswith("down_proj") else "Q4_K", n)]
            shards, start = [], 0
            for qtype, rows in parts:
                seed += 1
                shards.append(Shard(start, qtype, random_blocks(qtype, rows, k, seed=seed), k))
                start += rows
            sources[name] = shards
            mod.weight.data = torch.from_numpy(np.concatenate([dequant(s.qtype, s.data) for s in shards])
                                               ).to(mod.weight.dtype)
        emb = model.embed_tokens.weight
        w = torch.randn(emb.shape, generator=torch.Generator().manual_seed(0)).numpy()  # large: peaked logits
        blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
        emb.data = torch.from_numpy(dequant("Q8_0", blocks)).to(emb.dtype)
        sources["embed_tokens"] = [Shard(0, "Q8_0", blocks, w.shape[1])]
        model.gguf_sources = sources
        return model, cfg, tok, src


@pytest.fixture(scope="module")
def kquant_model_dir(tmp_path_factory):
    """A tiny Llama whose every in_features is a multiple of 256 (K-quant blocks), head tied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from iterserve.model.loader import load_tokenizer, resolve_model

    folder = tmp_path_factory.mktemp("tiny-kquant")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(folder)
    return folder


@pytest.mark.skipif(not prepack_available(), reason="needs oneDNN bf16")
def test_engine_runs_twins_of_the_files_blocks(kquant_model_dir, monkeypatch, tmp_path, caplog):
    """quantization=auto with gguf_sources: every projection and the tied head get a twin from their
    blocks, timed per block layout (the table and log line name the types), and single-row steps
    run them: teacher-forced, their logits are as close to float32's (the file's values exactly) as
    the bf16 weights' are, or closer (the bf16 path rounds every weight, the twin none)."""
    import iterserve.engine as engine_mod
    from iterserve.config import EngineConfig
    from iterserve.engine import LLMEngine

    monkeypatch.setattr(engine_mod, "load_model", _SourcesAdded(engine_mod.load_model))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = dict(model=str(kquant_model_dir), dtype="bfloat16", kv_cache_memory="16MiB", max_num_seqs=4)
    with caplog.at_level(logging.INFO, logger="iterserve.platform"):
        eng = LLMEngine(EngineConfig(**cfg, measure_kernels=True))
    choice = eng.platform.kernel_choice
    specs = eng.platform.gguf_twins  # module -> its twin's block layout
    assert specs["lm_head"] == "q8_0:49152" and specs["layers.0.self_attn.qkv_proj"] == "q4_k:384+q6_k:128"
    assert specs["layers.1.mlp.down_proj"] == "q6_k:256" and specs["layers.0.mlp.gate_up_proj"] == "q4_k:1024"
    assert len(specs) == 9 and eng.platform.resolved()["gguf_twins"] == ["q4_k", "q4_k+q6_k", "q6_k", "q8_0"]
    for name, mod in eng.model.named_modules():
        if isinstance(mod, CpuLinear):  # each twin as timed for its shape and block layout (0: none)
            plan = choice.plan("head" if name == "lm_head" else "proj", mod.out_features, mod.in_features, specs[name])
            assert plan.twin == gguf_twin_name(specs[name]) and mod.twin_max_tokens == plan.twin_max_tokens, name
            assert mod.twin == ("gguf" if plan.twin_max_tokens else "") and mod.twin_spec in ("", specs[name])
    assert "q4_k+q6_k" in choice.table() and "of the GGUF's own blocks" in caplog.text
    assert eng.model.gguf_sources == {}  # the twins hold the blocks: the loader's copies were let go
    # unmeasured: the twins at the fixed cut-overs of the layout, pinned to tiled on every CPU (auto
    # takes oneDNN's where AMX is, whose cut-over of 8 rows puts the 6-token prompt on the twins too:
    # on a 2-core AMX Xeon that run's logits were 0.49 from float32's against the bf16 run's 0.41, where
    # both are mostly the bf16 rounding of every output; tiled falls back to oneDNN's unvectorised)
    fixed = LLMEngine(EngineConfig(**cfg, measure_kernels=False, bf16_gemm="tiled"))
    want_max = {four_bit_max_tokens(fixed.platform.layout), Q8_HEAD_MAX_TOKENS}
    assert want_max == ({4} if fixed.platform.layout == "tiled" else {8, 4})  # the cut-overs as before
    assert {m.twin_max_tokens for m in fixed.model.modules() if isinstance(m, CpuLinear)} == want_max
    assert all(m.twin == "gguf" for m in fixed.model.modules() if isinstance(m, CpuLinear))
    plain = LLMEngine(EngineConfig(**cfg, measure_kernels=False, quantization="none", bf16_gemm="tiled"))
    assert all(m.twin == "" for m in plain.model.modules() if isinstance(m, CpuLinear))
    ref = LLMEngine(EngineConfig(**{**cfg, "dtype": "float32"}, measure_kernels=False, quantization="none"))
    ids = fixed.tokenizer("The capital of France is a city on the river Seine, and")["input_ids"]
    want = _decode_logits(ref, ids)
    twin, bf16 = _decode_logits(fixed, ids), _decode_logits(plain, ids)
    err_twin, err_bf16 = (twin - want).abs().mean().item(), (bf16 - want).abs().mean().item()
    top1 = (twin.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"decode logits vs float32: twins {err_twin:.4f}, bf16 weights {err_bf16:.4f}; twins' top-1 {top1:.2f}")
    assert err_twin <= 1.1 * err_bf16 and top1 >= 0.75


def _decode_logits(engine, ids: list[int], prompt: int = 6) -> torch.Tensor:
    """Teacher-forced: `prompt` tokens as one prefill, then one token a step (the twins' size)."""
    from model_utils import make_request, new_runner, run_step

    runner = new_runner((engine.model, engine.model_config, engine.tokenizer), num_blocks=8)
    req = make_request("seq", ids)
    got = [run_step(runner, [(req, prompt)])[0]]
    got += [run_step(runner, [(req, 1)])[0] for _ in range(len(ids) - prompt)]
    return torch.stack(got[1:]).float()


def _int8_reference(x: torch.Tensor, w: np.ndarray, c: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf_gemm(int8=True)'s sums in float64 from its own activation levels (round(x * (127 / amax)) to
    nearest even per 256 inputs, in float32 as the kernel computes them): the dot part and the mins
    alike (llama.cpp's bsums; from the float sums of x instead, the two terms' rounding errors add up
    rather than cancel), and the bound of float32 sums."""
    xf = x.float().reshape(x.shape[0], -1, 256)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = (torch.round(xf * inv) * (amax / 127.0)).double().reshape(x.shape)
    cd, md = torch.from_numpy(c).double(), torch.from_numpy(w - c).double()
    ref = xq @ (cd + md).t()
    bound = 2 ** -20 * (xq.abs() @ (cd.abs() + md.abs()).t())
    return ref, bound + (ref.abs() * 2 ** -8 if x.dtype == torch.bfloat16 else 0) + 1e-12


@pytest.mark.parametrize("qtype", sorted(KQUANTS))
def test_int8_activations_compute_llama_cpps_sums(qtype, kernel_variant, variant_kernels):
    """gguf_gemm(int8=True) (--gguf-activations int8): the K-quant sums on activations quantised to int8
    per 256 inputs, as a float64 reference on the same levels computes them, every row alone; further
    from float32 than the int16 path (the cost it buys its speed with), within int8's bound of it."""
    kernels = variant_kernels
    if not kernels.gguf_gemm_int8_supported():
        pytest.skip("this build has no AVX2 path (gguf_gemm int8 needs AVX2 + FMA + F16C)")
    torch.manual_seed(0)
    for k in sizes(qtype):
        data = random_blocks(qtype, 37, k, seed=k)
        w, c = dequant(qtype, data), dot_part(qtype, data)
        buf, meta = pack_gguf_twin([Shard(0, qtype, data, k)], k)
        for rows in (1, 2, 5, 9, 16):
            x = torch.randn(rows, k) * torch.rand(1, k) * 3
            y = kernels.gguf_gemm(x, buf, meta, 37, int8=True)
            ref, bound = _int8_reference(x, w, c)
            assert ((y.double() - ref).abs() <= bound).all(), (qtype, k, rows)
            alone = torch.cat([kernels.gguf_gemm(x[i:i + 1], buf, meta, 37, int8=True) for i in range(rows)])
            assert torch.equal(alone, y)  # 37 outputs: the pool's ranges hold 3, never 8 to interleave
            exact = x.double() @ torch.from_numpy(w).double().t()
            int8_cost = (x.double().abs().reshape(rows, -1, 256).amax(-1) / 254).repeat_interleave(256, 1) \
                @ torch.from_numpy(np.abs(w)).double().t()
            assert ((y.double() - exact).abs() <= int8_cost + bound).all()
        xb = torch.randn(3, k).bfloat16()
        ref, bound = _int8_reference(xb, w, c)
        assert ((kernels.gguf_gemm(xb, buf, meta, 37, int8=True).double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("qtype", sorted(KQUANTS))
def test_int8_activations_on_many_rows_interleave_eight_weight_rows(qtype, kernel_variant, variant_kernels):
    """From 16 activation rows (Q6_K: 32) the int8 K-quant sums run on 8 weight rows interleaved
    (gemm_gguf.cpp, il_shard): the reference's sums within float32's bound, for float32 and bfloat16
    rows, rows past a multiple of 4 and columns past a multiple of 8 (261 outputs: 17 a range of the
    pool, so every range ends in one the interleaved tiles leave to gg_rows_i8); a row's outputs are
    the same whatever the call's rows above the threshold, and differ from a row alone in the last
    bits only (another order of float sums: why int8 is refused with --batch-invariant)."""
    kernels = variant_kernels
    if not kernels.gguf_gemm_int8_supported():
        pytest.skip("this build has no AVX2 path (gguf_gemm int8 needs AVX2 + FMA + F16C)")
    k, n = 1024, 261
    data = random_blocks(qtype, n, k, seed=5)
    w, c = dequant(qtype, data), dot_part(qtype, data)
    buf, meta = pack_gguf_twin([Shard(0, qtype, data, k)], k)
    x = torch.randn(35, k, generator=torch.Generator().manual_seed(1)) * torch.rand(1, k) * 3
    y = kernels.gguf_gemm(x, buf, meta, n, int8=True)
    ref, bound = _int8_reference(x, w, c)
    assert ((y.double() - ref).abs() <= bound).all()
    alone = torch.cat([kernels.gguf_gemm(x[i:i + 1], buf, meta, n, int8=True) for i in range(35)])
    assert ((y - alone).abs() <= 2 * bound.float()).all()
    assert not torch.equal(y, alone)  # the interleaved path ran
    for rows in (33, 34) + ((16, 17, 19) if qtype != "Q6_K" else ()):
        assert torch.equal(kernels.gguf_gemm(x[:rows], buf, meta, n, int8=True), y[:rows]), rows
    xb = x[:19].bfloat16()
    ref, bound = _int8_reference(xb, w, c)
    assert ((kernels.gguf_gemm(xb, buf, meta, n, int8=True).double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("qtype", sorted(KQUANTS))
def test_int8_activations_on_amx_tiles_are_the_interleaved_kernels_bits(qtype):
    """gguf_gemm(int8=True, amx=True) runs K-quant shards of 16+ rows on AMX-INT8 tiles (gemm_gguf_amx.cpp):
    the same integer sums and float operations as the interleaved kernel, so where that kernel ran
    (Q4_K / Q5_K from 16 rows, Q6_K from 32) every output is its bit for bit: float32 and bf16 rows,
    one and several tiles of 16 rows, more than the 4 tiles one pass holds (80 rows), K of one and of
    nine super-blocks. 256 outputs: the pool's ranges hold 16, all of them interleaved without AMX.
    Then the rows and columns AMX leaves to the other loops (261 outputs, 16 to 19 rows; Q6_K's 16-31
    rows, rounded in the interleaved order instead of gg_rows_i8's): within float32's bound of the
    reference, each row's outputs the same whatever the other rows of its tile."""
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.gguf_gemm_amx_available():
        pytest.skip("needs a build with AMX-INT8 on a CPU and OS that lend it (gguf_gemm_amx_available)")
    for k in (256, 2304):
        data = random_blocks(qtype, 256, k, seed=k)
        buf, meta = pack_gguf_twin([Shard(0, qtype, data, k)], k)
        x = torch.randn(80, k, generator=torch.Generator().manual_seed(k)) * torch.rand(1, k) * 3
        for rows in (32, 33, 47, 80) + ((16, 17) if qtype != "Q6_K" else ()):
            for xs in (x[:rows], x[:rows].bfloat16()):
                got = kernels.gguf_gemm(xs, buf, meta, 256, int8=True, amx=True)
                want = kernels.gguf_gemm(xs, buf, meta, 256, int8=True, amx=False)
                assert torch.equal(got, want), (k, rows, xs.dtype)
    k, n = 1024, 261
    data = random_blocks(qtype, n, k, seed=7)
    w, c = dequant(qtype, data), dot_part(qtype, data)
    buf, meta = pack_gguf_twin([Shard(0, qtype, data, k)], k)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(2)) * torch.rand(1, k) * 3
    for xs in (x, x.bfloat16()):
        got = {rows: kernels.gguf_gemm(xs[:rows], buf, meta, n, int8=True, amx=True) for rows in (16, 19)}
        for rows, y in got.items():
            ref, bound = _int8_reference(xs[:rows], w, c)
            assert ((y.double() - ref).abs() <= bound).all(), (rows, xs.dtype)
        # a row's outputs do not depend on the other rows of its tile (zero rows pad the last one)
        assert torch.equal(got[16], got[19][:16])


def test_amx_tiles_without_vbmi_fold_q4_k_to_the_same_bits():
    """Where the CPU has AVX512-VBMI the AMX kernel folds Q4_K's levels by vpermb lookup; built without
    it (cpu_kernels' amx-no-vbmi variant: an AMX host without VBMI) it folds them by multiplies and
    blends. Both planes hold the same bytes, so both builds' AMX steps give the same bits, int8 and
    int16 activations, one pass (16, 33 rows) and several (80)."""
    reason = variant_skip_reason("amx-no-vbmi")
    if reason:
        pytest.skip(reason)
    native, plain = load_cpu_kernels(), load_cpu_kernels("amx-no-vbmi")
    if native is None or plain is None or not plain.gguf_gemm_amx_available():
        pytest.skip("needs builds with AMX-INT8 on a CPU and OS that lend it (gguf_gemm_amx_available)")
    for qtype in ("Q4_K", "Q5_K", "Q6_K"):
        k = 2304
        buf, meta = pack_gguf_twin([Shard(0, qtype, random_blocks(qtype, 64, k, seed=3), k)], k)
        x = torch.randn(80, k, generator=torch.Generator().manual_seed(4)) * torch.rand(1, k) * 3
        for rows in (16, 33, 80):
            for int8 in (True, False):
                want = native.gguf_gemm(x[:rows], buf, meta, 64, int8=int8, amx=True)
                got = plain.gguf_gemm(x[:rows], buf, meta, 64, int8=int8, amx=True)
                assert torch.equal(got, want), (qtype, rows, int8)


# run in a child: a read past the blocks is a segfault, which would take the test session with it
_GUARDED_BLOCKS = """
import ctypes, mmap, sys, torch
sys.path.insert(0, sys.argv[1])
from test_kquant import Shard, random_blocks
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_linear import pack_gguf_twin
kernels, libc, page = load_cpu_kernels(), ctypes.CDLL(None), mmap.PAGESIZE
for qtype in ("Q4_K", "Q5_K", "Q6_K"):
    for k in (256, 2304):
        buf, meta = pack_gguf_twin([Shard(0, qtype, random_blocks(qtype, 32, k, seed=k), k)], k)
        span = (buf.numel() + page - 1) // page * page
        mm = mmap.mmap(-1, span + page)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        assert libc.mprotect(ctypes.c_void_p(base + span), page, 0) == 0  # PROT_NONE after the blocks
        guarded = torch.frombuffer(mm, dtype=torch.uint8, offset=span - buf.numel(), count=buf.numel())
        guarded.copy_(buf)
        x = torch.randn(16, k).bfloat16()
        for int8 in (True, False):
            want = kernels.gguf_gemm(x, buf, meta, 32, int8=int8, amx=True)
            assert torch.equal(kernels.gguf_gemm(x, guarded, meta, 32, int8=int8, amx=True), want), (qtype, k, int8)
print("read within the blocks")
"""


def test_amx_tiles_read_nothing_past_a_tensors_last_block():
    """The AMX kernel reads a row group's headers with gathers of 4 bytes (AmxBlock::headers): none may
    reach past a super-block, or a tensor's last block at the end of a file's mapping would fault. The
    blocks end where a page that may not be read begins (int8 and int16 activations, every K-quant,
    16 rows: the kernel's first and last row group)."""
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.gguf_gemm_amx_available():
        pytest.skip("needs a build with AMX-INT8 on a CPU and OS that lend it (gguf_gemm_amx_available)")
    done = subprocess.run([sys.executable, "-c", _GUARDED_BLOCKS, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "read within the blocks" in done.stdout


def _int16_bound(x: torch.Tensor, w: np.ndarray, c: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """float64's x @ w.T and _check_gemm's bound of the int16 path: the activations' rounding to one
    int16 scale a row, float32 sums, bf16 outputs."""
    xd = x.double()
    ref = xd @ torch.from_numpy(w).double().t()
    act = xd.abs().amax(1, keepdim=True) / 65534 * torch.from_numpy(np.abs(c)).double().sum(1)
    acc = 2 ** -20 * (xd.abs() @ torch.from_numpy(np.abs(w)).double().t())
    return ref, act + acc + (ref.abs() * 2 ** -8 if x.dtype == torch.bfloat16 else 0) + 1e-12


@pytest.mark.parametrize("qtype", sorted(KQUANTS))
def test_int16_activations_on_amx_tiles_within_the_int16_bound(qtype):
    """gguf_gemm(amx=True) on the default int16 activations runs K-quant shards of 16+ rows on AMX-INT8
    tiles (gemm_gguf_amx.cpp: each level as a signed high and an unsigned low byte, four tile products
    a line against the weights' two planes): within the int16 path's bound of float64, float32 and
    bf16 rows, one tile and several (16, 19, 37, 80 rows: more than the 4 one pass holds), K of one
    and of nine super-blocks, 261 outputs (the columns past a multiple of 16 in a pool range go to
    gg_rows); a row's outputs the same whatever the other rows of its call; the AMX path ran
    (gguf_gemm_amx_calls), and fewer than 16 rows, or amx=False, give the int16 path's bits."""
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.gguf_gemm_amx_available():
        pytest.skip("needs a build with AMX-INT8 on a CPU and OS that lend it (gguf_gemm_amx_available)")
    n = 261
    for k in (256, 2304):
        data = random_blocks(qtype, n, k, seed=k + 1)
        w, c = dequant(qtype, data), dot_part(qtype, data)
        buf, meta = pack_gguf_twin([Shard(0, qtype, data, k)], k)
        x = torch.randn(80, k, generator=torch.Generator().manual_seed(k)) * torch.rand(1, k) * 3
        calls = kernels.gguf_gemm_amx_calls()
        got = {}
        for rows in (16, 19, 37, 80):
            for xs in (x[:rows], x[:rows].bfloat16()):
                y = got[rows, xs.dtype] = kernels.gguf_gemm(xs, buf, meta, n, amx=True)
                ref, bound = _int16_bound(xs, w, c)
                excess = (y.double() - ref).abs() - bound
                assert excess.max().item() <= 0, (k, rows, xs.dtype, excess.max().item())
        assert kernels.gguf_gemm_amx_calls() == calls + 8
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(got[80, dtype][:19], got[19, dtype]) and torch.equal(got[37, dtype][:16], got[16, dtype])
        assert not torch.equal(got[80, torch.float32], kernels.gguf_gemm(x, buf, meta, n))  # another rounding
        for m in (1, 8, 15):
            assert torch.equal(kernels.gguf_gemm(x[:m], buf, meta, n, amx=True), kernels.gguf_gemm(x[:m], buf, meta, n))
        assert torch.equal(kernels.gguf_gemm(x, buf, meta, n, amx=False), kernels.gguf_gemm(x, buf, meta, n))


def test_int8_amx_runs_fused_shards_and_only_where_asked():
    """One call over a fused projection's shards (Q4_K rows, then Q6_K, then a 32-input type, as a
    Q4_K_M's attention q/k/v): each K-quant shard on AMX within the reference's bound, the 32-input
    shard's outputs the int16 path's bits; a call of fewer than 16 rows, or with amx=False, gives the
    non-AMX build's bits."""
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.gguf_gemm_amx_available():
        pytest.skip("needs a build with AMX-INT8 on a CPU and OS that lend it (gguf_gemm_amx_available)")
    k, types, rows_of = 2048, ("Q4_K", "Q6_K", "Q8_0"), (48, 32, 16)
    shards, first = [], 0
    for i, (t, r) in enumerate(zip(types, rows_of)):
        shards.append(Shard(first, t, random_blocks(t, r, k, seed=i), k))
        first += r
    buf, meta = pack_gguf_twin(shards, k)
    x = torch.randn(24, k, generator=torch.Generator().manual_seed(4)) * 2
    y, y16 = kernels.gguf_gemm(x, buf, meta, first, int8=True, amx=True), kernels.gguf_gemm(x, buf, meta, first)
    assert torch.equal(y[:, 80:], y16[:, 80:])
    for s, cols in ((shards[0], slice(0, 48)), (shards[1], slice(48, 80))):
        ref, bound = _int8_reference(x, dequant(s.qtype, s.data), dot_part(s.qtype, s.data))
        assert ((y[:, cols].double() - ref).abs() <= bound).all(), s.qtype
    for m in (1, 8, 15):
        assert torch.equal(kernels.gguf_gemm(x[:m], buf, meta, first, int8=True, amx=True),
                           kernels.gguf_gemm(x[:m], buf, meta, first, int8=True))


@pytest.mark.parametrize("qtype", sorted(KQUANTS))
def test_int8_activations_on_avx512_are_the_avx2_paths_bits(qtype):
    """The AVX-512 build's int8 K-quant loop (64 inputs a vpmaddubsw and a vpdpwssd) adds the same
    integers as the AVX2 build's (32 a vpmaddubsw and a vpmaddwd) and folds its wide sums to the AVX2
    lanes before any float: its outputs are the AVX2 build's bit for bit, rows 1..8 (every row block
    of gg_rows_i8), float32 and bf16, K over one chunk too."""
    reason = variant_skip_reason("avx2")
    if reason:
        pytest.skip(reason)
    native, avx2 = load_cpu_kernels(), load_cpu_kernels("avx2")
    if avx2 is None or native.gguf_gemm_isa() != "avx512-vnni":
        pytest.skip("needs the AVX-512 VNNI build and the AVX2 one")
    for k in (256, 2304, 16896):
        data = random_blocks(qtype, 37, k, seed=k)
        buf, meta = pack_gguf_twin([Shard(0, qtype, data, k)], k)
        x = torch.randn(9, k, generator=torch.Generator().manual_seed(k)) * torch.rand(1, k) * 3
        for rows in range(1, 10):
            for xs in (x[:rows], x[:rows].bfloat16()):
                got, want = native.gguf_gemm(xs, buf, meta, 37, int8=True), avx2.gguf_gemm(xs, buf, meta, 37, int8=True)
                assert torch.equal(got, want), (qtype, k, rows, xs.dtype)


def test_int8_activations_leave_32_input_shards_and_long_rows_alone(kernel_variant, variant_kernels):
    """One call over shards of K-quants and of a 32-input type, K past one chunk (16384 / rows): the
    32-input shard's outputs are the int16 call's bits, the K-quant ones the reference's, whatever the rows."""
    kernels = variant_kernels
    if not kernels.gguf_gemm_int8_supported():
        pytest.skip("this build has no AVX2 path (gguf_gemm int8 needs AVX2 + FMA + F16C)")
    k, types = 16896, ("Q4_K", "Q5_1", "Q6_K")
    shards = [Shard(7 * i, t, random_blocks(t, 7, k, seed=i), k) for i, t in enumerate(types)]
    buf, meta = pack_gguf_twin(shards, k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(3)) * 2
    y, y16 = kernels.gguf_gemm(x, buf, meta, 21, int8=True), kernels.gguf_gemm(x, buf, meta, 21)
    assert torch.equal(y[:, 7:14], y16[:, 7:14]) and not torch.equal(y[:, :7], y16[:, :7])
    for s, cols in ((shards[0], slice(0, 7)), (shards[2], slice(14, 21))):
        ref, bound = _int8_reference(x, dequant(s.qtype, s.data), dot_part(s.qtype, s.data))
        assert ((y[:, cols].double() - ref).abs() <= bound).all(), s.qtype
    for m in (1, 4, 8):
        assert torch.equal(kernels.gguf_gemm(x[:m], buf, meta, 21, int8=True), y[:m])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0"])
def test_a_large_head_packs_in_slices_into_one_buffer(qtype):
    """More than 8,192 rows pack a slice at a time straight into the output: the bytes are those of
    packing every row at once, and unpack to the stored blocks."""
    from iterserve.platform.cpu_linear import GGUF_BLOCKS, pack_gguf_x4, unpack_gguf_x4

    k = 640  # Gemma 3's hidden size: 20 blocks, 5 groups
    size = GGUF_BLOCKS[qtype][2]
    data = torch.randint(0, 256, (8192 + 300, k // 32 * size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_gguf_x4(data, qtype)
    assert torch.equal(packed[8192:], pack_gguf_x4(data[8192:], qtype))
    assert torch.equal(packed[:8192], pack_gguf_x4(data[:8192], qtype))
    assert torch.equal(unpack_gguf_x4(packed, qtype, k), data)


def test_read_ahead_follows_the_order_of_execution_and_changes_no_number(kquant_model_dir, monkeypatch, tmp_path):
    """chain_read_ahead: each projection with a twin names the next one's blocks (the bytes of its
    shards, where its buffer holds more: a file's map) in the order a step runs them (q/k/v, o,
    gate/up, down, the next layer's, ..., the head, then layer 0's for the next step); decoding, the
    pool's idle worker reads them (read_ahead_bytes grows where the pool has a worker), and the
    logits are the same bits as with read-ahead off (it only reads)."""
    import iterserve.engine as engine_mod
    import iterserve.platform.cpu_linear as cpu_linear
    from iterserve.config import EngineConfig
    from iterserve.engine import LLMEngine

    monkeypatch.setattr(engine_mod, "load_model", _SourcesAdded(engine_mod.load_model))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = EngineConfig(model=str(kquant_model_dir), dtype="bfloat16", kv_cache_memory="16MiB", max_num_seqs=4,
                       measure_kernels=False, bf16_gemm="tiled")
    eng = LLMEngine(cfg)
    chain = [(name, m) for name, m in eng.model.named_modules() if isinstance(m, CpuLinear) and m.twin_max_tokens]
    names = [name for name, _ in chain]
    assert names[:5] == ["layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj", "layers.0.mlp.gate_up_proj",
                         "layers.0.mlp.down_proj", "layers.1.self_attn.qkv_proj"] and names[-1] == "lm_head"
    for (_, mod), (_, nxt) in zip(chain, chain[1:] + chain[:1]):  # the next one's own shards' bytes
        weight, meta = nxt._buffers["twin_weight"], nxt._buffers["twin_scales"]
        start, end = int(meta[:, 3].min()), int((meta[:, 3] + meta[:, 1] * meta[:, 2]).max())
        assert mod.read_next.data_ptr() == weight.data_ptr() + start and mod.read_next.numel() == end - start
    kernels = load_cpu_kernels()
    before = kernels.read_ahead_bytes()
    ids = eng.tokenizer("The capital of France is a city on the river Seine, and")["input_ids"]
    on = _decode_logits(eng, ids)
    if kernels.pool_threads() > 1:
        assert kernels.read_ahead_bytes() > before
    monkeypatch.setenv("ITERSERVE_READ_AHEAD_BYTES", "0")
    off_eng = LLMEngine(cfg)
    assert all(m.read_next is None for m in off_eng.model.modules() if isinstance(m, CpuLinear))
    assert torch.equal(on, _decode_logits(off_eng, ids))
    monkeypatch.setenv("ITERSERVE_READ_AHEAD_BYTES", "8 megs")
    with pytest.raises(ValueError, match="ITERSERVE_READ_AHEAD_BYTES: cannot read size '8 megs'"):
        cpu_linear.read_ahead_bytes()
    monkeypatch.setenv("ITERSERVE_READ_AHEAD_BYTES", "2MiB")
    assert cpu_linear.read_ahead_bytes() == 2 << 20


def test_engine_runs_steps_of_many_rows_on_amx_tiles_with_the_same_numbers(kquant_model_dir, monkeypatch, tmp_path):
    """gguf_activations=int8-except-down where AMX-INT8 is lent: the int8 projections' op runs gguf_gemm
    with amx (q/k/v, o, gate/up) and so do the int16 down projections (use_amx_tiles; this model's
    Q8_0 head stays on the int16 loop), and a 40-token prompt chunk through the twins runs them on AMX
    tiles (its Q6_K v rows too: from 32 rows, where the interleaved kernel runs without AMX; the two
    layers' down projections add two calls). With the down projections put back on the int16 loop the
    logits are --no-cpu-amx's bits (the int8 tiles give the interleaved kernel's numbers); with them on
    the tiles, within 1e-3 of those (the int16 levels summed in another order: here the bf16 outputs
    round the difference away)."""
    import iterserve.engine as engine_mod
    from iterserve.config import EngineConfig
    from iterserve.engine import LLMEngine
    from iterserve.platform.cpu_linear import GGUF_AMX, GGUF_INT8, GGUF_INT8_AMX

    kernels = load_cpu_kernels()
    if kernels is None or not kernels.gguf_gemm_amx_available():
        pytest.skip("needs a build with AMX-INT8 on a CPU and OS that lend it (gguf_gemm_amx_available)")
    monkeypatch.setattr(engine_mod, "load_model", _SourcesAdded(engine_mod.load_model))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    got, calls = {}, {}
    for run in ("amx", "amx-int8-only", "none"):
        amx = run != "none"
        cfg = EngineConfig(model=str(kquant_model_dir), dtype="bfloat16", kv_cache_memory="16MiB", max_num_seqs=4,
                           measure_kernels=False, bf16_gemm="tiled", gguf_activations="int8-except-down", cpu_amx=amx)
        eng = LLMEngine(cfg)
        assert eng.resolved_config()["gguf_int16_amx"] == amx
        twins = {name: m for name, m in eng.model.named_modules() if isinstance(m, CpuLinear) and m.twin_max_tokens}
        for name, m in twins.items():
            down, head = name.endswith("down_proj"), name == "lm_head"  # down: except-down; the head: Q8_0 here
            want = ("gguf" if head else (GGUF_AMX if amx else "gguf") if down else GGUF_INT8_AMX if amx else GGUF_INT8)
            assert m.op_twin == want, (name, m.op_twin)
            if down and run == "amx-int8-only":
                m.op_twin = "gguf"
            m.twin_max_tokens = 64  # the prompt chunk through the twins, as a measured choice can have it
        ids = eng.tokenizer("The capital of France is a city on the river Seine, and " * 4)["input_ids"][:42]
        before = kernels.gguf_gemm_amx_calls()
        got[run] = _decode_logits(eng, ids, prompt=40)
        calls[run] = kernels.gguf_gemm_amx_calls() - before
    assert calls["amx"] == calls["amx-int8-only"] + 2 and calls["amx-int8-only"] > 0 and calls["none"] == 0
    assert torch.equal(got["amx-int8-only"], got["none"])
    diff = (got["amx"] - got["none"]).abs().max().item()  # here 0: the bf16 outputs round the difference away
    assert diff <= 1e-3 * got["none"].abs().max().item(), diff


def test_read_ahead_outlives_the_tensor_it_names():
    """The pool keeps what it was asked to read ahead alive: a tensor dropped by Python right after
    read_ahead, and replaced by the next one, is never read after it is freed (the pool holds a
    reference until the next read_ahead, and waits for a worker still reading it before letting go)."""
    kernels = load_cpu_kernels()
    x, w = torch.randn(1, 256).bfloat16(), torch.from_numpy(random_blocks("Q4_K", 64, 256))
    buf, meta = pack_gguf_twin([Shard(0, "Q4_K", w.numpy(), 256)], 256)
    before = kernels.read_ahead_bytes()
    for i in range(50):
        kernels.gguf_gemm(x, buf, meta, 64, False)  # a job: the worker spins after it, and takes the next read
        t = torch.full((1 << 20,), i, dtype=torch.uint8)
        kernels.read_ahead(t, 1 << 20)
        del t
    kernels.read_ahead(torch.empty(0, dtype=torch.uint8), 1 << 20)  # nothing to read: ignored
    kernels.gguf_gemm(x, buf, meta, 64, False)
    if kernels.pool_threads() > 1:
        assert kernels.read_ahead_bytes() > before  # the worker read some of them


def test_the_prefetch_distance_changes_no_bit(kernel_variant, variant_kernels):
    """set_stream_ahead only moves where gguf_gemm asks for weight lines: every block type's outputs,
    int16 and int8 activations, one row and a few, are the same bits at every distance (0 asks for
    the line being read; 1 MiB past the end of these weights asks for none); out of range is refused."""
    kernels = variant_kernels
    int8 = [False] + ([True] if kernels.gguf_gemm_int8_supported() else [])
    was = kernels.stream_ahead()
    try:
        for qtype in TYPES:
            k = 4096 if qtype in KQUANTS else 640
            buf, meta = pack_gguf_twin([Shard(0, qtype, random_blocks(qtype, 45, k, seed=7), k)], k)
            x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
            for i8 in int8 if qtype in KQUANTS else [False]:
                outs = []
                for ahead in (0, 2048, 4096, 1 << 20):
                    kernels.set_stream_ahead(ahead)
                    assert kernels.stream_ahead() == ahead
                    outs.append([kernels.gguf_gemm(x[:rows], buf, meta, 45, int8=i8) for rows in (1, 5)])
                for other in outs[1:]:
                    assert all(torch.equal(a, b) for a, b in zip(outs[0], other)), (qtype, i8)
        for bad in (-1, (1 << 20) + 1):
            with pytest.raises(RuntimeError, match="stream ahead: 0 to 1 MiB"):
                kernels.set_stream_ahead(bad)
    finally:
        kernels.set_stream_ahead(was)


@pytest.mark.skipif(not prepack_available(), reason="needs oneDNN bf16")
def test_engine_times_the_twins_prefetch_distance_once(kquant_model_dir, monkeypatch, tmp_path, caplog):
    """A measured start times one-row passes through the twins at each of stream_ahead.CANDIDATES, sets
    the fastest in the kernels and caches it with the kernel choice (its ms per pass beside it); the
    resolved config reports it; a second start reads it back and times nothing; with measure_kernels off
    the kernels keep the distance they had."""
    import iterserve.engine as engine_mod
    import iterserve.platform.stream_ahead as stream_ahead
    from iterserve.config import EngineConfig
    from iterserve.engine import LLMEngine

    monkeypatch.setattr(engine_mod, "load_model", _SourcesAdded(engine_mod.load_model))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernels = load_cpu_kernels()
    was = kernels.stream_ahead()
    cfg = dict(model=str(kquant_model_dir), dtype="bfloat16", kv_cache_memory="16MiB", max_num_seqs=4)
    try:
        kernels.set_stream_ahead(1000)
        with caplog.at_level(logging.INFO, logger="iterserve.platform"):
            eng = LLMEngine(EngineConfig(**cfg, measure_kernels=True))
        choice = eng.platform.kernel_choice
        assert choice.source == "measured" and set(choice.stream_ahead_ms) == set(stream_ahead.CANDIDATES)
        assert choice.stream_ahead_ms[choice.stream_ahead] == min(choice.stream_ahead_ms.values())
        assert kernels.stream_ahead() == choice.stream_ahead
        assert eng.resolved_config()["gguf_stream_ahead"] == choice.stream_ahead
        # the pass goes through the projections whose one-row step the choice gave to a twin: all 9 have
        # one, but where a layout won the one-row call (by noise, on a model this small) it runs instead
        timed = len(twin_modules(eng.model))
        assert 1 <= timed <= 9
        assert f"ask for their weights' lines {choice.stream_ahead} bytes ahead (one-row pass through {timed} " \
            in caplog.text

        def not_again(*args, **kwargs):
            raise AssertionError("timed again although the cached choice holds the distance")

        monkeypatch.setattr(stream_ahead, "time_stream_ahead", not_again)
        kernels.set_stream_ahead(1000)
        again = LLMEngine(EngineConfig(**cfg, measure_kernels=True))
        assert again.platform.kernel_choice.source == "cache"
        assert again.platform.kernel_choice.stream_ahead_ms == choice.stream_ahead_ms
        assert kernels.stream_ahead() == choice.stream_ahead
        kernels.set_stream_ahead(1000)
        off = LLMEngine(EngineConfig(**cfg, measure_kernels=False))
        assert kernels.stream_ahead() == 1000 and off.resolved_config()["gguf_stream_ahead"] == 0
        # a second model prepared on the same platform (a draft model) leaves the first one's distance
        second, _, _, src = engine_mod.load_model(str(kquant_model_dir), torch.bfloat16, "cpu",
                                                  block_types=again.platform.gguf_block_types())
        again.platform.prepare_model(second, src)
        assert kernels.stream_ahead() == 1000 and again.resolved_config()["gguf_stream_ahead"] == choice.stream_ahead
    finally:
        kernels.set_stream_ahead(was)
