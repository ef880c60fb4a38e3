"""What every drafting method offers the engine. A proposer only reads requests' tokens; the
scheduler decides how many drafts a step verifies and the runner decides which are accepted."""
from __future__ import annotations

from abc import ABC, abstractmethod

from iterserve.request import Request


class Proposer(ABC):
    @abstractmethod
    def propose(self, items: list[tuple[Request, int]]) -> list[list[int]]:
        """For each (request, k): up to k draft tokens to follow req.all_token_ids (fewer, or none,
        when the method has no guess)."""

    def verified(self, req: Request) -> None:
        """A step appended tokens to req (accepted drafts and the one the target sampled)."""

    def finished(self, req: Request) -> None:
        """req left the engine (finished, aborted): drop its state; an index may learn its output."""
