"""The experts of a mixture-of-experts layer (model/moe.py) on iterserve's tiled bf16 GEMM in CPU bf16 runs.

torch's bf16 F.linear on a CPU without oneDNN's prepacked weight runs a one-row step at a fraction
of memory speed: 8 experts of a [1024 x 2048 + 512 x 1024] shape took 120 ms a decode row on the
Zen 5 host, the tiled GEMM 1.9 ms from the same numbers (bit-equal outputs: it rounds once per
output, as torch's does). So each expert's w13 and w2 are packed once (pack_bf16) into one stacked
buffer each, the plain weights dropped (no second copy), and the SiLU-and-multiply runs as one kernel
(csrc/elementwise.cpp) as CpuMLP's. The router stays torch's F.linear: its numerics decide which
experts run, and transformers computes it so.

A GGUF's quantised experts (the loader's block modules "layers.N.mlp.experts": w13 / w2 left on the
meta device) compute from the file's own blocks instead, llama.cpp's mul_mat_id: `BlockSparseMoeBlock`
runs the experts with few rows (every one in a decode step) through one gguf_moe_gemm call for gate
and up (one two-shard weight) and one for down, the layer's experts at once, and each expert with
many rows (prefill) through a panel of dequantised rows and the layout's GEMM (blocks_gemm). Expert e's rows are rows e*F .. (e+1)*F of the stacked tensor, so its
(buf, meta) is offsets into the one storage of the file's map (K-quants; no copy), as a dense
projection's in-place blocks are.
"""
from __future__ import annotations

import torch
from torch import nn

from iterserve.memory import empty_in_large_pages
from iterserve.model.moe import SparseMoeBlock, TopKRouter
from iterserve.platform.base import replace_module
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_linear import blocks_gemm, pack_bf16, pack_gguf_twin, tiled_gemm_vectorised


class CpuTopKRouter(TopKRouter):
    """The router's logits on one of our GEMMs, which compute each row alike at every step size
    (what --batch-invariant needs of every op): bf16 on the tiled GEMM from a packed weight, where
    torch's bf16 F.linear took ~130 us a decode row at Granite-3B-A800M's shape [40 x 1536] (oneDNN
    per call) and the tiled GEMM a few, with the same bits (one float32 sum rounded once:
    tests/test_moe.py checks the layer's output); float32 on f32_gemm (batch_invariant only: MKL's
    F.linear is as fast there and is transformers' own arithmetic)."""

    def __init__(self, router: TopKRouter) -> None:
        nn.Module.__init__(self)
        self.__dict__.update(router.__dict__)
        w = router.weight.detach()
        self._parameters, self._buffers = {}, {}
        self.num_experts, self.bf16 = w.shape[0], w.dtype == torch.bfloat16
        self.register_buffer("w", pack_bf16(w) if self.bf16 else w.float().contiguous(), persistent=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16:
            return load_cpu_kernels().bf16_gemm(x, self.w, self.num_experts, 0)
        return load_cpu_kernels().f32_gemm(x, self.w)


def cpu_router(router: TopKRouter, invariant: bool = False) -> TopKRouter:
    """CpuTopKRouter for a bf16 router whose widths the packing takes (even), or under batch_invariant
    a float32 one; else the router itself (refused under batch_invariant: its rows would not be alike)."""
    w = router.weight
    even = not (w.shape[0] % 2 or w.shape[1] % 2)
    if w.dtype == torch.bfloat16 and even and tiled_gemm_vectorised(load_cpu_kernels()):
        return CpuTopKRouter(router)
    if invariant and w.dtype == torch.float32:
        return CpuTopKRouter(router)
    if invariant:
        raise ValueError(f"batch_invariant: this MoE router ({w.dtype}, {tuple(w.shape)}) has no fixed-order GEMM here "
                         "(bf16 needs even widths and the tiled bf16 GEMM)")
    return router


class CpuCombine:
    """SparseMoeBlock.combine as one kernel (csrc/elementwise.cpp moe_combine): torch's index_add_
    of one bf16 decode row cost ~60 us (an OpenMP wake-up), k of them a layer; the same bits (each
    add rounded to the activations' dtype, in pair order: transformers' expert by expert)."""

    def combine(self, h: torch.Tensor, pair_weights: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor,
                T: int) -> torch.Tensor:
        return load_cpu_kernels().moe_combine(h, pair_weights, tokens, T)


def _expert_tiles(weights: torch.Tensor) -> torch.Tensor:
    """[E, N, K] expert weights -> [E, ...] pack_bf16 tiles, one expert at a time into one tensor in
    2 MiB pages (read every step; torch.stack of the packed list held every expert twice at load)."""
    first = pack_bf16(weights[0])
    out = empty_in_large_pages((weights.shape[0], *first.shape), first.dtype)
    out[0] = first
    for e in range(1, weights.shape[0]):
        out[e] = pack_bf16(weights[e])
    return out


class CpuSparseMoeBlock(CpuCombine, SparseMoeBlock):
    """A SparseMoeBlock whose experts run on the tiled bf16 GEMM from packed weights; shares the
    router and settings of the block it replaces."""

    def __init__(self, block: SparseMoeBlock) -> None:
        nn.Module.__init__(self)
        self.__dict__.update(block.__dict__)
        self._modules = {"gate": cpu_router(block.gate)}  # the plain expert weights are not kept
        w13, w2 = block.experts.w13_weight.detach(), block.experts.w2_weight.detach()
        self.hidden_size = w2.shape[1]
        self.register_buffer("w13_tiles", _expert_tiles(w13), persistent=False)
        self.register_buffer("w2_tiles", _expert_tiles(w2), persistent=False)
        self.silu = block.act is torch.nn.functional.silu

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        kernels = load_cpu_kernels()
        gate_up = kernels.bf16_gemm(x, self.w13_tiles[e], 2 * self.inter, 0)
        if self.silu:
            h = kernels.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.inter, dim=-1)
            h = self.act(gate) * up
        return kernels.bf16_gemm(h, self.w2_tiles[e], self.hidden_size, 0)


