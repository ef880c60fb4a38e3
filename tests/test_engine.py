"""LLMEngine on the tiny model: preemption keeps greedy output, rejection, abort, stop conditions,
incremental detokenisation.

Stop conditions and detokenisation need chosen output tokens, so those tests run the real engine
(scheduler, runner, sampler, detokeniser) over `ScriptedModel`, a stand-in whose logits spell a
fixed token sequence given by the tokenizer.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from iterserve.llm import LLM
from iterserve.request import Request, RequestRejected, RequestStatus
from iterserve.sampling import SamplingParams


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def prompt_ids(i: int, n: int) -> list[int]:
    return [100 + (37 * i + 11 * j) % 3000 for j in range(n)]


def run_to_end(engine, max_steps: int = 2000) -> dict[str, list]:
    """Steps until idle; returns every request's outputs in order."""
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def alone(make_engine, prompt: list[int], params: SamplingParams) -> list[int]:
    eng = make_engine()
    eng.add_request(prompt_token_ids=prompt, params=params, request_id="solo")
    return tokens_of(run_to_end(eng)["solo"])


# ---- preemption ---------------------------------------------------------------------------------
def test_tiny_cache_preempts_and_output_matches_running_alone(make_engine, caplog):
    caplog.set_level(logging.INFO, logger="iterserve.scheduler")
    specs = [(prompt_ids(i, 10 + 3 * i), 20 + 2 * i) for i in range(6)]
    eng = make_engine(block_size=8, num_kv_blocks=9, max_num_seqs=6, log_scheduler=True)
    for i, (p, m) in enumerate(specs):
        eng.add_request(prompt_token_ids=p, params=greedy(m, ignore_eos=True), request_id=f"p{i}")
    outs = run_to_end(eng)
    preempted = [rid for rec in eng.records for rid in rec.preempted]
    assert preempted, "9 blocks for 6 growing requests must force preemption"
    lines = [r.getMessage() for r in caplog.records if r.name == "iterserve.scheduler"]
    assert len(lines) == len(eng.records)
    for rid in set(preempted):
        assert any("preempted" in ln and rid in ln for ln in lines), f"no log line shows {rid} preempted"
    for i, (p, m) in enumerate(specs):
        got = outs[f"p{i}"]
        assert got[-1].finished and got[-1].finish_reason == "length"
        assert tokens_of(got) == alone(make_engine, p, greedy(m, ignore_eos=True)), f"p{i} changed"
    assert eng.pool.num_free == 9
    eng.pool.check_invariants()


def test_preempted_seeded_sampling_resumes_identically(make_engine):
    """Recompute after preemption draws from the request's own generator where it left off."""
    def sp(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=100 + i, ignore_eos=True)

    eng = make_engine(block_size=8, num_kv_blocks=8, max_num_seqs=5)
    for i in range(5):
        eng.add_request(prompt_token_ids=prompt_ids(i, 12), params=sp(i), request_id=f"s{i}")
    outs = run_to_end(eng)
    assert any(rec.preempted for rec in eng.records)
    for i in range(5):
        assert tokens_of(outs[f"s{i}"]) == alone(make_engine, prompt_ids(i, 12), sp(i)), f"s{i} changed"


# ---- rejection -------------------------------------------------------------------------------------
def test_impossible_requests_rejected_others_finish(make_engine):
    eng = make_engine(block_size=16, num_kv_blocks=4, max_model_len=100)
    ok = eng.add_request(prompt_token_ids=prompt_ids(0, 10), params=greedy(8), request_id="ok")
    with pytest.raises(RequestRejected, match=r"= 105 exceeds max_model_len 100"):
        eng.add_request(prompt_token_ids=prompt_ids(1, 60), params=greedy(45))
    eng2 = make_engine(block_size=16, num_kv_blocks=4)
    with pytest.raises(RequestRejected, match=r"needs 5 KV blocks but the whole cache has 4"):
        eng2.add_request(prompt_token_ids=prompt_ids(2, 60), params=greedy(10))
    eng3 = make_engine(max_input_len=20, max_output_len=30)
    with pytest.raises(RequestRejected, match="more than max_input_len 20"):
        eng3.add_request(prompt_token_ids=prompt_ids(3, 21), params=greedy(5))
    with pytest.raises(RequestRejected, match="exceeds max_output_len 30"):
        eng3.add_request(prompt_token_ids=prompt_ids(3, 5), params=greedy(31))
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        eng.add_request(prompt_token_ids=[10**6], params=greedy(2))
    with pytest.raises(RequestRejected, match="must not be empty"):
        eng.add_request(prompt="", params=greedy(2))
    assert list(eng.requests) == ["ok"], "a rejected request must leave no trace"
    outs = run_to_end(eng)
    assert outs["ok"][-1].finished and outs["ok"][-1].num_output_tokens == 8
    assert ok.finish_reason == "length"


