"""Memory of a served GGUF, iterserve beside llama.cpp's llama-server, with the same KV capacity:
peak (VmHWM) and steady (VmRSS) resident memory of each server process, after it has served a few
concurrent requests, and its RSS right after start.

    python benchmarks/serve_memory.py FILE.gguf [FILE.gguf ...] [--seqs 4] [--seq-len 4096] [--out results/x.json]

Capacity: `--seqs` sequences of `--seq-len` tokens. llama-server gets `NP=seqs CTX=seqs*seq_len` (its
start script: that many slots sharing one unified f16 KV cache of CTX cells); iterserve gets
`--max-num-seqs seqs --max-model-len seq_len --num-kv-blocks seqs*seq_len/16` (its KV cache in the
model dtype: bf16 where the CPU has it). The load: `--seqs` concurrent completions of a ~600-token prompt
and 32 generated tokens, twice. Both RSS figures count the file's mapped pages the process has
touched (both servers read the weights from the file's map; llama.cpp may also repack some for its
kernels). llama.cpp comes from ../shared/peers/ (setup_llamacpp.sh). The host line comes first.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path

import httpx

from machine import figures_line, machine_figures
from peers.systems import PeerInstall, System, serving
from peers.vs_peers import DEFAULT_PEERS_DIR, DEFAULT_PEERS_HOME
from iterserve.bench.common import load_average
from iterserve.bench.summary import git_commit

PROMPT = "The history of the city begins with a small settlement by the river. " * 40


def status_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmHWM:", "VmRSS:")):
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0])
    return out


def load(base_url: str, model: str, seqs: int) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=1800) as client, concurrent.futures.ThreadPoolExecutor(seqs) as pool:
        for _ in range(2):
            for r in pool.map(lambda _: client.post(f"{base_url}/v1/completions", json=body), range(seqs)):
                r.raise_for_status()


def measure(system: System, install: PeerInstall, gguf: Path, seqs: int, seq_len: int, log_dir: Path) -> dict:
    env = {"GGUF": str(gguf), "NP": str(seqs), "CTX": str(seqs * seq_len), "ALIAS": "model"}
    with serving(system, install, str(gguf), log_dir, 1800, env) as started:
        pid = started.pid or int(install.pid_file(system.kind).read_text().strip())
        after_start = status_kib(pid)["VmRSS"]
        served = httpx.get(f"{started.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        load(started.base_url, served, seqs)
        time.sleep(2)
        s = status_kib(pid)
    return {"system": system.label, "rss_after_start_gib": after_start / 2**20, "peak_rss_gib": s["VmHWM"] / 2**20,
            "steady_rss_gib": s["VmRSS"] / 2**20, "startup_s": started.startup_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path, nargs="+")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    ap.add_argument("--peers-home", type=Path, default=DEFAULT_PEERS_HOME)
    ap.add_argument("--log-dir", type=Path, default=Path("runs/serve_memory"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    host = machine_figures()
    print(figures_line(host), flush=True)
    install = PeerInstall(args.peers_dir, args.peers_home)
    blocks = args.seqs * args.seq_len // 16
    ours = System("iterserve", "iterserve", ("--max-num-seqs", str(args.seqs), "--max-model-len", str(args.seq_len),
                                             "--num-kv-blocks", str(blocks), "--block-size", "16"))
    peer = System("llama.cpp", "llamacpp")
    rows = []
    print("| model | system | RSS after start GiB | peak RSS GiB | steady RSS GiB | start s |")
    print("|---|---|---|---|---|---|")
    for gguf in args.gguf:
        for system in (peer, ours, peer):  # llama.cpp before and after: the page cache and the host change
            row = {"model": gguf.name, **measure(system, install, gguf, args.seqs, args.seq_len, args.log_dir)}
            rows.append(row)
            print(f"| {gguf.name} | {row['system']} | {row['rss_after_start_gib']:.2f} | {row['peak_rss_gib']:.2f} | "
                  f"{row['steady_rss_gib']:.2f} | {row['startup_s']:.1f} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"host": host, "commit": git_commit(), "command": " ".join(sys.argv),
                                        "load_average": load_average(), "seqs": args.seqs, "seq_len": args.seq_len,
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