class FixedF32SparseMoeBlock(CpuCombine, SparseMoeBlock):
    """A float32 SparseMoeBlock for --batch-invariant: its experts and router on f32_gemm, each
    output's sum in one order whatever the expert's or the step's rows (F.linear's MKL blocks by
    rows); float32 weights kept as they are."""

    def __init__(self, block: SparseMoeBlock) -> None:
        nn.Module.__init__(self)
        self.__dict__.update(block.__dict__)
        self._modules = {"gate": cpu_router(block.gate, invariant=True), "experts": block.experts}

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        kernels = load_cpu_kernels()
        gate, up = kernels.f32_gemm(x, self.experts.w13_weight[e]).split(self.inter, dim=-1)
        return kernels.f32_gemm(self.act(gate) * up, self.experts.w2_weight[e])


def use_invariant_moe(model: nn.Module) -> int:
    """--batch-invariant on a mixture-of-experts model: every MoE block's router on a fixed-order GEMM
    (cpu_router), a float32 block's experts on f32_gemm (FixedF32SparseMoeBlock). The rest is
    alike already: bf16 experts run the tiled GEMM (CpuSparseMoeBlock, or blocks_gemm's panels at
    every step), a GGUF's float32 experts gguf_gemm at every step or f32_gemm panels, and a token's
    outputs are summed in expert order whatever else the step holds. Returns the blocks changed."""
    changed = 0
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, SparseMoeBlock):
            continue
        if type(mod) is SparseMoeBlock:
            if mod.experts.w13_weight.dtype != torch.float32:
                raise ValueError("batch_invariant: a bf16 MoE block was left off the tiled GEMM (odd widths?)")
            replace_module(model, name, FixedF32SparseMoeBlock(mod))
        elif not isinstance(mod.gate, CpuTopKRouter):
            mod._modules["gate"] = cpu_router(mod.gate, invariant=True)
        changed += 1
    return changed


