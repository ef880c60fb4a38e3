"""A GGUF's quantised weights kept only as their blocks (one copy of the weights).

- csrc/gguf_dequant.cpp reads any row of a projection's blocks back as gguf-py dequantises it, bit
  for bit, as float32, as bf16 (rounded as a float copy cast to bf16 is) and as bf16_gemm's tiles.
- A step of many rows from the blocks (blocks_gemm: a panel of rows dequantised at a time) computes
  what the same layout computed from a float copy: bit for bit on our tiled GEMM, within float32's
  rounding on F.linear (a BLAS may block a panel's rows otherwise than the whole weight's).
- The engine, given a quantised GGUF (llama, tied head, Q4_K + Q8_0), allocates no float weight for
  a quantised module: the projections, the LM head and the embedding compute from the file's
  blocks. Echoed prompt logprobs (every step of many rows) equal a float copy's (quantization=none)
  exactly in bf16 on our tiled GEMM, and in a float32 run asked for by name every step is float32
  from gguf-py's numbers: greedy tokens as the float copy's, prompt logprobs within 1e-4.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_convert import convert, mixed_quant, quantize_q4_k
from test_model_families import random_model
from torch import nn

from iterserve.llm import LLM
from iterserve.memory import model_tensors, weight_bytes
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_linear import (GGUF_AMX, GGUF_INT8, GGUF_INT8_AMX, INVARIANT_FLOAT32, BlockEmbedding, CpuLinear, dequantize_gguf_twin,
                                           pack_bf16, pack_gguf_twin, prepack_available, random_shards, shard_span,
                                           tiled_gemm_vectorised)
from iterserve.sampling import SamplingParams

SPECS = ["q4_k:48", "q5_k:40", "q6_k:33", "q8_0:20", "q4_0:17", "q4_1:16", "q5_0:9", "q5_1:31",
         "q4_k:32+q6_k:16+q8_0:8"]

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="needs iterserve's CPU kernels")


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("k", [256, 512, 160])
def test_dequant_is_gguf_py_bit_for_bit(spec, k, kernel_variant, variant_kernels):
    """On the native build and the AVX2 one (no ISA branches in gguf_dequant.cpp, but each build
    vectorises its loops its own way: no fused multiply-add may creep in on either)."""
    if k % 256 and "_k" in spec:
        pytest.skip("K-quant blocks span 256 inputs")
    kernels = variant_kernels
    buf, meta = pack_gguf_twin(random_shards(spec, k), k)
    ref = dequantize_gguf_twin(buf, meta, k)  # == gguf-py's dequantisation (tests/test_kquant.py)
    rows = torch.randperm(ref.shape[0], generator=torch.Generator().manual_seed(0))
    assert torch.equal(kernels.gguf_dequant(buf, meta, k, rows), ref[rows])
    assert torch.equal(kernels.gguf_dequant(buf, meta, k, rows, True), ref[rows].bfloat16())
    tiles = kernels.gguf_dequant(buf, meta, k, torch.arange(ref.shape[0]), True, True)
    assert torch.equal(tiles, pack_bf16(ref.bfloat16()))


def test_dequant_refuses_rows_outside_the_weight():
    buf, meta = pack_gguf_twin(random_shards("q4_k:16", 256), 256)
    with pytest.raises(RuntimeError, match="row 16 outside the 16 rows"):
        load_cpu_kernels().gguf_dequant(buf, meta, 256, torch.tensor([16]))


LAYOUTS = [pytest.param("tiled", marks=pytest.mark.skipif(not tiled_gemm_vectorised(load_cpu_kernels()),
                                                          reason="our tiled GEMM needs AVX512-BF16")),
           pytest.param("onednn", marks=pytest.mark.skipif(not prepack_available(), reason="needs oneDNN bf16")),
           "float32", INVARIANT_FLOAT32]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_many_rows_from_the_blocks_compute_what_the_float_copy_did(layout, monkeypatch):
    import iterserve.platform.cpu_linear as cl

    monkeypatch.setattr(cl, "PANEL_BYTES", 64 * 512 * 2)  # several panels, the last one short
    k, spec = 512, "q4_k:200+q6_k:72+q8_0:40"
    buf, meta = pack_gguf_twin(random_shards(spec, k), k)
    weight = dequantize_gguf_twin(buf, meta, k)
    dtype = torch.float32 if layout in ("float32", INVARIANT_FLOAT32) else torch.bfloat16
    lin = nn.Linear(k, weight.shape[0], bias=False)
    lin.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    dense = CpuLinear(lin, layout=layout)
    meta_lin = nn.Linear(k, weight.shape[0], bias=False, device="meta", dtype=dtype)
    blocks = CpuLinear(meta_lin, twin_max_tokens=4, layout=layout, blocks=(buf, meta))
    assert blocks.packed_weight.numel() == 0 and blocks.weight is None  # the blocks are the only copy
    x = torch.randn(37, k).to(dtype)
    if layout == "onednn":  # oneDNN's prepacked and plain bf16 weights: the same GEMM, maybe another order
        torch.testing.assert_close(blocks(x), dense(x), rtol=1e-2, atol=1e-2)
    elif layout == "float32":  # F.linear on a panel of rows: the BLAS may block a smaller N otherwise
        torch.testing.assert_close(blocks(x), dense(x), rtol=1e-5, atol=1e-5)
    else:  # our tiled GEMM (each tile of 16 outputs alone) and f32_gemm (each output alone): panels change nothing
        assert torch.equal(blocks(x), dense(x))
    few = x[:3]  # at most twin_max_tokens rows: gguf_gemm on the blocks
    assert torch.equal(blocks(few), load_cpu_kernels().gguf_gemm(few, buf, meta, weight.shape[0]))


@pytest.fixture(scope="module")
def q4_k_file(tmp_path_factory):
    """A random llama (tied head) as llama.cpp would quantise it: Q4_K projections, Q8_0 v rows and
    embedding."""
    hf = random_model("llama", dict(num_hidden_layers=2, hidden_size=256, intermediate_size=256, head_dim=64,
                                    tie_word_embeddings=True))
    return convert(hf, tmp_path_factory.mktemp("blocks") / "llama-q.gguf", quant=mixed_quant)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), kv_cache_memory="16MiB", max_num_seqs=4, measure_kernels=False, **kw)


def _weight_bytes(model: nn.Module) -> int:
    seen = {}
    for t in [*model.parameters(), *model.buffers(), *(m.packed_weight for m in model.modules()
                                                       if isinstance(m, CpuLinear))]:
        if t.device.type == "cpu" and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=pytest.mark.skipif(
    not tiled_gemm_vectorised(load_cpu_kernels()), reason="the bf16 comparison runs our tiled GEMM (AVX512-BF16)")),
    "float32"])
def test_engine_keeps_only_the_blocks(q4_k_file, dtype, monkeypatch, tmp_path):
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    kw = dict(dtype=dtype, **({"bf16_gemm": "tiled"} if dtype == "bfloat16" else {}))
    blocks, dense = _llm(q4_k_file, **kw), _llm(q4_k_file, quantization="none", **kw)
    model = blocks.engine.model
    assert model.block_modules == {"embed_tokens", "lm_head"} | {
        f"layers.{i}.{m}" for i in range(2) for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                      "mlp.down_proj")}
    assert isinstance(model.embed_tokens, BlockEmbedding) and model.lm_head.from_blocks
    assert model.lm_head.twin_weight is model.embed_tokens.buf  # the tied head reads the embedding's blocks
    assert model.embed_tokens.mapped is None  # which the head reads whole each step: it stays mapped
    assert not any(p.device.type == "meta" for p in model.parameters())  # every meta weight was replaced
    assert model.gguf_sources == {}
    assert not any(isinstance(m, nn.Linear | nn.Embedding) for m in model.modules())
    resident, mapped = weight_bytes(model_tensors(model))  # private copies; the file's map, read in place
    assert resident < 0.45 * _weight_bytes(dense.engine.model)
    assert 0 < mapped <= q4_k_file.stat().st_size  # the modules of K-quants alone (o, gate/up, down)
    few = max(m.twin_max_tokens for m in model.modules() if isinstance(m, CpuLinear))
    assert few == (0 if dtype == "float32" else 4)  # float32 by name: float32 at every step

    prompts = [list(range(5, 45)), list(range(300, 317))]  # more rows than the twins take
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    ours = blocks.generate(prompts, params, use_tqdm=False)
    ref = dense.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, ref):
        if dtype == "float32":  # (F.linear by panels of rows: the BLAS may block them otherwise, ~1e-7)
            assert a.token_ids == b.token_ids
            torch.testing.assert_close([p[0] for p in a.prompt_logprobs[1:]], [p[0] for p in b.prompt_logprobs[1:]],
                                       rtol=0, atol=1e-4)
        else:  # our tiled GEMM, tile by tile: the float copy's numbers exactly
            assert a.prompt_logprobs == b.prompt_logprobs


def _pages_mapped(address: int, length: int) -> int:
    """How many of the 4 KiB pages in [address, address + length) this process maps (/proc/self/pagemap's
    present bit)."""
    first, n = address // 4096, -(-(address + length) // 4096) - address // 4096
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read(n * 8)
    return sum(int.from_bytes(entries[8 * i:8 * i + 8], "little") >> 63 for i in range(n))


def _q4_k_everywhere(name, w):
    """Every matrix Q4_K (the rows here are 256 long): every module reads the file's map in place."""
    return (quantize_q4_k(w), QT.Q4_K) if w.ndim == 2 else None


