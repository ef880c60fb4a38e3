"""Offline decode speed of the engine at fixed batch sizes (no HTTP): tokens/s and ms per step.

    python benchmarks/decode_speed.py --batch 1 16 --dtype float32 bfloat16 --tokens 64
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the server runs: before torch loads

import torch  # noqa: E402

from iterserve.llm import LLM  # noqa: E402
from iterserve.sampling import SamplingParams  # noqa: E402


def start_decode_batch(llm: LLM, batch: int, prompt_len: int, max_tokens: int) -> None:
    """Adds `batch` greedy, ignore_eos requests with distinct synthetic prompts and steps until
    every prompt is prefilled, so the engine's next steps are decode-only at this batch size.
    Shared by decode_speed, ab_decode and profile_step."""
    eng = llm.engine
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(params=sp, prompt_token_ids=[100 + (i * 7 + j) % 4000 for j in range(prompt_len)])
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.requests.values()):
        eng.step()


def drain(llm: LLM) -> None:
    """Aborts every request and steps until the engine holds none, so the next measurement starts
    from an empty batch. Shared by profile_step, ab_prefill and ab_rms_norm."""
    eng = llm.engine
    for rid in list(eng.requests):
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()


def decode_step_seconds(llm: LLM, steps: int = 8) -> float:
    """Mean seconds of `steps` decode steps after one untimed step (the one that follows a switch
    of kernels). Shared by ab_rms_norm and ab_elementwise."""
    eng = llm.engine
    eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return (time.perf_counter() - t0) / steps


def times_in_turns(switch: Callable[[bool], None], rounds: int,
                   measure: Callable[[], float]) -> dict[bool, list[float]]:
    """`measure()` with switch(False) and switch(True) in turns, `rounds` times each, so that a shared
    host's noise hits both alike: {False: [...], True: [...]}. Shared by ab_rms_norm and ab_elementwise."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for on in times:
            switch(on)
            times[on].append(measure())
    return times


def run(llm: LLM, batch: int, tokens: int, prompt_len: int) -> dict:
    start_decode_batch(llm, batch, prompt_len, tokens)
    eng = llm.engine
    t0 = time.perf_counter()
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    dt = time.perf_counter() - t0
    return {"batch": batch, "decode_tok_s": batch * steps / dt, "ms_per_step": 1e3 * dt / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtype", nargs="+", default=["float32"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--extra", default="{}", help="JSON of extra EngineConfig fields")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for dtype in args.dtype:
        llm = LLM(args.model, dtype=dtype, **json.loads(args.extra))
        run(llm, 1, 8, args.prompt_len)  # warm-up
        for b in args.batch:
            r = run(llm, b, args.tokens, args.prompt_len) | {"dtype": dtype}
            rows.append(r)
            print(f"{dtype:9s} batch {b:3d}: {r['decode_tok_s']:7.1f} tok/s  {r['ms_per_step']:6.1f} ms/step", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
