"""Server overhead: what a served request costs besides the forward passes, as fitted terms.

A step model alone predicts the runner's time; a real server also spends time between one step's
end and the next one's start (turning sampled tokens into text and stream chunks, the engine
thread's commands, the next `schedule`), before a request's first step (HTTP, JSON, tokenising,
handing it to the engine thread) and after its last one (the final chunk and the response's end).
On a small model these are a large share of what a client sees, so the profile carries them
(`iterserve profile MODEL --server-overhead`, measured by `sim/measure_server.py`) and the
simulator charges them. The form (all in seconds):

- after each step: gap = g0 + g_seq x (sequences in that step);
- at a step that admits requests: admit_s x (requests admitted), before its forward pass;
- a request reaches the scheduler arrival_s = a0 + a_tok x (prompt tokens) after it reaches the server;
- its first token reaches the client first_token_s after the step that sampled it ended;
- its response ends finish_s after the step that sampled its last token ended.

A profile without these (older JSON, or one measured without --server-overhead) charges nothing.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative term and refit until none
    is (a small active-set NNLS; enough for a handful of terms)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


@dataclass
class ServerOverhead:
    gap_s: list[float] = field(default_factory=lambda: [0.0, 0.0])  # g0, g_seq
    admit_s: float = 0.0
    arrival_s: list[float] = field(default_factory=lambda: [0.0, 0.0])  # a0, a_tok
    first_token_s: float = 0.0
    finish_s: float = 0.0
    fit: dict[str, Any] = field(default_factory=dict)  # what it was measured on, and how well it fits

    def gap(self, seqs: int) -> float:
        return self.gap_s[0] + self.gap_s[1] * seqs

    def to_arrival(self, prompt_tokens: int) -> float:
        return self.arrival_s[0] + self.arrival_s[1] * prompt_tokens

    def to_dict(self) -> dict[str, Any]:
        return {"formula": "gap = g0 + g_seq*seqs; admit per admitted request; arrival = a0 + a_tok*prompt_tokens; "
                           "first_token and finish after the step's end", **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ServerOverhead":
        return cls(gap_s=[float(c) for c in d["gap_s"]], admit_s=float(d["admit_s"]),
                   arrival_s=[float(c) for c in d["arrival_s"]], first_token_s=float(d["first_token_s"]),
                   finish_s=float(d["finish_s"]), fit=d.get("fit") or {})


NO_OVERHEAD = ServerOverhead()


def fit_gaps(steps: list[dict[str, Any]]) -> tuple[list[float], float, dict[str, Any]]:
    """(g0, g_seq), admit_s from consecutive step records of a busy engine (`/v1/scheduler`'s dicts
    with `t_run`): the gap between step k's end and step k+1's start, where step k left requests
    running (so the engine had no reason to wait), against step k's sequences and step k+1's
    admissions. The slowest 5% (another process took the core) are left out."""
    by_step = {int(s["step"]): s for s in steps}
    rows, gaps = [], []
    for k, s in by_step.items():
        nxt = by_step.get(k + 1)
        if nxt is None or not s.get("num_running"):
            continue
        gap = float(nxt["t_run"]) - (float(s["t_run"]) + float(s["duration"]))
        rows.append([1.0, float(s["batch_size"]), float(len(nxt.get("admitted") or []))])
        gaps.append(max(gap, 0.0))
    if len(gaps) < 3:
        raise ValueError(f"need at least 3 back-to-back steps to fit the gap between steps, got {len(gaps)}")
    x, y = np.array(rows), np.array(gaps)
    keep = y <= np.quantile(y, 0.95)
    coef = nonnegative_lstsq(x[keep], y[keep])
    resid = x[keep] @ coef - y[keep]
    info = {"gap_points": int(keep.sum()), "gap_median_s": float(np.median(y)),
            "gap_mean_abs_err_s": float(np.abs(resid).mean())}
    return [float(coef[0]), float(coef[1])], float(coef[2]), info
