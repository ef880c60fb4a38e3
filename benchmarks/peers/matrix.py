"""The peer matrix of issue 35: iterserve against vLLM for CPU and llama.cpp's server, measured by
vLLM's own client (`vllm bench serve`, benchmarks/peers/vllm_bench.py) over models x prompt shapes
x loads, in one sitting, with the targets judged per cell. benchmarks/peer_matrix.py runs it; this
module holds the plan, the verdicts and the table (the tests import it).

Models (all with SmolLM2's tokenizer, so one `--tokenizer` folder serves every client run):
  smollm2   SmolLM2-135M-Instruct: iterserve the embedded Q4_1 GGUF, llama.cpp the same file,
            vLLM its bf16 HF folder (the peers' model dir)
  1b-bf16   a random Llama-3.2-1B-shaped model (benchmarks/random_llama.py's preset "1b",
            SmolLM2's 49152-token vocabulary) as a bf16 HF folder: iterserve --dtype bfloat16, vLLM
  1b-q4km   the same weights as a Q4_K_M GGUF (f16 GGUF written here, llama.cpp's llama-quantize):
            iterserve the file, llama.cpp the file
  8b-q4km   a random Llama-3.1-8B-shaped Q4_K_M GGUF (benchmarks/random_gguf.py's preset "8b": random
            blocks in Q4_K_M's mix, 128256-token vocabulary: SmolLM2's padded with plain tokens):
            iterserve the file, llama.cpp the file
  granite-moe-q4km, olmoe-q4km  mixture-of-experts GGUFs at Granite-3B-A800M's and OLMoE-1B-7B's
            shapes (benchmarks/random_moe_gguf.py: random blocks laid out as Q4_K_M; SmolLM2's
            tokenizer): iterserve the file, llama.cpp the file
  granite-moe-bf16  a random GraniteMoE of Granite-3B-A800M's shape as a bf16 HF folder
            (benchmarks/random_moe.py, SmolLM2's tokenizer): iterserve --dtype bfloat16, vLLM
Shapes: random input/output token counts. Loads: `rate` (Poisson at --rate req/s, a moderate
load), `c16` / `c32` (every prompt at once, at most 16 / 32 in flight: saturation), `single`
(one at a time: the single-stream decode rate, 1000 / TPOT p50).

Targets (issue 35): at saturation iterserve's output tok/s >= 1.25x vLLM's with lower TTFT p95 and
E2EL p95; single stream decode >= 1.2x llama.cpp's on the same GGUF.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from iterserve.bench.common import markdown_table
from peers.vllm_bench import BenchSetting

SATURATION_RATIO = 1.25  # iterserve / vLLM output tok/s at saturation
SINGLE_RATIO = 1.2  # iterserve / llama.cpp single-stream decode tok/s
STEP_BOUND_RATIO = 1.7  # a 16-row decode step within this factor of its bound


@dataclass(frozen=True)
class ModelSpec:
    name: str
    iterserve: str  # model argument of `iterserve serve`; "$PEERS/..." is under the peers' home
    iterserve_args: tuple[str, ...] = ()
    hf_dir: str | None = None  # vLLM's folder under $PEERS/model (None: vLLM does not serve it)
    gguf: str | None = None  # llama.cpp's file under $PEERS/model (None: llama.cpp does not serve it)

    def peers(self) -> tuple[str, ...]:
        return tuple(k for k, have in (("vllm", self.hf_dir), ("llamacpp", self.gguf)) if have)


MODELS = {m.name: m for m in (
    ModelSpec("smollm2", "smollm2-135m", hf_dir="smollm2-135m-hf", gguf="SmolLM2-135M-Instruct.Q4_1.gguf"),
    ModelSpec("1b-bf16", "$PEERS/model/llama-1b-random-hf", ("--dtype", "bfloat16"), hf_dir="llama-1b-random-hf"),
    ModelSpec("1b-q4km", "$PEERS/model/llama-1b-random.Q4_K_M.gguf", gguf="llama-1b-random.Q4_K_M.gguf"),
    ModelSpec("8b-q4km", "$PEERS/model/llama-8b-random.Q4_K_M.gguf", gguf="llama-8b-random.Q4_K_M.gguf"),
    ModelSpec("granite-moe-q4km", "$PEERS/model/granite-3b-a800m-random.Q4_K_M.gguf",
              gguf="granite-3b-a800m-random.Q4_K_M.gguf"),
    ModelSpec("olmoe-q4km", "$PEERS/model/olmoe-1b-7b-random.Q4_K_M.gguf", gguf="olmoe-1b-7b-random.Q4_K_M.gguf"),
    ModelSpec("granite-moe-bf16", "$PEERS/model/granite-3b-a800m-random-hf", ("--dtype", "bfloat16"),
              hf_dir="granite-3b-a800m-random-hf"),
)}
# the GGUFs written with random blocks in Q4_K_M's mix (no f16 file first, no llama-quantize): model ->
# (the script under benchmarks/, its preset)
RANDOM_GGUFS = {"8b-q4km": ("random_gguf.py", "8b"), "granite-moe-q4km": ("random_moe_gguf.py", "granite-3b-a800m"),
                "olmoe-q4km": ("random_moe_gguf.py", "olmoe-1b-7b")}
TOKENIZER_DIR = "smollm2-135m-hf"  # under $PEERS/model: every model here has SmolLM2's vocabulary
SHAPES = ((64, 256), (256, 96), (512, 128), (1024, 64), (2048, 32))


@dataclass(frozen=True)
class Load:
    name: str
    concurrency: int | None  # most requests in flight (None: no cap)
    prompts: int  # requests per cell
    quick_prompts: int
    poisson: bool = False  # arrivals at --rate req/s; otherwise all at once


LOADS = {ld.name: ld for ld in (Load("rate", None, 16, 4, poisson=True), Load("c16", 16, 32, 16),
                                Load("c32", 32, 64, 32), Load("single", 1, 3, 2))}
SATURATION = ("c16", "c32")
PEER_ORDER = ("iterserve", "vllm", "llamacpp")
QUICK_OUTPUT_CAP = 8  # --quick: outputs cut to this many tokens (the shapes' inputs stay)


def shape_name(shape: tuple[int, int]) -> str:
    return f"{shape[0]}/{shape[1]}"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"256/96,1024/64" -> [(256, 96), (1024, 64)]; "all" -> SHAPES."""
    if text == "all":
        return list(SHAPES)
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        ins, sep, outs = part.partition("/")
        if not sep or not ins.isdigit() or not outs.isdigit() or int(ins) < 1 or int(outs) < 1:
            raise ValueError(f"shape {part!r}: want INPUT/OUTPUT tokens, e.g. 256/96")
        out.append((int(ins), int(outs)))
    return out


