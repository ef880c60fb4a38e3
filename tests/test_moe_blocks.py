"""A GGUF's quantised experts computed from the file's own blocks (platform/cpu_moe.py's
BlockSparseMoeBlock, llama.cpp's mul_mat_id), against the float path (quantization=none: gguf-py's
dequantisation of the same file into w13 / w2):

- the experts are kept as blocks only: no float expert weight is allocated, K-quant rows are read in
  place from the file's map, and the weight estimate counts their stored size;
- float32 by name: greedy tokens equal and prompt logprobs within 1e-4 (F.linear on panels of rows);
- bf16: an expert's rows above the gguf_gemm cut-over give the packed bf16 expert's numbers exactly
  (our tiled GEMM on the same bf16-rounded weights), at or below it gguf_gemm's;
- a one-token step runs only the k experts the router picked.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_convert import convert, mixed_quant, quantize_q4_k
from test_model_families import random_model

from iterserve.llm import LLM
from iterserve.memory import model_tensors, weight_bytes
from iterserve.model.loader import ModelSource
from iterserve.model.moe import SparseMoeBlock
from iterserve.model.weight_estimate import estimate_weight_bytes
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_linear import GGUF_BLOCKS, tiled_gemm_vectorised
from iterserve.platform.cpu_moe import EXPERT_TWIN_MAX_TOKENS, BlockSparseMoeBlock, CpuSparseMoeBlock
from iterserve.sampling import SamplingParams

EXPERTS, TOP_K = 8, 2


def _q4_k_experts(name: str, w: np.ndarray):
    """llama.cpp-like mix (gguf_convert.mixed_quant) with the stacked experts in Q4_K, expert by
    expert (each expert's rows quantised as a 2-d matrix of them, as llama-quantize does)."""
    if w.ndim == 3 and "_exps." in name:
        e, rows, cols = w.shape
        return quantize_q4_k(w.reshape(e * rows, cols)).reshape(e, rows, -1), QT.Q4_K
    return mixed_quant(name, w)


def write_q4_k_moe(folder):
    """A random Qwen3-MoE (rows of 256, Q4_K's block) written into `folder` as a Q4_K MoE GGUF."""
    hf = random_model("qwen3_moe", dict(num_hidden_layers=2, hidden_size=256, intermediate_size=256, head_dim=64,
                                        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=256,
                                        norm_topk_prob=True))
    return convert(hf, folder / "qwen3moe-q4_k.gguf", quant=_q4_k_experts)


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    return write_q4_k_moe(tmp_path_factory.mktemp("moe"))


def _llm(path, **kw) -> LLM:
    return LLM(str(path), kv_cache_memory="16MiB", max_num_seqs=4, measure_kernels=False, **kw)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path / "cache"))


def _moe_blocks(model) -> list[BlockSparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, BlockSparseMoeBlock)]


