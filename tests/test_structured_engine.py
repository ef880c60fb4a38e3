"""Structured outputs and logit_bias inside the engine's step: masks per request in a shared batch,
the grammar's end, preemption, compilation off the step, cache, errors."""
from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from iterserve.request import RequestRejected
from iterserve.sampling import SamplingParams
from iterserve.structured.params import StructuredOutputError, StructuredOutputsParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def run_to_end(engine, max_steps: int = 2000) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        before = engine.step_count
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        if engine.step_count == before:  # only requests waiting for their grammar
            time.sleep(0.005)
    raise AssertionError("engine did not finish")


def text_of(outs) -> str:
    return outs[-1].output_text


def chat(engine, content: str) -> list[int]:
    return engine.encode_prompt(messages=[{"role": "user", "content": content}])


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_params_need_exactly_one_constraint():
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(StructuredOutputError, match="non-empty"):
        StructuredOutputsParams(choice=["a", ""])
    assert StructuredOutputsParams(json=PERSON).key == StructuredOutputsParams(json=json.dumps(PERSON)).key
    with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={5: 101.0})


# ---- mechanics on the tiny model (random weights: only the grammar makes the output valid) ------------
def test_choice_and_regex_hold_and_stop_at_grammar_end(make_engine):
    eng = make_engine()
    choices = ["alpha", "beta", "gamma delta"]
    for i in range(4):
        eng.add_request(prompt_token_ids=[5 + i, 9, 11], request_id=f"c{i}", params=SamplingParams(
            max_tokens=20, temperature=1.0, seed=i, ignore_eos=True,
            structured_outputs=StructuredOutputsParams(choice=choices)))
        eng.add_request(prompt_token_ids=[7 + i, 3], request_id=f"r{i}", params=SamplingParams(
            max_tokens=30, temperature=1.0, seed=i, structured_outputs=StructuredOutputsParams(regex=r"[a-c]{2,4}-[0-9]{2}")))
    outs = run_to_end(eng)
    for i in range(4):
        assert text_of(outs[f"c{i}"]) in choices and outs[f"c{i}"][-1].finish_reason == "stop"
        # [0-9], not \d: the grammar's \d admits every Unicode digit, some newer than Python 3.11's re
        assert re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", text_of(outs[f"r{i}"])), text_of(outs[f"r{i}"])
        assert outs[f"r{i}"][-1].finish_reason == "stop"
    assert eng.structured.num_compiled == 2  # 4 requests each, one compilation per spec


def test_grammar_that_cannot_finish_in_max_tokens_ends_with_length(make_engine):
    eng = make_engine()
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40}}, "required": ["s"]}
    eng.add_request(prompt_token_ids=[5, 6], request_id="x", params=greedy(
        6, structured_outputs=StructuredOutputsParams(json=schema)))
    outs = run_to_end(eng)["x"]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 6


def test_logit_bias_forces_and_bans_tokens_in_a_shared_step(make_engine):
    eng = make_engine()
    free = greedy(8, ignore_eos=True)
    eng.add_request(prompt_token_ids=[5, 6, 7], request_id="free", params=free)
    alone = [t for o in run_to_end(eng)["free"] for t in o.new_token_ids]
    eng.add_request(prompt_token_ids=[5, 6, 7], request_id="free", params=free)
    eng.add_request(prompt_token_ids=[5, 6, 7], request_id="forced", params=greedy(8, ignore_eos=True, logit_bias={42: 100.0}))
    eng.add_request(prompt_token_ids=[5, 6, 7], request_id="banned", params=greedy(
        8, ignore_eos=True, logit_bias={t: -100.0 for t in set(alone)}))
    outs = run_to_end(eng)
    assert [t for o in outs["free"] for t in o.new_token_ids] == alone
    assert [t for o in outs["forced"] for t in o.new_token_ids] == [42] * 8
    assert not set(t for o in outs["banned"] for t in o.new_token_ids) & set(alone)
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        eng.add_request(prompt_token_ids=[5], params=greedy(2, logit_bias={10**6: 1.0}))


def test_compilation_never_blocks_the_step_and_a_failure_fails_only_its_request(make_engine, monkeypatch):
    eng = make_engine()
    gate = threading.Event()
    real = eng.structured._compile

    def slow(key):
        assert gate.wait(30)
        return real(key)

    monkeypatch.setattr(eng.structured, "_compile", slow)
    eng.add_request(prompt_token_ids=[5, 6], request_id="free", params=greedy(6, ignore_eos=True))
    eng.add_request(prompt_token_ids=[5, 6], request_id="json", params=greedy(
        40, structured_outputs=StructuredOutputsParams(json=PERSON)))
    eng.add_request(prompt_token_ids=[5, 6], request_id="bad", params=greedy(
        4, structured_outputs=StructuredOutputsParams(regex="[a-")))
    outs: dict[str, list] = {}
    for _ in range(8):  # the free request runs to its end while both grammars are still "compiling"
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["free"][-1].finished and "json" not in outs and "bad" not in outs
    gate.set()
    for rid, more in run_to_end(eng).items():
        outs.setdefault(rid, []).extend(more)
    assert outs["bad"][-1].finished and "invalid or unsupported regex" in outs["bad"][-1].error
    assert outs["json"][-1].finish_reason in ("stop", "length")
    jsonschema.validate(json.loads(text_of(outs["json"])), PERSON) if outs["json"][-1].finish_reason == "stop" else None
    # now cached: a bad spec is refused at once, a good one starts without waiting
    with pytest.raises(RequestRejected, match="invalid or unsupported regex"):
        eng.add_request(prompt_token_ids=[5], params=greedy(2, structured_outputs=StructuredOutputsParams(regex="[a-")))
    assert not eng.requests


