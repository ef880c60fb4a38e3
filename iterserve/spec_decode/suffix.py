"""Suffix decoding (Arctic Inference's method, vLLM's "suffix"): frequency-counted suffix tries over
the outputs of recently finished requests and over the request's own prompt + output. Agentic and
repetitive workloads repeat whole runs of earlier answers; a trie counts how often each
continuation followed a context, so a draft can be as long as its estimated probability allows
instead of a fixed k.

Pure Python with dicts. Costs, with D = suffix_decoding_max_tree_depth and k the draft cap:
- per appended token of a running request: O(D) (its trie's cursor extends D suffixes);
- indexing a prompt (once) or the prediction (once): O(tokens x D); memory up to D nodes a token;
- learning a finished output, and evicting it later: O(output tokens x D);
- a proposal: O(D^2) dict probes to match in the global trie (O(D) in the request's own, whose
  cursor already holds its suffixes' nodes) plus O(D x k) to walk drafts (each node keeps its most
  frequent child, so a walk never scans a vocabulary of children).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from iterserve.request import Request
from iterserve.spec_decode.proposer import Proposer


class _Node:
    """count: how many indexed occurrences of the path reach this node; best: its most frequent child."""
    __slots__ = ("count", "children", "best")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}
        self.best: int | None = None

    def bump(self, token: int, delta: int) -> _Node | None:
        """The child for token with its count moved by delta (created on +, pruned at zero); None
        when it is gone. Keeps `best` right: O(1) on an increment, O(children) when the best
        child loses counts (eviction only)."""
        child = self.children.get(token)
        if child is None:
            if delta <= 0:
                return None
            child = self.children[token] = _Node()
        child.count += delta
        if delta > 0:
            if self.best is None or (self.best != token and child.count > self.children[self.best].count):
                self.best = token
        else:
            if child.count <= 0:
                del self.children[token]
            if self.best == token:
                self.best = max(self.children, key=lambda t: self.children[t].count) if self.children else None
        return child if child.count > 0 else None


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    score: float = 0.0  # the sum of the prefixes' estimated probabilities: expected accepted tokens

    def better_than(self, other: Draft) -> bool:
        return (self.score, len(self.tokens)) > (other.score, len(other.tokens))


class SuffixTrie:
    """All suffixes of the indexed sequences, truncated to `depth` tokens, with counts."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: Sequence[int], delta: int = 1) -> None:
        """Indexes (delta=+1) or forgets (delta=-1) every suffix of one sequence: O(len x depth).
        Forgetting a sequence that was added before removes exactly its counts; a node whose count
        reaches zero is cut off with its subtree (a child never counts more than its parent)."""
        for i in range(len(tokens)):
            self.root.count += delta
            node: _Node | None = self.root
            for t in tokens[i:i + self.depth]:
                node = node.bump(t, delta)
                if node is None:
                    break

    def find(self, path: Sequence[int]) -> _Node | None:
        node: _Node | None = self.root
        for t in path:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def matches(self, tail: Sequence[int]) -> list[tuple[int, _Node]]:
        """(m, node) for each suffix of tail of length m < depth that is a path with a continuation,
        longest first: O(depth^2) probes at most."""
        out = []
        for m in range(min(self.depth - 1, len(tail)), 0, -1):
            node = self.find(tail[len(tail) - m:])
            if node is not None and node.children:
                out.append((m, node))
        return out


def walk(node: _Node, limit: int, min_prob: float, own_count: int = 0) -> Draft:
    """Follows the most frequent child while the product of child/parent counts stays >= min_prob.
    own_count: occurrences counted in `node` that cannot have a follower yet (the context's own
    end, in the request's trie)."""
    draft = Draft()
    prob, parent = 1.0, node.count - own_count
    while len(draft.tokens) < limit and node.best is not None and parent > 0:
        child = node.children[node.best]
        prob *= child.count / parent
        if prob < min_prob:
            break
        draft.tokens.append(node.best)
        draft.score += prob
        node, parent = child, child.count
    return draft


