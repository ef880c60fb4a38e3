"""Soak test: Poisson load with random disconnects against a server squeezed into preemption and
queue rejections, then a SIGTERM with requests in flight. Every request must end as one of:
completed, rejected with a reason (HTTP 4xx/503 before admission), failed with a clear error
(shutdown, engine error), disconnected by us, or (after the SIGTERM) not connected because the
server had exited; `lost` (no answer on an open connection, a dropped connection, a hang) must be 0, and after the load the KV cache must hold no block (`kv_blocks_leaked` 0).

    .venv/bin/python benchmarks/soak.py --duration 600            # the issue's 10 minutes
    .venv/bin/python benchmarks/soak.py --duration 90 --rate 6    # a smoke run
    .venv/bin/python benchmarks/soak.py --duration 90 --windowed  # KV cache groups freeing windows

Writes a summary JSON (--out, default runs/soak.json) and prints it; exits 1 when anything was lost
or leaked. The server is started here: --num-kv-blocks small enough that the running requests
outgrow the cache (preemption), --max-waiting small enough that bursts hit the queue bound.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from iterserve.bench.launcher import ServerProcess

WORDS = "the quick brown fox jumps over a lazy dog while seven bakers sing of distant harbours".split()


def windowed_model(folder: Path) -> str:
    """A small random Gemma 3 with SmolLM2's tokenizer, saved as a Hugging Face folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from iterserve.model.loader import load_tokenizer, resolve_model

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gemma3_text", vocab_size=49152, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                               sliding_window=32, query_pre_attn_scalar=32, max_position_embeddings=1024)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(folder)
    return str(folder)


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120)))


async def one(http: httpx.AsyncClient, rng: random.Random, outcomes: Counter, reasons: Counter,
              disconnect_p: float, timeout_s: float) -> None:
    """Sends one request and files its outcome."""
    stream = rng.random() < 0.5
    body = {"prompt": prompt(rng), "max_tokens": rng.randint(8, 160), "stream": stream,
            "temperature": rng.choice([0.0, 0.7, 1.0]), "ignore_eos": True}
    disconnect_after = rng.uniform(0.05, 3.0) if rng.random() < disconnect_p else None
    outcomes["sent"] += 1

    async def go() -> str:
        if not stream:
            r = await http.post("/v1/completions", json=body)
            if r.status_code == 200:
                return "completed"
            return classify(r.status_code, r.json()["error"], reasons)
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return classify(r.status_code, json.loads(await r.aread())["error"], reasons)
            finish, error, done = None, None, False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"]
                    elif chunk["choices"]:
                        finish = chunk["choices"][0]["finish_reason"] or finish
            if error is not None:
                return classify(200, error, reasons, admitted=True)
            return "completed" if done and finish in ("stop", "length") else "lost"

    try:
        if disconnect_after is not None:
            try:
                outcome = await asyncio.wait_for(go(), disconnect_after)
            except asyncio.TimeoutError:
                outcome = "disconnected"
        else:
            outcome = await asyncio.wait_for(go(), timeout_s)
    except httpx.ConnectError:  # no connection: the request never reached a server (it has exited)
        reasons["not connected (the server had exited)"] += 1
        outcome = "not_connected"
    except (httpx.HTTPError, asyncio.TimeoutError, json.JSONDecodeError, KeyError) as e:
        reasons[f"lost: {type(e).__name__}"] += 1
        outcome = "lost"
    outcomes[outcome] += 1


def classify(status: int, error: dict, reasons: Counter, admitted: bool = False) -> str:
    """A refusal before admission is 'rejected'; an error after it 'failed'; both need a message."""
    if not error.get("message"):
        return "lost"
    code = error.get("code") or error.get("type")
    if admitted or code in ("shutdown", "error"):
        reasons[f"failed {status} {code}"] += 1
        return "failed"
    reasons[f"rejected {status} {code}: {short(error['message'])}"] += 1
    return "rejected"


def short(message: str) -> str:
    """The reason without its numbers, so that equal reasons count together."""
    return " ".join(w for w in message.split()[:6] if not any(c.isdigit() for c in w))