def use_cpu_moe(model: nn.Module) -> int:
    """Swaps every bf16 SparseMoeBlock whose widths the packing takes (even) for CpuSparseMoeBlock
    (the kernels must have loaded, with the tiled GEMM vectorised); returns how many changed."""
    changed = 0
    for name, mod in list(model.named_modules()):
        if type(mod) is not SparseMoeBlock or mod.experts.w13_weight.dtype != torch.bfloat16:
            continue
        if mod.experts.w13_weight.device.type == "meta":
            continue  # kept as the GGUF's blocks: use_moe_blocks
        if mod.experts.w13_weight.shape[2] % 2 or mod.inter % 2:
            continue
        replace_module(model, name, CpuSparseMoeBlock(mod))
        changed += 1
    return changed


# Rows of one expert up to which gguf_gemm on its blocks beats blocks_gemm (a dequantised panel and the
# tiled GEMM): 16 at Granite-3B-A800M's expert [1024 x 1536] on the Zen 5 host (46 vs 596 us at 1
# row, 206 vs 488 at 8, even at 16; docs/profile.md). A dense projection's cut-over is lower (4):
# there the alternative is a float weight already laid out, here a panel dequantised every step.
EXPERT_TWIN_MAX_TOKENS = 16


class ExpertShard:
    """One expert's rows of a stacked GGUF expert tensor, as cpu_linear's shard functions read shards
    (a QuantShard's fields): `data` a view of the loader's shard, so in place where that is."""

    def __init__(self, stacked, expert: int, rows: int, row_start: int) -> None:
        self.row_start, self.rows, self.cols, self.qtype = row_start, rows, stacked.cols, stacked.qtype
        self.data = stacked.data[expert * rows:(expert + 1) * rows]


