"""Multi-turn chat on Ray Serve replicas: round-robin vs least-loaded vs prefix routing (issue 19).

Two workloads, each the multi-turn workload of `iterserve bench serve --workload multi-turn`:
- shared: every conversation starts with one 400-token system prompt (a hit on any replica), and
- distinct: each conversation its own system prompt, so only a conversation's own history can hit
  (the case where routing a conversation to the replica holding it decides the hit rate).
For each workload and configuration a fresh server is started (`iterserve serve MODEL --replicas 2
--threads-per-replica 1 --router R`, or one engine `iterserve serve MODEL --threads 2` as the
single-machine reference), the workload runs against it, the prefix cache's hit rate is read from
/v1/scheduler (summed over replicas), and the server is stopped with SIGINT. While the workload
runs, the CPU time of every process of the server (Ray's included) is measured by role, so the
cost per request of the Ray path shows where it goes.

Prints the host line and, per workload, a table (done/failed, hit rate, TTFT p50/p95, output
tok/s, CPU per request) and the CPU breakdown; per-request records and server logs go under
runs/scale_out/. About 8-9 minutes at the defaults on a quiet 2-core host (eight server starts of ~30 s,
eight runs of ~25 s).

    .venv/bin/python benchmarks/scale_out.py
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
from collections import defaultdict
from pathlib import Path

import httpx
import psutil

from iterserve.bench.launcher import wait_healthy
from machine import figures_line, machine_figures
from iterserve.bench.summary import git_commit

CONFIGS = {  # name -> serve flags
    "1 engine x 2 threads": ["--threads", "2"],
    "2 replicas round-robin": ["--replicas", "2", "--threads-per-replica", "1", "--router", "round-robin"],
    "2 replicas least-loaded": ["--replicas", "2", "--threads-per-replica", "1", "--router", "least-loaded"],
    "2 replicas prefix": ["--replicas", "2", "--threads-per-replica", "1", "--router", "prefix"],
}
WORKLOADS = {  # name -> bench serve flags
    "shared system prompt": [],  # bench serve's default
    "distinct system prompts": ["--system-prompts", "distinct"],
}
ROLES = ("engine", "replicas", "ingress", "proxy", "controller", "ray other", "driver")


def role(proc: psutil.Process, server_pid: int) -> str:
    """Which part of the server a process is, from the title Ray gives its workers."""
    if proc.pid == server_pid:
        return "driver"  # `iterserve serve`: the engine itself when single-process, else Ray's driver
    try:
        title = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return "ray other"
    for key, name in (("EngineReplica", "replicas"), ("Ingress", "ingress"), ("ProxyActor", "proxy"),
                      ("ServeController", "controller")):
        if key in title:
            return name
    return "ray other"  # raylet, GCS, agents, idle workers


def cpu_by_process(server_pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, user + system CPU seconds so far) for the server and all its descendants."""
    try:
        root = psutil.Process(server_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = (role(p, server_pid), t.user + t.system)
        except psutil.Error:
            pass
    return out


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent by role between two snapshots (a process born in between counts from 0)."""
    spent: dict[str, float] = defaultdict(float)
    for pid, (name, t) in after.items():
        spent[name] += t - before.get(pid, (name, 0.0))[1]
    return dict(spent)




def run_one(name: str, flags: list[str], workload: str, args, out_dir: Path) -> dict:
    base = f"http://127.0.0.1:{args.port}"
    iterserve = str(Path(sys.executable).with_name("iterserve"))
    tag = slug(f"{workload} {name}")
    server = subprocess.Popen([iterserve, "serve", args.model, "--port", str(args.port), *flags, *args.serve_arg],
                              stdout=subprocess.DEVNULL, stderr=open(out_dir / f"{tag}.server.log", "w"))
    try:
        wait_healthy(base, server, args.start_timeout)
        time.sleep(args.settle)  # start-up work (warm-up, Ray's agents) out of the CPU figures
        record = out_dir / f"{tag}.json"
        cpu_before = cpu_by_process(server.pid)
        subprocess.run([iterserve, "bench", "serve", "--base-url", base, "--workload", "multi-turn", "--no-progress",
                        "--conversations", str(args.conversations), "--turns", str(args.turns),
                        "--system-prompt-len", str(args.system_prompt_len), "--user-len", args.user_len,
                        "--output-len", str(args.output_len), "--think-time", str(args.think_time),
                        "--seed", str(args.seed), *WORKLOADS[workload], "--result-json", str(record)],
                       check=True, stdout=subprocess.DEVNULL)
        cpu = cpu_delta(cpu_before, cpu_by_process(server.pid))
        time.sleep(1.0)  # replicas report their counters every stats period (0.2 s)
        sched = httpx.get(base + "/v1/scheduler", timeout=30).json()
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    s = json.loads(record.read_text())["summary"]
    if "--replicas" not in flags:  # one process: the driver is the engine
        cpu["engine"] = cpu.pop("driver", 0.0)
    return {"system": name, "completed": s["completed"], "failed": s["failed"],
            "hit_rate": sched["prefix_cache"]["hit_rate"], "ttft_p50_ms": s["ttft_ms"]["median"],
            "ttft_p95_ms": s["ttft_ms"]["p95"], "output_tok_s": s["output_throughput"],
            "cpu_s": cpu, "cpu_ms_per_request": 1e3 * sum(cpu.values()) / max(1, s["completed"])}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def table(rows: list[dict]) -> str:
    lines = ["| system | done/failed | prefix hit rate | TTFT p50 ms | TTFT p95 ms | output tok/s | CPU ms/request |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
        lines.append(f"| {r['system']} | {r['completed']}/{r['failed']} | {hit} | {r['ttft_p50_ms']:.0f} | "
                     f"{r['ttft_p95_ms']:.0f} | {r['output_tok_s']:.1f} | {r['cpu_ms_per_request']:.0f} |")
    return "\n".join(lines)


def cpu_table(rows: list[dict]) -> str:
    """CPU ms per completed request, by process role."""
    lines = ["| system (CPU ms/request) | " + " | ".join(ROLES) + " |", "|---" * (len(ROLES) + 1) + "|"]
    for r in rows:
        n = max(1, r["completed"])
        lines.append(f"| {r['system']} | " + " | ".join(f"{1e3 * r['cpu_s'].get(k, 0.0) / n:.0f}" for k in ROLES) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="NAME",
                   help=f"which of: {', '.join(CONFIGS)} (default all)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS), metavar="NAME",
                   help=f"which of: {', '.join(WORKLOADS)} (default both)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-prompt-len", type=int, default=400)
    p.add_argument("--user-len", default="32:96")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--think-time", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle", type=float, default=3.0, help="seconds between /health and the workload")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--serve-arg", action="append", default=[], help="extra flag for every server (repeatable)")
    p.add_argument("--out", default="runs/scale_out", help="folder for per-request records and server logs")
    args = p.parse_args()
    out_dir = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    started = time.monotonic()
    header = f"{figures_line(machine_figures())}\ncommit {git_commit()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    print(header, flush=True)
    parts, results = [header], {}
    for workload in args.workloads:
        rows = [run_one(name, CONFIGS[name], workload, args, out_dir) for name in args.configs]
        results[workload] = rows
        text = f"\n### {workload}\n\n{table(rows)}\n\n{cpu_table(rows)}"
        print(text, flush=True)
        parts.append(text)
    parts.append(f"\n(run time {time.monotonic() - started:.0f} s)")
    print(parts[-1])
    (out_dir / "summary.md").write_text("\n".join(parts) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
