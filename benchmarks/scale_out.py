"""Multi-turn chat on Ray Serve replicas: round-robin vs least-loaded vs prefix routing (issue 19).

Each configuration starts a server (`iterserve serve MODEL --replicas 2 --threads-per-replica 1
--router R`, or one engine `iterserve serve MODEL --threads 2` as the single-machine reference),
waits for /health, runs the multi-turn workload of `iterserve bench serve --workload multi-turn`
against it, reads the prefix cache's hit rate from /v1/scheduler (summed over replicas), and stops it
with SIGINT. Prints a markdown table (hit rate, TTFT p50/p95, output throughput); per-request
records go under runs/scale_out/.

    .venv/bin/python benchmarks/scale_out.py --conversations 8 --turns 6 --system-prompt-len 400 \\
        --user-len 32:96 --output-len 64 --think-time 1.0
    # smoke test: --conversations 2 --turns 2 --system-prompt-len 40 --user-len 8 --output-len 4 --think-time 0
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

CONFIGS = {  # name -> serve flags
    "1 engine x 2 threads": ["--threads", "2"],
    "2 replicas round-robin": ["--replicas", "2", "--threads-per-replica", "1", "--router", "round-robin"],
    "2 replicas least-loaded": ["--replicas", "2", "--threads-per-replica", "1", "--router", "least-loaded"],
    "2 replicas prefix": ["--replicas", "2", "--threads-per-replica", "1", "--router", "prefix"],
}


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{base} not healthy after {timeout:.0f} s")


def run_one(name: str, flags: list[str], args, out_dir: Path) -> dict:
    base = f"http://127.0.0.1:{args.port}"
    iterserve = str(Path(sys.executable).with_name("iterserve"))
    server = subprocess.Popen([iterserve, "serve", args.model, "--port", str(args.port), *flags, *args.serve_arg],
                              stdout=subprocess.DEVNULL, stderr=open(out_dir / f"{slug(name)}.server.log", "w"))
    try:
        wait_healthy(base, server, args.start_timeout)
        record = out_dir / f"{slug(name)}.json"
        subprocess.run([iterserve, "bench", "serve", "--base-url", base, "--workload", "multi-turn", "--no-progress",
                        "--conversations", str(args.conversations), "--turns", str(args.turns),
                        "--system-prompt-len", str(args.system_prompt_len), "--user-len", args.user_len,
                        "--output-len", str(args.output_len), "--think-time", str(args.think_time),
                        "--result-json", str(record)], check=True, stdout=subprocess.DEVNULL)
        sched = httpx.get(base + "/v1/scheduler", timeout=30).json()
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    s = json.loads(record.read_text())["summary"]
    return {"system": name, "completed": s["completed"], "failed": s["failed"],
            "hit_rate": sched["prefix_cache"]["hit_rate"], "ttft_p50_ms": s["ttft_ms"]["median"],
            "ttft_p95_ms": s["ttft_ms"]["p95"], "output_tok_s": s["output_throughput"]}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def table(rows: list[dict]) -> str:
    lines = ["| system | done/failed | prefix hit rate | TTFT p50 ms | TTFT p95 ms | output tok/s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
        lines.append(f"| {r['system']} | {r['completed']}/{r['failed']} | {hit} | {r['ttft_p50_ms']:.0f} | "
                     f"{r['ttft_p95_ms']:.0f} | {r['output_tok_s']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="NAME",
                   help=f"which of: {', '.join(CONFIGS)} (default all)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-prompt-len", type=int, default=400)
    p.add_argument("--user-len", default="32:96")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--think-time", type=float, default=1.0)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--serve-arg", action="append", default=[], help="extra flag for every server (repeatable)")
    p.add_argument("--out", default="runs/scale_out", help="folder for per-request records and server logs")
    args = p.parse_args()
    out_dir = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    rows = [run_one(name, CONFIGS[name], args, out_dir) for name in args.configs]
    text = table(rows)
    (out_dir / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
