"""xgrammar vs llguidance on the embedded model's tokenizer (SmolLM2-135M, 49152 tokens).

Measures what the engine pays for each: compiling a grammar (JSON schemas, a regex, a choice list;
cold, with each library's cache bypassed) and, per decode step, filling the token bitmask of 16
constrained requests and applying it to a [16, vocab] float32 logits tensor. The 16 matchers are
walked through a real JSON document token by token so the masks are those of mid-generation states.

    .venv/bin/pip install xgrammar   # not a dependency of iterserve
    .venv/bin/python benchmarks/grammar_backends.py [--steps 40] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version

import llguidance
import llguidance.hf
import llguidance.torch
import torch

try:
    import xgrammar as xgr
except ImportError:  # not a dependency: only this comparison uses it
    raise SystemExit("this comparison needs xgrammar: .venv/bin/pip install xgrammar") from None

from iterserve.bench.common import best_time
from iterserve.model.loader import load_tokenizer, resolve_model

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {
            "type": "array", "items": {"type": "string"}, "maxItems": 4}}, "required": ["id", "tags"]},
        "status": {"enum": ["active", "inactive", "banned"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["user", "status", "score"]},
    "tool_call": {"type": "object", "properties": {
        "location": {"type": "string", "minLength": 1, "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["location", "unit"], "additionalProperties": False},
}
REGEX = r"\d{3}-\d{3}-\d{4}"
CHOICE = ["positive", "negative", "neutral"]
DOC = json.dumps({"user": {"id": 12345, "tags": ["alpha", "beta", "gamma"]}, "status": "active", "score": 0.75})


def timed(fn, repeats: int) -> float:
    """Best of `repeats` single calls, with no untimed call first: a compile is timed cold."""
    return best_time(fn, repeats, warmup=False)


def bench_xgrammar(hf_tok, vocab: int, eos: list[int], steps: int, repeats: int, batch: int) -> dict:
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab, stop_token_ids=eos)
    out = {}
    for name, schema in SCHEMAS.items():
        out[f"compile {name}"] = timed(lambda s=schema: xgr.GrammarCompiler(info, cache_enabled=False)
                                       .compile_json_schema(json.dumps(s)), repeats)
    out["compile regex"] = timed(lambda: xgr.GrammarCompiler(info, cache_enabled=False).compile_regex(REGEX), repeats)
    ebnf = "root ::= " + " | ".join(json.dumps(c) for c in CHOICE)
    out["compile choice"] = timed(lambda: xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(ebnf), repeats)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMAS["nested"]))
    doc_ids = hf_tok.encode(DOC, add_special_tokens=False)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    batch_matcher = xgr.BatchGrammarMatcher()
    fill, fill_batched, apply = [], [], []
    for step in range(min(steps, len(doc_ids))):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        fill.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
        fill_batched.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        apply.append(time.perf_counter() - t0)
        for m in matchers:
            assert m.accept_token(doc_ids[step])
    out["mask fill (loop)"] = statistics.median(fill)
    out["mask fill (batched)"] = statistics.median(fill_batched)
    out["mask apply"] = statistics.median(apply)
    return out


def bench_llguidance(hf_tok, vocab: int, eos: list[int], steps: int, repeats: int, batch: int) -> dict:
    tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab, eos_token=eos[0])
    out = {}

    def compile_(grammar: str) -> None:
        err = llguidance.LLMatcher.validate_grammar(grammar, tok)
        assert not err, err
        llguidance.LLMatcher(tok, grammar)  # llguidance compiles lazily; a matcher does the work

    for name, schema in SCHEMAS.items():
        g = llguidance.LLMatcher.grammar_from_json_schema(schema)
        out[f"compile {name}"] = timed(lambda g=g: compile_(g), repeats)
    g = llguidance.LLMatcher.grammar_from_regex(REGEX)
    out["compile regex"] = timed(lambda: compile_(g), repeats)
    lark = "start: " + " | ".join(json.dumps(c) for c in CHOICE)
    g = llguidance.grammar_from("lark", lark)
    out["compile choice"] = timed(lambda: compile_(g), repeats)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMAS["nested"])
    doc_ids = hf_tok.encode(DOC, add_special_tokens=False)
    matchers = [llguidance.LLMatcher(tok, grammar) for _ in range(batch)]
    bitmask = llguidance.torch.allocate_token_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    executor = llguidance.LLExecutor()
    fill, fill_batched, apply = [], [], []
    for step in range(min(steps, len(doc_ids))):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(m, bitmask, i)
        fill.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        fill_batched.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
        apply.append(time.perf_counter() - t0)
        for m in matchers:
            assert m.consume_token(doc_ids[step]), m.get_error()
    out["mask fill (loop)"] = statistics.median(fill)
    out["mask fill (batched)"] = statistics.median(fill_batched)
    out["mask apply"] = statistics.median(apply)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="decode steps walked through the JSON document")
    ap.add_argument("--repeats", type=int, default=3, help="compilations per grammar (best kept)")
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    hf_tok = load_tokenizer(resolve_model("smollm2-135m"))
    vocab, eos = len(hf_tok), [hf_tok.eos_token_id]
    rows = {"xgrammar " + version("xgrammar"): bench_xgrammar(hf_tok, vocab, eos, args.steps, args.repeats, args.batch),
            "llguidance " + version("llguidance"): bench_llguidance(hf_tok, vocab, eos, args.steps, args.repeats,
                                                                        args.batch)}
    names = list(next(iter(rows.values())))
    print(f"| ms (batch {args.batch} for masks) | " + " | ".join(rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{r[n] * 1e3:.2f}" for r in rows.values()) + " |")


if __name__ == "__main__":
    main()
