"""iterserve against peer servers on this machine: runs the plan of peers.vs_peers
(see `--help`, or that module's docstring) system after system, and writes the table and JSON.

    .venv/bin/python benchmarks/vs_peers.py --quick --peers iterserve,llamacpp

This script holds what runs things (the servers, the offline comparison of offline_vs_hf.py, the
summary and the raw report); the plan, the metrics and the table are in peers/vs_peers.py, where
the tests import them.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from iterserve.bench.common import load_average
from machine import figures_line, machine_figures
from peers.systems import PeerInstall, System, Unavailable, serving
from iterserve.bench.summary import default_raw_dir, git_commit, write_json
from peers.vllm_bench import QUICK_SETTINGS, SETTINGS, bench_table, run_bench
from peers.vs_peers import (DEFAULT_PEERS_HOME, TRANSFORMERS, Plan, Report, build_workloads, engine_flags,
                                      markdown, measure, notes, parse_args, plan_from_args, report_table,
                                      summarise)


def run_offline(plan: Plan, variants: Sequence[System], model: str, say) -> dict[str, Any]:
    """offline_vs_hf.py's comparison for each iterserve variant's engine flags (server-only flags
    are ignored) against one transformers run, on the same mixed-length set."""
    # a sibling script (running this one puts its folder first on sys.path); torch and transformers:
    # only for --offline
    import offline_vs_hf as ovh

    from iterserve.model.loader import load_tokenizer, resolve_model

    source = resolve_model(model)
    if source.kind != "gguf":
        return {"error": "the offline comparison loads transformers from a .gguf: give a GGUF model"}
    tokenizer = load_tokenizer(source)
    specs, prompts = ovh.make_workload(plan.offline_requests, plan.seed, tokenizer)
    out_lens = [s.output_len for s in specs]
    result: dict[str, Any] = {"num_requests": len(prompts), "loadavg_before": load_average()}
    tokens: dict[str, list[list[int]]] = {}
    for v in variants:
        dtype, engine_args = engine_flags(v.args)
        say(f"offline: {v.label}")
        run = ovh.run_iterserve(model, prompts, out_lens, dtype, engine_args)
        tokens[v.label] = run.pop("token_ids")
        result[v.label] = run
    say("offline: transformers")
    hf = ovh.run_transformers(source, prompts, out_lens, tokenizer, batch_size=8)
    hf_tokens = hf.pop("token_ids")
    result[TRANSFORMERS] = hf
    result["first16_agree"] = {label: ovh.agreement(t, hf_tokens) for label, t in tokens.items()}
    result["loadavg_after"] = load_average()
    return result


# ---------------------------------------------------------------- main

def _say(text: str) -> None:
    print(f"vs_peers: {text}", file=sys.stderr, flush=True)


def run_all(args: argparse.Namespace, report: Report) -> None:
    from iterserve.model.loader import load_tokenizer, resolve_model  # torch: not for --help / tests

    plan = report.plan
    work = build_workloads(plan, load_tokenizer(resolve_model(args.model)))
    install = PeerInstall(args.peers_dir, Path(os.environ.get("PEERS") or DEFAULT_PEERS_HOME))
    log_dir = args.log_dir or args.raw_dir / "logs"
    for system in args.systems:
        load_before = load_average()
        _say(f"{system.label}: starting (load {load_before[0]:.2f})")
        try:
            with serving(system, install, args.model, log_dir, args.startup_timeout) as started:
                _say(f"{system.label}: up after {started.startup_s:.1f} s at {started.base_url}")
                workloads = measure(started.base_url, work, _say)
                if args.vllm_bench:
                    workloads.update(vllm_bench(args, install, started.base_url, system.label))
            report.systems[system.label] = {
                "kind": system.kind, "settings": started.settings, "startup_s": started.startup_s,
                "loadavg_before": load_before, "loadavg_after": load_average(), "workloads": workloads}
        except Unavailable as e:
            report.skipped[system.label] = str(e)
            _say(f"{system.label}: skipped: {e}")
    if args.offline:
        variants = [s for s in args.systems if s.kind == "iterserve"]
        report.offline = run_offline(plan, variants, args.model, _say)
    _say(f"iterserve logs in {log_dir}")


def vllm_bench(args: argparse.Namespace, install: PeerInstall, base_url: str, label: str) -> dict[str, Any]:
    """`vllm bench serve` against one running server, each setting as workload "vllm_bench:NAME"."""
    # the tokenizer of the model being served: vLLM's folder (MODEL_DIR, as start_vllm.sh reads it)
    tokenizer = Path(os.environ.get("MODEL_DIR") or install.home / "model" / "smollm2-135m-hf")
    vllm = install.home / "vvenv" / "bin" / "vllm"
    out: dict[str, Any] = {}
    for setting in QUICK_SETTINGS if args.quick else SETTINGS:
        if not vllm.exists() or not tokenizer.exists():
            out[f"vllm_bench:{setting.name}"] = {"error": f"needs {vllm} and {tokenizer} (../shared/peers/setup_vllm.sh)"}
            continue
        m = run_bench(vllm, base_url, tokenizer, setting, args.raw_dir / "vllm_bench" / label)
        out[f"vllm_bench:{setting.name}"] = m
        _say(f"  vllm bench serve {setting.name}: {m}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report(plan_from_args(args))
    args.raw_dir = args.raw_dir or default_raw_dir("vs_peers")
    started, load_start = datetime.now().astimezone().isoformat(timespec="seconds"), load_average()
    host = machine_figures()
    _say(figures_line(host))
    try:
        run_all(args, report)
    except KeyboardInterrupt:  # every server is already stopped by then: report what ran
        report.interrupted = True
        _say("interrupted: reporting what finished")
    lines = report_table(report, args.systems)
    table = markdown(lines)
    print("\n".join([figures_line(host), table, *notes(report)]))
    bench = {label: {k.partition(":")[2]: w for k, w in r["workloads"].items() if k.startswith("vllm_bench:")}
             for label, r in report.systems.items()}
    if args.vllm_bench:
        print("vllm bench serve:\n" + bench_table(bench))
    command = ["python", "benchmarks/vs_peers.py", *(sys.argv[1:] if argv is None else argv)]
    result = {"date": started, "finished": datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": shlex.join(command), "commit": git_commit(), "host": host,
              "raw": str(args.raw_dir / "vs_peers.json"),
              "loadavg_at_start": load_start, "loadavg_at_end": load_average(),
              "plan": dataclasses.asdict(report.plan), "order": [s.label for s in args.systems],
              "interrupted": report.interrupted, "skipped": report.skipped,
              "table": {"rows": lines, "markdown": table},
              "vllm_bench_table": bench_table(bench) if args.vllm_bench else None, "systems": report.systems, "offline": report.offline}
    write_json(args.raw_dir / "vs_peers.json", result, compact=True)
    write_json(args.out, summarise(result))
    _say(f"wrote {args.out}; raw records in {args.raw_dir}")
    return 1 if report.interrupted or not report.systems else 0


if __name__ == "__main__":
    sys.exit(main())