def parse_names(text: str, known: Sequence[str], what: str) -> list[str]:
    names = list(known) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names or len(set(names)) < len(names):
        raise ValueError(f"--{what} wants distinct names from {','.join(known)} (or all); got {text!r}")
    return names


def setting(shape: tuple[int, int], load: Load, rate: float, quick: bool, prompts: int | None = None) -> BenchSetting:
    """One cell's `vllm bench serve` setting (rate inf = all at once); `prompts` overrides the load's."""
    ins, outs = shape
    if quick:
        outs = min(outs, QUICK_OUTPUT_CAP)
    prompts = prompts or (load.quick_prompts if quick else load.prompts)
    return BenchSetting(f"{ins}_{outs}_{load.name}", ins, outs, rate if load.poisson else float("inf"), prompts,
                        max_concurrency=load.concurrency)


def systems_for(model: ModelSpec, peers: Sequence[str]) -> list[str]:
    """The systems a model is served by, in run order, among the selected ones."""
    return [s for s in PEER_ORDER if s in peers and (s == "iterserve" or s in model.peers())]


def cell_key(model: str, shape: str, load: str) -> str:
    return f"{model} {shape} {load}"


def decode_tok_s(m: dict[str, Any]) -> float | None:
    tpot = m.get("median_tpot_ms")
    return 1e3 / tpot if tpot else None