def test_abort_while_compiling(make_engine, monkeypatch):
    eng = make_engine()
    gate = threading.Event()
    real = eng.structured._compile
    monkeypatch.setattr(eng.structured, "_compile", lambda key: (gate.wait(30), real(key))[1])
    eng.add_request(prompt_token_ids=[5, 6], request_id="j", params=greedy(
        10, structured_outputs=StructuredOutputsParams(json_object=True)))
    assert eng.abort_request("j")
    outs = eng.step()
    assert [o.finish_reason for o in outs] == ["abort"] and not eng.has_unfinished_requests()
    gate.set()


# ---- the embedded model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_engine_factory(smol_loaded):
    from iterserve.config import EngineConfig
    from iterserve.engine import LLMEngine

    def make(**kw):
        kw.setdefault("kv_cache_memory", "64MiB")
        return LLMEngine(EngineConfig(**kw), loaded=smol_loaded)

    return make


@pytest.mark.real_model
def test_constrained_and_free_in_the_same_step(smol_engine_factory):
    """float32 greedy: the free request's tokens are those it produces alone."""
    eng = smol_engine_factory()
    free_prompt = chat(eng, "Name three colours.")
    eng.add_request(prompt_token_ids=free_prompt, request_id="free", params=greedy(24, ignore_eos=True))
    alone = [t for o in run_to_end(eng)["free"] for t in o.new_token_ids]
    eng.add_request(prompt_token_ids=free_prompt, request_id="free", params=greedy(24, ignore_eos=True))
    eng.add_request(prompt_token_ids=chat(eng, "Describe a person as JSON."), request_id="json",
                    params=greedy(24, structured_outputs=StructuredOutputsParams(json=PERSON)))
    first = len(eng.records)
    outs = run_to_end(eng)
    shared = [r for r in list(eng.records)[first:] if r.batch_size == 2]
    assert len(shared) >= 10, "the two requests must share steps"
    assert [t for o in outs["free"] for t in o.new_token_ids] == alone
    assert outs["json"][-1].finish_reason == "stop"
    jsonschema.validate(json.loads(text_of(outs["json"])), PERSON)


@pytest.mark.real_model
def test_preempted_constrained_requests_resume_their_grammar(smol_engine_factory):
    """Recompute keeps the generated tokens, so the matcher keeps its state: same output as alone."""
    prompts = [f"Describe person number {i} as JSON." for i in range(4)]

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=40, temperature=0.8, seed=i,
                              structured_outputs=StructuredOutputsParams(json=PERSON))

    eng = smol_engine_factory(block_size=16, num_kv_blocks=12, max_num_seqs=4)
    for i, p in enumerate(prompts):
        eng.add_request(prompt_token_ids=chat(eng, p), request_id=f"p{i}", params=params(i))
    outs = run_to_end(eng)
    assert any(r.preempted for r in eng.records), "12 blocks for 4 requests must force preemption"
    for i, p in enumerate(prompts):
        solo = smol_engine_factory()
        solo.add_request(prompt_token_ids=chat(solo, p), request_id="solo", params=params(i))
        assert text_of(outs[f"p{i}"]) == text_of(run_to_end(solo)["solo"])
        if outs[f"p{i}"][-1].finish_reason == "stop":
            jsonschema.validate(json.loads(text_of(outs[f"p{i}"])), PERSON)


@pytest.mark.parametrize("any_whitespace", [False, True])
def test_json_whitespace_is_one_space_unless_any_whitespace_is_asked(make_engine, any_whitespace):
    """The default grammar writes `{"name": ...}` with exactly one space after ':' and ',' (a small
    model under a whitespace-flexible grammar was seen filling max_tokens with newlines);
    --structured-outputs-any-whitespace gives vLLM's flexible grammar back."""
    engine = make_engine(structured_outputs_any_whitespace=any_whitespace)
    proto = engine.structured.compile(StructuredOutputsParams(json=PERSON)).result(timeout=30)
    tok = engine.tokenizer

    def accepts(text: str) -> bool:
        matcher = engine.structured.new_grammar(proto).matcher
        ids = tok.encode(text, add_special_tokens=False)
        return matcher.validate_tokens(ids) == len(ids)

    assert accepts('{"name": "Al", "age": 3}')
    assert accepts('{\n  "name"') is any_whitespace
    assert accepts('{"name":  "Al"') is any_whitespace
    assert accepts('{"name":"Al"') is any_whitespace