class TrieCursor:
    """A request's own trie, grown token by token: `active[m - 1]` is the node of the context's
    suffix of length m (m < depth), so each append extends them all in O(depth) and matching the
    context needs no search."""

    def __init__(self, depth: int) -> None:
        self.trie = SuffixTrie(depth)
        self.active: list[_Node] = []
        self.num_tokens = 0
        self.last_token: int | None = None

    def extend(self, tokens: Sequence[int]) -> None:
        depth, root = self.trie.depth, self.trie.root
        for t in tokens:
            root.count += 1
            nodes = [root.bump(t, 1)] + [n.bump(t, 1) for n in self.active]
            self.active = nodes[:depth - 1]
            self.num_tokens += 1
            self.last_token = t

    def matches(self) -> list[tuple[int, _Node]]:
        return [(m, n) for m, n in reversed(list(enumerate(self.active, 1))) if n.children]  # longest first


@dataclass
class _RequestState:
    cursor: TrieCursor


class SuffixProposer(Proposer):
    """Drafts from the global trie of finished outputs and from the request's own trie (prompt,
    output and the client's `prediction`); the draft with the larger expected accepted length wins."""

    def __init__(self, depth: int = 24, max_cached_requests: int = 1000, spec_factor: float = 1.0,
                 min_token_prob: float = 0.1) -> None:
        self.depth = depth
        self.max_cached_requests = max_cached_requests
        self.spec_factor = spec_factor
        self.min_token_prob = min_token_prob
        self.global_trie = SuffixTrie(depth)
        self._cached: deque[list[int]] = deque()  # learnt outputs, oldest first
        self._state: dict[str, _RequestState] = {}

    @classmethod
    def from_config(cls, spec) -> SuffixProposer:
        return cls(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                   spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob)

    # ---- per-request index ------------------------------------------------------------------
    def _sync(self, req: Request) -> _RequestState:
        st = self._state.get(req.request_id)
        if st is not None and (st.cursor.num_tokens > req.num_tokens or (
                st.cursor.num_tokens and st.cursor.last_token != req.token_at(st.cursor.num_tokens - 1))):
            st = None  # not the sequence it indexed (a reused id): start again
        if st is None:
            st = self._state[req.request_id] = _RequestState(TrieCursor(self.depth))
            if req.prediction_token_ids:  # its own sequence in the trie: continuations, not context
                st.cursor.trie.add(req.prediction_token_ids)
        have = st.cursor.num_tokens
        if have < req.num_tokens:
            st.cursor.extend(req.token_slice(have, req.num_tokens - have))
        return st

    def _limit(self, m: int, k: int) -> int:
        return min(k, math.ceil(self.spec_factor * m), self.depth - m)

    def propose(self, items: list[tuple[Request, int]]) -> list[list[int]]:
        out: list[list[int]] = []
        for req, k in items:
            st = self._sync(req)
            best = Draft()
            for m, node in st.cursor.matches():
                # the cursor's node counts the context's own end, which has no follower yet
                d = walk(node, self._limit(m, k), self.min_token_prob, own_count=1)
                if d.better_than(best):
                    best = d
            if self.global_trie.root.children:
                tail = req.token_slice(max(0, req.num_tokens - self.depth + 1), min(self.depth - 1, req.num_tokens))
                for m, node in self.global_trie.matches(tail):
                    d = walk(node, self._limit(m, k), self.min_token_prob)
                    if d.better_than(best):
                        best = d
            out.append(best.tokens)
        return out

    def verified(self, req: Request) -> None:
        if req.request_id in self._state:
            self._sync(req)

    def finished(self, req: Request) -> None:
        """Learns req's output into the global trie; forgets the oldest learnt output past the cap."""
        self._state.pop(req.request_id, None)
        if self.max_cached_requests <= 0 or not req.output_token_ids:
            return
        tokens = list(req.output_token_ids)
        self.global_trie.add(tokens)
        self._cached.append(tokens)
        while len(self._cached) > self.max_cached_requests:
            self.global_trie.add(self._cached.popleft(), -1)
