"""Sampling: the batched Sampler on crafted logits (exact definitions), and seeds, temperature,
top-k/top-p and logprobs through the engine on the tiny model."""
from __future__ import annotations

import math

import pytest
import torch

from iterserve.sampling import GREEDY_TEMPERATURE, Sampler, SamplingParams, first_argmax

VOCAB = 6


def sample(logits: torch.Tensor, params: list[SamplingParams], histories=None, prompt_lens=None,
           generators=None):
    n = logits.shape[0]
    return Sampler(logits.shape[1])(
        logits, params, histories or [[] for _ in range(n)], prompt_lens or [0] * n,
        generators or [None] * n)


def frequencies(logits_row: list[float], params: SamplingParams, n: int = 6000) -> torch.Tensor:
    """Empirical distribution of n draws (one batch of n identical rows)."""
    torch.manual_seed(1234)
    logits = torch.tensor([logits_row] * n)
    ids = sample(logits, [params] * n).token_ids
    return torch.bincount(torch.tensor(ids), minlength=len(logits_row)).float() / n


PROBS = [0.5, 0.3, 0.15, 0.05, 0.0, 0.0]
LOGITS = [math.log(p) if p else -1e9 for p in PROBS]


# ---- the sampler's definitions -----------------------------------------------------------------
def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0)] * 2).token_ids == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_first_argmax_is_torch_argmax_on_ties_nan_and_infinities(dtype):
    """The sampler's greedy choice (first_argmax, by torch.max) is torch.argmax's: the first of
    equal maxima, a NaN the largest (the first NaN), +inf over finite, an all -inf row its first."""
    g = torch.Generator().manual_seed(0)
    for vocab in (7, 100, 49152):
        x = torch.randint(0, 4, (12, vocab), generator=g).float()  # every row full of ties
        x[1, torch.randperm(vocab, generator=g)[:3]] = float("nan")
        x[2] = float("-inf")
        x[3, [vocab // 2, vocab - 1]] = float("inf")
        x[4, -1] = 10.0
        x = x.to(dtype)
        assert torch.equal(first_argmax(x), x.argmax(dim=-1))
        assert torch.equal(first_argmax(x[5]), x[5].argmax())
    greedy = sample(torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("nan"), 1.0, float("nan"), 2.0]]),
                    [SamplingParams(temperature=0)] * 2)
    assert greedy.token_ids == [1, 0]


def test_temperature_one_samples_the_softmax():
    freq = frequencies(LOGITS, SamplingParams(temperature=1.0))
    assert torch.allclose(freq, torch.tensor(PROBS), atol=0.025)


def test_temperature_sharpens_and_flattens():
    target_hot = torch.tensor(LOGITS).div(2.0).softmax(-1)
    target_cold = torch.tensor(LOGITS).div(0.5).softmax(-1)
    assert torch.allclose(frequencies(LOGITS, SamplingParams(temperature=2.0)), target_hot, atol=0.025)
    assert torch.allclose(frequencies(LOGITS, SamplingParams(temperature=0.5)), target_cold, atol=0.025)


@pytest.mark.parametrize("params,allowed", [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_k=1), {0}),
    (SamplingParams(top_p=0.8), {0, 1}),  # mass before token 2 is 0.8: dropped
    (SamplingParams(top_p=0.81), {0, 1, 2}),
    (SamplingParams(top_p=1e-6), {0}),
    (SamplingParams(min_p=0.5), {0, 1}),  # keeps p >= 0.5 * 0.5
    (SamplingParams(min_p=0.2), {0, 1, 2}),
    (SamplingParams(top_k=3, min_p=0.5), {0, 1}),
])
def test_filters_keep_exactly_the_defined_tokens(params, allowed):
    freq = frequencies(LOGITS, params, n=3000)
    seen = {i for i, f in enumerate(freq.tolist()) if f > 0}
    assert seen == allowed
    # what is kept is sampled in proportion to its renormalised probability
    mass = sum(PROBS[i] for i in allowed)
    for i in allowed:
        assert freq[i].item() == pytest.approx(PROBS[i] / mass, abs=0.03)


