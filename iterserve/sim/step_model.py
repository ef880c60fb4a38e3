"""Step-time models: how long one engine step takes, from what the scheduler put in it.

The simulator replaces the forward pass (and sampling) by one of these. Both read the same
`StepFeatures` off a `SchedulerOutput` (`step_features`), so a scheduler change that alters what goes
in a step alters the predicted time:

- `LinearStepModel` (measured, `iterserve profile MODEL`): least squares, weighted by 1/time so
  that short decode steps are fitted as closely (in relative terms) as long prefills, over
  t = c0 + c_seq*seqs + c_tok*tokens + c_pre*prefill_tokens + c_dkv*(decode_kv - shared)
      + c_pkv*prefill_kv/1e3 + c_full*[tokens > twin_max_tokens] + c_head*[seqs > head_max_seqs]
      + c_shared*shared + c_pcached*prefill_cached_kv/1e3 + c_moe*moe_experts,
  where shared is the decode KV read from blocks another row of the step reads too (prefix
  caching's shared blocks, still in the CPU's caches the second time: cheaper per token), and
  prefill_cached_kv the part of prefill_kv a chunk reads from tokens cached before it (a chat turn
  after its history: no causal half to skip there). moe_experts is, on a mixture-of-experts
  model, the distinct experts the step's tokens were routed to, summed over the MoE layers: each is
  read once per step, so c_moe is one expert's weight read (sim/moe.py: what to expect for T tokens).
  The two bracketed terms are steps: on CPU the engine runs small steps on quantised copies of the weights (a
  4-bit twin of each projection for steps of at most `twin_max_tokens` rows, a Q8 LM head for at
  most `head_max_seqs` sampled rows: platform/kernel_choice.py) and switches to the bf16 weights
  above, so step time jumps at those sizes; a line through both regimes is off by tens of percent
  on the batch sizes between. The cut-overs are the engine's own (saved with the model); 0 means no
  such copy, and the term is off. Coefficients the data wants negative are dropped and the rest
  refitted (a small active-set NNLS), so no extrapolation predicts a step that gets cheaper with
  more work.
- `RooflineStepModel` (analytic, `iterserve profile --analytic`): max(FLOPs / achievable FLOP/s,
  bytes / achievable bandwidth) + a fixed per-step overhead, from a GPU's published peaks and the
  model's shape; an MoE model's bytes are its other weights plus one expert's per distinct expert.
  An estimate, labelled so wherever it is written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from iterserve.sim.overhead import nonnegative_lstsq

if TYPE_CHECKING:  # only a type here: this module (and a profile) loads without torch
    from iterserve.core.scheduler import SchedulerOutput
    from iterserve.sim.moe import MoeRouting

FEATURES = ("const", "seqs", "tokens", "prefill_tokens", "decode_kv", "prefill_kv_k", "full_weights", "full_head",
            "decode_kv_shared", "prefill_cached_kv_k", "moe_experts")
BASE_FEATURES = 6  # profiles written before the cut-over terms have only the first six
CUTOVER_FEATURES = 8  # and those written before the shared-KV and cached-prefill terms the first eight
SHARED_FEATURES = 10  # and those written before the MoE term the first ten
DECODE_KV, SHARED_KV, CACHED_PKV, MOE_EXPERTS = (FEATURES.index(n) for n in (
    "decode_kv", "decode_kv_shared", "prefill_cached_kv_k", "moe_experts"))


@dataclass
class StepFeatures:
    """What one step computes. decode_kv: KV tokens the single-token rows attend to (their context
    lengths summed); prefill_kv_k: sum over prefill chunks of chunk length x context length, in
    thousands (their attention is quadratic in the chunk); decode_kv_shared: of decode_kv, the tokens
    in blocks another row of the step reads too (`SchedulerOutput.shared_decode_kv`);
    prefill_cached_kv_k: of prefill_kv_k, chunk length x the tokens cached before the chunk;
    moe_experts: distinct experts the step reads, summed over MoE layers (0 on a dense model; counted
    by `iterserve profile`, expected from the token count in the simulator: sim/moe.py)."""

    seqs: int
    tokens: int
    prefill_tokens: int
    decode_kv: int
    prefill_kv_k: float
    decode_kv_shared: int = 0
    prefill_cached_kv_k: float = 0.0
    moe_experts: float = 0.0

    def row(self, twin_max_tokens: int = 0, head_max_seqs: int = 0) -> list[float]:
        """The fit's columns, in FEATURES order; the decode KV column holds the distinct tokens
        only, the shared ones have a column (and a price) of their own."""
        return [1.0, self.seqs, self.tokens, self.prefill_tokens, self.decode_kv - self.decode_kv_shared,
                self.prefill_kv_k, float(bool(twin_max_tokens) and self.tokens > twin_max_tokens),
                float(bool(head_max_seqs) and self.seqs > head_max_seqs), self.decode_kv_shared,
                self.prefill_cached_kv_k, self.moe_experts]


def step_features(sched: SchedulerOutput, block_size: int, null_block: int | None = None,
                  moe: MoeRouting | None = None) -> StepFeatures:
    """Each row attends to its `start` cached tokens plus its `n` new ones (a static padding row's
    start is kept inside its reservation, as the runner computes it). A speculative verify row
    (its last token and its drafts) is priced as a prompt chunk of that many tokens: its positions
    count as prefill tokens, its attention (multi-token: attended_kv's second number) likewise. `block_size`: the KV cache's,
    to count the tokens of shared blocks; `null_block`: the pool's (a windowed group's freed entries).
    `moe`: an MoE model's routing (the profile's), for the expected distinct experts of the step's tokens."""
    decode_kv, prefill_kv = sched.attended_kv()
    verify = sum(s.num_tokens for s in sched.scheduled if s.spec_token_ids)
    return StepFeatures(len(sched.scheduled), sched.num_tokens, sched.num_prefill_tokens + verify, decode_kv,
                        prefill_kv / 1e3,
                        sched.shared_decode_kv(block_size, null_block), sched.cached_prefill_kv() / 1e3,
                        moe.step_experts(sched.num_tokens - sched.num_prefill_tokens, sched.num_prefill_tokens)
                        if moe is not None else 0.0)