@pytest.fixture(scope="module")
def q4_k_only_file(tmp_path_factory):
    """A random llama, GQA, whose Q/K rows llama.cpp's converter permutes, all in K-quants."""
    hf = random_model("llama", dict(num_hidden_layers=2, hidden_size=256, intermediate_size=256, head_dim=64,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    return convert(hf, tmp_path_factory.mktemp("mapped") / "llama-q4k.gguf", quant=_q4_k_everywhere)


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=pytest.mark.skipif(
    not tiled_gemm_vectorised(load_cpu_kernels()), reason="the bf16 comparison runs our tiled GEMM (AVX512-BF16)")),
    "float32"])
def test_k_quant_blocks_are_read_in_place_from_the_file(q4_k_only_file, dtype, monkeypatch, tmp_path):
    """A file of K-quants: every module's blocks are the file's own pages (one storage, the map; a
    second process serving the file shares them), Q/K rows left in llama.cpp's permuted order and
    the outputs gathered back, with the numbers of the float copy of the same blocks."""
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    # int16 activations: the bound below is theirs (auto's int8 ones are llama.cpp's, ~10x further off)
    kw = dict(dtype=dtype, gguf_activations="int16", **({"bf16_gemm": "tiled"} if dtype == "bfloat16" else {}))
    blocks, dense = _llm(q4_k_only_file, **kw), _llm(q4_k_only_file, quantization="none", **kw)
    model = blocks.engine.model
    linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
    storages = {m.twin_weight.untyped_storage().data_ptr() for m in linears} | {
        model.embed_tokens.buf.untyped_storage().data_ptr()}
    assert len(storages) == 1  # one storage: the file's map
    assert model.embed_tokens.buf.numel() == q4_k_only_file.stat().st_size
    ordered = {n for n, m in model.named_modules() if isinstance(m, CpuLinear) and m.out_order is not None}
    assert ordered == {f"layers.{i}.self_attn.qkv_proj" for i in range(2)}  # Q and K rows as the file has them
    resident, mapped = weight_bytes(model_tensors(model))
    assert mapped == q4_k_only_file.stat().st_size and resident < 0.05 * mapped  # norms and tables alone

    prompts = [list(range(5, 45)), list(range(300, 303))]  # many rows (panels), few rows (gguf_gemm)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    ours, ref = blocks.generate(prompts, params, use_tqdm=False), dense.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, ref):
        if dtype == "float32":
            assert a.token_ids == b.token_ids
            torch.testing.assert_close([p[0] for p in a.prompt_logprobs[1:]], [p[0] for p in b.prompt_logprobs[1:]],
                                       rtol=0, atol=1e-4)
        else:  # tiled panels: the float copy's numbers exactly; the decode rows ran gguf_gemm on the map
            assert a.prompt_logprobs == b.prompt_logprobs
    if dtype == "bfloat16":  # every module's blocks in one map: each read-ahead names its own bytes in it
        chained = [m for m in linears if m.read_next is not None]
        assert len({m.read_next.data_ptr() for m in chained}) == len(chained) > 1
    # the untied embedding's table is unmapped after each lookup (the page cache keeps it); the
    # projections' pages, read each step, stay mapped
    address, length = model.embed_tokens.mapped
    table = shard_span(model.embed_tokens.buf, model.embed_tokens.meta)
    assert table.data_ptr() <= address and address + length <= table.data_ptr() + table.numel() and length > 0
    assert _pages_mapped(address, length) == 0
    down = model.layers[0].mlp.down_proj
    start = down.twin_weight.data_ptr() + int(down.twin_scales[0, 3])
    assert _pages_mapped(start, 4096) == -(-(start + 4096) // 4096) - start // 4096  # every page it spans
    if dtype == "bfloat16":  # gguf_gemm on the map and the gather, against the gather of the copy's rows
        qkv = model.layers[0].self_attn.qkv_proj
        x = torch.randn(2, 256).to(torch.bfloat16)
        torch.testing.assert_close(qkv(x).float(), dense.engine.model.layers[0].self_attn.qkv_proj(x).float(),
                                   rtol=2e-2, atol=2e-2)


def test_forced_bf16w_warns_of_no_rounding_for_blocks(q4_k_file, monkeypatch, tmp_path, caplog):
    """--bf16-gemm bf16w on a float32 run: the modules kept as blocks compute from float32 panels, so
    the warning that weights are rounded to bf16 names none of them (it counts dense shapes only)."""
    import logging

    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="iterserve.platform"):
        llm = _llm(q4_k_file, dtype="float32", bf16_gemm="bf16w")
    assert llm.engine.model.block_modules and "rounded to bf16" not in caplog.text


