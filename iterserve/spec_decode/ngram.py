"""Prompt lookup (vLLM's method "ngram"): the tokens that followed the latest earlier occurrence of
the context's last n tokens are the draft. Input-grounded work (rewrite, edit, summarise a given
text or code) copies long runs of its prompt, and a lookup costs a few dict probes.

The index is built incrementally: a request's prompt is indexed once, then each step adds only the
tokens it appended, so a step costs O(new tokens x number of n) per request, never a rescan of a
long prompt (vLLM's CPU proposer rescans the whole context with a KMP-like search each step).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from iterserve.request import Request
from iterserve.spec_decode.proposer import Proposer


class NgramIndex:
    """For each n in [min_n, max_n]: n-gram -> the position of the token that followed its latest
    occurrence in the indexed sequence. An n-gram enters the index only once a token follows it, so
    the sequence's own end (the tail we look up) is never found as its own match.

    Memory: one tuple key per position per n, overwritten in place when an n-gram recurs.
    """

    def __init__(self, min_n: int, max_n: int, tokens: Sequence[int] = ()) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._follow: dict[int, dict[tuple[int, ...], int]] = {}
        self.reset()
        self.extend(tokens)

    def reset(self) -> None:
        self.tokens = []
        self._follow = {n: {} for n in range(self.min_n, self.max_n + 1)}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends tokens; each new position p gives the n-grams ending at p - 1 a follower."""
        seq = self.tokens
        for t in tokens:
            p = len(seq)
            for n in range(self.min_n, min(self.max_n, p) + 1):
                self._follow[n][tuple(seq[p - n:p])] = p
            seq.append(t)

    def lookup(self, tail: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest occurrence of tail's last n tokens, for the
        largest n in [min_n, max_n] that occurs; [] when none does (or k < 1)."""
        return self.match(tail, k)[1]

    def match(self, tail: Sequence[int], k: int) -> tuple[int, list[int]]:
        """lookup's draft with the matched n (0: no match): callers that weigh sources compare it."""
        if k < 1:
            return 0, []
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            p = self._follow[n].get(tuple(tail[len(tail) - n:]))
            if p is not None:
                return n, self.tokens[p:p + k]
        return 0, []


def sync_index(index: NgramIndex, req: Request) -> None:
    """Brings an index over req's prompt + output up to date: only the tokens appended since.
    A request's tokens only grow (rejected drafts never enter them); if the index nonetheless
    disagrees at its last token (a request id reused), it is rebuilt."""
    have = len(index)
    if have and (have > req.num_tokens or index.tokens[-1] != req.token_at(have - 1)):
        index.reset()
        have = 0
    if have < req.num_tokens:
        index.extend(req.token_slice(have, req.num_tokens - have))


@dataclass
class _NgramState:
    context: NgramIndex
    prediction: NgramIndex | None = None  # over the client's `prediction`, built once
    seen_prediction: bool = False


class NgramProposer(Proposer):
    """Prompt lookup in the request's own prompt + output, and in the client's `prediction`
    (OpenAI's predicted outputs) when it sent one. While the output is the prediction's opening,
    the prediction's next tokens are the draft; after that the longer match wins, and on equal
    length the prediction (the client's own statement of what comes next) does."""

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._state: dict[str, _NgramState] = {}

    @classmethod
    def from_config(cls, spec) -> NgramProposer:
        return cls(spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _get(self, req: Request) -> _NgramState:
        st = self._state.get(req.request_id)
        if st is None:
            st = self._state[req.request_id] = _NgramState(NgramIndex(self.min_n, self.max_n))
        if not st.seen_prediction:
            st.seen_prediction = True
            if req.prediction_token_ids:
                st.prediction = NgramIndex(self.min_n, self.max_n, req.prediction_token_ids)
        sync_index(st.context, req)
        return st

    def propose(self, items: list[tuple[Request, int]]) -> list[list[int]]:
        out: list[list[int]] = []
        for req, k in items:
            st = self._get(req)
            tail = req.token_slice(max(0, req.num_tokens - self.max_n), min(self.max_n, req.num_tokens))
            pred, done = req.prediction_token_ids, req.num_output_tokens
            if pred and 0 < done < len(pred) and pred[:done] == req.output_token_ids:
                out.append(list(pred[done:done + k]))  # the output so far is the prediction's opening
                continue
            n, draft = st.context.match(tail, k)
            if st.prediction is not None:
                pn, pdraft = st.prediction.match(tail, k)
                if pn >= n and pdraft:
                    draft = pdraft
            out.append(draft)
        return out

    def verified(self, req: Request) -> None:
        st = self._state.get(req.request_id)
        if st is not None:
            sync_index(st.context, req)

    def finished(self, req: Request) -> None:
        self._state.pop(req.request_id, None)