async def load(base_url: str, rate: float, duration: float, disconnect_p: float, seed: int,
               outcomes: Counter, reasons: Counter, timeout_s: float, until=None) -> None:
    """Poisson arrivals for `duration` seconds (or until `until` is set); waits for every request."""
    rng = random.Random(seed)
    tasks = []
    # idle connections expire here before the server's keep-alive timeout (uvicorn's 5 s) closes them:
    # with equal timeouts, a request sent on a connection the server is closing at that moment can fail
    # with ReadError before the server has read it, a client-side race (httpx's default expiry is 5 s;
    # a 20-minute run with it counted 1 ReadError in 4,702 requests)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as http:
        end = time.monotonic() + duration
        while time.monotonic() < end and not (until is not None and until.is_set()):
            tasks.append(asyncio.ensure_future(one(http, random.Random(rng.random()), outcomes, reasons,
                                                   disconnect_p, timeout_s)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


def scheduler(base_url: str) -> dict:
    return httpx.get(base_url + "/v1/scheduler", timeout=10).json()


def wait_idle(base_url: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        snap = scheduler(base_url)
        if (snap["running"] == 0 and snap["waiting"] == 0) or time.monotonic() > deadline:
            return snap
        time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model to serve (default smollm2-135m)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load before the SIGTERM phase (default 600)")
    p.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second (default 8)")
    p.add_argument("--disconnect", type=float, default=0.2, help="share of requests the client drops (default 0.2)")
    p.add_argument("--num-kv-blocks", type=int, default=48,
                   help="KV blocks of 16 tokens: small, to force preemption (default 48)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="running-batch bound (default 16)")
    p.add_argument("--max-waiting", type=int, default=8, help="queue bound: beyond it 503 (default 8)")
    p.add_argument("--shutdown-timeout", type=float, default=3.0, help="the server's drain time (default 3)")
    p.add_argument("--timeout", type=float, default=120.0, help="a request with no end after this is lost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/soak.json", help="summary JSON (default runs/soak.json)")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for iterserve serve (repeatable)")
    p.add_argument("--windowed", action="store_true",
                   help="serve a random-weight Gemma 3 (5 local layers of window 32 : 1 global) instead of --model: "
                        "windowed KV cache groups free blocks mid-sequence under the same load")
    args = p.parse_args()
    if args.windowed:
        args.model = windowed_model(Path(tempfile.mkdtemp(prefix="soak-gemma3-")))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    server_args = [args.model, "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.max_num_seqs),
                   "--max-waiting", str(args.max_waiting), "--max-model-len", "512",
                   "--shutdown-timeout", str(args.shutdown_timeout), "--log-level", "warning", *args.server_arg]
    srv = ServerProcess(server_args, log_path=out.with_suffix(".server.log"))
    load_outcomes, load_reasons = Counter(), Counter()
    term_outcomes, term_reasons = Counter(), Counter()
    t0 = time.monotonic()
    with srv:
        asyncio.run(load(srv.base_url, args.rate, args.duration, args.disconnect, args.seed, load_outcomes,
                         load_reasons, args.timeout))
        snap = wait_idle(srv.base_url)
        metrics = httpx.get(srv.base_url + "/metrics", timeout=10).text
        leaked = snap["kv_cache"]["used_blocks"]

        async def terminate() -> None:  # load again, and a SIGTERM while requests are in flight
            stop = asyncio.Event()
            runner = asyncio.ensure_future(load(srv.base_url, args.rate * 2, 30.0, 0.0, args.seed + 1,
                                                term_outcomes, term_reasons, args.timeout, until=stop))
            await asyncio.sleep(3.0)
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(args.shutdown_timeout + 1.0)
            stop.set()
            await runner

        asyncio.run(terminate())
        exit_code = srv.proc.wait(60)
    elapsed = time.monotonic() - t0
    lost = load_outcomes["lost"] + term_outcomes["lost"]
    summary = {
        "command": " ".join(sys.argv), "duration_s": args.duration, "rate": args.rate, "elapsed_s": round(elapsed, 1),
        "load": dict(load_outcomes), "load_reasons": dict(load_reasons),
        "sigterm_phase": dict(term_outcomes), "sigterm_reasons": dict(term_reasons),
        "num_preemptions": snap["num_preemptions_total"], "kv_blocks_leaked": leaked,
        "kv_total_blocks": snap["kv_cache"]["total_blocks"], "lost": lost, "server_exit_code": exit_code,
        "engine_step_failures": metric(metrics, "iterserve:engine_step_failures_total"),
        "rejected_503": metric(metrics, 'iterserve:request_rejected_total{model_name="', '503'),
    }
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    ok = lost == 0 and leaked == 0 and exit_code == 0
    print("OK" if ok else "FAILED: requests lost, KV blocks leaked or a bad exit code")
    return 0 if ok else 1


def metric(text: str, prefix: str, contains: str = "") -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix) and contains in line)


if __name__ == "__main__":
    sys.exit(main())
