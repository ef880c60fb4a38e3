"""Sampling parameters and the batched sampler.

One tensor pipeline per step for the whole batch: penalties, temperature, top-k, top-p, min-p, then
inverse-CDF sampling with one uniform per row, which lets requests with a seed draw from their own
generator while the rest share one draw.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from iterserve.pooling import PoolingParams
from iterserve.structured.params import StructuredOutputsParams
from iterserve.thinking import ThinkingSpec

# Below this temperature sampling is greedy: dividing logits by a denormal overflows them to inf, and
# softmax of inf - inf is NaN. A temperature this small is argmax in all but exact ties anyway.
GREEDY_TEMPERATURE = 1e-5
# Repetition penalty bounds: logits multiplied or divided by the penalty stay finite in float32.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over the last dim as torch.argmax defines it (the first of equal maxima; a
    NaN counts as the largest), by torch.max's reduction, 2.4x argmax's speed on CPU: 16 rows x
    128,256 float32 in 0.57 against 1.37 ms, one row in 56 against 159 us (2-core AMX Xeon).
    tests/test_sampling.py checks that the two agree on ties, NaN and infinities."""
    return x.max(dim=-1).indices


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob plus the top k
    n: int = 1
    # constrained decoding (vLLM's names): the output must match this; None = free text
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> added to its logit, in [-100, 100]
    # vLLM's: each prompt token's logprob (the first one's is None) plus the top k at its position;
    # None: off. The request computes every prompt position whose logits it needs (no cached blocks)
    prompt_logprobs: int | None = None
    # an embedding request: its prompt is computed and pooled, nothing is sampled (pooling.py)
    pooling: PoolingParams | None = None
    # OpenAI's `prediction` as tokens: the text the output is expected to share much of, which
    # speculative decoding drafts from (it never changes what is sampled, only how fast)
    prediction_token_ids: list[int] | None = None
    # the LoRA adapter the request runs under (lora/; the server takes it from `model`); None: the base
    # model. It travels with the params, as pooling does, so every path to the engine carries it
    lora_name: str | None = None
    # vLLM's: special tokens are left out of the output text. The server turns it off for tool_choice
    # "auto" when its tool-call parser's markers are special tokens (Mistral's [TOOL_CALLS], Llama's
    # <|python_tag|>), which the parser must see
    skip_special_tokens: bool = True
    # a reasoning model's thinking markers, phase and budget (thinking.py; the server's reasoning parser
    # fills it): the budget forces the end marker, and the grammar above constrains only the answer
    thinking: ThinkingSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if self.n != 1:
            bad(f"n must be 1 (one SamplingParams is one sequence; the server's n > 1 runs one per choice), "
                f"got {self.n}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], "
                f"got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad(f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}")
        if self.pooling is not None and (self.structured_outputs is not None or self.prompt_logprobs is not None):
            bad("an embedding request (pooling) samples nothing: no structured outputs or prompt_logprobs")
        if self.prediction_token_ids is not None and (
                not isinstance(self.prediction_token_ids, list)
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.prediction_token_ids)):
            bad("prediction_token_ids must be a list of token ids (integers >= 0)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > 16:
            bad("at most 16 stop strings")
        for tok, bias in (self.logit_bias or {}).items():
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                bad(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
            if not -100.0 <= bias <= 100.0:
                bad(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


CDF_CHUNK = 1024  # vocabulary entries per chunk of sample_inverse_cdf's two-level search


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [n, vocab] (rows need not sum to 1), where the row's cumulative
    mass first passes u [n] (uniform in [0, 1), float64) times its total: exact inverse-CDF
    sampling with one random number per row. The exponential race (argmax of p / Exp(1)) drew one
    per vocabulary entry: 87 ms for 16 rows of Gemma 3's 262k vocabulary, against 1-2 ms here
    (Zen 5). Two levels keep float32's running sums short: the chunks' totals, accumulated in
    float64, pick the chunk; a float32 cumulative sum inside that chunk alone picks the token. A
    token of zero mass is never chosen."""
    n, vocab = probs.shape
    pad = -vocab % CDF_CHUNK
    chunks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs.contiguous()).view(n, -1, CDF_CHUNK)
    chunk_cdf = chunks.sum(-1).double().cumsum(-1)  # [n, vocab / chunk]: float32 sums of 1024, then float64
    r = (u * chunk_cdf[:, -1]).unsqueeze(1)
    ci = torch.searchsorted(chunk_cdf, r, right=True).clamp_(max=chunk_cdf.shape[1] - 1)  # [n, 1]
    before = torch.where(ci > 0, chunk_cdf.gather(1, (ci - 1).clamp(min=0)), 0.0)
    rows = torch.arange(n, device=probs.device)
    inner = chunks[rows, ci.squeeze(1)].cumsum(-1)  # [n, chunk] float32
    j = torch.searchsorted(inner, (r - before).to(inner.dtype), right=True).clamp_(max=CDF_CHUNK - 1)
    token = (ci * CDF_CHUNK + j).squeeze(1).clamp_(max=vocab - 1)
    # rounding at a chunk's or the row's end can land on an entry of zero mass: take the row's best
    landed = probs[rows, token] > 0
    return token if bool(landed.all()) else torch.where(landed, token, first_argmax(probs))


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: (chosen token logprob, [(token id, logprob), ...top k]) or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    """Samples one token per row of a [batch, vocab] logits tensor. argmax: the rows' greedy choice,
    first_argmax's numbers (a platform may hand in a faster kernel of the same definition)."""

    def __init__(self, vocab_size: int, argmax: Callable[[torch.Tensor], torch.Tensor] = first_argmax) -> None:
        self.vocab_size = vocab_size
        self.argmax = argmax

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 token_histories: list[list[int]], prompt_lens: list[int],
                 generators: list[torch.Generator | None]) -> SampleResult:
        raw = logits.float()
        n, dev = raw.shape[0], raw.device
        probs, greedy_rows, chosen = self._distributions(raw, params, token_histories, prompt_lens)
        if probs is not None:
            sampled = sample_inverse_cdf(probs, self.uniforms(n, generators, dev))
            chosen = torch.where(greedy_rows, chosen, sampled)
        token_ids = chosen.tolist()
        return SampleResult(token_ids, self.logprobs(raw, token_ids, params))

    def _distributions(self, raw: torch.Tensor, params: list[SamplingParams], token_histories: list[list[int]],
                       prompt_lens: list[int]) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(the probabilities rows are sampled from, or None when every row is greedy; which rows
        are greedy; each row's argmax after penalties)."""
        logits = raw
        dev = raw.device
        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits.clone(), params, token_histories, prompt_lens)
        temps = torch.tensor([p.temperature for p in params], device=dev)
        greedy_rows = temps < GREEDY_TEMPERATURE
        chosen = self.argmax(logits)
        if bool(greedy_rows.all()):
            return None, greedy_rows, chosen
        scaled = logits / torch.where(greedy_rows, 1.0, temps).unsqueeze(1)
        scaled = self._apply_top_k_top_p_min_p(scaled, params)
        probs = scaled.softmax(dim=-1)
        # no NaN reaches the sampling: a row that is not a distribution (non-finite logits) is greedy.
        # A NaN anywhere in a row makes its sum NaN: one reduction instead of a pass per test
        # (each op over a vocabulary row costs tens of us, a twentieth of a 1-row step's sampling)
        broken = ~torch.isfinite(probs.sum(dim=-1))
        if bool(broken.any()):
            probs = probs.nan_to_num(0.0)
        return probs, greedy_rows | broken, chosen

    def target_probs(self, logits: torch.Tensor, params: list[SamplingParams], token_histories: list[list[int]],
                     prompt_lens: list[int]) -> torch.Tensor:
        """What each row's token is drawn from, as probabilities [n, vocab] (float32): the same
        penalties, temperature, top-k, top-p and min-p as __call__, a greedy row one-hot at its
        argmax. Speculative decoding's acceptance rule (rejection_sampler.py) needs p itself."""
        raw = logits.float()
        probs, greedy_rows, chosen = self._distributions(raw, params, token_histories, prompt_lens)
        one_hot = torch.zeros_like(raw).scatter_(1, chosen.unsqueeze(1), 1.0)
        return one_hot if probs is None else torch.where(greedy_rows.unsqueeze(1), one_hot, probs)

    @staticmethod
    def uniforms(n: int, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
        """One uniform in [0, 1) per row (float64): a row with its own generator (a request's seed)
        draws from it, on the generator's device (CPU), so seeded rows also work on CUDA."""
        u = torch.rand(n, dtype=torch.float64, device=device)
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand(1, dtype=torch.float64, generator=g, device=g.device).item()
        return u

    @staticmethod
    def logprobs(raw: torch.Tensor, token_ids: list[int], params: list[SamplingParams]) -> list:
        """Each row's chosen token's logprob and top k from the raw logits (OpenAI's logprobs are the
        model's, before sampling's processing), for the rows that asked; None for the others."""
        n = len(token_ids)
        logprobs: list = [None] * n
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp = raw[want].float().log_softmax(dim=-1)
            k = max(params[i].logprobs for i in want)
            top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (None, None)
            for row, i in enumerate(want):
                kk = params[i].logprobs
                top = [] if kk == 0 else list(zip(top_i[row, :kk].tolist(), top_v[row, :kk].tolist()))
                logprobs[i] = (float(lp[row, token_ids[i]]), top)
        return logprobs

    def _apply_penalties(self, logits: torch.Tensor, params: list[SamplingParams],
                         histories: list[list[int]], prompt_lens: list[int]) -> torch.Tensor:
        n, dev = logits.shape[0], logits.device
        maxlen = max(1, max(len(h) for h in histories))
        ids = torch.full((n, maxlen), self.vocab_size, dtype=torch.long)
        is_out = torch.zeros((n, maxlen), dtype=torch.float32)
        for i, h in enumerate(histories):
            ids[i, : len(h)] = torch.tensor(h, dtype=torch.long)
            is_out[i, prompt_lens[i]: len(h)] = 1.0
        ids, is_out = ids.to(dev), is_out.to(dev)
        # counts over vocab + 1 (the extra column absorbs padding)
        seen = torch.zeros((n, self.vocab_size + 1), device=dev)
        seen.scatter_(1, ids, 1.0)
        out_counts = torch.zeros((n, self.vocab_size + 1), device=dev)
        out_counts.scatter_add_(1, ids, is_out)
        seen, out_counts = seen[:, :-1], out_counts[:, :-1]

        rep = torch.tensor([p.repetition_penalty for p in params], device=dev).unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen > 0, penalised, logits)
        freq = torch.tensor([p.frequency_penalty for p in params], device=dev).unsqueeze(1)
        pres = torch.tensor([p.presence_penalty for p in params], device=dev).unsqueeze(1)
        return logits - freq * out_counts - pres * (out_counts > 0).float()

    @staticmethod
    def _apply_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        dev = logits.device
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=dev).unsqueeze(0)
            drop = ranks >= top_k.unsqueeze(1)
            probs = sorted_logits.softmax(dim=-1)
            # drop a token when the mass strictly before it already reaches top_p
            drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        if bool((min_p > 0).any()):
            probs = logits.softmax(dim=-1)
            thresh = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < thresh, float("-inf"))
        return logits