def test_rows_use_their_own_params_in_one_batch():
    logits = torch.tensor([LOGITS] * 4)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(temperature=5.0),
              SamplingParams(temperature=0)]
    for _ in range(20):
        ids = sample(logits, params).token_ids
        assert ids[0] == ids[1] == ids[3] == 0


def test_repetition_penalty_definition():
    """Seen tokens (prompt and output): positive logits divided by the penalty, negative multiplied."""
    s = Sampler(VOCAB)
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0, 0.0]])
    out = s._apply_penalties(logits.clone(), [SamplingParams(repetition_penalty=2.0)], [[0, 2]], [1])
    assert out.tolist() == [[1.0, 1.0, -2.0, 0.5, 0.0, 0.0]]


def test_frequency_and_presence_penalties_count_output_only():
    s = Sampler(VOCAB)
    logits = torch.zeros(1, VOCAB)
    hist = [[1, 1, 3, 3, 3, 4]]  # prompt [1, 1]; output 3, 3, 3, 4
    out = s._apply_penalties(logits.clone(), [SamplingParams(frequency_penalty=0.5)], hist, [2])
    assert out.tolist() == [[0.0, 0.0, 0.0, -1.5, -0.5, 0.0]]
    out = s._apply_penalties(logits.clone(), [SamplingParams(presence_penalty=0.7)], hist, [2])
    assert out[0].tolist() == pytest.approx([0.0, 0.0, 0.0, -0.7, -0.7, 0.0])
    out = s._apply_penalties(logits.clone(), [SamplingParams(frequency_penalty=-0.5, presence_penalty=1.0)],
                             hist, [2])
    assert out[0].tolist() == pytest.approx([0.0, 0.0, 0.0, 1.5 - 1.0, 0.5 - 1.0, 0.0])


def test_penalties_change_the_choice_and_only_for_their_row():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0]] * 2)
    params = [SamplingParams(temperature=0, repetition_penalty=2.0), SamplingParams(temperature=0)]
    res = sample(logits, params, histories=[[0], [0]], prompt_lens=[1, 1])
    assert res.token_ids == [1, 0]
    params = [SamplingParams(temperature=0, presence_penalty=0.6), SamplingParams(temperature=0)]
    res = sample(logits, params, histories=[[3, 0], [3, 0]], prompt_lens=[1, 1])
    assert res.token_ids == [1, 0]


def test_penalised_distribution_is_sampled():
    """A presence penalty of log(2) halves the odds of the seen token, as the definition says."""
    logits = torch.tensor([[0.0, 0.0, -1e9, -1e9]] * 4000)
    params = [SamplingParams(presence_penalty=math.log(2))] * 4000
    torch.manual_seed(7)
    ids = torch.tensor(sample(logits, params, histories=[[3, 0]] * 4000, prompt_lens=[1] * 4000).token_ids)
    assert (ids == 0).float().mean().item() == pytest.approx(1 / 3, abs=0.03)


def test_logprobs_match_log_softmax_of_raw_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.7, logprobs=0),
              SamplingParams(temperature=0)]
    res = sample(logits, params)
    lp = logits.log_softmax(-1)
    chosen, top = res.logprobs[0]
    assert chosen == pytest.approx(lp[0, res.token_ids[0]].item(), abs=1e-6)
    want_v, want_i = lp[0].topk(3)
    assert [t for t, _ in top] == want_i.tolist()
    assert [v for _, v in top] == pytest.approx(want_v.tolist(), abs=1e-6)
    assert top[0][0] == res.token_ids[0], "greedy picks the top token"
    chosen1, top1 = res.logprobs[1]
    assert top1 == [] and chosen1 == pytest.approx(lp[1, res.token_ids[1]].item(), abs=1e-6)
    assert res.logprobs[2] is None


