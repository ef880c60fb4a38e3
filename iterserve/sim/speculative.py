"""Speculative decoding in the simulator: how many drafts a decode row verifies, how many it accepts.

Why a model of acceptance and not of proposers: what a draft costs is known (a verify row with k
drafts is k + 1 query tokens over its context, which the step-time model prices like a short prompt
chunk), but whether a draft is right depends on the text. The simulator therefore takes one number,
alpha, the probability that each next draft token is accepted given the ones before it were, and
draws a row's accepted count from the geometric law truncated at its drafts: P(accept >= i) =
alpha^i, i <= k. That is the standard model of speculative decoding (Leviathan et al. 2023) and needs
only what a server reports: `alpha_from_totals` inverts a measured acceptance rate (accepted / draft
tokens, /v1/scheduler's `speculative` totals or the vLLM counters) at the measured drafts per row.

Which rows draft follows the engine's policy: decode rows only (a prompt chunk has nothing to
verify), none in a step whose running requests exceed `disable_by_batch_size`, never more drafts
than the request may still emit (max_tokens, max_model_len) nor than the step's token budget and the
free KV blocks allow. Every eligible row drafts `k` tokens with probability `draft_fraction` (prompt
lookup finds no match in some rows; a measured fraction is verify rows / decode rows); the engine's
per-row adaptation of k is not modelled, so a simulated k is the most a row drafts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class SpecPolicy:
    num_speculative_tokens: int  # k: drafts per verify row
    acceptance: float  # alpha: per-token acceptance probability, in [0, 1]
    disable_by_batch_size: int | None = None  # no drafts in a step with more running requests than this
    draft_fraction: float = 1.0  # share of eligible decode rows that draft at all
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"spec acceptance must be in [0, 1], got {self.acceptance}")
        if not 0.0 <= self.draft_fraction <= 1.0:
            raise ValueError(f"spec draft fraction must be in [0, 1], got {self.draft_fraction}")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        self.rng = random.Random(self.seed)

    def active(self, num_running: int) -> bool:
        """Whether this step drafts at all (the engine switches speculation off at high batch)."""
        limit = self.disable_by_batch_size
        return self.num_speculative_tokens > 0 and (limit is None or num_running <= limit)

    def drafts(self, room: int) -> int:
        """Drafts for one eligible row that may still take `room` draft tokens."""
        if room <= 0 or (self.draft_fraction < 1.0 and self.rng.random() >= self.draft_fraction):
            return 0
        return min(self.num_speculative_tokens, room)

    def accepted(self, drafts: int) -> int:
        """Drafts accepted of `drafts`: the leading run of successes, each with probability alpha."""
        m = 0
        while m < drafts and self.rng.random() < self.acceptance:
            m += 1
        return m


def expected_accepted(alpha: float, k: int) -> float:
    """E[accepted drafts] of a row with k drafts: sum of alpha^i for i = 1..k."""
    return sum(alpha ** i for i in range(1, k + 1))


def alpha_from_rate(rate: float, k: float) -> float:
    """The per-token alpha whose truncated geometric law gives acceptance rate `rate` (accepted /
    draft tokens) at `k` drafts per row (a mean: fractional k is interpolated). Bisection: the rate
    grows with alpha from 0 to 1."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {rate}")
    if k <= 1 or rate in (0.0, 1.0):
        return rate

    def rate_at(alpha: float) -> float:
        lo = int(k)
        frac = k - lo
        acc = (1 - frac) * expected_accepted(alpha, lo) + frac * expected_accepted(alpha, lo + 1)
        return acc / k

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate_at(mid) < rate else (lo, mid)
    return (lo + hi) / 2


def alpha_from_totals(num_drafts: int, draft_tokens: int, accepted_tokens: int) -> float | None:
    """alpha from a server's totals (/v1/scheduler's `speculative`, or the vLLM counters): the
    acceptance rate inverted at the measured drafts per verify row; None when nothing drafted."""
    if not num_drafts or not draft_tokens:
        return None
    return alpha_from_rate(accepted_tokens / draft_tokens, draft_tokens / num_drafts)
