"""One request's grammar state: advanced with each accepted token, asked for the next mask."""
from __future__ import annotations

import llguidance
import llguidance.numpy
import torch


class RequestGrammar:
    """Wraps an llguidance matcher. Its state always matches the request's output tokens: a
    request preempted by recompute keeps those tokens, so the matcher keeps its state too;
    `rollback` is there for anything that drops tokens it had accepted."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        """False when the grammar does not allow the token (then the request must stop)."""
        ok = self.matcher.consume_token(token_id)
        if ok:
            self.num_accepted += 1
        return ok

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens the grammar would accept, without changing its state (a
        forbidden token given to accept_token puts the matcher in an error state)."""
        return self.matcher.validate_tokens(token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the mask into row `row` of a CPU int32 bitmask, through a numpy view of the same
        memory (llguidance.torch would do the same, but importing it imports torch.compile's
        machinery: seconds at every process start)."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask.numpy(), row)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    def reset(self) -> None:
        self.matcher.reset()
        self.num_accepted = 0

    @property
    def is_terminated(self) -> bool:
        """The grammar's end: nothing more may follow (a closed JSON object, a whole choice)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None
