"""Multi-LoRA serving throughput (issue 33): 16 concurrent requests spread over 4 adapters of rank 16,
against the same traffic on the base model alone, and against one adapter at a time.

Makes 4 random rank-16 adapters with PEFT (all seven projections) on a Hugging Face folder of the
base model (--hf-dir or $MODEL_DIR: e.g. SmolLM2-135M converted by ../shared/peers/gguf_to_hf.py),
then for each configuration starts `iterserve serve MODEL` alone on a loopback port and sends the same
closed-loop traffic (--requests requests, --concurrency at a time, prose prompts of --input-len tokens,
--output-len tokens each, EOS ignored):

  base          no --enable-lora; every request on the base model (the target's denominator)
  base+lora     --enable-lora --max-loras 4, every request on the base model (the hooks' own cost)
  multi-lora    --enable-lora --max-loras 4, request i on adapter i % 4: every step mixes adapters
  one-at-a-time --enable-lora --max-loras 1, the same traffic: a step holds one adapter's rows only,
                what a server without multi-LoRA batching does

Target: multi-lora output tokens/s >= 0.8 x base. Prints the host CPU and a markdown table; the
results go to --out (JSON).

    .venv/bin/python benchmarks/lora_throughput.py --hf-dir PATH/TO/smollm2-135m-hf
    # smoke test: --requests 8 --output-len 8 --input-len 32
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from iterserve.bench.launcher import ServerProcess  # noqa: E402
from peers.systems import PeerInstall, System, Unavailable, serving  # noqa: E402
from machine import figures_line, machine_figures  # noqa: E402
from iterserve.bench.random_lora import AdapterSpec, make_random_adapter  # noqa: E402
from iterserve.bench.summary import git_commit, write_json  # noqa: E402
from iterserve.bench.workload import RequestSpec, build_prompts  # noqa: E402
from iterserve.model.loader import load_tokenizer, resolve_model  # noqa: E402

NUM_ADAPTERS = 4


def make_adapters(hf_dir: str, out: Path, rank: int) -> dict[str, str]:
    paths = {}
    for i in range(NUM_ADAPTERS):
        path = out / f"r{rank}-{i}"
        if not (path / "adapter_model.safetensors").is_file():
            make_random_adapter(hf_dir, path, AdapterSpec(rank=rank, alpha=2 * rank, std=0.02), seed=i)
        paths[f"lora{i}"] = str(path)
    return paths


async def closed_loop(base_url: str, prompts: list[str], models: list[str], output_len: int,
                      concurrency: int) -> dict:
    """`concurrency` workers take the next request until none is left; returns the run's figures."""
    queue = list(range(len(prompts)))
    done: list[tuple[int, float, float]] = []  # (output tokens, sent, finished)
    async with httpx.AsyncClient(base_url=base_url, timeout=None,
                                 limits=httpx.Limits(max_connections=None)) as http:
        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                sent = time.perf_counter()
                r = await http.post("/v1/completions", json={"model": models[i], "prompt": prompts[i],
                                                              "max_tokens": output_len, "temperature": 0,
                                                              "ignore_eos": True})
                r.raise_for_status()
                done.append((r.json()["usage"]["completion_tokens"], sent, time.perf_counter()))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(n for n, _, _ in done)
    lat = sorted(e - s for _, s, e in done)
    return {"requests": len(done), "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "latency_p50_s": lat[len(lat) // 2]}


def run_vllm(args, adapters: dict[str, str], prompts: list[str], base_models: list[str],
             mixed: list[str]) -> dict:
    """vLLM CPU on the same HF folder and traffic: the base model alone, then the four adapters
    resident at once (vLLM's --enable-lora --max-loras 4). A config it cannot run is recorded, not fatal."""
    install = PeerInstall(args.peers_dir, args.peers_home)
    lora_args = (f"--enable-lora --max-loras {NUM_ADAPTERS} --max-lora-rank {args.rank} --lora-modules "
                 + " ".join(f"{n}={path}" for n, path in adapters.items()))
    out = {}
    for name, extra, models in (("vllm base", "", base_models), ("vllm multi-lora", lora_args, mixed)):
        env = {"MODEL_DIR": args.hf_dir, "SERVED_NAME": "base", "MAX_NUM_SEQS": str(args.concurrency),
               "VLLM_EXTRA_ARGS": extra}
        try:
            with serving(System(name, "vllm"), install, args.model, Path(args.log_dir), 900.0, env) as srv:
                asyncio.run(closed_loop(srv.base_url, prompts[:2], models[:2], 4, 2))  # warm-up
                out[name] = asyncio.run(closed_loop(srv.base_url, prompts, models, args.output_len, args.concurrency))
        except (Unavailable, httpx.HTTPError) as e:
            out[name] = {"error": str(e)[:300], "output_tok_s": float("nan"), "latency_p50_s": float("nan")}
        print(f"{name}: {out[name]['output_tok_s']:.1f} tok/s", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="what `iterserve serve` loads (default: embedded)")
    p.add_argument("--hf-dir", default=os.environ.get("MODEL_DIR"),
                   help="Hugging Face folder of the same base model, for PEFT (default: $MODEL_DIR)")
    p.add_argument("--adapter-dir", default="runs/lora_throughput/adapters", help="where the adapters are written")
    p.add_argument("--log-dir", default="runs/lora_throughput", help="the servers' logs")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--server-args", default="", help="extra `iterserve serve` flags for every configuration")
    p.add_argument("--only", nargs="+", default=None, help="run only these configurations")
    p.add_argument("--vllm", action="store_true",
                   help="also vLLM CPU (the peers' install, ../shared/peers) on --hf-dir: the base model, and "
                        "the same adapters with --enable-lora")
    p.add_argument("--peers-dir", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "peers",
                   help="the peers' scripts (start_vllm.sh)")
    p.add_argument("--peers-home", type=Path, default=Path(os.environ.get("PEERS", Path.home() / ".cache" / "iterserve-peers")),
                   help="where the peers are installed ($PEERS)")
    p.add_argument("--out", default="runs/lora_throughput/result.json")
    args = p.parse_args()
    if not args.hf_dir:
        p.error("give --hf-dir (or $MODEL_DIR): a Hugging Face folder of the base model, for PEFT")

    fig = machine_figures()
    print(figures_line(fig), flush=True)
    adapters = make_adapters(args.hf_dir, Path(args.adapter_dir), args.rank)
    tok = load_tokenizer(resolve_model(args.model))
    specs = [RequestSpec(i, 0.0, args.input_len, args.output_len) for i in range(args.requests)]
    prompts = [s.prompt for s in build_prompts(specs, tok)]
    names = list(adapters)
    lora_flags = ["--enable-lora", "--max-lora-rank", str(args.rank), "--max-cpu-loras", str(NUM_ADAPTERS),
                  "--lora-modules", *(f"{n}={path}" for n, path in adapters.items())]
    base_models = ["base"] * args.requests
    mixed = [names[i % NUM_ADAPTERS] for i in range(args.requests)]
    configs = {"base": ([], base_models),
               "base+lora": ([*lora_flags, "--max-loras", str(NUM_ADAPTERS)], base_models),
               "multi-lora": ([*lora_flags, "--max-loras", str(NUM_ADAPTERS)], mixed),
               "one-at-a-time": ([*lora_flags, "--max-loras", "1"], mixed)}
    results = {}
    for name, (flags, models) in configs.items():
        if args.only and name not in args.only:
            continue
        serve = [args.model, "--served-model-name", "base", "--max-num-seqs", str(args.concurrency),
                 *args.server_args.split(), *flags]
        with ServerProcess(serve, log_path=Path(args.log_dir) / f"{name}.log") as srv:
            asyncio.run(closed_loop(srv.base_url, prompts[:2], models[:2], 4, 2))  # warm-up
            stats = httpx.get(srv.base_url + "/v1/scheduler").json().get("lora")
            results[name] = asyncio.run(closed_loop(srv.base_url, prompts, models, args.output_len, args.concurrency))
            lora = httpx.get(srv.base_url + "/v1/scheduler").json().get("lora")
            if lora:
                results[name]["slot_loads"] = lora["loads_total"] - (stats or {}).get("loads_total", 0)
        print(f"{name}: {results[name]['output_tok_s']:.1f} tok/s", flush=True)
    if args.vllm:
        results.update(run_vllm(args, adapters, prompts, base_models, mixed))
    base = results.get("base", {}).get("output_tok_s")
    print("\n| configuration | output tok/s | vs base | p50 latency (s) | slot loads |\n|---|---|---|---|---|")
    for name, r in results.items():
        ratio = f"{r['output_tok_s'] / base:.2f}x" if base else "-"
        print(f"| {name} | {r['output_tok_s']:.1f} | {ratio} | {r['latency_p50_s']:.2f} | {r.get('slot_loads', '-')} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"command": " ".join(sys.argv), "commit": git_commit(), "host": fig, "args": vars(args),
                     "results": results})


if __name__ == "__main__":
    main()
