"""Speculative decoding in the continuous batch: float32 greedy text is identical with and without
it for every method (alone, in a mixed batch of 16, under preemption, with prefix caching, with
n = 4, with stop strings and structured outputs), sampled tokens keep their distribution (a
chi-square test that also catches a broken acceptance rule), rejected drafts give their blocks
back, and bad configurations are refused at start.

Greedy tests run SmolLM2 in float32 on prompts that ask it to copy or edit a given text, so that
lookups find drafts that are partly accepted and partly rejected; the distribution test runs the
tiny random model, whose sampled tokens spread over a few candidates.
"""
from __future__ import annotations

import math

import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.engine import LLMEngine
from iterserve.sampling import SamplingParams

TEXTS = [
    "def area(radius):\n    return 3.14159 * radius * radius\n\n\ndef perimeter(radius):\n"
    "    return 2 * 3.14159 * radius\n",
    "The cache holds blocks of sixteen tokens. A request takes blocks as it grows and gives them back "
    "when it finishes, so memory follows the work actually in flight.",
    "Monday: buy milk, eggs and bread. Tuesday: call the plumber about the kitchen sink. Wednesday: "
    "return the library books before noon.",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'even')\n    else:\n        print(i, 'odd')\n",
]
OPEN = ["Write a short poem about the sea.", "Name three uses of a paperclip.",
        "Why is the sky blue?", "Tell me a fact about owls."]

METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
}


def copy_messages(i: int) -> list[dict]:
    return [{"role": "user", "content": "Copy this text exactly:\n\n" + TEXTS[i % len(TEXTS)]}]


def open_messages(i: int) -> list[dict]:
    return [{"role": "user", "content": OPEN[i % len(OPEN)]}]


def greedy(max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run(engine: LLMEngine, check_blocks: bool = True) -> dict[str, dict]:
    """Steps until idle: each request's tokens, text and final speculation totals. After every step
    each running request holds no block beyond what its verified tokens and the next one need."""
    outs: dict[str, dict] = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            return outs
        for o in engine.step():
            d = outs.setdefault(o.request_id, {"tokens": [], "text": ""})
            d["tokens"] += o.new_token_ids
            if o.finished:
                d.update(text=o.output_text, reason=o.finish_reason, n_out=o.num_output_tokens,
                         spec=(o.spec_num_drafts, o.spec_draft_tokens, o.spec_accepted_tokens))
        if check_blocks:
            engine.pool.check_invariants()
            for req in engine.scheduler.running:
                assert len(engine.pool.tables[req.request_id]) <= engine.pool.blocks_for(req.num_computed_tokens + 1) \
                    or req.num_tokens - req.num_computed_tokens > 1, req
    raise AssertionError("engine did not finish")


def spec_totals(outs: dict[str, dict]) -> tuple[int, int, int]:
    rows = [o["spec"] for o in outs.values() if "spec" in o]
    return tuple(sum(r[i] for r in rows) for i in range(3))


@pytest.fixture(scope="module")
def smol32(smol_loaded):
    model, cfg, tok = smol_loaded
    assert next(model.parameters()).dtype == torch.float32
    return smol_loaded


def engine_for(loaded, spec=None, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", "64MiB")
    return LLMEngine(EngineConfig(speculative_config=spec, **kw), loaded=loaded)


def add(engine: LLMEngine, rid: str, messages: list[dict], params: SamplingParams, **kw) -> None:
    engine.add_request(prompt_token_ids=engine.encode_prompt(messages=messages), params=params, request_id=rid,
                       **kw)


@pytest.fixture(scope="module")
def baseline(smol32):
    """Each copy and open prompt alone, without speculation."""
    out = {}
    for i in range(len(TEXTS)):
        for kind, msgs in (("copy", copy_messages(i)), ("open", open_messages(i))):
            e = engine_for(smol32)
            add(e, "r", msgs, greedy())
            out[(kind, i)] = run(e)["r"]
    return out


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "random_draft_model", "prediction"])
def test_greedy_text_identical_alone(smol32, baseline, tiny_model_dir, method):
    if method == "draft_model":  # the target's own weights: drafts mostly accepted
        spec = {"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 3}
    elif method == "random_draft_model":  # the tiny random model: drafts (almost) all rejected
        spec = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3}
    elif method == "prediction":
        spec = None
    else:
        spec = METHODS[method]
    e = engine_for(smol32, spec)
    drafted = accepted = 0
    for i in range(len(TEXTS)):
        want = baseline[("copy", i)]
        # a prediction that is the right answer with every 9th token wrong: drafts accepted and rejected
        pred = [t if j % 9 != 4 else (t + 1) % 49152 for j, t in enumerate(want["tokens"])]
        params = greedy(prediction_token_ids=pred if method == "prediction" else None)
        for rep in range(2 if method == "suffix" else 1):  # suffix learns from the first answer
            add(e, f"r{i}-{rep}", copy_messages(i), params)
            got = run(e)[f"r{i}-{rep}"]
            assert got["tokens"] == want["tokens"] and got["text"] == want["text"], (method, i, rep)
            drafted += got["spec"][1]
            accepted += got["spec"][2]
    assert drafted > 0 and (accepted > 0 or method == "random_draft_model"), (drafted, accepted)
    if method in ("random_draft_model", "prediction"):  # its random drafts and the wrong tokens are rejected
        assert accepted < drafted


