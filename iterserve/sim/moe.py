"""Mixture-of-experts in the step model: how many distinct experts a step makes the engine read.

A step on an MoE model runs each expert that any of its tokens chose once, over that expert's rows
(model/moe.py), so the expert weights it reads grow with the number of *distinct* experts its
tokens touch, not with its token count: one decode row reads k experts per MoE layer, 64 rows may
read all E of them, and past that point added rows read no more weights. The step model's
`moe_experts` feature is that count summed over the MoE layers; this module says what to expect
for a step of T tokens (decode rows and prompt tokens alike: every token is routed).

The assumption, stated: under uniform, independent routing (each token picks k of the E experts,
every choice alike, tokens independent of one another) an expert is missed by one token with
probability 1 - k/E, so T tokens touch E * (1 - (1 - k/E)^T) distinct experts per layer in
expectation. A trained router is skewed (some experts are popular), which touches fewer.
`iterserve profile` therefore counts the distinct experts of every step it times
(SparseMoeBlock.expert_counts) and keeps, per decode batch size, the measured mean over the
uniform expectation (`curve`); between measured sizes the ratio is interpolated, beyond them the
nearest one holds, and the result never exceeds E. A profile's decode rows carry random token ids,
so its curve is the router on random contexts; real traffic (one language, one task) may be more
skewed still. A prompt chunk's tokens are not independent (they share a context), and touch fewer
experts than as many decode rows: a random 32-expert top-4 model's 64-token chunks touched 20 per
layer where 64 rows touch 32 (benchmarks/sim_moe_check.py). So the profile keeps a second curve for
its prompt chunks (`prefill_curve`, uniform when not measured), and a step's decode rows and its
prompt tokens are combined as independent sets: E - (E - d)(E - p)/E (a step's chunks are priced as
one chunk of their tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from iterserve.config import ModelConfig


def uniform_distinct(tokens: float, num_experts: int, top_k: int) -> float:
    """Expected distinct experts per layer that `tokens` tokens touch under uniform routing."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass
class MoeRouting:
    """What the step model needs to know of a model's experts, saved with its profile."""

    num_experts: int  # E, per MoE layer
    top_k: int  # k: experts each token is sent to
    moe_layers: int  # layers whose MLP is the experts'
    expert_bytes: float  # one expert's weights (gate, up, down) in one layer, as the engine holds them
    # measured [tokens, mean distinct experts per MoE layer] of decode steps, by tokens; empty: uniform
    curve: list[list[float]] = field(default_factory=list)
    # and of prompt chunks alone, [chunk tokens, mean distinct experts per MoE layer]; empty: uniform
    prefill_curve: list[list[float]] = field(default_factory=list)
    _memo: dict[tuple[int, int], float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def uniform(self, tokens: float) -> float:
        return uniform_distinct(tokens, self.num_experts, self.top_k)

    def per_layer(self, tokens: float, curve: list[list[float]] | None = None) -> float:
        """Expected distinct experts per MoE layer for `tokens` decode rows (or, with `curve` the
        prefill curve, a prompt chunk of `tokens`): the curve's ratio to uniform routing, interpolated,
        times the uniform expectation; at most E."""
        curve = self.curve if curve is None else curve
        if tokens <= 0:
            return 0.0
        if not curve:
            return self.uniform(tokens)
        xs = [t for t, _ in curve]
        ratios = [d / self.uniform(t) for t, d in curve]
        return min(float(self.num_experts), float(np.interp(tokens, xs, ratios)) * self.uniform(tokens))

    def step_experts(self, decode_tokens: int, prefill_tokens: int = 0) -> float:
        """The `moe_experts` feature of a step: distinct experts summed over the MoE layers, its decode
        rows' and its prompt tokens' experts taken as independent sets (memoised: the simulator asks
        once per step, about a few thousand shapes)."""
        key = (decode_tokens, prefill_tokens)
        got = self._memo.get(key)
        if got is None:
            e = float(self.num_experts)
            d, p = self.per_layer(decode_tokens), self.per_layer(prefill_tokens, self.prefill_curve)
            got = self._memo[key] = self.moe_layers * (e - (e - d) * (e - p) / e)
        return got

    def describe(self, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)) -> str:
        where = "measured" if self.curve else "uniform routing"
        return (f"{self.num_experts} experts, top-{self.top_k}, {self.moe_layers} MoE layers; distinct experts per "
                f"layer for B decode rows ({where}): "
                + ", ".join(f"B={b}: {self.per_layer(b):.1f}" for b in sizes))

    def to_dict(self) -> dict[str, Any]:
        return {"num_experts": self.num_experts, "top_k": self.top_k, "moe_layers": self.moe_layers,
                "expert_bytes": self.expert_bytes, "curve": self.curve, "prefill_curve": self.prefill_curve,
                "assumption": "distinct experts per layer = curve ratio x E*(1-(1-k/E)^tokens) (uniform routing "
                              "when the curve is empty); a step's decode rows (d) and prompt tokens (p, "
                              "prefill_curve) combine as E-(E-d)(E-p)/E"}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MoeRouting":
        return cls(int(d["num_experts"]), int(d["top_k"]), int(d["moe_layers"]), float(d["expert_bytes"]),
                   [[float(t), float(n)] for t, n in d.get("curve") or []],
                   [[float(t), float(n)] for t, n in d.get("prefill_curve") or []])


def moe_routing(cfg: ModelConfig, bytes_per_param: float, curve: list[list[float]] | None = None,
                prefill_curve: list[list[float]] | None = None) -> MoeRouting | None:
    """The routing of `cfg`'s MoE layers (None for a dense model): one expert is a gated MLP of
    3 x hidden x moe_intermediate_size parameters."""
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    if not layers:
        return None
    inter = cfg.moe_intermediate_size or cfg.intermediate_size
    return MoeRouting(cfg.num_experts, cfg.num_experts_per_tok, layers,
                      3.0 * cfg.hidden_size * inter * bytes_per_param, curve or [], prefill_curve or [])


def measured_curve(steps: list[tuple[int, float]], moe_layers: int) -> list[list[float]]:
    """[tokens, mean distinct experts per MoE layer] from steps' (tokens, distinct experts summed
    over the layers) counts, one point per token count (decode steps' rows, or a chunk's tokens)."""
    by_rows: dict[int, list[float]] = {}
    for rows, experts in steps:
        by_rows.setdefault(rows, []).append(experts / moe_layers)
    return [[float(b), sum(v) / len(v)] for b, v in sorted(by_rows.items())]
