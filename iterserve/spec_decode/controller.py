"""Which requests speculate in the next step, and how far: the engine asks once per step.

A row that verifies k drafts costs more than a one-token row and yields 1 + (accepted drafts)
tokens. With a per-token acceptance estimate a, k drafts yield (1 - a^(k+1)) / (1 - a) tokens on
average (drafts are accepted in order, each with probability a), so each row takes the k that
maximises that per unit of cost, cost = 1 + EXTRA_TOKEN_COST x k. The estimate is the row's own,
from its recent verifications (an exponential average of accepted drafts over trials); a row
whose estimate falls so low that no k pays stops drafting and tries one draft again after
PROBE_AFTER steps. Above `disable_by_batch_size` running requests nobody drafts: the step is then
compute-bound, and a draft row's compute is better spent on other rows.

A request that brings OpenAI's `prediction` drafts with or without a server-wide method: the
ngram and suffix proposers look it up beside the request's own tokens; a server with no method, or
a draft model, looks it up with the ngram proposer first (spec_decode/ngram.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from iterserve.config import SpeculativeConfig
from iterserve.request import Request
from iterserve.spec_decode.ngram import NgramProposer
from iterserve.spec_decode.proposer import Proposer

# Step time of one more verified token in a row, relative to a one-token row's: SmolLM2 alone on
# Zen 5, a step of 1 + k tokens took 1 + 0.12 k times a one-token step's (docs/speculative.md)
EXTRA_TOKEN_COST = 0.12
PRIOR_ACCEPTANCE = 0.6  # a new request's per-token acceptance estimate
EMA_WEIGHT = 0.3  # weight of the latest verification in the estimate
PROBE_AFTER = 16  # steps a row that stopped drafting waits before trying one draft again


def expected_tokens(a: float, k: int) -> float:
    """Tokens a row yields on average when it verifies k drafts, each accepted with probability a
    given the ones before it were: 1 + a + a^2 + ... + a^k."""
    return k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def best_num_drafts(a: float, k_max: int, extra_cost: float = EXTRA_TOKEN_COST) -> int:
    return max(range(k_max + 1), key=lambda k: (expected_tokens(a, k) / (1.0 + extra_cost * k), -k))


@dataclass
class _RowState:
    accepted: float = PRIOR_ACCEPTANCE  # exponential averages of accepted drafts and of trials
    trials: float = 1.0
    idle_steps: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.trials if self.trials > 0 else PRIOR_ACCEPTANCE


class SpecController:
    def __init__(self, config: SpeculativeConfig | None, proposer: Proposer | None,
                 predictions: bool = True) -> None:
        """predictions: whether requests' `prediction` drafts without a method (not under static
        batching, whose fixed batches plan one token per row: there it is a hint left unused)."""
        self.config = config or SpeculativeConfig()  # prediction-only servers: the ngram defaults
        self.proposer = proposer if config is not None else None
        # requests with a prediction, where the method does not read it
        self.predictor = NgramProposer.from_config(self.config) \
            if predictions and (config is None or config.method == "draft_model") else None
        self._rows: dict[str, _RowState] = {}

    @property
    def enabled(self) -> bool:
        """Whether any request may draft (a server-wide method; `prediction` works without one)."""
        return self.proposer is not None

    def _state(self, req: Request) -> _RowState:
        st = self._rows.get(req.request_id)
        if st is None:
            st = self._rows[req.request_id] = _RowState()
        return st

    def num_drafts(self, req: Request) -> int:
        st = self._state(req)
        k_max = min(self.config.num_speculative_tokens, req.params.max_tokens - req.num_output_tokens - 1)
        if k_max < 1:
            return 0
        k = best_num_drafts(st.acceptance, k_max)
        if k == 0:
            st.idle_steps += 1
            if st.idle_steps >= PROBE_AFTER:
                st.idle_steps, k = 0, 1
        return k

    def propose(self, running: list[Request]) -> None:
        """Sets spec_token_ids of the running requests whose next step is one decoding token."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        items: list[tuple[Request, int]] = []
        predicted: list[tuple[Request, int]] = []
        for req in running:
            if req.num_tokens - req.num_computed_tokens != 1 or req.is_pooling or req.is_finished:
                continue
            by_prediction = self.predictor is not None and bool(req.prediction_token_ids)
            if self.proposer is None and not by_prediction:
                continue
            k = self.num_drafts(req)
            if k:
                (predicted if by_prediction else items).append((req, k))
        if predicted:
            for (req, k), drafts in zip(predicted, self.predictor.propose(predicted)):
                if drafts:
                    req.spec_token_ids = list(drafts[:k])
                elif self.proposer is not None:  # a draft model guesses where the prediction has nothing
                    items.append((req, k))
        if items:
            for (req, k), drafts in zip(items, self.proposer.propose(items)):
                req.spec_token_ids = list(drafts[:k])

    def verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """A step appended tokens to req, after verifying num_drafts drafts (0: it had none)."""
        if num_drafts:
            st = self._state(req)
            trials = num_accepted + (1 if num_accepted < num_drafts else 0)
            st.accepted = (1 - EMA_WEIGHT) * st.accepted + EMA_WEIGHT * num_accepted
            st.trials = (1 - EMA_WEIGHT) * st.trials + EMA_WEIGHT * trials
            st.idle_steps = 0
        for p in self._proposers(req):
            p.verified(req)

    def finished(self, req: Request) -> None:
        self._rows.pop(req.request_id, None)
        for p in self._proposers(req):
            p.finished(req)

    def _proposers(self, req: Request) -> list[Proposer]:
        """Those that may hold state for req: the method's, and the predictor for a prediction."""
        out = [self.proposer] if self.proposer is not None else []
        if self.predictor is not None and req.prediction_token_ids:
            out.append(self.predictor)
        return out

