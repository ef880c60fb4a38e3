"""A request's life: its tokens, how many are computed, its status and its timestamps.

There is no prefill phase and decode phase: a request has tokens it wants computed
(prompt + generated) and tokens already computed; each step catches some of them up. Chunked
prefill, decode and resume after preemption are the same code (vLLM v1's idea).
"""
from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from iterserve.pooling import pooled_range
from iterserve.sampling import SamplingParams
from iterserve.structured.grammar import RequestGrammar
from iterserve.thinking import ThinkingState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"  # the client went away
    FINISHED_ERROR = "error"  # the engine failed it (a failed step, a detokeniser error)
    FINISHED_SHUTDOWN = "shutdown"  # the server stopped before it finished

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR,
                        RequestStatus.FINISHED_SHUTDOWN)


class RequestRejected(ValueError):
    """A request that can never be served (too long, bad parameters, queue full)."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    def summary(self) -> dict:
        """Server-side seconds a client cannot see for itself (the `iterserve` key of answers)."""
        return {"queue_time": self.queue_time, "ttft": self.ttft, "e2e": self.e2e}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), priority: int = 0,
                 arrival_time: float | None = None, prompt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # prefix caching: the hashes of its full blocks (grown as it generates), the tokens its
        # latest admission found cached, the tokens it had computed when last preempted
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = 0
        self.num_computed_before_preemption = 0
        # parallel sampling (n > 1): a sibling waits for its leader's prompt to be cached, then
        # shares those blocks (only the last, partial block is computed again per sibling)
        self.prefix_leader: Request | None = None
        # speculative decoding: the drafts the next step verifies (set between steps), the tokens the
        # client predicted (OpenAI's `prediction`), and this request's running totals: verify rows
        # with at least one draft, draft tokens verified, drafts accepted
        self.spec_token_ids: list[int] = []
        self.prediction_token_ids: list[int] | None = params.prediction_token_ids or None
        self.spec_num_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        # LoRA: the adapter it runs under (None: the base model), and what its block hashes carry
        # besides the tokens (the adapter's identity: the same prompt under another adapter has other KV)
        self.lora_name: str | None = params.lora_name
        self.cache_key: Hashable | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None  # why it ended, for FINISHED_ERROR / FINISHED_SHUTDOWN
        self.times = RequestTimes(arrival=arrival_time if arrival_time is not None else time.monotonic())
        self.logprobs: list = []
        self.generator: torch.Generator | None = None
        self.grammar: RequestGrammar | None = None  # set once its structured-output grammar is compiled
        # a reasoning model's thinking phase (thinking.py): the grammar sees only the answer's tokens
        self.thinking: ThinkingState | None = ThinkingState(params.thinking) if params.thinking is not None else None
        # prompt logprobs (params.prompt_logprobs): one entry per prompt token computed so far, from the
        # first (None: nothing predicts it); each (logprob, rank, [(token id, logprob), ...top k])
        self.prompt_logprobs: list = [None] if params.prompt_logprobs is not None else []
        self.prompt_logprobs_sent = False
        # an embedding request (params.pooling): the sum of its pooled hidden states and the prompt
        # position up to which they are summed; `embedding` once the prompt is computed
        self.pool_range = pooled_range(params.pooling.method or "last", len(prompt_token_ids)) \
            if params.pooling is not None else (0, 0)
        self.pool_sum: torch.Tensor | None = None
        self.pooled_upto = self.pool_range[0]
        self.embedding: list[float] | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        # incremental detokenisation state
        self.output_text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._sent_text_len = 0

    # ---- token bookkeeping ------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def token_slice(self, start: int, n: int) -> list[int]:
        """Token ids start .. start + n - 1 of prompt + output, without concatenating the whole."""
        p = len(self.prompt_token_ids)
        if start + n <= p:
            return self.prompt_token_ids[start:start + n]
        if start >= p:
            return self.output_token_ids[start - p:start - p + n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:start + n - p]

    @property
    def is_pooling(self) -> bool:
        return self.params.pooling is not None

    def max_cached_tokens(self) -> int:
        """Tokens an admission may take from the prefix cache: all but the last (whose logits give the
        next token), and none from the first position whose logits (prompt logprobs) or hidden state
        (pooling) the request still needs: cached blocks are never computed, so they have neither."""
        n = self.num_tokens - 1
        if self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens:
            n = min(n, len(self.prompt_logprobs) - 1)
        if self.is_pooling and self.pooled_upto < self.pool_range[1]:
            n = min(n, self.pooled_upto)
        return n

    def prompt_logprob_rows(self, start: int, n: int) -> range:
        """The positions among start .. start + n - 1 whose logits give a prompt token's logprob not
        yet known (the logits at position p give token p + 1's)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(start + n, self.num_prompt_tokens - 1))

    def pooled_rows(self, start: int, n: int) -> range:
        """The positions among start .. start + n - 1 whose hidden states the pooling still needs."""
        if not self.is_pooling:
            return range(0)
        return range(max(start, self.pooled_upto), min(start + n, self.pool_range[1]))

    def add_pooled(self, total: torch.Tensor, upto: int) -> None:
        self.pool_sum = total if self.pool_sum is None else self.pool_sum + total
        self.pooled_upto = upto

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        if self.times.first_token is None:
            self.times.first_token = now
        self.times.last_token = now
        self.times.token_times.append(now)
        answer = self.thinking.on_token(token_id) if self.thinking is not None else True
        if self.grammar is not None and answer:
            self.grammar.accept_token(token_id)

    def check_stop_token(self, max_model_len: int) -> RequestStatus | None:
        """Stop conditions that need no text: stop ids / EOS, the grammar's end, max_tokens,
        max_model_len. A grammar that cannot finish within max_tokens ends with "length", as vLLM's."""
        last = self.output_token_ids[-1]
        if last in self._stop_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and (self.grammar.is_terminated or self.grammar.error):
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- incremental detokenisation ------------------------------------------------------------
    def detokenize_step(self, tokenizer) -> str:
        """Extends output_text with what the new tokens spell; holds back an incomplete UTF-8 tail.

        Decoding a sliding window (prefix_offset..) and emitting only what extends past read_offset
        is how HF's TextStreamer and vLLM keep SentencePiece/BPE spacing right token by token.
        """
        ids = self.output_token_ids
        if self.stop_reason is not None and isinstance(self.stop_reason, int) and ids and ids[-1] == self.stop_reason:
            ids = ids[:-1]  # the stop token itself is not part of the text
        skip = self.params.skip_special_tokens
        prefix = tokenizer.decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        full = tokenizer.decode(ids[self._prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.output_text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
        return self.output_text

    def check_stop_strings(self) -> bool:
        """Truncates output_text at the first stop string; True when one was found."""
        if not self.params.stop:
            return False
        # only the new tail can contain a stop string that was not there before
        longest = max(len(s) for s in self.params.stop)
        start = max(0, self._sent_text_len - longest + 1)
        hit = None
        for s in self.params.stop:
            j = self.output_text.find(s, start)
            if j != -1 and (hit is None or j < hit[0]):
                hit = (j, s)
        if hit is None:
            return False
        self.output_text = self.output_text[: hit[0]]
        self.stop_reason = hit[1]
        return True

    def take_text_delta(self) -> str:
        """Text not yet handed to the client; holds back a possible partial stop string."""
        hold = 0
        if self.params.stop and not self.is_finished:
            hold = max(len(s) for s in self.params.stop) - 1
        end = max(self._sent_text_len, len(self.output_text) - hold)
        delta = self.output_text[self._sent_text_len:end]
        self._sent_text_len = end
        return delta

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")


@dataclass
class RequestOutput:
    """What one step produced for one request: the new tokens, the text delta, and at the end
    the finish reason and timings."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    times: RequestTimes
    new_logprobs: list = field(default_factory=list)
    output_text: str = ""
    error: str | None = None
    # the prompt's logprobs (SamplingParams.prompt_logprobs), once, in the first output after the
    # prompt is computed: one entry per prompt token, the first None, each (logprob, rank, top)
    prompt_logprobs: list | None = None
    embedding: list[float] | None = None  # an embedding request's vector, in its final output
    # speculative decoding, this request's totals so far: verify rows with drafts, drafts, accepted
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # what ended a finished request: the stop string, or the stop token id (EOS included); None for
    # the grammar's end or a length limit. vLLM's CompletionOutput.stop_reason; the Anthropic
    # Messages API answers a stop string as its `stop_sequence`.
    stop_reason: str | int | None = None
