"""A reasoning request's constraints in the sampling step: the grammar on the answer only, and the
tokens the thinking phase forces (thinking.py).

While a request thinks its grammar is not applied (the thinking is free text) and has seen none of
its tokens; from the token after the end marker on it constrains as for any request. A request that
may or may not open a thinking block (Qwen3's template) gets, at its first token, the grammar's mask
plus the start marker's first token: it may think first or answer at once under the grammar. Forced
tokens (a spent thinking budget's end marker) leave one finite logit in the row, so greedy and
seeded sampling alike take it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from iterserve.structured.grammar import RequestGrammar

if TYPE_CHECKING:
    from iterserve.request import Request


class _GatedGrammar:
    """The grammar's mask with one more token allowed (the start marker's first token)."""

    def __init__(self, grammar: RequestGrammar, token_id: int) -> None:
        self.grammar, self.token_id = grammar, token_id

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.grammar.fill_bitmask(bitmask, row)
        words = bitmask.numpy()[row].view(np.uint32)  # bit j of word i is token 32 * i + j
        words[self.token_id >> 5] |= np.uint32(1 << (self.token_id & 31))


def step_grammar(req: Request):
    """What constrains this request's next token, as TokenConstraints takes it: its grammar, the
    grammar gated open for a start marker, or None (no grammar, or the request is thinking)."""
    grammar, thinking = req.grammar, req.thinking
    if grammar is None or thinking is None or thinking.answering:
        return grammar
    gate = thinking.gate_token()
    return _GatedGrammar(grammar, gate) if gate is not None and not thinking.forced_token(True) else None


def forced_tokens(reqs: list[Request], live: list[bool]) -> list[int | None]:
    """Per row, the token the thinking phase forces, or None."""
    return [r.thinking.forced_token(r.grammar is not None) if ok and r.thinking is not None else None
            for r, ok in zip(reqs, live)]


def apply_forced(logits: torch.Tensor, forced: list[int | None]) -> torch.Tensor:
    """Rows with a forced token keep only that token's logit (float32, in place)."""
    if not any(t is not None for t in forced):
        return logits
    logits = logits.float()
    for row, tok in enumerate(forced):
        if tok is not None:
            keep = logits[row, tok].clone()
            logits[row].fill_(float("-inf"))
            logits[row, tok] = keep if torch.isfinite(keep) else 0.0
    return logits
