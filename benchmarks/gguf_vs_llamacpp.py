"""Greedy text of one GGUF file on iterserve against llama.cpp's llama-server, prompt by prompt, up to
the first parting, with iterserve's own top-2 logprob margin at the parting token (a near-tie when it
is small: llama.cpp quantises activations to 8 bits in its K-quant dot products, so the two differ by
more than rounding).

Both servers get the same plain prompts on /v1/completions (temperature 0, `max_tokens` each), so a
base model without a chat template works. llama-server comes from ../shared/peers/
(setup_llamacpp.sh, started here through start_llamacpp.sh with GGUF=the file). iterserve runs
once per `--iterserve-args` variant (default: float32, and the default dtype with its twins).

    .venv/bin/python benchmarks/gguf_vs_llamacpp.py FILE.gguf [--max-tokens 32] [--out summary.json]
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

import httpx

from iterserve.bench.launcher import ServerProcess, free_port
from machine import figures_line, machine_figures
from peers.systems import peer_environ
from iterserve.bench.summary import git_commit

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at a temperature of",
    "The most important thing to remember when learning a new language is",
    "In 1969, the first humans to walk on the Moon were",
    "A recipe for pancakes: first,",
    "The quick brown fox",
    "Photosynthesis is the process by which",
]
PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"


def completions(base_url: str, model: str, max_tokens: int, logprobs: int | None) -> list[dict]:
    out = []
    with httpx.Client(timeout=300) as client:
        for p in PROMPTS:
            body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0}
            if logprobs is not None:
                body["logprobs"] = logprobs
            r = client.post(base_url + "/v1/completions", json=body)
            r.raise_for_status()
            out.append(r.json()["choices"][0])
    return out


def parting(ours: dict, theirs: str) -> dict:
    """Where our text leaves theirs: the token index, and our top-2 margin (nats) at that token."""
    text = ours["text"]
    common = next((i for i, (a, b) in enumerate(zip(text, theirs)) if a != b), min(len(text), len(theirs)))
    if text == theirs:
        return {"equal": True}
    lp = ours.get("logprobs") or {}
    tokens, tops = lp.get("tokens") or [], lp.get("top_logprobs") or []
    pos, index = 0, len(tokens)
    for i, tok in enumerate(tokens):
        pos += len(tok)
        if pos > common:
            index = i
            break
    margin, second = None, None
    if index < len(tops) and len(tops[index]) >= 2:
        ranked = sorted(tops[index].items(), key=lambda kv: kv[1], reverse=True)
        margin = round(ranked[0][1] - ranked[1][1], 4)
        start = sum(len(t) for t in tokens[:index])  # where the parting token starts in our text
        second = theirs[start:].startswith(ranked[1][0])  # llama.cpp took our runner-up
    return {"equal": False, "common_chars": common, "token_index": index, "margin": margin,
            "theirs_is_our_second": second, "ours": text[common:common + 30], "theirs": theirs[common:common + 30]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--iterserve-args", action="append", metavar="'FLAGS'",
                    help="one iterserve variant's serve flags (repeatable; default: '--dtype float32' and '')")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    variants = args.iterserve_args or ["--dtype float32", ""]
    figures = machine_figures()
    print(figures_line(figures))
    port = free_port()
    env = peer_environ({"GGUF": str(args.gguf.resolve()), "PORT": str(port), "ALIAS": "peer"})
    subprocess.run(["bash", str(PEERS / "start_llamacpp.sh")], check=True, env=env)
    try:
        theirs = [c["text"] for c in completions(f"http://127.0.0.1:{port}", "peer", args.max_tokens, None)]
    finally:
        subprocess.run(["bash", str(PEERS / "stop.sh"), "llamacpp"], check=False, env=env)
    results = {}
    for flags in variants:
        with ServerProcess(["--model", str(args.gguf), *shlex.split(flags)], startup_timeout=600) as srv:
            served = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
            ours = completions(srv.base_url, served, args.max_tokens, 2)
        rows = [parting(o, t) for o, t in zip(ours, theirs)]
        results[flags or "(defaults)"] = rows
        equal = sum(r["equal"] for r in rows)
        print(f"\niterserve {flags or '(defaults)'}: {equal}/{len(rows)} texts equal to llama.cpp's")
        for p, r in zip(PROMPTS, rows):
            if not r["equal"]:
                print(f"  {p[:40]!r}: parts at token {r['token_index']} (our top-2 margin {r['margin']} nats, "
                      f"theirs our runner-up: {r['theirs_is_our_second']}): "
                      f"ours {r['ours']!r} vs {r['theirs']!r}")
    if args.out:
        args.out.write_text(json.dumps({"file": args.gguf.name, "max_tokens": args.max_tokens, "results": results,
                                        "host": figures, "commit": git_commit(),
                                        "command": "benchmarks/gguf_vs_llamacpp.py " + " ".join(sys.argv[2:])},
                                       indent=2) + "\n")


if __name__ == "__main__":
    main()
