"""Load time and peak RSS of a model, each measured in a fresh Python process.

    python benchmarks/load_time.py [--model smollm2-135m] [--repeats 3] [--baseline-src DIR] [--transformers]

cold: an empty cache (the GGUF metadata index and the converted tokenizer are built);
warm: the cache is filled, as on every load after the first. The cache is a temporary folder, so
the user's own cache is neither used nor changed. --baseline-src runs the same measurement with
another iterserve source tree (e.g. an older checkout), interleaved with this one, for a ratio;
--transformers also times transformers' own loading of the same GGUF (model + tokenizer, float32).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch
from iterserve.model.loader import load_model, resolve_model
if sys.argv[2] == "transformers":
    from transformers import AutoModelForCausalLM, AutoTokenizer
t1 = time.perf_counter()
if sys.argv[2] == "transformers":
    src = resolve_model(sys.argv[1])
    model = AutoModelForCausalLM.from_pretrained(str(src.folder), gguf_file=src.path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src.folder), gguf_file=src.path.name)
else:
    model, cfg, tok, src = load_model(sys.argv[1])
t2 = time.perf_counter()
rss = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
params = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0, "rss_after_mib": rss / 2**20,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "params_mib": params / 2**20}))
"""


def run_child(model: str, cache: str, src_dir: str | None, loader: str = "iterserve") -> dict:
    """One fresh process; adds its CPU time (user + sys), which contention on a shared machine
    inflates far less than wall time."""
    env = {**os.environ, "ITERSERVE_CACHE": cache, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    if src_dir:
        env["PYTHONPATH"] = src_dir + os.pathsep + env.get("PYTHONPATH", "")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # cwd=cache: `python -c` puts the working directory first on sys.path, which must not shadow src_dir
    out = subprocess.run([sys.executable, "-c", CHILD, model, loader], env=env, cwd=cache, capture_output=True,
                         text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return row


Runs = dict[tuple[str, str], list[dict]]  # (system, cache state) -> one row per process


def measure(model: str, repeats: int, systems: list[tuple[str, str | None, str]]) -> Runs:
    """Systems interleaved within each repeat, so that a change in the machine's load hits all alike."""
    runs: Runs = {}
    for _ in range(repeats):
        for name, src_dir, loader in systems:
            if loader == "transformers":  # keeps no cache of its own
                runs.setdefault((name, "-"), []).append(run_child(model, tempfile.gettempdir(), None, loader))
                continue
            with tempfile.TemporaryDirectory() as cache:
                runs.setdefault((name, "cold"), []).append(run_child(model, cache, src_dir))
                runs.setdefault((name, "warm"), []).append(run_child(model, cache, src_dir))
    return runs


def summary(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model name or path (default smollm2-135m)")
    ap.add_argument("--repeats", type=int, default=3, help="cold + warm pairs to run (medians reported)")
    ap.add_argument("--baseline-src", help="another iterserve source tree to measure too, for comparison")
    ap.add_argument("--transformers", action="store_true", help="also time transformers loading the same GGUF")
    args = ap.parse_args()
    systems = ([("baseline", args.baseline_src, "iterserve")] if args.baseline_src else []) \
        + [("current", None, "iterserve")] + ([("transformers", None, "transformers")] if args.transformers else [])
    print(f"{args.model}: medians of {args.repeats} fresh processes each (ITERSERVE_CACHE in a temp dir)")
    print(f"{'system':12} {'cache':5} {'import s':>8} {'load s':>7} {'total s':>7} {'CPU s':>6} "
          f"{'peak RSS MiB':>12} {'RSS after MiB':>13} {'params MiB':>10}")
    for (name, mode), runs in measure(args.model, args.repeats, systems).items():
        s = summary(runs)
        print(f"{name:12} {mode:5} {s['import_s']:8.2f} {s['load_s']:7.2f} {s['total_s']:7.2f} {s['cpu_s']:6.2f} "
              f"{s['peak_rss_mib']:12.0f} {s['rss_after_mib']:13.0f} {s['params_mib']:10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
