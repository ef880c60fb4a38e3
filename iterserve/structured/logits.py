"""The step's token constraints on the sampled rows' logits: grammar bitmasks, then logit_bias.

One int32 bitmask for the whole batch (a bit per token, llguidance's layout): constrained rows get
their grammar's mask, free rows stay all ones, and one in-place kernel applies it. Rows without a
grammar or a bias are left bit for bit as they were, so a free request batched with constrained
ones samples exactly what it would alone.
"""
from __future__ import annotations

import llguidance.numpy
import numpy as np
import torch

from iterserve.structured.grammar import RequestGrammar


class TokenConstraints:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bitmask = allocate_bitmask(16, vocab_size)

    def apply(self, logits: torch.Tensor, grammars: list[RequestGrammar | None],
              logit_biases: list[dict[int, float] | None]) -> torch.Tensor:
        """Returns float32 logits with the constraints applied (in place when already float32)."""
        if not any(g is not None for g in grammars) and not any(logit_biases):
            return logits
        logits = logits.float()
        for row, bias in enumerate(logit_biases):
            if bias:
                ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
                vals = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
                logits[row].index_add_(0, ids, vals)
        if any(g is not None for g in grammars):
            n = logits.shape[0]
            if self._bitmask.shape[0] < n:
                self._bitmask = allocate_bitmask(n, self.vocab_size)
            mask = self._bitmask[:n]
            mask.fill_(-1)
            for row, g in enumerate(grammars):
                if g is not None:
                    g.fill_bitmask(mask, row)
            rows = [row for row, g in enumerate(grammars) if g is not None]
            apply_bitmask(logits, mask, rows)
        return logits


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-ones CPU bitmask in llguidance's layout, pinned where a GPU will receive it (as
    llguidance.torch allocates it; that module is not imported: it imports torch.compile)."""
    shape = llguidance.numpy.get_bitmask_shape(rows, vocab_size)
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets the logits of disallowed tokens to -inf in the given rows. numpy unpacks the bits (bit
    j of int32 word i is token 32 * i + j) and, on CPU, writes the -inf in place on one thread:
    torch's masked_fill_ on two busy cores was 10-20x slower, and llguidance's own kernel is a
    torch.compile'd function that compiles for seconds at its first call and per batch size."""
    words = bitmask.numpy()[rows]  # numpy indexing: torch's took ~18 ms for 16 rows on two busy cores
    banned = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]] == 0
    if logits.device.type == "cpu":
        view = logits.numpy()
        for i, row in enumerate(rows):
            np.putmask(view[row], banned[i], -np.inf)
        return
    banned_t = torch.from_numpy(banned).to(logits.device, non_blocking=True)
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(banned_t, float("-inf"))
