"""`iterserve` command line: generate, serve, bench, compare, probe, tune, profile, simulate, plan.

Sub-commands live next to what they drive (each module has `add_parser(subparsers)`); this file
wires them up, holds `generate`, and chooses between two packages where one command spans both
(`serve --replicas`: server or serve_ray; `tune --simulate`: bench or sim), so that the lower
package never imports the upper one. The engine flags that `generate` and `serve` share are declared
once in engine_args.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from iterserve.engine_args import add_engine_args, apply_omp_wait, engine_config_from_args, setup_logging
from iterserve.server import cli_serve


# ---- serve ---------------------------------------------------------------------------------------
def add_serve_parser(sub) -> None:
    cli_serve.add_parser(sub).set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """`serve`: one process (server/cli_serve.py), or with --replicas the same API on Ray Serve
    (serve_ray/launch.py). The choice is made here, above both packages: serve_ray builds on server,
    so server never imports serve_ray."""
    args = cli_serve.prepare(args)
    if args.replicas is not None:
        from iterserve.serve_ray.launch import serve_replicas  # imports Ray only when run

        return serve_replicas(args)
    return cli_serve.serve_one_process(args)


# ---- tune ----------------------------------------------------------------------------------------
def add_tune_parser(sub) -> None:
    from iterserve.bench import tune

    tune.add_parser(sub).set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    """`tune`: the grid replayed for real (bench/tune.py), or with --simulate swept in the simulator
    first (sim/tune_simulated.py). The choice is made here: the simulator builds on the measuring
    tools, so bench never imports sim."""
    from iterserve.bench import tune

    plan = tune.plan_tune(args)
    if args.simulate:
        from iterserve.sim.tune_simulated import cmd_tune_simulated  # loads torch only when run

        return cmd_tune_simulated(args, plan)
    return tune.cmd_tune_measured(args, plan)


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
    from iterserve.llm import LLM  # here, not at the top: `iterserve --help` must not load torch
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


def add_bench_parser(sub) -> None:
    from iterserve.bench import cli_bench

    cli_bench.add_parser(sub)


def add_compare_parser(sub) -> None:
    from iterserve.bench import compare

    compare.add_parser(sub)


def add_probe_parser(sub) -> None:
    from iterserve.bench import probe

    probe.add_parser(sub)


def add_sim_parsers(sub) -> None:
    from iterserve.sim import cli_sim

    cli_sim.add_parser(sub)  # profile, simulate and plan


# Each sub-command and what adds its parser, importing its module only then: a command line builds its
# own command's parser alone, so that `serve` never imports the measuring tools (their HTTP client,
# progress bars and report templates: ~130 modules, ~7 MiB of the server's resident memory); `--help`
# and a mistyped command build them all.
COMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "generate": add_generate_parser, "serve": add_serve_parser, "bench": add_bench_parser,
    "compare": add_compare_parser, "probe": add_probe_parser, "tune": add_tune_parser,
    **dict.fromkeys(("profile", "simulate", "plan"), add_sim_parsers),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every sub-command, or of `command`'s alone (COMMANDS)."""
    parser = argparse.ArgumentParser(prog="iterserve", description="A readable LLM serving engine with "
                                     "continuous batching and a paged KV cache, and the tools to measure it.")
    sub = parser.add_subparsers(dest="command", required=True)
    adders = [COMMANDS[command]] if command in COMMANDS else list(COMMANDS.values())
    for add_parser in dict.fromkeys(adders):  # add_sim_parsers adds its three commands once
        add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    # Spinning OpenMP workers collapse torch's speed when any other process holds a core, so passive
    # is the default; set before torch loads.
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
