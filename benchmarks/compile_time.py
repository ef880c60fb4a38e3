"""What `--compile` costs at start-up, cold and with inductor's caches kept across restarts, and what
it gains per decode step: decides whether compile can be the default (docs/benchmarks/compile.md).

Each start is a fresh process (as a server restart is): `LLM(model, compile=...)`, then decode
steps at batch 1 and 16. "cold" starts with an empty TORCHINDUCTOR_CACHE_DIR; "warm" is the next
process with the same folder (FX graph cache and AOT autograd cache, on by default in torch 2.13);
"eager" has no compile. Kernel measurement is off (ITERSERVE_MEASURE_KERNELS=0) so the starts time
only the compile.

    python benchmarks/compile_time.py --json results/compile_time.json
    python benchmarks/compile_time.py --tokens 4 --batch 1      # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from decode_speed import run  # sibling script (running this one puts its folder first on sys.path)

from iterserve.bench.summary import run_info, write_json
from iterserve.llm import LLM



def child(model: str, compile: bool, tokens: int, batches: list[int]) -> None:
    """One start, in this fresh process: the time until the engine is ready, then ms per decode step."""
    t0 = time.perf_counter()
    llm = LLM(model, compile=compile)
    ready = time.perf_counter() - t0
    steps = {b: run(llm, b, tokens, 64)["ms_per_step"] for b in batches}
    print("RESULT " + json.dumps({"ready_s": ready, "load_s": llm.engine.load_seconds, "ms_per_step": steps}))


def start(model: str, compile: bool, cache: str, tokens: int, batches: list[int]) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "ITERSERVE_MEASURE_KERNELS": "0",
           "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    out = subprocess.run([sys.executable, __file__, "--child", "--model", model, "--tokens", str(tokens),
                          "--batch", *map(str, batches), *(["--compile"] if compile else [])],
                         env=env, capture_output=True, text=True, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"child failed:\n{out.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one start (this script, again)
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model, args.compile, args.tokens, args.batch)
        return
    info = run_info(["python", "benchmarks/compile_time.py", *sys.argv[1:]])
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        rows = {"eager": start(args.model, False, cache, args.tokens, args.batch),
                "compile, cold cache": start(args.model, True, cache, args.tokens, args.batch),
                "compile, warm cache": start(args.model, True, cache, args.tokens, args.batch)}
    eager = rows["eager"]
    table = ["| start | ready after (s) | of which loading (s) | " + " | ".join(f"ms/step at {b}" for b in args.batch)
             + " |", "|---|---:|---:|" + "---:|" * len(args.batch)]
    for name, r in rows.items():
        cells = " | ".join(f"{r['ms_per_step'][str(b)]:.1f}" for b in args.batch)
        table.append(f"| {name} | {r['ready_s']:.1f} | {r['load_s']:.1f} | {cells} |")
    print("\n".join(table))
    print(f"compile overhead over eager start: cold {rows['compile, cold cache']['ready_s'] - eager['ready_s']:.1f} s, "
          f"warm {rows['compile, warm cache']['ready_s'] - eager['ready_s']:.1f} s")
    if args.json:
        write_json(Path(args.json), {**info, "args": vars(args), "table": "\n".join(table), "rows": rows})


if __name__ == "__main__":
    main()