def test_mixed_batch_of_16_preemption_and_prefix_caching(smol32, baseline):
    """16 at once: copy prompts (lookups find drafts), open prompts (few), predictions; first with a
    roomy cache, then with one so small that requests are preempted and recomputed."""
    def fill(e):
        for j in range(16):
            i = j % len(TEXTS)
            if j % 4 == 3:
                add(e, f"p{j}", copy_messages(i), greedy(prediction_token_ids=baseline[("copy", i)]["tokens"]))
            elif j % 4 == 2:
                add(e, f"o{j}", open_messages(i), greedy())
            else:
                add(e, f"c{j}", copy_messages(i), greedy())

    def want(rid):
        i = int(rid[1:]) % len(TEXTS)
        return baseline[("open" if rid[0] == "o" else "copy", i)]["tokens"]

    spec = dict(METHODS["ngram"], disable_by_batch_size=None)
    for blocks in (None, 40):
        e = engine_for(smol32, spec, num_kv_blocks=blocks, max_num_seqs=16)
        fill(e)
        outs = run(e)
        for rid, o in outs.items():
            assert o["tokens"] == want(rid), (blocks, rid)
        drafted, accepted = spec_totals(outs)[1:]
        assert 0 < accepted < drafted
        assert e.scheduler.prefix_cache_hits > 0  # the same copy prompts share their blocks
        if blocks:
            assert e.scheduler.num_preemptions_total > 0


def test_n4_siblings_and_stop_strings(smol32, baseline):
    e = engine_for(smol32, METHODS["ngram"])
    want = baseline[("copy", 0)]
    add(e, "lead", copy_messages(0), greedy())
    for j in range(3):
        add(e, f"sib{j}", copy_messages(0), greedy(), prefix_leader="lead")
    outs = run(e)
    assert all(o["tokens"] == want["tokens"] for o in outs.values())
    assert spec_totals(outs)[2] > 0
    # a stop string inside a run of accepted drafts: the text and the token count stop where they did
    stop = want["text"][len(want["text"]) // 2:][:6]
    base = engine_for(smol32)
    add(base, "s", copy_messages(0), greedy(stop=[stop]))
    ref = run(base)["s"]
    e = engine_for(smol32, METHODS["ngram"])
    add(e, "s", copy_messages(0), greedy(stop=[stop], prediction_token_ids=want["tokens"]))
    got = run(e)["s"]
    assert ref["reason"] == "stop" and (got["text"], got["n_out"], got["reason"]) == (ref["text"], ref["n_out"], "stop")
    assert got["spec"][2] > 0


def test_logprobs_of_accepted_tokens(smol32, baseline):
    """Each accepted draft and the token after it carry the logprob (and top 2) they carry
    without speculation: the same positions' logits, from one verify row instead of one step each."""
    def logprobs(pred):
        e = engine_for(smol32)
        add(e, "l", copy_messages(1), greedy(24, logprobs=2, prediction_token_ids=pred))
        out = []
        while e.has_unfinished_requests():
            for o in e.step():
                out += o.new_logprobs
                if o.finished:
                    spec = o.spec_accepted_tokens
        return out, spec

    ref, _ = logprobs(None)
    got, accepted = logprobs(baseline[("copy", 1)]["tokens"])
    assert accepted > 0 and len(got) == len(ref) == 24
    for (lp, top), (rlp, rtop) in zip(got, ref):
        assert lp == pytest.approx(rlp, abs=2e-3)
        assert [t for t, _ in top] == [t for t, _ in rtop]


def test_structured_outputs_never_accept_a_forbidden_draft(smol32):
    from iterserve.structured.params import StructuredOutputsParams

    msgs = [{"role": "user", "content": "Give a JSON object with a name and an age."}]
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}

    def params(pred=None):
        return greedy(60, structured_outputs=StructuredOutputsParams(json=schema), prediction_token_ids=pred)

    base = engine_for(smol32)
    add(base, "j", msgs, params())
    ref = run(base)["j"]
    tok = smol32[2]
    # the right answer with every fourth token a bare letter, which the grammar forbids almost anywhere
    x = tok.encode("x", add_special_tokens=False)[0]
    bad = [t if i % 4 != 2 else x for i, t in enumerate(ref["tokens"])]
    e = engine_for(smol32)
    add(e, "j", msgs, params(bad))
    got = run(e)["j"]
    assert got["tokens"] == ref["tokens"] and got["text"] == ref["text"]
    drafted, accepted = got["spec"][1:]
    assert 0 < accepted < drafted