def record_features(step: dict[str, Any], moe: MoeRouting | None = None) -> StepFeatures | None:
    """The same features from a server's step record (`/v1/scheduler`), or None from a server that
    does not report what attention read. A speculative verify row (drafts + 1 positions, which the
    record counts among decode_tokens) is priced as step_features prices it: a short prompt chunk,
    so its positions move to prefill_tokens here; its attention is in prefill_kv_tokens already
    (SchedulerOutput.attended_kv puts every multi-token row there). A server does not report its
    experts: an MoE model's (`moe`) are the expectation for the step's tokens."""
    if "decode_kv_tokens" not in step:
        return None
    verify = int(step.get("spec_draft_tokens", 0)) + int(step.get("spec_num_drafts", 0))
    prefill = int(step["prefill_tokens"])
    tokens = prefill + int(step["decode_tokens"])
    return StepFeatures(int(step["batch_size"]), tokens, prefill + verify,
                        int(step["decode_kv_tokens"]), int(step["prefill_kv_tokens"]) / 1e3,
                        int(step.get("decode_kv_shared_tokens", 0)), int(step.get("prefill_cached_kv_tokens", 0)) / 1e3,
                        moe.step_experts(tokens - prefill, prefill) if moe is not None else 0.0)


def features_of(sample: dict[str, Any]) -> StepFeatures:
    """A saved sample's features (a profile's `samples` / `in_service_samples` entry)."""
    return StepFeatures(int(sample["seqs"]), int(sample["tokens"]), int(sample["prefill_tokens"]),
                        int(sample["decode_kv"]), float(sample["prefill_kv_k"]), int(sample.get("decode_kv_shared", 0)),
                        float(sample.get("prefill_cached_kv_k", 0.0)), float(sample.get("moe_experts", 0.0)))


def step_kind(f: StepFeatures) -> str:
    """decode (single-token rows only), prefill (one prompt chunk alone) or mixed."""
    return "decode" if not f.prefill_tokens else ("prefill" if f.seqs == 1 else "mixed")


def errors_by_kind(model: "StepTimeModel", steps: Iterable[tuple[StepFeatures, float]]) -> dict[str, dict[str, float]]:
    """`model` against measured steps ((features, seconds) pairs), per `step_kind`: how many, and the
    mean and mean absolute relative error of the prediction."""
    by_kind: dict[str, list[float]] = {}
    for f, t in steps:
        if t > 0:
            by_kind.setdefault(step_kind(f), []).append((model.predict(f) - t) / t)
    return {k: {"steps": len(v), "mean": sum(v) / len(v), "mean_abs": sum(map(abs, v)) / len(v)}
            for k, v in by_kind.items()}


def errors_line(errors: dict[str, dict[str, float]]) -> str:
    """errors_by_kind's result as one line ("" when there were no steps)."""
    return "; ".join(f"{k} {e['steps']} steps, mean error {e['mean']:+.0%} (|{e['mean_abs']:.0%}|)"
                     for k, e in errors.items())


class StepTimeModel(Protocol):
    def predict(self, f: StepFeatures) -> float: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass
