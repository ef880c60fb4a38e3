"""What the step's token budget (--max-num-batched-tokens) buys on this host: prompt processing time
and how long running streams stall while a long prompt is prefilled, for each budget, one engine per
budget in one process and the budgets taken in turns each round (a shared host's noise hits all).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/step_budget.py FILE.gguf --budgets 512 2048 --rounds 2 \\
        [--out results/x.json]

Cases, each with fresh random token ids (no prefix-cache hit):
- prefill N x L: N prompts of L tokens arrive together, 1 token each; the wall time until all answered;
- stall: 4 streams decoding (context ~64), then one 2048-token prompt arrives; the longest step the
  streams waited through (their worst inter-token gap) and the prompt's time to first token.
The host line (CPU, flags, copy bandwidth, GEMM figure) comes first. Memory is serve_memory.py's.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from machine import figures_line, machine_figures  # noqa: E402  (sibling script)

from iterserve.bench.summary import git_commit  # noqa: E402
from iterserve.engine import LLMEngine  # noqa: E402
from iterserve.config import EngineConfig  # noqa: E402
from iterserve.sampling import SamplingParams  # noqa: E402

PREFILL_CASES = ((1, 2048), (4, 560), (16, 256))
STALL_PROMPT = 2048
STREAMS = 4


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 1) for _ in range(n)]


def run_until_done(eng: LLMEngine) -> None:
    while eng.has_unfinished_requests():
        eng.step()


def time_prefill(eng: LLMEngine, rng: random.Random, n: int, length: int) -> float:
    vocab = eng.model_config.vocab_size
    t0 = time.perf_counter()
    for i in range(n):
        eng.add_request(prompt_token_ids=random_prompt(rng, length, vocab), request_id=f"p{i}",
                        params=SamplingParams(max_tokens=1, temperature=0.0))
    run_until_done(eng)
    return time.perf_counter() - t0


def time_stall(eng: LLMEngine, rng: random.Random) -> dict[str, float]:
    """Streams decoding, then a long prompt: the longest step they sat through, and its TTFT."""
    vocab = eng.model_config.vocab_size
    for i in range(STREAMS):
        eng.add_request(prompt_token_ids=random_prompt(rng, 64, vocab), request_id=f"s{i}",
                        params=SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True))
    for _ in range(3):  # prefilled and decoding
        eng.step()
    eng.add_request(prompt_token_ids=random_prompt(rng, STALL_PROMPT, vocab), request_id="long",
                    params=SamplingParams(max_tokens=1, temperature=0.0))
    t0, worst = time.perf_counter(), 0.0
    while "long" in eng.requests:
        eng.step()
        worst = max(worst, eng.records[-1].duration)
    ttft = time.perf_counter() - t0
    for i in range(STREAMS):
        eng.abort_request(f"s{i}")
    run_until_done(eng)
    return {"worst_stream_gap_s": worst, "long_prompt_ttft_s": ttft}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    host = machine_figures()
    print(figures_line(host), flush=True)
    engines = {b: LLMEngine(EngineConfig(model=args.model, max_num_batched_tokens=b, max_num_seqs=16,
                                         max_model_len=4096, num_kv_blocks=1024)) for b in args.budgets}
    rng = random.Random(0)
    rows: dict[int, dict[str, list[float]]] = {b: {} for b in args.budgets}
    for rnd in range(args.rounds):
        for b, eng in engines.items():
            got = {f"prefill {n}x{length} s": time_prefill(eng, rng, n, length) for n, length in PREFILL_CASES}
            got.update(time_stall(eng, rng))
            for k, v in got.items():
                rows[b].setdefault(k, []).append(v)
            print(f"round {rnd} budget {b}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    keys = list(next(iter(rows.values())))
    print("| budget | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for b, cols in rows.items():
        print(f"| {b} | " + " | ".join(f"{min(v):.2f}-{max(v):.2f}" for v in cols.values()) + " |")
    if args.out:
        args.out.write_text(json.dumps({"host": host, "commit": git_commit(), "command": " ".join(sys.argv),
                                        "rows": {str(b): cols for b, cols in rows.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