def test_llm_generate_rejects_before_running(tiny_loaded):
    llm = LLM(loaded=tiny_loaded, kv_cache_memory="64MiB", max_model_len=64)
    with pytest.raises(RequestRejected, match="exceeds max_model_len 64"):
        llm.generate([prompt_ids(0, 10), prompt_ids(1, 60)], greedy(10), use_tqdm=False)


# ---- abort ---------------------------------------------------------------------------------------------
def test_abort_frees_blocks_at_once(make_engine):
    eng = make_engine(block_size=8, num_kv_blocks=20)
    eng.add_request(prompt_token_ids=prompt_ids(0, 20), params=greedy(30, ignore_eos=True), request_id="a")
    eng.add_request(prompt_token_ids=prompt_ids(1, 9), params=greedy(5, ignore_eos=True), request_id="b")
    eng.step()
    eng.step()
    held = len(eng.pool.tables["a"])
    assert held == 3
    free_before = eng.pool.num_free
    assert eng.abort_request("a")
    assert eng.pool.num_free == free_before + held and "a" not in eng.pool.tables
    assert not eng.abort_request("a") and not eng.abort_request("unknown")
    outs = run_to_end(eng)
    assert outs["a"][-1].finished and outs["a"][-1].finish_reason == "abort"
    assert outs["b"][-1].finish_reason == "length"
    assert eng.pool.num_free == 20


def test_abort_waiting_request(make_engine):
    eng = make_engine(max_num_seqs=1)
    eng.add_request(prompt_token_ids=prompt_ids(0, 5), params=greedy(4), request_id="a")
    eng.add_request(prompt_token_ids=prompt_ids(1, 5), params=greedy(4), request_id="b")
    eng.step()
    assert eng.abort_request("b")
    outs = run_to_end(eng)
    assert outs["b"] == [o for o in outs["b"] if o.finished] and outs["b"][0].finish_reason == "abort"
    assert outs["b"][0].num_output_tokens == 0
    assert outs["a"][-1].finish_reason == "length"


# ---- a model that says what it is told -------------------------------------------------------------------
class ScriptedModel(torch.nn.Module):
    """Logits that make greedy decoding emit `script`: the token after position p is
    script[p + 1 - prompt_len] (the last one repeats). Every request must have prompt_len tokens."""

    def __init__(self, vocab_size: int, prompt_len: int, script: list[int]) -> None:
        super().__init__()
        self.vocab_size, self.prompt_len = vocab_size, prompt_len
        self.script = torch.tensor(script, dtype=torch.long)

    def forward(self, input_ids, positions, logits_indices):
        pos = positions[logits_indices]
        idx = (pos + 1 - self.prompt_len).clamp(0, len(self.script) - 1)
        logits = torch.zeros(len(pos), self.vocab_size)
        logits[torch.arange(len(pos)), self.script[idx]] = 20.0
        return logits


@pytest.fixture
def scripted(make_engine, tiny_loaded):
    """scripted(text or ids, eos=..., **engine kw) -> (engine, script ids, prompt ids)."""
    _, cfg, tok = tiny_loaded

    def make(script, eos: tuple[int, ...] | None = None, **kw):
        ids = tok.encode(script, add_special_tokens=False) if isinstance(script, str) else list(script)
        mcfg = cfg if eos is None else dataclasses.replace(cfg, eos_token_ids=eos)
        model = ScriptedModel(cfg.vocab_size, 6, ids)
        return make_engine(loaded=(model, mcfg, tok), **kw), ids, prompt_ids(0, 6)

    return make


def run_one(engine, prompt, params):
    engine.add_request(prompt_token_ids=prompt, params=params, request_id="x")
    outs = run_to_end(engine)["x"]
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    return outs


TEXT = "Hello world, this is the end. More text follows here"


def test_scripted_model_drives_engine(scripted, tiny_loaded):
    eng, ids, prompt = scripted(TEXT)
    outs = run_one(eng, prompt, greedy(len(ids)))
    assert tokens_of(outs) == ids
    assert outs[-1].output_text == TEXT
    assert "".join(o.text_delta for o in outs) == TEXT


