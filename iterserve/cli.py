"""`iterserve` command line: generate, serve, bench, compare, probe, tune.

Sub-commands live next to what they drive; this file wires them up and holds the engine flags
that `generate` and `serve` share (named as vLLM names them).
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from dataclasses import fields

from iterserve.config import EngineConfig

# sub-command -> module with `add_parser(subparsers)`; imported only when present
SUBCOMMAND_MODULES = [
    "iterserve.server.cli_serve",
    "iterserve.bench.cli_bench",
    "iterserve.bench.compare",
    "iterserve.bench.probe",
    "iterserve.bench.tune",
]


# --omp-wait: the environment libgomp reads when torch loads (so it is applied before any torch import)
OMP_WAIT = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"},
            "spin": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "200000"}}


def apply_omp_wait(choice: str) -> None:
    """passive only fills what the environment leaves unset (an exported OMP_WAIT_POLICY wins);
    spin is an explicit request and overrides it."""
    choice = getattr(choice, "value", choice)  # `serve` wraps defaults it lets a --config file replace
    if "torch" in sys.modules:  # too late: main() in a process that loaded torch (tests), or a --config file
        applied = all(os.environ.get(k) == v for k, v in OMP_WAIT[choice].items())
        if choice != "passive" and not applied:
            logging.getLogger("iterserve").warning("--omp-wait %s ignored: torch was loaded before it", choice)
        return
    for key, value in OMP_WAIT[choice].items():
        if choice == "passive":
            os.environ.setdefault(key, value)
        else:
            os.environ[key] = value


ENGINE_ENV_HELP = (
    "Environment (CPU kernels, iterserve/csrc, built on first use): ITERSERVE_CPU_KERNELS=0 turns them "
    "all off (torch and oneDNN paths); ITERSERVE_BF16_GEMM=auto|tiled|onednn picks the bf16 projections' "
    "GEMM (auto: ours where AVX512-BF16 exists and the CPU has no AMX); ITERSERVE_DECODE_ATTENTION="
    "torch|cpu|triton forces the decode attention backend.")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.epilog = f"{p.epilog} {ENGINE_ENV_HELP}" if p.epilog else ENGINE_ENV_HELP
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default=d.dtype, help="auto (bfloat16 on CUDA and on CPUs with native bf16: AVX512-BF16 or AMX; float32 on other CPUs), float32, bfloat16, float16")
    g.add_argument("--device", default=d.device, help="auto, cpu or cuda[:N]")
    g.add_argument("--quantization", choices=["auto", "none", "int4"], default=d.quantization,
                   help="int4: keep a 4-bit copy of each projection for steps of <= 4 tokens (8 where iterserve's bf16 "
                        "GEMM is not vectorised) and a Q8_0 "
                        "copy of the LM head for <= 4 (CPU bf16; about 2.5x faster single-stream decoding). auto (default): only when the checkpoint "
                        "is a 4-bit GGUF already, so no new rounding; none: bf16/float32 weights only")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the decoder layers (inductor fuses norms, RoPE, activations and adds; "
                        "1.2-1.3x faster steps measured on CPU). Costs about a minute of compilation at "
                        "startup on 2 cores (50-65 s measured), less when inductor's on-disk cache has the graphs")
    g.add_argument("--batching", choices=["continuous", "static"], default=d.batching,
                   help="continuous: iteration-level scheduling (default); static: fill-or-timeout batches "
                        "that run to their slowest member, for comparison")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most sequences in one step (continuous batching); default 16, as in docs/seed-case.md")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step; longer prompts are prefilled in chunks")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy,
                   help="fcfs: first come first served; priority: lower 'priority' value first, arrival breaks ties")
    g.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="static batching: batch size (default 8)")
    g.add_argument("--batch-timeout", dest="batch_timeout_ms", type=float, default=d.batch_timeout_ms,
                   help="static batching: ms the oldest request waits before a partial batch starts")
    g.add_argument("--block-size", type=int, default=d.block_size, choices=[1, 8, 16, 32, 64, 128],
                   help="tokens per KV cache block (default 16)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="number of KV blocks; overrides the memory budget")
    g.add_argument("--kv-cache-memory", default=d.kv_cache_memory, help="CPU memory for KV blocks, e.g. 512MiB, 2GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="CUDA: share of GPU memory for weights, activations and KV blocks (default 0.9)")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: min(model, 4096))")
    g.add_argument("--max-input-len", type=int, default=None, help="reject prompts longer than this many tokens")
    g.add_argument("--max-output-len", type=int, default=None, help="reject max_tokens above this")
    g.add_argument("--log-scheduler", action="store_true",
                   help="log one line per engine step: batch size, tokens, KV blocks, finished/preempted requests")
    g.add_argument("--threads", dest="num_threads", type=int, default=None, help="torch math threads on CPU")
    g.add_argument("--omp-wait", choices=sorted(OMP_WAIT), default="passive",
                   help="how idle OpenMP math threads wait between ops. passive (default): they sleep at "
                        "once, safe when other processes share the cores. spin: they spin briefly first "
                        "(OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT=200000), 1.2-1.35x faster steps on 2 "
                        "otherwise idle cores here, but 2x slower when another process keeps a core busy")
    g.add_argument("--seed", type=int, default=d.seed, help="engine seed")


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw.update(overrides)
    return EngineConfig(**kw)


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# ---- generate ------------------------------------------------------------------------------------
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos",
                 "repetition_penalty", "frequency_penalty", "presence_penalty", "logprobs")


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline for one or more prompts",
                       description="Generate offline with the engine. Prompts go through the model's chat "
                                   "template unless --raw. Answers go to stdout (one per prompt, separated by "
                                   "blank lines), logs to stderr.")
    p.add_argument("prompts", nargs="*", help="prompts to answer")
    p.add_argument("--model", default="smollm2-135m", help="a .gguf file, a Hugging Face folder, or smollm2-135m")
    p.add_argument("--input", help="JSONL: one object a line with 'prompt' or 'messages' and sampling fields")
    p.add_argument("--output", help="JSONL results in input order (text, finish_reason, tokens, timings)")
    p.add_argument("--raw", action="store_true", help="send prompts as they are, without the chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                   "whose probability reaches this (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens (default 0 = off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this fraction of the top token's probability (default 0 = off)")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
                raise ValueError(f"{path}:{n}: each line needs 'prompt' or 'messages'")
            rows.append(row)
    return rows


def cmd_generate(args: argparse.Namespace) -> int:
    from iterserve.engine import LLM
    from iterserve.sampling import SamplingParams

    setup_logging(args.verbose)
    base = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                min_p=args.min_p, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    rows = _read_jsonl(args.input) if args.input else []
    rows += [{"prompt": p} for p in args.prompts]
    if not rows:
        raise ValueError("give at least one prompt, or --input FILE")
    prompts, params, prios = [], [], []
    for row in rows:
        unknown = set(row) - set(SAMPLING_KEYS) - {"prompt", "messages", "priority"}
        if unknown:
            raise ValueError(f"unknown field(s) in input: {', '.join(sorted(unknown))}")
        sp = SamplingParams(**{**base, **{k: row[k] for k in SAMPLING_KEYS if k in row}})
        params.append(sp)
        prios.append(int(row.get("priority", 0)))
        if "messages" in row:
            prompts.append({"messages": row["messages"]})
        elif args.raw:
            prompts.append(row["prompt"])
        else:
            prompts.append({"messages": [{"role": "user", "content": row["prompt"]}]})
    llm = LLM(config=engine_config_from_args(args, model=args.model))
    results = llm.generate(prompts, params, use_tqdm=not args.no_progress, priorities=prios)
    if args.output:
        with open(args.output, "w") as f:
            for r in results:
                t = r.times
                f.write(json.dumps({
                    "text": r.text, "finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens,
                    "completion_tokens": r.completion_tokens, "queue_time": t.queue_time, "ttft": t.ttft,
                    "e2e": t.e2e}) + "\n")
    if not args.output or args.prompts:
        print("\n\n".join(r.text for r in results))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterserve", description="A readable LLM serving engine with "
                                     "continuous batching and a paged KV cache, and the tools to measure it.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    for mod_name in SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name == mod_name:
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    # Spinning OpenMP workers collapse torch's speed when any other process holds a core (measured
    # here: 1.8 s vs 0.1 s per step), so passive is the default; set before torch loads.
    apply_omp_wait(getattr(args, "omp_wait", "passive"))
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
