"""What a second replica of one GGUF on one host costs in memory: replicas are separate processes
(`serve --replicas N` runs each as a Ray Serve replica, a process of its own), and a GGUF's K-quant
blocks are read in place from the file's memory map, so the file's pages are the page cache's, shared
by every process that maps the file; a replica adds its own KV cache, activations and the few weights
it copies (norms, tables, blocks of types the kernels repack).

    python benchmarks/replica_memory.py FILE.gguf [--replicas 2] [--kv-cache-memory 256MiB] [--out results/x.json]

Each replica is an engine in a fresh process (LLM(FILE), one short generation so every weight has
been read), started one after another. Per replica: RSS, PSS and its split from /proc/PID/smaps_rollup
(file pages shared with the others vs anonymous, private memory), its KV cache bytes, and the drop in
the host's MemAvailable while it started. The host line (CPU, flags, copy bandwidth, GEMM) comes first.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from machine import figures_line, machine_figures

CHILD = r"""
import json, sys
from iterserve.llm import LLM
from iterserve.sampling import SamplingParams
llm = LLM(sys.argv[1], kv_cache_memory=sys.argv[2])
llm.generate(["Hello there"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
m = llm.engine.memory
print(json.dumps({"kv_cache_bytes": m.kv_cache, "weights_resident": m.weights_resident,
                  "weights_mapped": m.weights_mapped}), flush=True)
sys.stdin.readline()  # held until the parent has read every replica
"""


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup's kB fields, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a GGUF file (or any model name iterserve loads)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--out", help="write the summary JSON here")
    args = ap.parse_args()
    host = machine_figures()
    print(figures_line(host), flush=True)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs, rows = [], []
    file_bytes = Path(args.model).stat().st_size if Path(args.model).exists() else None
    try:
        for i in range(args.replicas):
            before = mem_available()
            p = subprocess.Popen([sys.executable, "-c", CHILD, args.model, args.kv_cache_memory], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(p)
            engine = json.loads(p.stdout.readline())
            rows.append({"replica": i + 1, "mem_available_drop": before - mem_available(), **engine})
        for row, p in zip(rows, procs):
            r = rollup(p.pid)
            row.update(rss=r["Rss"], pss=r["Pss"], anonymous=r["Anonymous"], file_shared=r["Shared_Clean"],
                       file_private=r["Private_Clean"])
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.write("\n")
                p.stdin.flush()
                p.wait(timeout=60)
    gib = 2 ** 30
    print(f"file: {args.model} ({file_bytes / gib:.2f} GiB)" if file_bytes else f"model: {args.model}")
    print("| replica | RSS | PSS | anonymous (private) | of it KV cache | file pages shared | MemAvailable drop |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['replica']} | {r['rss'] / gib:.2f} | {r['pss'] / gib:.2f} | {r['anonymous'] / gib:.2f} | "
              f"{r['kv_cache_bytes'] / gib:.2f} | {r['file_shared'] / gib:.2f} | {r['mem_available_drop'] / gib:.2f} |")
    if len(rows) > 1 and file_bytes:
        added = rows[1]["anonymous"] - rows[1]["kv_cache_bytes"]
        print(f"second replica: {added / gib:.3f} GiB private besides its KV cache = "
              f"{100 * added / file_bytes:.1f} % of the file; MemAvailable fell "
              f"{rows[1]['mem_available_drop'] / gib:.2f} GiB ({100 * rows[1]['mem_available_drop'] / file_bytes:.1f} %"
              f" of the file, KV cache included)")
    if args.out:
        Path(args.out).write_text(json.dumps({"host": host, "model": args.model, "file_bytes": file_bytes,
                                              "kv_cache_memory": args.kv_cache_memory, "replicas": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