@pytest.mark.skipif(not (load_cpu_kernels() and load_cpu_kernels().gguf_gemm_int8_supported()),
                    reason="gguf_gemm's int8 activations need the AVX2 build")
def test_int8_activations_run_the_k_quant_modules_and_nothing_else(q4_k_only_file, monkeypatch, tmp_path):
    """--gguf-activations int8: every module whose blocks are K-quants tells gguf_gemm int8 (each within
    int8's error of the int16 module; the kernel's numbers are checked in test_kquant.py), a run takes
    that path, the resolved config says so; refused with the reason where no step would read K-quant
    blocks on gguf_gemm."""
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    int8, int16 = _llm(q4_k_only_file, gguf_activations="int8"), _llm(q4_k_only_file, gguf_activations="int16")
    mods = [m for m in int8.engine.model.modules() if isinstance(m, CpuLinear)]
    amx = int8.engine.platform.int8_amx  # steps of 16+ rows on AMX-INT8 tiles where lent (test_kquant.py)
    assert mods and all(m.op_twin == (GGUF_INT8_AMX if amx else GGUF_INT8) for m in mods)
    on16 = GGUF_AMX if int16.engine.platform.int16_amx else "gguf"  # 16+ rows on AMX-INT8 tiles where lent
    assert all(m.op_twin == on16 for m in int16.engine.model.modules() if isinstance(m, CpuLinear))
    assert int8.engine.platform.resolved()["gguf_activations"] == "int8"
    x = torch.randn(3, 256)
    for m8, m16 in zip(mods, (m for m in int16.engine.model.modules() if isinstance(m, CpuLinear))):
        y8, y16 = m8(x), m16(x)  # few rows: gguf_gemm, int8 and int16 activations
        assert not torch.equal(y8, y16)
        assert (y8 - y16).abs().max() <= 0.03 * y16.abs().max()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    prompts = [list(range(300, 303)), list(range(7, 12))]
    a, b = int8.generate(prompts, params, use_tqdm=False), int16.generate(prompts, params, use_tqdm=False)
    for x8, x16 in zip(a, b):  # a random model's logits are large (logprobs near -60): no closeness asked here
        assert len(x8.token_ids) == 4 and x8.prompt_logprobs[1:] != x16.prompt_logprobs[1:]
    with pytest.raises(ValueError, match="gguf_activations=int8 applies to a GGUF's K-quant blocks"):
        _llm(q4_k_only_file, gguf_activations="int8", dtype="float32")  # float32 by name: no gguf_gemm
    with pytest.raises(ValueError, match="gguf_activations must be one of auto, int16, int8, int8-except-down"):
        _llm(q4_k_only_file, gguf_activations="int4")
    with pytest.raises(ValueError, match="gguf_activations=int8 is not batch-invariant"):
        _llm(q4_k_only_file, gguf_activations="int8", batch_invariant=True)