# ---- stop conditions ---------------------------------------------------------------------------------------
def test_stop_at_eos_unless_ignore_eos(scripted):
    eng, ids, prompt = scripted(TEXT)
    eos = ids[4]  # " is"
    eng, _, _ = scripted(TEXT, eos=(eos,))
    outs = run_one(eng, prompt, greedy(30))
    assert tokens_of(outs) == ids[:5], "stops at the EOS token, which is returned as a token id"
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].output_text == "Hello world, this", "EOS is not part of the text"
    eng, _, _ = scripted(TEXT, eos=(eos,))
    outs = run_one(eng, prompt, greedy(8, ignore_eos=True))
    assert tokens_of(outs) == ids[:8] and outs[-1].finish_reason == "length"


def test_stop_token_ids(scripted):
    eng, ids, prompt = scripted(TEXT)
    outs = run_one(eng, prompt, greedy(30, stop_token_ids=[ids[6], 12345]))  # " end"
    assert tokens_of(outs) == ids[:7]
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].output_text == "Hello world, this is the"


@pytest.mark.parametrize("stop,expected", [
    ("is the en", "Hello world, this "),  # spans " is", " the", " end"; starts inside " is"
    ([". More", "xyz"], "Hello world, this is the end"),
    ("d, t", "Hello worl"),
])
def test_stop_strings_truncate_text(scripted, stop, expected):
    eng, ids, prompt = scripted(TEXT)
    outs = run_one(eng, prompt, greedy(40, stop=stop))
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].output_text == expected
    streamed = "".join(o.text_delta for o in outs)
    assert streamed == expected, "no piece of the stop string may be streamed"
    # generation stopped at the token that completed the stop string
    full = ""
    for n, t in enumerate(ids, 1):
        full = eng.tokenizer.decode(ids[:n])
        if any(s in full for s in ([stop] if isinstance(stop, str) else stop)):
            break
    assert len(tokens_of(outs)) == n


def test_max_tokens_length(scripted):
    eng, ids, prompt = scripted(TEXT)
    outs = run_one(eng, prompt, greedy(3, stop=["zzz"]))
    assert tokens_of(outs) == ids[:3] and outs[-1].finish_reason == "length"
    assert outs[-1].num_output_tokens == 3


def test_max_model_len_stops_a_sequence():
    """Rejection keeps prompt + max_tokens <= max_model_len, so this guard is checked on a Request."""
    req = Request("r", [5] * 10, SamplingParams(max_tokens=100, temperature=0), eos_token_ids=(2,))
    req.append_token(7, 0.0)
    assert req.check_stop_token(max_model_len=12) is None
    req.append_token(7, 0.0)
    assert req.check_stop_token(max_model_len=12) is RequestStatus.FINISHED_LENGTH


def test_stop_string_on_last_token_counts(scripted):
    eng, ids, prompt = scripted(TEXT)
    outs = run_one(eng, prompt, greedy(4, stop=" this"))  # the 4th token both ends it and hits the stop
    assert outs[-1].finish_reason == "stop" and outs[-1].output_text == "Hello world,"


# ---- multi-byte characters ----------------------------------------------------------------------------------
MULTIBYTE = "Hi 🦀 crab 你好世界 and 🤖ロボット ok"


def test_multibyte_characters_never_cut(scripted, tiny_loaded):
    _, _, tok = tiny_loaded
    eng, ids, prompt = scripted(MULTIBYTE)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the text must contain characters split over tokens"
    outs = run_one(eng, prompt, greedy(len(ids)))
    for o in outs:
        assert "\ufffd" not in o.text_delta and "\ufffd" not in o.output_text
    assert "".join(o.text_delta for o in outs) == MULTIBYTE
    for o in outs:  # every intermediate text is a prefix made of whole characters
        assert MULTIBYTE.startswith(o.output_text)


def test_multibyte_stop_string(scripted):
    eng, ids, prompt = scripted(MULTIBYTE)
    outs = run_one(eng, prompt, greedy(len(ids), stop="世"))
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].output_text == "Hi 🦀 crab 你好"
    assert "".join(o.text_delta for o in outs) == "Hi 🦀 crab 你好"


def test_detokenizer_incremental_matches_full_decode(tiny_loaded):
    """Request.detokenize_step over one token at a time spells what a full decode spells."""
    _, _, tok = tiny_loaded
    for text in [MULTIBYTE, TEXT, "  spaces   and\nnewlines\t tabs", "ÄÖÜ ß é ñ — “quotes” 😀😃"]:
        ids = tok.encode(text, add_special_tokens=False)
        req = Request("r", [1], SamplingParams(max_tokens=len(ids)))
        deltas = []
        for i in ids:
            req.append_token(i, 0.0)
            req.detokenize_step(tok)
            assert "\ufffd" not in req.output_text
            deltas.append(req.take_text_delta())
        assert req.output_text == tok.decode(ids) == "".join(deltas)


