"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE, GraniteMoE): a router picks each token's
top-k experts and their weights; each expert is a gated MLP; a token's output is the weighted sum of
its experts' outputs.

Why this shape:
- The router (`TopKRouter`) follows transformers' arithmetic for each family exactly, dtype casts
  included (the ModelConfig's router_* fields say which variant): a near-tie between two experts
  must resolve as transformers resolves it, or a whole expert's output changes.
- The experts are stacked parameters, `w13_weight` [E, 2F, H] (gate rows, then up rows) and
  `w2_weight` [E, H, F] (vLLM's names), not E nn.Linear modules: one step touches only the experts its
  tokens chose, so the step's (token, expert) pairs are sorted by expert and each used expert runs
  once over its rows (F.linear on its slice): a one-token decode reads k experts, not E. The CPU
  platform's linear swaps (nn.Linear -> CpuLinear) never see these parameters; in bf16 it lays each
  expert out for its tiled GEMM instead (platform/cpu_moe.py), float32 keeps F.linear (MKL).
- The pairs are ordered by (expert, slot in the top-k, token), the order transformers visits them in,
  and summed with index_add_ in the activations' dtype, expert by expert: the same additions in the
  same order, so float32 results match transformers' to the last bit where the GEMMs do.
- `expert_counts` (off, None, unless `count_experts` turns it on): each forward appends how many
  distinct experts it ran, what a step's expert weight reads grow with; `iterserve profile` reads it
  (sim/moe.py). One append per layer per step, of a number the loop computes anyway.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.config import ModelConfig
from iterserve.model.activations import activation


class TopKRouter(nn.Module):
    """Router logits (x @ weight.T, in the activations' dtype) -> (weights [T, k], expert ids [T, k])."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.top_k = cfg.num_experts_per_tok
        self.topk_first = cfg.router_topk_first
        self.renormalize = cfg.router_renormalize
        self.weights_float32 = cfg.router_weights_float32

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T as transformers computes it (CpuTopKRouter: our tiled bf16 GEMM, the same bits)."""
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(x)
        if self.topk_first:  # GraniteMoE: top-k of the float32 logits, softmax over those k
            top, ids = logits.float().topk(self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        else:  # softmax over every expert in float32, then top-k (Mixtral, Qwen3-MoE, OLMoE)
            weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.weights_float32 else weights.to(x.dtype)), ids


class SparseMoeBlock(nn.Module):
    """The MLP of a mixture-of-experts layer: `gate` (the router, Hugging Face's name) and the
    stacked experts; [T, H] in, [T, H] out, as MLP."""

    expert_counts: list[int] | None = None  # distinct experts of each forward, when a list (count_experts)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(f"num_experts_per_tok {cfg.num_experts_per_tok} must be in 1..num_experts "
                             f"({cfg.num_experts})")
        self.num_experts = cfg.num_experts
        self.inter = cfg.moe_intermediate_size or cfg.intermediate_size
        self.act = activation(cfg.hidden_act)
        self.gate = TopKRouter(cfg)
        self.experts = nn.Module()  # parameter names under it: Hugging Face's `mlp.experts.` prefix
        self.experts.w13_weight = nn.Parameter(torch.empty(cfg.num_experts, 2 * self.inter, cfg.hidden_size))
        self.experts.w2_weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, self.inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        T = x.shape[0]
        # the (token, expert) pairs in (expert, top-k slot, token) order: slot-major flattening, then
        # a stable sort by expert
        flat = ids.t().reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        tokens = order % T
        pair_weights = weights.t().reshape(-1)[order]
        if self.expert_counts is not None:
            self.expert_counts.append(len(experts))
        h = self.experts_forward(x, tokens, experts, counts)
        return self.combine(h, pair_weights, tokens, counts, T)

    def combine(self, h: torch.Tensor, pair_weights: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor,
                T: int) -> torch.Tensor:
        """The layer's output [T, H]: each pair's expert output times its weight, added into its
        token's row, one index_add_ per expert as transformers does (torch's bf16 index_add_ sums a
        call's duplicates in float32 and rounds once, so one call for all pairs would round
        differently). The CPU blocks run it as one kernel with the same bits (csrc/elementwise.cpp)."""
        out, start = h.new_zeros(T, h.shape[1]), 0
        for n in counts.tolist():
            rows = slice(start, start + n)
            out.index_add_(0, tokens[rows], (h[rows] * pair_weights[rows, None]).to(h.dtype))
            start += n
        return out

    def experts_forward(self, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor,
                        counts: torch.Tensor) -> torch.Tensor:
        """The pairs' rows x[tokens] [P, H], sorted by expert (counts[u] rows for experts[u]) -> each
        row through its expert's MLP, [P, H]. Here one expert_forward per used expert;
        BlockSparseMoeBlock groups them into one kernel call (platform/cpu_moe.py)."""
        xs, outs, start = x[tokens], [], 0
        for e, n in zip(experts.tolist(), counts.tolist()):
            outs.append(self.expert_forward(e, xs[start:start + n]))
            start += n
        return torch.cat(outs) if outs else xs.new_empty(0, xs.shape[1])

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e`'s gated MLP on its rows: one GEMM for gate and up, act-and-mul, one for down
        (the CPU platform's CpuSparseMoeBlock runs them on its bf16 GEMM: platform/cpu_moe.py)."""
        gate, up = F.linear(x, self.experts.w13_weight[e]).split(self.inter, dim=-1)
        return F.linear(self.act(gate) * up, self.experts.w2_weight[e])


def count_experts(model: nn.Module) -> list[list[int]]:
    """Turns on every SparseMoeBlock's `expert_counts` in `model` and returns those lists (one per MoE
    layer; none for a dense model): after a step, each holds the distinct experts that layer ran."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    for b in blocks:
        b.expert_counts = []
    return [b.expert_counts for b in blocks]