def verdict(load: str, cell: dict[str, dict[str, Any]]) -> str:
    """The target of a cell ({system: metrics}): "met", "missed: why", or "-" (no target / no peer)."""
    ours = cell.get("iterserve") or {}
    if "error" in ours:
        return "-"
    if load in SATURATION and "output_throughput" in (vllm := cell.get("vllm") or {}):
        r = ours["output_throughput"] / vllm["output_throughput"]
        misses = [f"tok/s {r:.2f}x"] if r < SATURATION_RATIO else []
        misses += [f"{k} {ours[key]:.0f} vs {vllm[key]:.0f} ms" for k, key in
                   (("TTFT p95", "p95_ttft_ms"), ("E2EL p95", "p95_e2el_ms")) if ours[key] >= vllm[key]]
        return "missed: " + "; ".join(misses) if misses else f"met ({r:.2f}x)"
    if load == "single" and (theirs := decode_tok_s(cell.get("llamacpp") or {})):
        r = (decode_tok_s(ours) or 0) / theirs
        return f"met ({r:.2f}x)" if r >= SINGLE_RATIO else f"missed: decode {r:.2f}x"
    return "-"


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def table(cells: dict[str, dict[str, dict[str, Any]]]) -> list[list[str]]:
    """One line per cell (key "model shape load"): output tok/s per system and iterserve's ratios,
    then TTFT p95 / E2EL p95 / decode tok/s as "iterserve / vLLM / llama.cpp", then the verdict. In
    single-stream cells the ratio columns compare decode tok/s (1000 / TPOT p50) instead."""
    head = ["model", "in/out", "load", "tok/s iterserve", "vLLM", "llama.cpp", "vs vLLM", "vs llama.cpp",
            "TTFT p95 ms (i / v / l)", "E2EL p95 ms (i / v / l)", "decode tok/s (i / v / l)", "target"]
    lines = [head]
    for key, cell in cells.items():
        model, shape, load = key.split(" ")
        get = lambda s, k: (cell.get(s) or {}).get(k)  # noqa: E731
        tput = {s: get(s, "output_throughput") for s in PEER_ORDER}
        dec = {s: decode_tok_s(cell.get(s) or {}) for s in PEER_ORDER}
        basis = dec if load == "single" else tput
        trio = lambda k: " / ".join(_fmt(get(s, k)) if s in cell else "-" for s in PEER_ORDER)  # noqa: E731
        errors = [s for s in PEER_ORDER if "error" in (cell.get(s) or {})]
        lines.append([model, shape, load, *(_fmt(tput[s]) if s not in errors else "error" for s in PEER_ORDER),
                      _ratio(basis["iterserve"], basis["vllm"]), _ratio(basis["iterserve"], basis["llamacpp"]),
                      trio("p95_ttft_ms"), trio("p95_e2el_ms"),
                      " / ".join(_fmt(dec[s]) if s in cell else "-" for s in PEER_ORDER), verdict(load, cell)])
    return lines


def markdown(lines: Sequence[Sequence[str]]) -> str:
    return markdown_table(lines, "lll" + "r" * (len(lines[0]) - 4) + "l")


def merge(old: dict[str, Any] | None, new_cells: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Cells of an earlier summary (--append) updated with this run's: a system's new figures replace
    its old ones in the same cell, other systems' stay."""
    cells = {k: dict(v) for k, v in ((old or {}).get("cells") or {}).items()}
    for key, by_system in new_cells.items():
        cells.setdefault(key, {}).update(by_system)
    return cells


# ---------------------------------------------------------------- the decode step's bound

def llama_step_cost(cfg: dict[str, int], rows: int, weight_bytes: float) -> dict[str, float]:
    """A decode step of `rows` rows of a Llama config (HF keys): FLOPs of its projections and LM
    head (attention over short contexts left out), and the weight bytes it reads once."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter  # q, o; k, v; gate, up, down
    params = layers * per_layer + cfg["vocab_size"] * h
    return {"flops": 2.0 * rows * params, "weight_bytes": weight_bytes, "matmul_params": params}


def step_bounds(cost: dict[str, float], copy_gb_s: float, gemm_gflop_s: float, step_ms: float) -> dict[str, float]:
    """Bandwidth bound (weight bytes / copy bandwidth), compute bound (FLOPs / GEMM rate), the
    larger of the two, and the measured step over it (target: <= STEP_BOUND_RATIO)."""
    bw_ms = cost["weight_bytes"] / (copy_gb_s * 1e9) * 1e3
    compute_ms = cost["flops"] / (gemm_gflop_s * 1e9) * 1e3
    bound = max(bw_ms, compute_ms)
    return {"bandwidth_bound_ms": bw_ms, "compute_bound_ms": compute_ms, "bound_ms": bound,
            "step_ms": step_ms, "over_bound": step_ms / bound}