def test_seeded_row_is_independent_of_its_neighbours():
    logits = torch.tensor([LOGITS] * 5)
    sp = SamplingParams(temperature=1.0, seed=42)
    alone = sample(logits[:1], [sp], generators=[torch.Generator().manual_seed(42)]).token_ids[0]
    gens = [None, None, torch.Generator().manual_seed(42), torch.Generator().manual_seed(9), None]
    mixed = sample(logits, [SamplingParams(temperature=1.0)] * 2 + [sp] + [SamplingParams(seed=9)]
                   + [SamplingParams(temperature=0)], generators=gens)
    assert mixed.token_ids[2] == alone
    # and a sequence of draws from one generator repeats exactly

    def draws() -> list[int]:
        g = torch.Generator().manual_seed(42)
        return [sample(logits[:1], [sp], generators=[g]).token_ids[0] for _ in range(30)]

    first = draws()
    assert first == draws() and len(set(first)) > 1


@pytest.mark.parametrize("kw", [
    dict(n=2), dict(n=0), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
    dict(min_p=1.5), dict(repetition_penalty=0.0), dict(frequency_penalty=2.5), dict(presence_penalty=-3),
    dict(logprobs=21), dict(logprobs=-1), dict(max_tokens=0), dict(stop=[""]), dict(stop=["x"] * 17),
])
def test_bad_values_raise(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_n_message_is_clear():
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(n=3)


def test_stop_accepts_a_string_and_top_k_minus_one_is_off():
    sp = SamplingParams(stop="END", top_k=-1)
    assert sp.stop == ["END"] and sp.top_k == 0


# ---- through the engine -----------------------------------------------------------------------------------
PROMPT = [100 + 7 * j for j in range(12)]
OTHERS = [[300 + 13 * j for j in range(n)] for n in (5, 20, 9)]


def generate(make_engine, params: SamplingParams, others: list[SamplingParams] = ()) -> list[int]:
    """Token ids of PROMPT, run together with other requests (added first, so they shift its row)."""
    eng = make_engine()
    for i, sp in enumerate(others):
        eng.add_request(prompt_token_ids=OTHERS[i % len(OTHERS)], params=sp, request_id=f"o{i}")
    eng.add_request(prompt_token_ids=PROMPT, params=params, request_id="me")
    toks: list[int] = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == "me":
                toks += o.new_token_ids
    return toks


def test_seed_reproducible_and_independent_of_batch(make_engine):
    sp = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    first = generate(make_engine, sp)
    assert generate(make_engine, sp) == first
    others = [SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)]
    assert generate(make_engine, sp, others) == first
    other_seed = SamplingParams(max_tokens=24, temperature=1.0, seed=4321, ignore_eos=True)
    assert generate(make_engine, other_seed) != first