@pytest.mark.skipif(not (load_cpu_kernels() and load_cpu_kernels().gguf_gemm_int8_supported()),
                    reason="gguf_gemm's int8 activations need the AVX2 build")
def test_int8_except_down_keeps_the_down_projections_on_int16(q4_k_only_file, monkeypatch, tmp_path):
    """--gguf-activations int8-except-down: every K-quant module on int8 but the MLP's down projections,
    which compute as the int16 run's do (same bits; where AMX-INT8 is lent, their steps of 16+ rows on
    its tiles in both runs), a run takes both paths, the resolved config says so; refused with
    --batch-invariant like int8."""
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    mixed, int16 = _llm(q4_k_only_file, gguf_activations="int8-except-down"), _llm(q4_k_only_file, gguf_activations="int16")
    mods = {n: m for n, m in mixed.engine.model.named_modules() if isinstance(m, CpuLinear)}
    plain = {n: m for n, m in int16.engine.model.named_modules() if isinstance(m, CpuLinear)}
    down = [n for n in mods if n.endswith("mlp.down_proj")]
    assert down and len(down) < len(mods)
    on16 = GGUF_AMX if mixed.engine.platform.int16_amx else "gguf"  # 16+ rows on AMX-INT8 tiles where lent
    assert all((m.op_twin == on16) == (n in down) for n, m in mods.items())
    int8_op = GGUF_INT8_AMX if mixed.engine.platform.int8_amx else GGUF_INT8
    assert all((m.op_twin == int8_op) == (n not in down) for n, m in mods.items())
    assert mixed.engine.platform.resolved()["gguf_activations"] == "int8-except-down"
    x = torch.randn(3, 256)
    for n in down:
        assert torch.equal(mods[n](x), plain[n](x))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    out = mixed.generate([list(range(300, 303))], params, use_tqdm=False)[0]
    ref = int16.generate([list(range(300, 303))], params, use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and out.prompt_logprobs[1:] != ref.prompt_logprobs[1:]
    with pytest.raises(ValueError, match="gguf_activations=int8-except-down is not batch-invariant"):
        _llm(q4_k_only_file, gguf_activations="int8-except-down", batch_invariant=True)


def test_auto_activations_are_int8_except_down_where_the_int8_kernel_is_built(q4_k_only_file, monkeypatch,
                                                                              tmp_path):
    """--gguf-activations auto (the default): int8-except-down where the int8 kernel is built and K-quant
    blocks run on gguf_gemm, on hosts with and without AVX-512 alike; int16 under --batch-invariant and
    with --dtype float32 asked for by name; the resolved config names the choice. The host is faked
    both ways, so both run on any x86 host the int8 kernel builds on."""
    kernels = load_cpu_kernels()
    if not (kernels and kernels.gguf_gemm_int8_supported()):
        pytest.skip("gguf_gemm's int8 activations need the AVX2 build")
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("ITERSERVE_GGUF_ACTIVATIONS", raising=False)
    from iterserve.platform import cpu as cpu_platform
    flags = cpu_platform.cpu_flags() - {"avx512f"}
    monkeypatch.setattr(cpu_platform, "cpu_flags", lambda: flags)  # a Zen 3 / Intel desktop host
    auto = _llm(q4_k_only_file)
    assert auto.engine.config.gguf_activations == "auto"
    assert auto.engine.platform.resolved()["gguf_activations"] == "int8-except-down"
    mods = {n: m for n, m in auto.engine.model.named_modules() if isinstance(m, CpuLinear)}
    assert all((m.op_twin in ("gguf", GGUF_AMX)) == n.endswith("mlp.down_proj") for n, m in mods.items())
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:  # (float32 batch-invariant runs from the blocks)
        invariant = _llm(q4_k_only_file, batch_invariant=True)
        assert invariant.engine.platform.resolved()["gguf_activations"] in ("int16", None)
        assert all(m.op_twin not in (GGUF_INT8, GGUF_INT8_AMX) for m in invariant.engine.model.modules() if isinstance(m, CpuLinear))
    exact = _llm(q4_k_only_file, dtype="float32")  # float32 by name: gguf-py's numbers, no int8
    assert all(m.op_twin not in (GGUF_INT8, GGUF_INT8_AMX) for m in exact.engine.model.modules() if isinstance(m, CpuLinear))
    monkeypatch.setattr(cpu_platform, "cpu_flags", lambda: flags | {"avx512f"})  # an AVX-512 host
    wide = _llm(q4_k_only_file)
    assert wide.engine.platform.resolved()["gguf_activations"] == "int8-except-down"
    wide_mods = {n: m for n, m in wide.engine.model.named_modules() if isinstance(m, CpuLinear)}
    assert all((m.op_twin in ("gguf", GGUF_AMX)) == n.endswith("mlp.down_proj") for n, m in wide_mods.items())