def test_switch_off_above_batch_size(smol32):
    e = engine_for(smol32, dict(METHODS["ngram"], disable_by_batch_size=2))
    for j in range(3):
        add(e, f"c{j}", copy_messages(j), greedy(12))
    outs = run(e)
    # three running: nobody drafts until one finishes (they finish together here)
    assert spec_totals(outs) == (0, 0, 0)


def test_bad_configs_refused_at_start(tiny_loaded, tmp_path):
    for bad, words in (({"method": "medusa"}, "unknown method"), ({"num_speculative_tokens": 0}, "from 1 to 16"),
                       ({"method": "draft_model"}, "needs `model`"), ({"methd": "ngram"}, "unknown key"),
                       ("{not json", "not JSON")):
        with pytest.raises(ValueError, match=words):
            EngineConfig(speculative_config=bad)
    with pytest.raises(ValueError, match="static batching"):
        EngineConfig(speculative_config={"method": "ngram"}, batching="static")
    # a draft model whose vocabulary is not the target's
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    small.save_pretrained(tmp_path / "draft")
    with pytest.raises(ValueError, match="vocab"):
        engine_for(tiny_loaded, {"method": "draft_model", "model": str(tmp_path / "draft")})


# ---- the distribution --------------------------------------------------------------------------
def chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of a chi-square test that two samples of categories come from one distribution
    (categories seen fewer than 5 times in all are pooled)."""
    cats = sorted(set(a) | set(b))
    counts = torch.tensor([[a.count(c), b.count(c)] for c in cats], dtype=torch.float64)
    small = counts.sum(1) < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sampled_sequences(loaded, prompt: list[int], pred: list[int] | None, num: int, seed0: int) -> list[tuple]:
    e = LLMEngine(EngineConfig(kv_cache_memory="64MiB", max_num_seqs=64,
                               speculative_config={"method": "ngram", "disable_by_batch_size": None,
                                                   "num_speculative_tokens": 3}), loaded=loaded)
    for s in range(num):
        e.add_request(prompt_token_ids=prompt, request_id=str(s),
                      params=SamplingParams(max_tokens=4, temperature=1.0, seed=seed0 + s, prediction_token_ids=pred))
    outs = run(e, check_blocks=False)
    if pred is not None:
        assert spec_totals(outs)[2] > 0
    return [tuple(outs[str(s)]["tokens"]) for s in range(num)]


@pytest.fixture(scope="module")
def distribution_case(tiny_loaded):
    """The tiny model with its LM head scaled up 3x, so that at temperature 1 its tokens spread over a
    handful of candidates (unscaled, over thousands: no test would have power); a prompt; and the
    most likely continuation, which is the drafts (a prediction) the test verifies."""
    import copy

    model, cfg, tok = tiny_loaded
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    loaded = (model, cfg, tok)
    prompt = [100 + 7 * j for j in range(12)]
    e = LLMEngine(EngineConfig(kv_cache_memory="64MiB"), loaded=loaded)
    e.add_request(prompt_token_ids=prompt, request_id="g", params=SamplingParams(max_tokens=4, temperature=0))
    return loaded, prompt, run(e)["g"]["tokens"]


def test_sampled_distribution_unchanged(distribution_case):
    loaded, prompt, likely = distribution_case
    n = 600
    plain = sampled_sequences(loaded, prompt, None, n, 0)
    drafted = sampled_sequences(loaded, prompt, likely, n, 10_000)
    # the test has power: the first token spreads, and later ones are not all the likely ones
    assert len(set(s[0] for s in plain)) > 1 and sum(s[1:3] == tuple(likely[1:3]) for s in plain) < 0.9 * n
    for pos in (1, 2, 3):
        p = chi_square_p([s[pos] for s in plain], [s[pos] for s in drafted])
        assert p > 1e-3, (pos, p)
    p = chi_square_p([hash(s[:3]) for s in plain], [hash(s[:3]) for s in drafted])
    assert p > 1e-3, p


def test_broken_acceptance_rule_is_caught(distribution_case, monkeypatch):
    """The same test fails when drafts are accepted with probability sqrt(p) instead of p."""
    import iterserve.runner as runner_mod
    from iterserve import rejection_sampler

    def broken(probs, drafts, u_accept, u_next, draft_probs=None):
        return rejection_sampler.verify_drafts(probs.sqrt(), drafts, u_accept, u_next, draft_probs)

    loaded, prompt, likely = distribution_case
    n = 600
    plain = sampled_sequences(loaded, prompt, None, n, 0)
    monkeypatch.setattr(runner_mod, "verify_drafts", broken)
    drafted = sampled_sequences(loaded, prompt, likely, n, 10_000)
    worst = min(chi_square_p([s[pos] for s in plain], [s[pos] for s in drafted]) for pos in (1, 2, 3))
    assert worst < 1e-3, worst


def test_verify_rule_exact_on_small_vocabulary():
    """The rule itself, exactly: over many uniforms, the token after one draft is distributed as p
    for a point-mass draft and for a draft distribution q."""
    from iterserve.rejection_sampler import verify_drafts

    torch.manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    q = torch.tensor([[0.2, 0.7, 0.1]])
    for draft_probs in (None, q):
        first = [0, 0, 0]
        for _ in range(20000):
            u = torch.rand(2, dtype=torch.float64)
            d = 1 if draft_probs is None else int(torch.multinomial(q[0], 1))  # a draft is drawn from q
            v = verify_drafts(p, [d], u[:1], u[1:], draft_probs)
            first[v.token_ids[0]] += 1
        freq = [c / 20000 for c in first]
        assert all(math.isclose(f, t, abs_tol=0.015) for f, t in zip(freq, [0.5, 0.3, 0.2])), (draft_probs, freq)


# ---- the server ---------------------------------------------------------------------------------
def test_server_prediction_metrics_and_scheduler(tiny_model_dir, tiny_loaded):
    """Over HTTP: OpenAI's `prediction` on chat and completions gives the same greedy text as
    without it, with drafts accepted; a prediction of the wrong shape is a 400; /metrics (both
    names) and /v1/scheduler count the drafts."""
    from app_server import AppServer

    args = [str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-memory", "64MiB",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    with AppServer(args, tiny_loaded) as srv, srv.client(timeout=60) as client:
        body = {"model": "tiny", "prompt": "The river runs", "max_tokens": 24, "temperature": 0}
        plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        ids = client.post("/tokenize", json={"prompt": plain, "add_special_tokens": False}).json()["tokens"]
        assert len(ids) > 8
        # the answer itself, as a client would predict it, and chat's list-of-parts form
        for pred in (plain, [{"type": "text", "text": plain[:10]}, {"type": "text", "text": plain[10:]}]):
            got = client.post("/v1/completions", json={**body, "prediction": {"type": "content", "content": pred}})
            assert got.status_code == 200 and got.json()["choices"][0]["text"] == plain
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0}
        want = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
        got = client.post("/v1/chat/completions", json={**chat, "prediction": {"type": "content", "content": want}})
        assert got.json()["choices"][0]["message"]["content"] == want
        for bad in ({"type": "text", "content": "x"}, {"type": "content", "content": 5}, "just text",
                    {"type": "content"}):
            r = client.post("/v1/completions", json={**body, "prediction": bad})
            assert r.status_code == 400 and "prediction" in r.json()["error"]["message"], (bad, r.text)
        sched = client.get("/v1/scheduler").json()["speculative"]
        assert sched["config"]["method"] == "ngram" and sched["accepted_tokens"] > 0
        assert 0 < sched["acceptance_rate"] <= 1 and sched["mean_accepted_length"] > 1
        metrics = client.get("/metrics").text

        def value(name: str) -> float:
            return sum(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith(name + "{") or line.startswith(name + " "))

        for prefix in ("iterserve:", "vllm:"):
            assert value(prefix + "spec_decode_num_accepted_tokens_total") == sched["accepted_tokens"]
            assert value(prefix + "spec_decode_num_draft_tokens_total") == sched["draft_tokens"]