def test_temperature_differs_from_greedy_and_filters_reduce_to_greedy(make_engine):
    greedy = generate(make_engine, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    hot = SamplingParams(max_tokens=24, temperature=3.0, seed=1, ignore_eos=True)
    assert generate(make_engine, hot) != greedy
    for kw in (dict(top_k=1), dict(top_p=1e-9)):
        sp = SamplingParams(max_tokens=24, temperature=3.0, seed=1, ignore_eos=True, **kw)
        assert generate(make_engine, sp) == greedy, kw


def test_greedy_unaffected_by_sampled_neighbours(make_engine):
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    others = [SamplingParams(max_tokens=25, temperature=2.0, top_k=50, ignore_eos=True),
              SamplingParams(max_tokens=15, temperature=1.0, repetition_penalty=1.5, ignore_eos=True)]
    assert generate(make_engine, sp, others) == generate(make_engine, sp)


def test_engine_logprobs_match_transformers(make_engine, tiny_model_dir):
    """The chosen tokens' logprobs equal log_softmax of the reference model's logits."""
    from transformers import AutoModelForCausalLM

    eng = make_engine()
    req = eng.add_request(prompt_token_ids=PROMPT, params=SamplingParams(
        max_tokens=6, temperature=0.9, seed=3, logprobs=2, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert len(req.logprobs) == 6
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = ref(torch.tensor([req.all_token_ids])).logits[0]
    lp = logits.log_softmax(-1)
    P = len(PROMPT)
    for k, (chosen, top) in enumerate(req.logprobs):
        row = lp[P - 1 + k]
        assert chosen == pytest.approx(row[req.output_token_ids[k]].item(), abs=2e-3)
        assert [t for t, _ in top] == row.topk(2).indices.tolist()
        assert [v for _, v in top] == pytest.approx(row.topk(2).values.tolist(), abs=2e-3)


@pytest.mark.parametrize("kw", [dict(temperature=1e-39), dict(temperature=5e-324), dict(temperature=1e-6),
                                dict(temperature=1e-4, repetition_penalty=100.0),
                                dict(temperature=1e-4, repetition_penalty=0.01), dict(temperature=1e30),
                                dict(temperature=1e-4, top_p=1e-300, min_p=1.0),
                                dict(temperature=0.7, presence_penalty=2.0, frequency_penalty=-2.0)])
def test_extreme_values_sample_a_real_token(kw):
    """No NaN reaches the race: every row picks a token of the vocabulary; below the greedy threshold it
    is exactly the argmax."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 30  # peaked, as a real model's are
    params = [SamplingParams(**kw)] * 4
    out = Sampler(50)(logits, params, [[1, 2, 3, 4, 5]] * 4, [2] * 4, [None] * 4)
    assert all(0 <= t < 50 for t in out.token_ids)
    if kw["temperature"] < GREEDY_TEMPERATURE:
        assert params[0].greedy and out.token_ids == logits.argmax(dim=-1).tolist()


def test_penalties_are_bounded():
    for bad in (1e300, 1e-300, 0.0):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad)


def test_inverse_cdf_sampling_across_chunks_never_picks_zero_mass():
    """The two-level search (sampling.sample_inverse_cdf) on a vocabulary of several chunks with a
    ragged end: empirical frequencies match the distribution, zero-mass tokens are never drawn."""
    from iterserve.sampling import CDF_CHUNK, sample_inverse_cdf

    g = torch.Generator().manual_seed(0)
    vocab = 3 * CDF_CHUNK + 17
    probs = torch.zeros(vocab)
    live = torch.tensor([0, 5, CDF_CHUNK - 1, CDF_CHUNK, 2 * CDF_CHUNK + 3, vocab - 1])
    probs[live] = torch.tensor([0.05, 0.15, 0.2, 0.1, 0.3, 0.2])
    n = 40000
    drawn = sample_inverse_cdf(probs.expand(n, vocab), torch.rand(n, dtype=torch.float64, generator=g))
    counts = torch.bincount(drawn, minlength=vocab).float() / n
    assert counts.sum() == 1.0 and set(drawn.unique().tolist()) <= set(live.tolist())
    assert (counts[live] - probs[live]).abs().max() < 0.01


def test_rows_that_are_not_distributions_fall_back_to_their_argmax_and_leave_the_others_alone():
    """A NaN or +inf logit, or a row of -inf, makes softmax NaN: that row takes its argmax (greedy)
    and the rows beside it are still sampled from their own distributions."""
    nan_row = [0.0, 1.0, float("nan"), 0.5, 0.0, 0.0]
    inf_row = [0.0, float("inf"), 0.0, 0.0, 0.0, 0.0]
    dead_row = [float("-inf")] * VOCAB
    good_row = [0.0, 0.0, 0.0, 0.0, 0.0, 8.0]  # token 5 all but always
    logits = torch.tensor([nan_row, inf_row, dead_row] + [good_row] * 200)
    params = [SamplingParams(temperature=1.0)] * logits.shape[0]
    ids = sample(logits, params).token_ids
    assert ids[:3] == [int(torch.tensor(r).argmax()) for r in (nan_row, inf_row, dead_row)]
    assert all(0 <= t < VOCAB for t in ids)
    assert sum(t == 5 for t in ids[3:]) >= 190
