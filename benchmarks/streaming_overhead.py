"""Streaming overhead: time per output token over HTTP streaming vs the offline engine, one client.

Both run the same model and engine flags, alternately (and in alternating order) so that machine
load drifts hit both alike. Offline TPOT comes from the engine's own token timestamps; HTTP TPOT is
what the client sees: from the first content chunk to the final chunk, over the output tokens
minus one. The server's own view of the same request (its `iterserve` timings) is recorded too:
client over server isolates the cost of the HTTP/SSE path from any difference in engine speed
between the two processes. On a shared machine wall times swing with other load, so the CPU time
each side spends per output token is recorded as well (Linux /proc: the server process for an
HTTP run, this process for an offline run, where the idle HTTP client costs nothing). Usage:

    .venv/bin/python benchmarks/streaming_overhead.py --model smollm2-135m --rounds 5 --max-tokens 128
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from iterserve.bench.launcher import ServerProcess  # noqa: E402
from iterserve.config import EngineConfig  # noqa: E402
from iterserve.engine import LLMEngine  # noqa: E402
from iterserve.sampling import SamplingParams  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def offline_tpot(engine: LLMEngine, max_tokens: int) -> tuple[float, float]:
    req = engine.add_request(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    t = req.times
    return (t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1), t.first_token - t.arrival


def http_tpot(http: httpx.Client, model: str, max_tokens: int) -> tuple[float, float, dict]:
    """Client-side TPOT and TTFT, and the server's own timings for the same request."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    tokens, server = 0, {}
    sent = time.perf_counter()
    with http.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk["choices"]:
                choice = chunk["choices"][0]
                if choice["text"] and first is None:
                    first = now
                if choice["text"] or choice["finish_reason"]:
                    last = now
            server = chunk.get("iterserve") or server
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    assert tokens == max_tokens, f"got {tokens} tokens"
    server["tpot"] = (server["e2e"] - server["ttft"]) / (tokens - 1)
    return (last - first) / (tokens - 1), first - sent, server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    args = ap.parse_args()

    flags = ["--threads", str(args.threads)] if args.threads else []
    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.threads))
    offline_tpot(engine, 8)  # warm-up (the server warms itself up)
    gc.collect()
    gc.freeze()  # as the server does after loading: no full collections over the model's objects
    res: dict[str, list[float]] = {k: [] for k in ("offline", "http", "server", "offline_ttft", "http_ttft",
                                                    "server_ttft", "server_queue", "offline_cpu", "http_cpu")}
    # one keep-alive client: creating an httpx client per request costs more than a token here
    with ServerProcess([args.model, *flags]) as srv, httpx.Client(base_url=srv.base_url, timeout=600) as http:
        http_tpot(http, args.model, 8)

        def run_offline() -> None:
            cpu = cpu_seconds(os.getpid())
            tpot, ttft = offline_tpot(engine, args.max_tokens)
            res["offline_cpu"].append((cpu_seconds(os.getpid()) - cpu) / args.max_tokens)
            res["offline"].append(tpot)
            res["offline_ttft"].append(ttft)

        def run_http() -> None:
            cpu = cpu_seconds(srv.proc.pid)
            tpot, ttft, server = http_tpot(http, args.model, args.max_tokens)
            res["http_cpu"].append((cpu_seconds(srv.proc.pid) - cpu) / args.max_tokens)
            res["http"].append(tpot)
            res["http_ttft"].append(ttft)
            res["server"].append(server["tpot"])
            res["server_ttft"].append(server["ttft"])
            res["server_queue"].append(server["queue_time"])

        for r in range(args.rounds):
            for fn in ((run_offline, run_http) if r % 2 == 0 else (run_http, run_offline)):
                fn()
            print(f"round {r + 1}: offline {res['offline'][-1] * 1e3:.2f} ms/token, http {res['http'][-1] * 1e3:.2f}"
                  f" (server {res['server'][-1] * 1e3:.2f}) ms/token; cpu offline "
                  f"{res['offline_cpu'][-1] * 1e3:.1f} http {res['http_cpu'][-1] * 1e3:.1f} ms/token", flush=True)
    med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
    pair_ratios = [h / o for h, o in zip(res["http"], res["offline"])]
    transport = [h / s for h, s in zip(res["http"], res["server"])]
    print(json.dumps({
        "model": args.model, "max_tokens": args.max_tokens, "rounds": args.rounds,
        **{f"{k}_ms_median": round(v, 3) for k, v in med.items()},
        "ratio_http_over_offline_medians": round(med["http"] / med["offline"], 4),
        "ratio_http_over_offline_per_round_median": round(statistics.median(pair_ratios), 4),
        "ratio_client_over_server_median": round(statistics.median(transport), 4),
        "ratio_cpu_http_over_offline_medians": round(med["http_cpu"] / med["offline_cpu"], 4),
        **{f"{k}_ms": [round(x * 1e3, 2) for x in v] for k, v in res.items()}}, indent=1))


if __name__ == "__main__":
    main()