# ---- bookkeeping ----------------------------------------------------------------------------------------------------
def test_timestamps_and_outputs(make_engine):
    eng = make_engine()
    req = eng.add_request(prompt_token_ids=prompt_ids(0, 12), params=greedy(5, ignore_eos=True))
    outs = run_to_end(eng)[req.request_id]
    t = req.times
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.last_token <= t.finished
    assert len(t.token_times) == 5 and t.token_times == sorted(t.token_times)
    assert t.queue_time >= 0 and t.ttft >= t.queue_time and t.e2e >= t.ttft
    assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4, 5]
    assert outs[-1].num_prompt_tokens == 12


def test_duplicate_request_id_rejected(make_engine):
    eng = make_engine()
    eng.add_request(prompt_token_ids=[5, 6], params=greedy(2), request_id="same")
    with pytest.raises(RequestRejected, match="already in use"):
        eng.add_request(prompt_token_ids=[5, 6], params=greedy(2), request_id="same")


def test_resolved_config_names_what_the_platform_chose(make_engine, monkeypatch):
    """Kernel switches are EngineConfig fields (defaults from ITERSERVE_*); the engine reports what
    they resolved to, which /v1/scheduler and the benchmarks' JSON record."""
    eng = make_engine(decode_attention="torch", num_kv_blocks=40)
    got = eng.resolved_config()
    assert got["decode_attention"] == "torch" and got["device"] == "cpu" and got["num_kv_blocks"] == 40
    assert got["dtype"] == str(eng.dtype).removeprefix("torch.") and got["max_model_len"] == eng.max_model_len
    monkeypatch.setenv("ITERSERVE_DECODE_ATTENTION", "torch")
    monkeypatch.setenv("ITERSERVE_CPU_KERNELS", "0")
    got = make_engine().resolved_config()
    assert got["decode_attention"] == "torch" and got["cpu_kernels"] is False


def test_profile_run_is_one_prefill_at_the_token_budget(tiny_loaded):
    """What the CUDA platform measures to size the KV cache: one step of `n` tokens through the
    real model, writing exactly the blocks that n tokens need (and never the pool's)."""
    from iterserve.attention.backend import TorchAttentionBackend
    from iterserve.runner import ModelRunner

    model, cfg, _ = tiny_loaded
    runner = ModelRunner(model, cfg, 5, 16, torch.device("cpu"), next(model.parameters()).dtype,
                         TorchAttentionBackend())
    runner.profile_run(40)  # 3 blocks of 16
    k_cache = runner.kv_caches[0][0]
    assert all(k_cache[b].abs().sum() > 0 for b in range(3)) and k_cache[3:].abs().sum() == 0
    assert k_cache[2, 8:].abs().sum() == 0  # token 40 onwards was never written


def test_failed_step_keeps_outputs_of_requests_already_ended(make_engine):
    """An abort's final output waits for the next step; a step that then fails must not lose it."""
    llm = make_engine()
    for rid in ("a", "b"):
        llm.add_request(params=SamplingParams(max_tokens=50, ignore_eos=True), request_id=rid,
                        prompt_token_ids=[1, 2, 3])
    llm.step()
    llm.abort_request("a")
    real = llm.runner.execute

    def broken(sched):
        raise RuntimeError("injected")

    llm.runner.execute = broken
    with pytest.raises(RuntimeError, match="injected"):
        llm.step()
    llm.runner.execute = real
    finished = [o for o in llm.step() if o.finished]
    assert [(o.request_id, o.finish_reason) for o in finished] == [("a", "abort")]


def test_error_in_one_requests_processing_ends_only_it(make_engine, monkeypatch):
    llm = make_engine()
    real = Request.detokenize_step

    def poisoned(self, tokenizer):
        if self.request_id == "bad":
            raise ValueError("decoder exploded")
        return real(self, tokenizer)

    monkeypatch.setattr(Request, "detokenize_step", poisoned)
    for rid in ("bad", "good"):
        llm.add_request(params=SamplingParams(max_tokens=5, ignore_eos=True), request_id=rid, prompt_token_ids=[1, 2, 3])
    ends = {}
    while llm.has_unfinished_requests():
        ends.update({o.request_id: o for o in llm.step() if o.finished})
    assert ends["bad"].finish_reason == "error" and "ValueError" in ends["bad"].error
    assert ends["good"].finish_reason == "length" and ends["good"].num_output_tokens == 5
    assert llm.pool.usage().used_blocks == 0
