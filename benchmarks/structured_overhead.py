"""What structured outputs cost the engine (no HTTP): decode step time with every request of a
batch constrained by a JSON schema vs none, and time to first token of a new schema (compiled on
the grammar thread while the request waits) vs a cached one vs no constraint.

    .venv/bin/python benchmarks/structured_overhead.py [--batch 16] [--tokens 48] [--repeats 3] [--dtype auto]

Step times are the engine's own StepRecord durations (forward + masks + sampling) of decode-only
steps at the full batch; the two modes alternate `--repeats` times and the medians are compared.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the server runs: before torch loads

import torch  # noqa: E402

from iterserve.llm import LLM  # noqa: E402
from iterserve.sampling import SamplingParams  # noqa: E402
from iterserve.structured.params import StructuredOutputsParams  # noqa: E402

# long enough never to end inside --tokens, with structure at every few tokens (keys, numbers, strings)
STEP_SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}}


def ttft_schema(i: int) -> dict:
    """A schema no earlier request used (new property names), so it must be compiled."""
    return {"type": "object", "properties": {f"field_{i}_{k}": {"type": t} for k, t in
                                             enumerate(["string", "integer", "boolean", "number"])},
            "required": [f"field_{i}_0"], "additionalProperties": False}


def prompt(llm: LLM, i: int) -> list[int]:
    return llm.engine.encode_prompt(messages=[{"role": "user", "content": f"List people number {i} as JSON."}])


class TimedConstraints:
    """Wraps the runner's TokenConstraints to time the masking itself (fill + apply), which a
    shared machine's step-time noise would otherwise hide."""

    def __init__(self, inner) -> None:
        self.inner, self.times = inner, []

    def apply(self, logits, grammars, biases):
        t0 = time.perf_counter()
        out = self.inner.apply(logits, grammars, biases)
        if any(g is not None for g in grammars):
            self.times.append(time.perf_counter() - t0)
        return out


def decode_step_ms(llm: LLM, batch: int, tokens: int, constrained: bool) -> tuple[float, int]:
    """Median decode-only step at the full batch, and how many such steps there were."""
    eng = llm.engine
    so = StructuredOutputsParams(json=STEP_SCHEMA) if constrained else None
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, structured_outputs=so)
    if so is not None:
        eng.structured.compile(so).result()  # compilation is measured below, not here
    first = eng.step_count
    for i in range(batch):
        eng.add_request(params=sp, prompt_token_ids=prompt(llm, i))
    while eng.has_unfinished_requests():
        eng.step()
    steps = [r.duration for r in list(eng.records)[-(eng.step_count - first):]
             if r.batch_size == batch and r.prefill_tokens == 0]
    return statistics.median(steps) * 1e3, len(steps)


def ttft_ms(llm: LLM, params: SamplingParams, i: int) -> float:
    eng = llm.engine
    req = eng.add_request(params=params, prompt_token_ids=prompt(llm, i))
    while eng.has_unfinished_requests():
        before = eng.step_count
        eng.step()
        if eng.step_count == before:  # waiting for its grammar: the engine thread would sleep too
            time.sleep(0.0005)
    return req.times.ttft * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per request in the step runs")
    ap.add_argument("--repeats", type=int, default=3, help="alternating free/constrained runs")
    ap.add_argument("--ttft-samples", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype)
    eng = llm.engine
    eng.structured.warm_up().result()  # the llguidance tokenizer, built once per server start
    timed = eng.runner.constraints = TimedConstraints(eng.runner.constraints)
    decode_step_ms(llm, 2, 4, constrained=True)  # warm-up
    free, constrained, n_steps = [], [], 0
    for _ in range(args.repeats):
        ms, n = decode_step_ms(llm, args.batch, args.tokens, constrained=False)
        free.append(ms)
        ms, n2 = decode_step_ms(llm, args.batch, args.tokens, constrained=True)
        constrained.append(ms)
        n_steps += n + n2
    f, c = statistics.median(free), statistics.median(constrained)
    mask_ms = statistics.median(timed.times) * 1e3

    one = dict(max_tokens=2, temperature=0, ignore_eos=True)
    new, cached, plain, compile_ms = [], [], [], []
    for i in range(args.ttft_samples):
        so = StructuredOutputsParams(json=ttft_schema(1000 + i))
        new.append(ttft_ms(llm, SamplingParams(**one, structured_outputs=so), i))
        cached.append(ttft_ms(llm, SamplingParams(**one, structured_outputs=so), i))
        plain.append(ttft_ms(llm, SamplingParams(**one), i))
        t0 = time.perf_counter()
        eng.structured._compile(StructuredOutputsParams(json=ttft_schema(2000 + i)).key)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    out = {"model": args.model, "dtype": str(eng.dtype).removeprefix("torch."), "batch": args.batch,
           "decode_step_ms_free": round(f, 2), "decode_step_ms_json_schema": round(c, 2),
           "overhead_pct": round(100 * (c - f) / f, 1), "decode_steps_measured": n_steps,
           "mask_ms_per_step": round(mask_ms, 2), "mask_pct_of_free_step": round(100 * mask_ms / f, 1),
           "ttft_ms_new_schema": round(statistics.median(new), 1),
           "ttft_ms_cached_schema": round(statistics.median(cached), 1),
           "ttft_ms_unconstrained": round(statistics.median(plain), 1),
           "compile_ms_json_schema": round(statistics.median(compile_ms), 2)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
