"""One copy of a GGUF's weights against the float copy: decode and prefill speed and peak memory of
the same file, each run in a fresh process, this tree beside a baseline tree (an older checkout),
interleaved so that a change in the machine's load hits both.

    python benchmarks/gguf_one_copy.py [--baseline-src OLD_CHECKOUT] [--model smollm2-135m --model FILE.gguf]
        [--repeats 3] [--quantization none] [--kv-cache-memory 2GiB]

Per process: the engine is built (kernels measured or read from the kernel-choice cache, as a
server does), one warm-up request, then the best of 3 single-stream decodes of 64 tokens (tokens
after the first over their span) and one 512-token prefill (one token sampled); peak RSS is the
process's VmHWM, beside its RSS after loading and the engine's own count of its weights (private and
read in place from the file's map); load is the
engine's construction (weights, kernel choice, KV cache). The host line (CPU, flags, copy bandwidth,
GEMM) comes first. Leave --baseline-src out where the old tree cannot hold the model (a float copy of
an 8B needs ~16 GB more).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from machine import figures_line, machine_figures

CHILD = r"""
import json, resource, sys, time
from iterserve.llm import LLM
from iterserve.sampling import SamplingParams
t = time.perf_counter()
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
load = time.perf_counter() - t
after = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**30
decode = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
llm.generate(["Hello there"], decode, use_tqdm=False)
best = 0.0
for _ in range(3):
    tt = llm.generate(["The capital of France is"], decode, use_tqdm=False)[0].times.token_times
    best = max(best, (len(tt) - 1) / (tt[-1] - tt[0]))
t = time.perf_counter()
llm.generate([list(range(1000, 1512))], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
prefill = 512 / (time.perf_counter() - t)
print(json.dumps({"load_s": load, "rss_after_load_gib": after, "decode_tok_s": best, "prefill_512_tok_s": prefill,
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "weights_gib": (llm.engine.memory.weights_resident + llm.engine.memory.weights_mapped) / 2**30,
                  "weights_mapped_gib": llm.engine.memory.weights_mapped / 2**30}))
"""


def run_child(model: str, src_dir: str, engine_kwargs: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": src_dir, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, model, json.dumps(engine_kwargs)], env=env, cwd=src_dir,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="model name or GGUF path (repeatable; default smollm2-135m)")
    ap.add_argument("--baseline-src", help="an iterserve source tree to compare against (an older checkout)")
    ap.add_argument("--repeats", type=int, default=3, help="processes per system and model (medians reported)")
    ap.add_argument("--quantization", help="passed to both engines (e.g. none: the float copy in both)")
    ap.add_argument("--kv-cache-memory", default="256MiB", help="each engine's KV cache (default 256MiB)")
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    kwargs = {"kv_cache_memory": args.kv_cache_memory, **({"quantization": args.quantization} if args.quantization
                                                           else {})}
    print(figures_line(machine_figures()))
    print(f"{'model':28} {'system':9} {'load s':>6} {'decode tok/s':>12} {'prefill 512 tok/s':>17} "
          f"{'RSS after load GiB':>18} {'peak RSS GiB':>12} {'weights GiB':>11}")
    for model in args.model or ["smollm2-135m"]:
        trees = {"current": here, **({"baseline": os.path.abspath(args.baseline_src)} if args.baseline_src else {})}
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.repeats):
            for name, tree in trees.items():
                runs[name].append(run_child(model, tree, kwargs))
        for name, rows in runs.items():
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(f"{os.path.basename(model)[:28]:28} {name:9} {med['load_s']:6.1f} {med['decode_tok_s']:12.1f} "
                  f"{med['prefill_512_tok_s']:17.0f} {med['rss_after_load_gib']:18.2f} {med['peak_rss_gib']:12.2f} "
                  f"{med['weights_gib']:11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
