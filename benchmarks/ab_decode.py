"""Decode speed of several engine configurations, interleaved in one process (A, B, A, B, ...), so
that a shared host's noise hits every configuration alike. Prints the best ms/step of each per
batch size and its ratio to the first configuration.

    python benchmarks/ab_decode.py --configs '{}' '{"compile": true}' --batch 1 16 --rounds 3

Each configuration gets its own engine and model copy; compilation (if any) happens at its start.
Kernel switches are EngineConfig fields like any other, e.g. the decode attention backend:

    python benchmarks/ab_decode.py --configs '{"decode_attention": "torch"}' '{}'
    python benchmarks/ab_decode.py --configs '{"cpu_kernels": false}' '{}'   # no C++ kernels

--json writes a summary (the table, each configuration's best ms/step per batch size with the
engine's resolved switches: device, dtype, kernels; host, commit and command); the run keeps no
per-request records, so there is nothing raw to put under runs/.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from decode_speed import run  # noqa: E402  (sibling script)

from iterserve.bench.summary import run_info, write_json  # noqa: E402
from iterserve.llm import LLM  # noqa: E402


def decode_ms_per_step(llm: LLM, batch: int, tokens: int, prompt_len: int) -> float:
    return run(llm, batch, tokens, prompt_len)["ms_per_step"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--configs", nargs="+", default=["{}", '{"compile": true}'],
                    help="one JSON object of EngineConfig fields per configuration")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    info = run_info(["python", "benchmarks/ab_decode.py", *sys.argv[1:]])
    llms = []
    for c in args.configs:
        t0 = time.perf_counter()
        llms.append(LLM(args.model, **json.loads(c)))
        decode_ms_per_step(llms[-1], 1, 4, 8)  # warm-up
        print(f"{c}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
    best: dict[tuple[int, int], float] = {}
    for _ in range(args.rounds):
        for b in args.batch:
            for i, llm in enumerate(llms):
                ms = decode_ms_per_step(llm, b, args.tokens, args.prompt_len)
                best[i, b] = min(best.get((i, b), float("inf")), ms)
    rows = []
    table = ["| batch | " + " | ".join(args.configs) + " |", "|---:|" + "---:|" * len(args.configs)]
    for b in args.batch:
        table.append(f"| {b} | " + " | ".join(f"{best[i, b]:.1f} ms ({1e3 * b / best[i, b]:.0f} tok/s)"
                                             for i in range(len(args.configs))) + " |")
        for i, c in enumerate(args.configs):
            ms = best[i, b]
            rows.append({"config": json.loads(c), "engine": llms[i].engine.resolved_config(), "batch": b,
                         "ms_per_step": ms, "tok_s": 1e3 * b / ms, "speedup_vs_first": best[0, b] / ms})
            print(f"batch {b:3d} {c:40s} {ms:7.1f} ms/step {1e3 * b / ms:7.1f} tok/s  x{best[0, b] / ms:.2f}")
    print("\n".join(table))
    if args.json:
        write_json(Path(args.json), {**info, "args": vars(args), "table": "\n".join(table), "rows": rows})


if __name__ == "__main__":
    main()