def _stack_experts(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert (buf, meta) from pack_gguf_twin -> one buf and meta [E, S, 4]: in place, every buf is
    the file map's one storage and is kept once; copied (32-input types, repacked), the bufs are
    joined and each expert's offsets moved by where its buf starts."""
    bufs, metas = [b for b, _ in pairs], [m for _, m in pairs]
    whole = all(b.storage_offset() == 0 and b.numel() == b.untyped_storage().nbytes() for b in bufs)
    if whole and len({b.untyped_storage().data_ptr() for b in bufs}) == 1:
        return bufs[0], torch.stack(metas).contiguous()
    starts = torch.tensor([0] + [b.numel() for b in bufs[:-1]]).cumsum(0)
    metas = [m.clone() for m in metas]
    for m, start in zip(metas, starts.tolist()):
        m[:, 3] += start
    joined = empty_in_large_pages((sum(b.numel() for b in bufs),), torch.uint8)  # read every step: 2 MiB pages
    return torch.cat(bufs, out=joined), torch.stack(metas).contiguous()


class BlockSparseMoeBlock(CpuCombine, SparseMoeBlock):
    """A SparseMoeBlock whose experts compute from the GGUF's blocks, their only copy (llama.cpp's
    mul_mat_id): steps of at most `twin_max_tokens` rows for an expert run gguf_gemm on its blocks,
    larger ones blocks_gemm in `layout` (float32 panels in a float32 run: gguf-py's numbers, so the
    float path's results). Shares the router and settings of the block it replaces."""

    def __init__(self, block: SparseMoeBlock, gate: object, up: object, down: object, layout: str,
                 twin_max_tokens: int, amx_min_rows: int = 0) -> None:
        nn.Module.__init__(self)
        self.__dict__.update(block.__dict__)
        self._modules = {"gate": cpu_router(block.gate)}  # the meta expert parameters go
        E, F, H = self.num_experts, self.inter, int(gate.cols)
        self.hidden_size, self.layout = H, layout
        self.twin_max_tokens, self.amx_min_rows = twin_max_tokens, amx_min_rows
        w13 = _stack_experts([pack_gguf_twin([ExpertShard(gate, e, F, 0), ExpertShard(up, e, F, F)], H)
                              for e in range(E)])
        w2 = _stack_experts([pack_gguf_twin([ExpertShard(down, e, H, 0)], F) for e in range(E)])
        self.register_buffer("w13_buf", w13[0], persistent=False)
        self.register_buffer("w13_meta", w13[1], persistent=False)
        self.register_buffer("w2_buf", w2[0], persistent=False)
        self.register_buffer("w2_meta", w2[1], persistent=False)
        self.silu_kernel = block.act is torch.nn.functional.silu
        self.types = sorted({str(gate.qtype), str(up.qtype), str(down.qtype)})

    def _gemm(self, x: torch.Tensor, buf: torch.Tensor, meta: torch.Tensor, n: int) -> torch.Tensor:
        if x.shape[0] <= self.twin_max_tokens:
            return load_cpu_kernels().gguf_gemm(x, buf, meta, n)
        return blocks_gemm(x, buf, meta, n, self.layout, self.amx_min_rows).to(x.dtype)

    def _act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.silu_kernel and gate_up.dtype == torch.bfloat16:
            return load_cpu_kernels().silu_and_mul(gate_up)
        gate, up = gate_up.split(self.inter, dim=-1)  # float32: the float path's ops, so its numbers
        return self.act(gate) * up

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = self._gemm(x, self.w13_buf, self.w13_meta[e], 2 * self.inter)
        return self._gemm(self._act_and_mul(gate_up), self.w2_buf, self.w2_meta[e], self.hidden_size)

    def experts_forward(self, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor,
                        counts: torch.Tensor) -> torch.Tensor:
        """The experts with at most twin_max_tokens rows (a decode step's, all of them) in one
        gguf_moe_gemm call each for w13 and w2 (their rows' numbers are gguf_gemm's, expert by expert;
        the layer's input gathered per pair inside the call); the others one blocks_gemm per expert,
        as expert_forward."""
        if len(counts) and int(counts.max()) <= self.twin_max_tokens:
            return self._grouped(x, tokens, experts, counts)
        few = counts <= self.twin_max_tokens
        if not bool(few.any()):
            return super().experts_forward(x, tokens, experts, counts)
        ends = counts.cumsum(0)
        starts = ends - counts
        rows = torch.cat([torch.arange(a, b) for a, b in zip(starts[few].tolist(), ends[few].tolist())])
        out = x.new_empty(len(tokens), x.shape[1])
        out[rows] = self._grouped(x, tokens[rows], experts[few], counts[few])
        for e, a, b in zip(experts[~few].tolist(), starts[~few].tolist(), ends[~few].tolist()):
            out[a:b] = self.expert_forward(e, x[tokens[a:b]])
        return out

    def _grouped(self, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
        kernels = load_cpu_kernels()
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        gate_up = kernels.gguf_moe_gemm(x, self.w13_buf, self.w13_meta, experts, offsets, 2 * self.inter, tokens)
        return kernels.gguf_moe_gemm(self._act_and_mul(gate_up), self.w2_buf, self.w2_meta, experts, offsets,
                                     self.hidden_size)


def use_moe_blocks(model: nn.Module, layout: str, twin_max_tokens: int, amx_min_rows: int = 0) -> list[str]:
    """Replaces each MoE block whose experts the loader kept as GGUF blocks (`model.block_modules`
    names "layers.N.mlp.experts"; their shards in `model.gguf_sources` under .gate_proj / .up_proj /
    .down_proj) with a BlockSparseMoeBlock, then drops those shards. Returns the block types used,
    one entry per replaced layer."""
    blocks = getattr(model, "block_modules", set())
    sources = getattr(model, "gguf_sources", None) or {}
    used: list[str] = []
    for name in sorted(m for m in blocks if m.endswith(".mlp.experts")):
        parent = name.removesuffix(".experts")
        block = model.get_submodule(parent)
        gate, up, down = (sources[f"{name}.{p}"][0] for p in ("gate_proj", "up_proj", "down_proj"))
        new = BlockSparseMoeBlock(block, gate, up, down, layout, twin_max_tokens, amx_min_rows)
        replace_module(model, parent, new)
        used.append("/".join(new.types))
        for p in ("gate_proj", "up_proj", "down_proj"):
            sources.pop(f"{name}.{p}", None)
    return used
