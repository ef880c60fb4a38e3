"""A request's thinking phase as the engine sees it: token ids, not text.

A reasoning model writes its thinking between two markers (`<think>` ... `</think>`; Granite's
"Here is my thought process:" ... "Here is my response:") and then its answer. The server's
reasoning parsers (server/reasoning/) split the *text*; the engine needs the same boundary in
*tokens* for two things it does while sampling, per request:

- a thinking budget: once the thinking has taken `budget` tokens, the tokens of the end marker are
  forced one by one (every other logit set to -inf), and the model goes on to its answer;
- structured outputs and forced tool calls constrain the answer, not the thinking: the grammar
  sees no token before the end marker, and its mask is applied only after it.

The server fills a `ThinkingSpec` per request (the marker ids from the tokenizer, the phase the
prompt leaves the model in) and puts it in SamplingParams; the Request keeps a `ThinkingState`.
Markers are matched as token sequences on the sampled ids, so a marker the model spells with other
tokens than the tokenizer's own encoding is not seen (the text parser still splits the text).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(str, enum.Enum):
    UNDECIDED = "undecided"  # the model may open a thinking block with its first tokens (Qwen3's template)
    THINKING = "thinking"  # everything until the end marker is thinking
    ANSWER = "answer"  # the answer: the grammar, if any, applies


@dataclass(frozen=True)
class ThinkingSpec:
    """Shared by the choices of one request (each choice's Request has its own ThinkingState)."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    phase: Phase = Phase.THINKING  # the phase at the first output token
    budget: int | None = None  # thinking tokens before the end marker is forced; None: unlimited

    def __post_init__(self) -> None:
        if not self.end_ids:
            raise ValueError("a thinking spec needs the end marker's token ids")
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"the thinking budget must be >= 0 (or None: unlimited), got {self.budget}")


class ThinkingState:
    """Follows one request's sampled tokens through its phases."""

    def __init__(self, spec: ThinkingSpec) -> None:
        self.spec = spec
        self.phase = spec.phase
        self.num_thinking_tokens = 0  # tokens since the thinking began (start marker excluded)
        self._head: list[int] = []  # UNDECIDED: the leading tokens that match the start marker so far
        self._tail: list[int] = []  # THINKING: the last tokens, to find the end marker
        self._skipping_start = spec.phase == Phase.THINKING and bool(spec.start_ids)

    @property
    def answering(self) -> bool:
        return self.phase == Phase.ANSWER

    @property
    def allows_drafts(self) -> bool:
        """Speculative drafts are verified without the forcing below: only an answering request drafts."""
        return self.phase == Phase.ANSWER

    def on_token(self, token_id: int) -> bool:
        """Follows a sampled token; True when it belongs to the answer (the grammar must see it)."""
        if self.phase == Phase.ANSWER:
            return True
        start, end = self.spec.start_ids, self.spec.end_ids
        if self.phase == Phase.UNDECIDED:
            if start and len(self._head) < len(start) and token_id == start[len(self._head)]:
                self._head.append(token_id)
                if len(self._head) == len(start):
                    self.phase = Phase.THINKING
                return False
            self.phase = Phase.ANSWER  # the model answered without thinking
            return True
        if self._skipping_start:  # a start marker the model writes although the prompt opened the block
            if len(self._head) < len(start) and token_id == start[len(self._head)]:
                self._head.append(token_id)
                self._skipping_start = len(self._head) < len(start)
                return False
            self._skipping_start = False
            self.num_thinking_tokens += len(self._head)  # it was not the marker after all
        self.num_thinking_tokens += 1
        self._tail = (self._tail + [token_id])[-len(end):]
        if tuple(self._tail) == end:
            self.phase = Phase.ANSWER
        return False

    def forced_token(self, has_grammar: bool) -> int | None:
        """The token the next step must sample, or None to sample freely.

        THINKING past the budget: the next token of the end marker (continuing a marker the model
        has begun). UNDECIDED with a grammar: a start marker the model has begun is completed, since
        the grammar has not seen it and could not take it as the answer's first tokens."""
        if self.phase == Phase.THINKING and self.spec.budget is not None \
                and self.num_thinking_tokens >= self.spec.budget and not (self._skipping_start and self._head):
            return self.spec.end_ids[_partial_match(self._tail, self.spec.end_ids)]
        if self.phase == Phase.UNDECIDED and has_grammar and self._head:
            return self.spec.start_ids[len(self._head)]
        return None

    def gate_token(self) -> int | None:
        """UNDECIDED with a grammar, before any token: the start marker's first token, allowed next
        to the grammar's own (the model may think first, or answer at once under the grammar)."""
        if self.phase == Phase.UNDECIDED and not self._head and self.spec.start_ids:
            return self.spec.start_ids[0]
        return None


def _partial_match(tail: list[int], marker: tuple[int, ...]) -> int:
    """Length of the longest suffix of tail that is a proper prefix of marker."""
    for k in range(min(len(tail), len(marker) - 1), 0, -1):
        if tuple(tail[-k:]) == marker[:k]:
            return k
    return 0
