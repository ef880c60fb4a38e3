"""Multi-turn chat with prefix caching on vs off, on one client and one workload (issue 17).

Each configuration starts `iterserve serve MODEL` alone on a loopback port (caching on, then off;
the order alternates over --rounds so that load drift hits both), warms it up with two short
requests that share nothing with the workload, runs the multi-turn workload of
`iterserve bench serve --workload multi-turn` (iterserve/bench/conversation.py: N concurrent
conversations over one shared system prompt, each turn resending the whole history after a think
time), and stops it. `--peer-url URL` adds an already-running OpenAI server (e.g. vLLM for CPU,
started by ../shared/peers/) measured with the same client and workload. The 1-minute load average
is recorded around each run. Prints a markdown table; the full results go to runs/prefix_cache/.

    .venv/bin/python benchmarks/prefix_cache.py --conversations 8 --turns 6 --system-prompt-len 400 \\
        --user-len 32:96 --output-len 64 --think-time 1.0
    # smoke test: --conversations 2 --turns 2 --system-prompt-len 60 --user-len 8 --output-len 4 --think-time 0
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from iterserve.bench.client import RunResult, run_load  # noqa: E402
from iterserve.bench.conversation import ConversationOptions, build_conversations, run_conversations  # noqa: E402
from iterserve.bench.launcher import ServerProcess  # noqa: E402
from iterserve.bench.workload import len_arg, build_prompts, constant  # noqa: E402
from iterserve.model.loader import load_tokenizer, resolve_model  # noqa: E402


def summary_row(name: str, result: RunResult, load: tuple[float, float]) -> dict:
    s, cache, later = result.summary(), result.meta.get("prefix_cache") or {}, result.meta["later_turns"]
    return {"system": name, "completed": s["completed"], "failed": s["failed"], "duration_s": s["duration_s"],
            "output_tok_s": s["output_throughput"], "ttft_p50_ms": s["ttft_ms"]["median"],
            "ttft_p95_ms": s["ttft_ms"]["p95"], "later_ttft_p50_ms": later["ttft_p50_ms"],
            "later_ttft_p95_ms": later["ttft_p95_ms"], "hit_rate": cache.get("hit_rate"),
            "load_before": load[0], "load_after": load[1]}


async def measure(base_url: str, model: str | None, opts: ConversationOptions, tokenizer, endpoint: str,
                  warm: bool) -> RunResult:
    if warm:  # two short requests from elsewhere in the text: nothing the workload could hit
        warm_specs = constant(6, 10.0, input_len=16, output_len=4)[4:]  # prose far from the system prompt's
        await run_load(base_url, build_prompts(warm_specs, tokenizer), model=model, progress=False)
    return await run_conversations(base_url, build_conversations(opts, tokenizer), model=model,
                                   endpoint=endpoint, progress=False)


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--server-args", default="", help="extra `iterserve serve` flags for both configurations")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-prompt-len", type=int, default=400)
    p.add_argument("--user-len", type=len_arg, default=(32, 96))
    p.add_argument("--output-len", type=len_arg, default=64)
    p.add_argument("--think-time", type=float, default=1.0)
    p.add_argument("--stagger", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="on/off pairs, order alternating")
    p.add_argument("--peer-url", help="also measure this running OpenAI server (same client, same workload)")
    p.add_argument("--peer-model", help="model name at --peer-url (default: its first)")
    p.add_argument("--out", default="runs/prefix_cache")
    args = p.parse_args()

    opts = ConversationOptions(args.conversations, args.turns, args.system_prompt_len, args.user_len,
                               args.output_len, args.think_time, args.stagger, args.seed)
    tokenizer = load_tokenizer(resolve_model(args.model))
    rows, raw = [], []
    configs = [("iterserve, prefix caching on", "--enable-prefix-caching"),
               ("iterserve, prefix caching off", "--no-enable-prefix-caching")]
    for r in range(args.rounds):
        for name, flag in (configs if r % 2 == 0 else configs[::-1]):
            load0 = os.getloadavg()[0]
            with ServerProcess([args.model, flag, *args.server_args.split()]) as srv:
                result = asyncio.run(measure(srv.base_url, None, opts, tokenizer, args.endpoint, warm=True))
            rows.append(summary_row(name, result, (load0, os.getloadavg()[0])))
            raw.append({"system": name, **result.to_dict()})
        if args.peer_url:
            load0 = os.getloadavg()[0]
            result = asyncio.run(measure(args.peer_url, args.peer_model, opts, tokenizer, args.endpoint, warm=True))
            rows.append(summary_row(f"peer {args.peer_url}", result, (load0, os.getloadavg()[0])))
            raw.append({"system": "peer", **result.to_dict()})

    print(f"multi-turn: {vars(opts)}, endpoint {args.endpoint}, model {args.model}")
    print("| system | done | duration s | output tok/s | TTFT p50 / p95 ms | later turns TTFT p50 / p95 ms "
          "| hit rate | load avg before / after |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['system']} | {row['completed']}/{row['completed'] + row['failed']} | "
              f"{row['duration_s']:.1f} | {row['output_tok_s']:.1f} | "
              f"{fmt(row['ttft_p50_ms'], '.0f')} / {fmt(row['ttft_p95_ms'], '.0f')} | "
              f"{fmt(row['later_ttft_p50_ms'], '.0f')} / {fmt(row['later_ttft_p95_ms'], '.0f')} | "
              f"{fmt(row['hit_rate'], '.1%')} | {row['load_before']:.1f} / {row['load_after']:.1f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"options": vars(args) | {"user_len": args.user_len, "output_len": args.output_len},
                                "rows": rows, "runs": raw}, default=str))
    print(f"raw results: {path}")


if __name__ == "__main__":
    main()
