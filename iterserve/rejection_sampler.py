"""Speculative sampling's acceptance rule (Leviathan et al. 2023; Chen et al. 2023), so that
speculation never changes what a request's tokens are distributed as.

Draft i (token d, proposed with probability q(d) given the tokens before it) is accepted with
probability min(1, p(d) / q(d)), p the target's distribution at its position; at the first
rejection the token is drawn from the residual max(0, p - q) renormalised, and when every draft is
accepted one more token is drawn from p at the position after the last draft. The result is
distributed exactly as tokens drawn one at a time from p. A lookup method's draft (n-gram,
suffix, `prediction`) and a greedy draft model's are point masses (q(d) = 1): the rule is then
"accept with probability p(d), else draw from p without d", and for a greedy request, whose p is
one-hot, "accept while the draft is the argmax".

The runner applies it (verification is a sampling step of the target's forward pass); the drafts
come from spec_decode/, which imports the runner, so the rule lives here, beside sampling.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from iterserve.sampling import sample_inverse_cdf


@dataclass
class Verified:
    num_accepted: int  # leading drafts accepted
    token_ids: list[int]  # the accepted drafts, then the token drawn after them


def verify_drafts(probs: torch.Tensor, drafts: list[int], u_accept: torch.Tensor, u_next: torch.Tensor,
                  draft_probs: torch.Tensor | None = None) -> Verified:
    """probs [k + 1, vocab]: the target's distribution at the row's last token and after each of its
    k drafts. u_accept [k] and u_next [1]: uniforms in [0, 1) (float64). draft_probs [k, vocab]:
    the drafter's q at each draft, None for point masses."""
    k = len(drafts)
    idx = torch.arange(k, device=probs.device)
    d = torch.tensor(drafts, dtype=torch.long, device=probs.device)
    p_d = probs[idx, d].double()
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs[idx, d].double()
    ok = (u_accept < p_d / q_d).tolist()
    a = ok.index(False) if False in ok else k
    if a == k:
        dist = probs[k]
    elif draft_probs is None:
        dist = probs[a].clone()
        dist[drafts[a]] = 0.0
    else:
        dist = (probs[a] - draft_probs[a]).clamp_(min=0.0)
    if not bool(dist.sum() > 0):  # a rejected draft that held all of p's mass: cannot happen in exact
        dist = probs[a]  # arithmetic (u < 1 accepts it), but rounding may leave nothing to draw from
    nxt = int(sample_inverse_cdf(dist.unsqueeze(0).float(), u_next)[0])
    return Verified(a, drafts[:a] + [nxt])
