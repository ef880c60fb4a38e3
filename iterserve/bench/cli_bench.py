"""`iterserve bench serve`: drive a running OpenAI-compatible server with a workload and report.

The main CLI calls `add_bench_serve_parser(bench_subparsers)` with the sub-parsers of its `bench`
command; the handler is set as `func`. Input problems end as one `error: ...` line and exit code 2.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from iterserve.bench.client import ClientError, add_target_server_args, parse_slo, print_table, run_load
from iterserve.bench.common import one_line
from iterserve.bench.conversation import ConversationOptions, build_conversations, run_conversations
from iterserve.bench.workload import (WorkloadError, add_workload_args, build_prompts, describe_workload,
                                      workload_from_args)


def add_bench_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `serve` to the `bench` command's sub-parsers; returns the new parser."""
    p = subparsers.add_parser("serve", help="load-test a running OpenAI-compatible server",
                              description=__doc__.splitlines()[0])
    add_target_server_args(p)
    p.add_argument("--tokenizer", metavar="PATH",
                   help="local tokenizer (dir or cached name) to cut prompts to exact token "
                        "counts; default approximates with ~0.75 words per token")
    p.add_argument("--slo", action="extend", nargs="+", default=[], metavar="SPEC",
                   help="e.g. ttft=500ms tpot=50ms e2e_p95=2s; goodput counts requests meeting all")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="bound on the whole run (default: last arrival + 600 s)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to generate exactly max_tokens (default on)")
    p.add_argument("--result-json", metavar="PATH", help="write the summary and every request here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_workload_args(p)
    p.set_defaults(func=cmd_bench_serve)
    return p


def _load_tokenizer(name: str | None) -> Any:
    if not name:
        return None
    try:
        from transformers import AutoTokenizer  # slow import: only when asked for

        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure is one reportable input error
        raise WorkloadError(f"cannot load tokenizer {name}: {one_line(e)[:200]}") from None


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Runs the load, prints the table, writes the JSON; 2 on bad input or unreachable server."""
    try:
        slos = [parse_slo(text) for text in args.slo]
        workload = describe_workload(args)
        if workload["kind"] == "multi-turn":
            if slos:
                raise WorkloadError("--slo is not supported with --workload multi-turn")
            opts = ConversationOptions(**{k: v for k, v in workload.items() if k != "kind"})
            convs = build_conversations(opts, _load_tokenizer(args.tokenizer))
            result = asyncio.run(run_conversations(
                args.base_url, convs, model=args.model, endpoint=args.endpoint, api_key=args.api_key,
                timeout_s=args.timeout, ignore_eos=args.ignore_eos, progress=not args.no_progress))
        else:
            specs = workload_from_args(args)
            build_prompts(specs, _load_tokenizer(args.tokenizer))
            result = asyncio.run(run_load(
                args.base_url, specs, model=args.model, endpoint=args.endpoint, api_key=args.api_key,
                timeout_s=args.timeout, ignore_eos=args.ignore_eos, progress=not args.no_progress,
                slos=slos))
        result.meta["workload"] = workload
        print_table(result)
        if args.result_json:
            path = Path(args.result_json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(result.to_json())
    except (WorkloadError, ClientError, OSError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0 if result.completed else 1


def add_parser(subparsers: Any) -> None:
    """`iterserve bench ...`: benchmark sub-commands (today: `serve`)."""
    bench = subparsers.add_parser("bench", help="benchmarks: load-test a server with a workload or trace")
    add_bench_serve_parser(bench.add_subparsers(dest="bench_command", required=True))


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry for trying the command without the main CLI."""
    parser = argparse.ArgumentParser(prog="iterserve bench")
    add_bench_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