class LinearStepModel:
    coef: list[float]  # one per FEATURES (or the first BASE_, CUTOVER_ or SHARED_FEATURES), seconds per unit
    twin_max_tokens: int = 0  # the engine's cut-over from its 4-bit projections to bf16 (0: none)
    head_max_seqs: int = 0  # and from its Q8 LM head (0: none)

    def __post_init__(self) -> None:
        n = len(self.coef)
        if n not in (BASE_FEATURES, CUTOVER_FEATURES, SHARED_FEATURES, len(FEATURES)):
            raise ValueError(f"linear step model: {n} coefficients, want {len(FEATURES)}")
        self.coef = list(self.coef) + [0.0] * (len(FEATURES) - n)  # an older profile: no MoE term (dense)
        if n < SHARED_FEATURES:  # an older profile priced shared KV tokens as any other (and cached
            # prefill reads as fresh ones: 0 extra): keep its predictions
            self.coef[SHARED_KV] = self.coef[DECODE_KV]

    def predict(self, f: StepFeatures) -> float:
        c = self.coef
        t = (c[0] + c[1] * f.seqs + c[2] * f.tokens + c[3] * f.prefill_tokens
             + c[DECODE_KV] * (f.decode_kv - f.decode_kv_shared) + c[5] * f.prefill_kv_k
             + c[SHARED_KV] * f.decode_kv_shared + c[CACHED_PKV] * f.prefill_cached_kv_k
             + c[MOE_EXPERTS] * f.moe_experts)
        if self.twin_max_tokens and f.tokens > self.twin_max_tokens:
            t += c[6]
        if self.head_max_seqs and f.seqs > self.head_max_seqs:
            t += c[7]
        return t

    def to_dict(self) -> dict[str, Any]:
        return {"form": "linear", "features": list(FEATURES), "coef": list(self.coef),
                "twin_max_tokens": self.twin_max_tokens, "head_max_seqs": self.head_max_seqs,
                "formula": "t = " + " + ".join(f"c_{n}*{n}" for n in FEATURES).replace(
                    "c_decode_kv*decode_kv", "c_decode_kv*(decode_kv - decode_kv_shared)")
                + " (full_weights = [tokens > twin_max_tokens], full_head = [seqs > head_max_seqs])"}

    @classmethod
    def fit(cls, rows: list[StepFeatures], seconds: list[float], twin_max_tokens: int = 0,
            head_max_seqs: int = 0, weights: list[float] | None = None) -> "LinearStepModel":
        """Non-negative least squares on relative error (each row weighted by 1/t, times its weight)."""
        if len(rows) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} measured steps to fit, got {len(rows)}")
        x = np.array([r.row(twin_max_tokens, head_max_seqs) for r in rows], dtype=float)
        y = np.asarray(seconds, dtype=float)
        w = (1.0 if weights is None else np.sqrt(np.asarray(weights, dtype=float))) / y
        coef = [float(c) for c in nonnegative_lstsq(x * w[:, None], y * w)]
        if not x[:, SHARED_KV].any():  # no step read shared blocks: nothing tells the two prices apart
            coef[SHARED_KV] = coef[DECODE_KV]
        return cls(coef, twin_max_tokens, head_max_seqs)


@dataclass
class RooflineStepModel:
    """Per step: FLOPs = 2 x (non-embedding params) x tokens + 2 x vocab x hidden x seqs (LM head of
    each sampled row) + 4 x layers x heads x head_dim x attended (QK and PV); bytes = the weights
    once + the K/V read by attention + the K/V written. On an MoE model `weight_bytes` is the weights
    but the experts, `params_per_token` counts the k experts a token uses, and each distinct expert
    the step reads (`moe_experts`) adds `expert_bytes`. Achievable rates are the published peaks
    times `flops_efficiency` / `bandwidth_efficiency` (assumptions, saved with the profile)."""

    peak_flops: float  # FLOP/s at the profile's dtype
    bandwidth: float  # bytes/s
    weight_bytes: float
    params_per_token: float  # 2 x non-embedding parameters: FLOPs per token
    head_flops_per_seq: float  # 2 x vocab x hidden
    attn_flops_per_kv: float  # 4 x layers x heads x head_dim: FLOPs per (query token, key token)
    kv_bytes_per_token: float
    flops_efficiency: float = 0.5
    bandwidth_efficiency: float = 0.7
    overhead_s: float = 0.002  # scheduling, launches, sampling: per step, whatever is in it
    expert_bytes: float = 0.0  # one expert of one MoE layer (0: a dense model)
    source: dict[str, Any] = field(default_factory=dict)

    def predict(self, f: StepFeatures) -> float:
        attended = f.decode_kv + f.prefill_kv_k * 1e3
        flops = (self.params_per_token * f.tokens + self.head_flops_per_seq * f.seqs
                 + self.attn_flops_per_kv * attended)
        kv_read = f.decode_kv + f.prefill_tokens  # prefill chunks read their context once per chunk
        moved = (self.weight_bytes + self.expert_bytes * f.moe_experts
                 + self.kv_bytes_per_token * (kv_read + f.tokens))
        return max(flops / (self.peak_flops * self.flops_efficiency),
                   moved / (self.bandwidth * self.bandwidth_efficiency)) + self.overhead_s

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {"form": "roofline", **d}


def model_from_dict(d: dict[str, Any]) -> StepTimeModel:
    form = d.get("form")
    if form == "linear":
        names = list(d.get("features", []))
        if names not in [list(FEATURES[:n]) for n in (len(FEATURES), SHARED_FEATURES, CUTOVER_FEATURES, BASE_FEATURES)]:
            raise ValueError(f"linear step model: features {d.get('features')} differ from {list(FEATURES)}")
        return LinearStepModel([float(c) for c in d["coef"]], int(d.get("twin_max_tokens", 0)),
                               int(d.get("head_max_seqs", 0)))
    if form == "roofline":
        return RooflineStepModel(**{k: v for k, v in d.items() if k != "form"})
    raise ValueError(f"unknown step model form {form!r} (linear or roofline)")