def test_float32_experts_from_blocks_equal_the_float_path(moe_file, caplog):
    with caplog.at_level(logging.INFO, logger="iterserve.platform"):
        blocks = _llm(moe_file, dtype="float32")
    assert "the experts of 2 mixture-of-experts layers compute from the GGUF's blocks (Q4_K)" in caplog.text
    dense = _llm(moe_file, dtype="float32", quantization="none")
    model = blocks.engine.model
    assert {f"layers.{i}.mlp.experts" for i in range(2)} <= model.block_modules
    moe = _moe_blocks(model)
    assert len(moe) == 2 and all(m.types == ["Q4_K"] for m in moe)
    assert not any("experts" in n for n, _ in model.named_parameters())  # no float expert weight at all
    assert not any(p.device.type == "meta" for p in model.parameters())
    assert model.gguf_sources == {}
    assert all(m.twin_max_tokens == 0 for m in moe)  # float32 by name: float32 panels at every step
    # in place: every expert's rows are offsets into the file map's one storage, nothing copied
    assert len({m.w13_buf.untyped_storage().data_ptr() for m in moe} | {m.w2_buf.untyped_storage().data_ptr()
                                                                        for m in moe}) == 1
    resident, mapped = weight_bytes(model_tensors(model))
    expert_bytes = 2 * EXPERTS * 3 * 256 * 256 // 256 * GGUF_BLOCKS["Q4_K"][2]
    assert expert_bytes <= mapped <= moe_file.stat().st_size
    dense_resident, _ = weight_bytes(model_tensors(dense.engine.model))
    assert dense_resident - resident >= 2 * EXPERTS * 3 * 256 * 256 * 4  # the float experts are not held
    src = ModelSource(moe_file, "gguf", "q")
    floats = estimate_weight_bytes(src, torch.float32)
    stored = estimate_weight_bytes(src, torch.float32, blocks.engine.platform.gguf_block_types())
    assert floats - stored >= 2 * EXPERTS * 3 * 256 * 256 * 4 - expert_bytes

    prompts = [list(range(5, 45)), list(range(300, 317))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    for a, b in zip(blocks.generate(prompts, params, use_tqdm=False), dense.generate(prompts, params, use_tqdm=False)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close([p[0] for p in a.prompt_logprobs[1:]], [p[0] for p in b.prompt_logprobs[1:]],
                                   rtol=0, atol=1e-4)
        torch.testing.assert_close([p[0] for p in a.logprobs], [p[0] for p in b.logprobs], rtol=0, atol=1e-4)


@torch.inference_mode()
def test_decode_step_reads_only_k_experts(moe_file, monkeypatch):
    model = _llm(moe_file, dtype="float32").engine.model
    block = _moe_blocks(model)[0]
    ran: list[int] = []
    run = BlockSparseMoeBlock.expert_forward
    monkeypatch.setattr(BlockSparseMoeBlock, "expert_forward", lambda self, e, x: ran.append(e) or run(self, e, x))
    x = torch.randn(1, block.hidden_size)
    block(x)
    assert sorted(ran) == sorted(block.gate(x)[1][0].tolist()) and len(ran) == TOP_K


@pytest.mark.skipif(not tiled_gemm_vectorised(load_cpu_kernels()), reason="our tiled bf16 GEMM (AVX512-BF16)")
@torch.inference_mode()
def test_bf16_experts_from_blocks_as_the_dense_blocks_path(moe_file):
    """bf16: many rows, the packed float expert's numbers exactly (panels rounded to bf16 as pack_bf16
    rounds gguf-py's floats, the same tiled GEMM); few rows, gguf_gemm on the expert's blocks."""
    blocks = _llm(moe_file, dtype="bfloat16", bf16_gemm="tiled", cpu_amx=False).engine.model  # (as ref's GEMM)
    floats = _llm(moe_file, dtype="float32", quantization="none").engine.model
    ours = _moe_blocks(blocks)[1]
    assert ours.twin_max_tokens == EXPERT_TWIN_MAX_TOKENS and ours.layout == "tiled"
    ref_block = floats.layers[1].mlp
    assert type(ref_block) is SparseMoeBlock
    ref = CpuSparseMoeBlock(ref_block.to(torch.bfloat16))
    x = torch.randn(EXPERT_TWIN_MAX_TOKENS + 8, ours.hidden_size).bfloat16()
    for e in range(EXPERTS):
        assert torch.equal(ours.expert_forward(e, x), ref.expert_forward(e, x))
    few = x[:3]
    k = load_cpu_kernels()
    h = k.silu_and_mul(k.gguf_gemm(few, ours.w13_buf, ours.w13_meta[5], 2 * ours.inter))
    assert torch.equal(ours.expert_forward(5, few), k.gguf_gemm(h, ours.w2_buf, ours.w2_meta[5], ours.hidden_size))


@torch.inference_mode()
def test_32_input_expert_blocks_are_repacked_per_expert():
    """Experts in a 32-input type (Q8_0: a width that is no multiple of 256) are repacked expert by
    expert into one buffer (pack_gguf_x4), each expert's offsets moved to its part: every expert's
    output is the float block's on gguf-py's dequantisation, at every row count."""
    import gguf

    from iterserve.config import ModelConfig
    from iterserve.model.gguf_file import QuantShard

    E, H, F = 4, 96, 160
    cfg = ModelConfig(vocab_size=8, hidden_size=H, intermediate_size=F, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=H, num_experts=E, num_experts_per_tok=2)
    block = SparseMoeBlock(cfg)
    torch.manual_seed(0)
    stored = []
    for rows, cols in ((F, H), (F, H), (H, F)):
        w = (0.1 * torch.randn(E * rows, cols)).numpy()
        q = torch.from_numpy(gguf.quants.quantize(w, QT.Q8_0))
        stored.append((QuantShard(0, E * rows, cols, "Q8_0", q),
                       torch.from_numpy(gguf.quants.dequantize(q.numpy(), QT.Q8_0)).reshape(E, rows, cols)))
    (gate, g), (up, u), (down, d) = stored
    block.experts.w13_weight.data = torch.cat([g, u], 1)
    block.experts.w2_weight.data = d
    block.gate.weight.data = torch.randn(E, H)
    ours = BlockSparseMoeBlock(block, gate, up, down, "float32", 4)
    assert ours.w13_meta.shape == (E, 2, 4) and len(set(ours.w13_meta[:, 0, 3].tolist())) == E
    x = torch.randn(12, H)
    torch.testing.assert_close(ours(x), block(x), rtol=1e-5, atol=1e-5)  # float32 panels: the float numbers
    few, ref = ours(x[:1]), block(x[:1])  # one row, top-2: each expert's row on gguf_gemm (quantised activations)
    assert ((few - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_grouped_expert_gemm_is_each_experts_gguf_gemm(qtype, kernel_variant, variant_kernels):
    """gguf_moe_gemm (one call a layer, llama.cpp's mul_mat_id) gives every row exactly the numbers
    gguf_gemm gives it for its expert alone: experts used in any order, empty groups, one row to
    nine, gate and up as two shards, float32 and bf16 activations, the input gathered per pair
    inside the call (rows) or before it; native and AVX2 builds."""
    from test_kquant import random_blocks

    from iterserve.model.gguf_file import QuantShard
    from iterserve.platform.cpu_linear import pack_gguf_twin
    from iterserve.platform.cpu_moe import ExpertShard, _stack_experts

    kernels = variant_kernels
    E, F, H = 6, 40, 256
    gate, up = (QuantShard(0, E * F, H, qtype, torch.from_numpy(random_blocks(qtype, E * F, H, seed=s)))
                for s in (1, 2))
    buf, meta = _stack_experts([pack_gguf_twin([ExpertShard(gate, e, F, 0), ExpertShard(up, e, F, F)], H)
                                for e in range(E)])
    counts = [3, 1, 0, 9, 2]
    experts = torch.tensor([4, 0, 2, 5, 1])
    offsets = torch.tensor([0, *np.cumsum(counts)])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(sum(counts), H).to(dtype)
        got = kernels.gguf_moe_gemm(x, buf, meta, experts, offsets, 2 * F)
        for e, a, b in zip(experts.tolist(), offsets[:-1].tolist(), offsets[1:].tolist()):
            if b > a:
                assert torch.equal(got[a:b], kernels.gguf_gemm(x[a:b], buf, meta[e], 2 * F)), (qtype, dtype, e)
        gather = torch.randint(0, 4, (sum(counts),))  # the rows of a 4-token step, per pair
        base = torch.randn(4, H).to(dtype)
        assert torch.equal(kernels.gguf_moe_gemm(base, buf, meta, experts, offsets, 2 * F, gather),
                           kernels.gguf_moe_gemm(base[gather], buf, meta, experts, offsets, 2 * F))
    gather[0] = 4
    with pytest.raises(RuntimeError, match="row 4 not in 0..3"):
        kernels.gguf_moe_gemm(base, buf, meta, experts, offsets, 2 * F, gather)
    with pytest.raises(RuntimeError, match="expert 6 not in 0..5"):
        kernels.gguf_moe_gemm(x, buf, meta, torch.tensor([6]), torch.tensor([0, 15]), 2 * F)
    with pytest.raises(RuntimeError, match="offsets must run from 0"):
        kernels.gguf_moe_gemm(x, buf, meta, torch.tensor([1]), torch.tensor([0, 14]), 2 * F)
    with pytest.raises(RuntimeError, match="N is 7"):
        kernels.gguf_moe_gemm(x, buf, meta, experts, offsets, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_grouped_experts_give_the_per_expert_numbers(moe_file, dtype, monkeypatch):
    """A MoE layer's few-row experts in one gguf_moe_gemm per weight, many-row ones on blocks_gemm:
    the layer's output is bit-equal to running every expert alone (SparseMoeBlock's loop) for a
    decode row, a 16-row step where some experts take more rows than the cut-over, and a prefill-size
    chunk; a decode row's grouped call gets exactly the k experts the router picked."""
    if dtype == torch.bfloat16:
        block = _moe_blocks(_llm(moe_file, dtype="bfloat16", bf16_gemm="tiled").engine.model)[0]
        assert block.twin_max_tokens == EXPERT_TWIN_MAX_TOKENS
    else:  # float32 by name runs no gguf_gemm; an AVX2 host's auto float32 does
        block = _moe_blocks(_llm(moe_file, dtype="float32").engine.model)[0]
    block.twin_max_tokens = 4  # a 16-row step then has experts on both paths
    torch.manual_seed(3)
    for rows in (1, 16, 40):
        x = torch.randn(rows, block.hidden_size).to(dtype)
        assert torch.equal(block(x), _looped(block, x)), rows
    seen: list[list[int]] = []
    grouped = BlockSparseMoeBlock._grouped
    monkeypatch.setattr(BlockSparseMoeBlock, "_grouped",
                        lambda self, x, tok, ex, c: seen.append(ex.tolist()) or grouped(self, x, tok, ex, c))
    x = torch.randn(1, block.hidden_size).to(dtype)
    block(x)
    assert seen == [sorted(block.gate(x)[1][0].tolist())]


def _looped(block: BlockSparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The block's output with every expert run alone (SparseMoeBlock.experts_forward's loop)."""
    orig = type(block).experts_forward
    try:
        type(block).experts_forward = SparseMoeBlock.experts_forward
        return block(x)
    finally:
        type(block).experts_forward = orig


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_kernel_is_transformers_expert_by_expert_sum(dtype, variant_kernels):
    """moe_combine gives SparseMoeBlock.combine's bits (one index_add_ per expert, as transformers):
    a decode row's k pairs and a prefill-sized step (the pool splits columns), router weights in
    float32 or the activations' dtype, a width that is no multiple of the vector."""
    g = torch.Generator().manual_seed(5)
    block = SparseMoeBlock.__new__(SparseMoeBlock)
    for T, k, E, H in ((1, 8, 40, 1536), (300, 4, 16, 200)):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        flat = ids.t().reshape(-1)
        order = torch.argsort(flat, stable=True)
        _, counts = torch.unique_consecutive(flat[order], return_counts=True)
        tokens = order % T
        h = torch.randn(T * k, H, generator=g).to(dtype)
        for w in (torch.rand(T * k, generator=g), torch.rand(T * k, generator=g).to(dtype)):
            want = SparseMoeBlock.combine(block, h, w, tokens, counts, T)
            assert torch.equal(variant_kernels.moe_combine(h, w, tokens, T), want), (T, w.dtype)
    bad = tokens.clone()
    bad[7] = T
    with pytest.raises(RuntimeError, match="token 300 not in 0..299"):
        variant_kernels.moe_combine(h, w, bad, T)
