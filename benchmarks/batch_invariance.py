"""How many greedy texts change with what shares their step, default kernels against --batch-invariant.

The same 12 prompts (iterserve/testing.py's, as tests/test_batch_invariant.py) run alone, in one batch of 16 (4 fillers),
and under KV pressure (--max-num-seqs 8 --num-kv-blocks 24: preemption and recompute); for each
mode it prints how many of the 12 texts differ from the alone run. Speed cost of the mode:
`python benchmarks/ab_decode.py --configs '{}' '{"batch_invariant": true}' --batch 1 16`.

    python benchmarks/batch_invariance.py --json results/batch_invariance.json
    ITERSERVE_CPU_KERNELS_VARIANT=avx2 python benchmarks/batch_invariance.py --dtype float32  # Zen 3's path
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from iterserve.bench.summary import run_info, write_json  # noqa: E402
from iterserve.llm import LLM  # noqa: E402
from iterserve.sampling import SamplingParams  # noqa: E402
from iterserve.testing import BATCH_INVARIANCE_FILLERS as FILLERS  # noqa: E402
from iterserve.testing import BATCH_INVARIANCE_PROMPTS as PROMPTS  # noqa: E402


def texts(llm: LLM, prompts: list[str], max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [r.text for r in llm.generate(prompts, params, use_tqdm=False)]


def run(model: str, max_tokens: int, **mode) -> dict:
    llm = LLM(model, max_num_seqs=16, kv_cache_memory="256MiB", **mode)
    alone = [texts(llm, [p], max_tokens)[0] for p in PROMPTS]
    batched = texts(llm, PROMPTS + FILLERS, max_tokens)[:len(PROMPTS)]
    tight = LLM(model, max_num_seqs=8, num_kv_blocks=24, **mode)
    pressed = texts(tight, PROMPTS, max_tokens)
    return {"engine": llm.engine.resolved_config(),
            "preempted": sum(len(r.preempted) for r in tight.engine.records),
            "differ_batch16": sum(a != b for a, b in zip(alone, batched)),
            "differ_kv_pressure": sum(a != b for a, b in zip(alone, pressed))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", help="the engine's --dtype (float32: what a CPU without "
                    "AVX512-BF16 runs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    info = run_info(["python", "benchmarks/batch_invariance.py", *sys.argv[1:]])
    rows = {"default": run(args.model, args.max_tokens, dtype=args.dtype),
            "batch_invariant": run(args.model, args.max_tokens, dtype=args.dtype, batch_invariant=True)}
    table = ["| mode | texts differing from alone, batch of 16 | under KV pressure (preemptions) |",
             "|---|---:|---:|"]
    for name, r in rows.items():
        table.append(f"| {name} | {r['differ_batch16']} of {len(PROMPTS)} | "
                     f"{r['differ_kv_pressure']} of {len(PROMPTS)} ({r['preempted']}) |")
    print("\n".join(table))
    if args.json:
        write_json(Path(args.json), {**info, "args": vars(args), "table": "\n".join(table), "rows": rows})


if __name__ == "__main__":
    main()
