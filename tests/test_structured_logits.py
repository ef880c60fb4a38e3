"""The step's token constraints without a model: the bitmask's bit order, rows left alone, logit_bias."""
from __future__ import annotations

import torch

from iterserve.structured.logits import TokenConstraints, apply_bitmask

VOCAB = 49152


def reference_banned(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Token t of a row is allowed when bit t % 32 of int32 word t // 32 is set."""
    t = torch.arange(vocab)
    words = bitmask[:, t // 32]
    return ((words >> (t % 32)) & 1) == 0


def test_apply_bitmask_matches_the_bit_layout_and_leaves_other_rows():
    g = torch.Generator().manual_seed(0)
    mask = torch.randint(-2**31, 2**31 - 1, (6, VOCAB // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(6, VOCAB, generator=g)
    before = logits.clone()
    rows = [1, 4]
    apply_bitmask(logits, mask, rows)
    banned = reference_banned(mask, VOCAB)
    for r in range(6):
        if r in rows:
            assert torch.equal(torch.isneginf(logits[r]), banned[r])
            assert torch.equal(logits[r][~banned[r]], before[r][~banned[r]])
        else:
            assert torch.equal(logits[r], before[r])


class FixedGrammar:
    """Stands in for a request's matcher: allows only the given tokens."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = [0] * bitmask.shape[1]
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.tensor([w - 2**32 if w >= 2**31 else w for w in words], dtype=torch.int32)

def test_token_constraints_mask_bias_and_free_rows():
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    out = TokenConstraints(VOCAB).apply(logits, [FixedGrammar([5, 31, 40000]), None, None],
                                        [None, None, {7: 100.0, 8: -100.0}])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [5, 31, 40000]
    assert torch.equal(out[1], before[1])  # free row: bit for bit
    assert out[2].argmax() == 7 and out[2][8] == before[2][8] - 100
    assert torch.equal(TokenConstraints(VOCAB).apply(before, [None] * 3, [None] * 3), before)
