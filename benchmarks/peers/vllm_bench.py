"""vLLM's own serving benchmark client (`vllm bench serve`) against any OpenAI-compatible server,
so iterserve and the peers are also measured by the client vLLM reports its numbers with.

The client comes from the vLLM install ../shared/peers/setup_vllm.sh made ($PEERS/vvenv); it is a
benchmark tool only, never an iterserve dependency. Each setting is its random dataset (input and
output lengths in tokens of the given tokenizer, ignore_eos) at a Poisson request rate; the
served model's name is read from the server's /v1/models here and passed on (`--model`), because
the client's own lookup needs vLLM's extra `root` field, which llama.cpp's server does not send.
The client runs through `vllm_bench_fresh.py`, which mends two of its faults against llama.cpp's
server (a reused connection that server closed; its keep-alive comments glued to the events after
them): that file says why.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


@dataclass(frozen=True)
class BenchSetting:
    name: str
    input_len: int
    output_len: int
    rate: float  # requests/s (Poisson); inf: all at once
    num_prompts: int
    max_concurrency: int | None = None  # most requests in flight (the client's --max-concurrency)


SETTINGS = (BenchSetting("random_128_64_4rps", 128, 64, 4.0, 32),  # issue 16's setting
            BenchSetting("prefill_1024_16_1rps", 1024, 16, 1.0, 16))  # prefill-heavy: TTFT under load
# smoke test: both shapes (short and 1024-token prompts), few requests
QUICK_SETTINGS = (BenchSetting("random_128_64_4rps", 128, 8, 4.0, 4),
                  BenchSetting("prefill_1024_16_1rps", 1024, 4, 1.0, 2))
METRICS = {"output_throughput": "output tok/s", "median_ttft_ms": "TTFT p50 ms", "p95_ttft_ms": "TTFT p95 ms",
           "median_tpot_ms": "TPOT p50 ms", "p95_e2el_ms": "E2EL p95 ms", "completed": "completed"}


def served_model(base_url: str) -> str:
    """The first model id the server lists (OpenAI's /v1/models, which every system here speaks)."""
    return httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def command(vllm: Path, base_url: str, model: str, tokenizer: Path, s: BenchSetting, out_dir: Path) -> list[str]:
    fresh = Path(__file__).with_name("vllm_bench_fresh.py")
    return [str(vllm.with_name("python")), str(fresh), "bench", "serve", "--backend", "openai",
            "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model, "--served-model-name", model,
            "--tokenizer", str(tokenizer), "--dataset-name", "random",
            "--random-input-len", str(s.input_len), "--random-output-len", str(s.output_len),
            "--num-prompts", str(s.num_prompts), "--request-rate", str(s.rate), "--ignore-eos", "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95",
            "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(out_dir),
            "--result-filename", f"{s.name}.json",
            *(["--max-concurrency", str(s.max_concurrency)] if s.max_concurrency else [])]


def run_bench(vllm: Path, base_url: str, tokenizer: Path, s: BenchSetting, out_dir: Path,
              timeout_s: float = 1800) -> dict[str, Any]:
    """The setting's metrics (METRICS' keys), or {"error": ...} when the client failed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        model = served_model(base_url)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        return {"error": f"no model listed at {base_url}/v1/models: {e}"[:300]}
    try:
        done = subprocess.run(command(vllm, base_url, model, tokenizer, s, out_dir), capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)[:300]}
    path = out_dir / f"{s.name}.json"
    if done.returncode or not path.exists():
        return {"error": f"vllm bench serve exited {done.returncode}: {(done.stderr or done.stdout)[-400:]}"}
    data = json.loads(path.read_text())
    out = {k: data.get(k) for k in METRICS}
    out["failed"] = data.get("failed", s.num_prompts - (data.get("completed") or 0))
    return out


def bench_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Markdown: one row per (system, setting), one column per metric."""
    lines = ["| system | setting | " + " | ".join(METRICS.values()) + " |", "|---|---|" + "---:|" * len(METRICS)]
    for system, by_setting in results.items():
        for name, m in by_setting.items():
            if "error" in m:
                lines.append(f"| {system} | {name} | " + m["error"][:120].replace("|", "/") + " |")
                continue
            cells = [f"{m[k]:.1f}" if isinstance(m.get(k), float) else str(m.get(k)) for k in METRICS]
            lines.append(f"| {system} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
