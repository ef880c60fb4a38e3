"""Which kernel each CPU projection and the decode attention get, chosen by timing them on this
machine rather than by its feature flags.

Flags say what a CPU can run, not what runs fastest: oneDNN on AMX beat our AVX512-BF16 GEMM on one
host and lost on another, and where the 4-bit twin stops paying depends on the memory bandwidth.
So, once per model shape and machine, `choose_kernels` builds each candidate for the model's real
projection shapes (random weights of the same shape: only the shape matters for speed) and times it
at the step sizes the engine will run (`batch_buckets`):

- the bf16 layouts: our tiled AVX512-BF16 GEMM, oneDNN's prepacked weight (which runs on AMX tiles
  where the CPU has them, so on an AMX host AMX is one of the measured candidates), and float32
  (where bf16 is emulated or slow); where AMX is lent to us, the tiled layout is also timed with
  every step on our AMX path (`AMX`), and the tiled layout's AMX cut-over (`amx_min_rows`) is the
  smallest bucket from which that path beat the AVX-512 one at every larger bucket: the tiled
  layout's time is then the better of the two at each bucket;
- the float32 layouts: plain float32, and bf16 weights on our AVX2 GEMM (`bf16w`) only for a shape
  whose weights are all bf16-exact (`ChoiceRequest.bf16_exact`): elsewhere bf16w rounds them, and a
  float32 run is asked for float32's numbers, not for the fastest approximation of them;
- the quantised twins, when the model has them (4-bit for the projections, Q8_0 for the LM head;
  for a GGUF of other block types, a twin from the file's own blocks, timed per distinct shape and
  block layout, `spec`: random blocks of the same types and row ranges): each twin's cut-over
  (`twin_max_tokens`) is the largest bucket up to which it beat the chosen layout at every bucket;
  where a twin takes under 1/SURE_MARGIN of every layout's one-row time, the layouts are not timed
  at that size (`measure`'s `twin`: the twin runs it whatever they would take);
- the decode attention backends (the C++ kernel, torch's SDPA).

A layout is picked per shape by its time relative to the best at each bucket, summed over the
buckets it will run: those above its twin's cut-over, or all of them where there is no twin
(`layout_and_cutover`; a scale-free score, so the 64-row bucket does not drown the decode sizes).
One layout per shape: two would double the weights' memory. A candidate whose first call took more
than GIVE_UP times the fastest layout's is not called again (`time_round_robin`): an 8B's first
start measured in 13 s where it took 30.

The table is cached as JSON under the user's cache folder (`kernel_choice_dir`), keyed by everything
that changes the answer: CPU model and flags, torch version, thread count, the hash of the kernels'
and this layer's sources, dtype, the model's shapes and the buckets. A second start reads it back
for free; `EngineConfig.remeasure_kernels` measures again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from iterserve.attention.backend import AttentionBackend, TorchAttentionBackend
from iterserve.attention.cpu_backend import CpuKernelAttentionBackend
from iterserve.attention.metadata import DecodeMetadata
from iterserve.cpu_info import cpu_flags_line, cpu_model_name
from iterserve.platform.base import user_cache_dir
from iterserve.platform.cpu_kernels import KERNEL_FILES
from iterserve.platform.cpu_linear import (AMX_MIN_ROWS, EVERY_ROW, GGUF_AMX, GGUF_INT8, GGUF_INT8_AMX, KQUANT_NAMES,
                                           LAYOUTS,
                                           CpuLinear, bf16_exact, bf16w_gemm_vectorised, four_bit_twin, gguf_int8_amx,
                                           gguf_twin_name, is_down_projection, pack_gguf_twin, prepack_available,
                                           random_shards, release_panel_scratch, tiled_gemm_amx,
                                           tiled_gemm_vectorised)

log = logging.getLogger("iterserve.platform")

CHOICE_VERSION = 5  # bump when the meaning of a cached table changes (2: the tiled layout's AMX cut-over;
# 3: twins from GGUF blocks, keyed by their spec; 4: layouts not timed where the twin surely runs, and
# chosen by the step sizes they run; 5: the candidates' weights in 2 MiB pages, as the model's are)
AMX = "tiled+amx"  # the tiled layout with every step on our AMX path: timed to find its cut-over
PREFILL_ROWS = 64  # one prefill-sized bucket: the layout also runs every prompt chunk
INT8_PREFILL_ROWS = 512  # a K-quant twin on int8 activations or AMX tiles is timed at a prompt chunk's rows too
GIVE_UP = 2.5  # a layout this many times slower than the best at a step size is not timed further
TWIN_GIVE_UP = 1.2  # a twin this much slower than the best layout has passed its cut-over
SURE_MARGIN = 2.0  # a twin under 1/this of every layout's one-row time surely runs that step size
COPIES_BYTES = 48 << 20  # bf16 bytes of distinct weights one timed call of a projection reads
MAX_COPIES = 32
ATTENTION_CONTEXT = 256  # tokens of context per sequence when timing decode attention
# the files whose contents decide what a candidate computes and how fast: these three and every C++
# source and header of the kernels
SOURCES = [Path(__file__).resolve().parent / n for n in ("cpu_linear.py", "kernel_choice.py", "stream_ahead.py")
           ] + KERNEL_FILES


def kernel_choice_dir() -> Path:
    """Where chosen tables are cached: $XDG_CACHE_HOME/iterserve/kernel_choice (~/.cache/...)."""
    return user_cache_dir() / "kernel_choice"


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The decode step sizes to time: powers of two up to the most sequences a step decodes, and that
    number itself. (The projections are also timed at PREFILL_ROWS; the LM head, which sees only
    sampled rows, and the decode attention are not.)"""
    sizes = {1 << i for i in range(max(1, max_num_seqs).bit_length()) if 1 << i <= max_num_seqs}
    return sorted(sizes | {max_num_seqs})


def time_round_robin(calls: Mapping[str, Callable[[], object]], min_reps: int = 3, max_reps: int = 20,
                     min_seconds: float = 0.004, rivals: Collection[str] | None = None) -> dict[str, float]:
    """Best time of each call, the calls taking turns (A, B, C, A, B, C, ...) after one warm-up each,
    so a burst of another process's work on a shared host hits them all rather than one. A call that
    took over 10 ms at its warm-up is timed once more only: it is far from any fast candidate; and
    one whose warm-up took more than GIVE_UP times the fastest warm-up of the `rivals` (default: all
    of them) not at all: its warm-up stands for its time (an 8B's 512-row panels on the AVX-512 and
    float32 layouts take 0.5-0.65 s a call where AMX takes 0.12, two of them for each such shape)."""
    best: dict[str, float] = {}
    reps: dict[str, int] = {}
    warm: dict[str, float] = {}
    for name, fn in calls.items():
        t0 = time.perf_counter()
        fn()
        warm[name] = time.perf_counter() - t0
        reps[name] = 1 if warm[name] > 0.01 else min_reps
        best[name] = math.inf
    bar = min([warm[n] for n in calls if rivals is None or n in rivals] or [math.inf])
    far = {n for n in calls if warm[n] > 0.01 and warm[n] > GIVE_UP * bar}
    for name in far:
        best[name] = warm[name]
    total = dict.fromkeys(calls, 0.0)
    done = dict.fromkeys(calls, 0)
    while True:
        todo = [n for n in calls
                if n not in far and (done[n] < reps[n] or (total[n] < min_seconds and done[n] < max_reps))]
        if not todo:
            return best
        for name in todo:
            t0 = time.perf_counter()
            calls[name]()
            dt = time.perf_counter() - t0
            best[name], total[name], done[name] = min(best[name], dt), total[name] + dt, done[name] + 1


def measure(candidates: Mapping[str, Callable[[int], Callable[[], object]]], buckets: Sequence[int],
            give_up: Mapping[str, float] | None = None, twin: str | None = None) -> dict[str, dict[int, float]]:
    """Seconds per call of each candidate at each bucket (smallest first); `candidates[name](rows)`
    returns the call. A candidate slower than `give_up[name]` (default GIVE_UP) times the best at a
    bucket is not timed at the larger ones (inf there): it cannot win, and timing it costs start-up.
    The best is that of the candidates without a `give_up` of their own (the layouts, not a twin,
    which only has to beat them).

    `twin`: the candidate that runs a step instead of the others up to its cut-over. After the first
    bucket it is timed alone first, and where it takes under 1/SURE_MARGIN of the others' fastest
    time at the first bucket, they are not timed there (inf): a call of more rows costs a layout at
    least what one row does, so the twin runs that step size whatever they would take. (A GGUF
    layout's call dequantises every panel: of an 8B's ~27 s of timed calls at a first start, ~13 s
    went to the sizes 2-16, where its twins were 5-30x faster than any layout.) From the first bucket
    where it is not that far ahead, every live candidate is timed at every bucket."""
    times: dict[str, dict[int, float]] = {name: {} for name in candidates}
    live = list(candidates)
    floor = math.inf  # the others' fastest time at the first bucket
    for i, b in enumerate(buckets):
        if twin in live and i > 0:
            alone = time_round_robin({twin: candidates[twin](b)})[twin]
            if alone * SURE_MARGIN < floor:
                times[twin][b] = alone
                for name in candidates:
                    times[name].setdefault(b, math.inf)
                continue
            twin = None  # not surely ahead here: so not at the larger buckets either
        rivals = [n for n in live if n not in (give_up or {})] or live
        for name, t in time_round_robin({name: candidates[name](b) for name in live}, rivals=rivals).items():
            times[name][b] = t
        if i == 0:
            floor = min([times[n][b] for n in live if n != twin] or [0.0])
        best = min(times[n][b] for n in rivals)
        live = [n for n in live if times[n][b] <= (give_up or {}).get(n, GIVE_UP) * best]
        for name in candidates:
            times[name].setdefault(b, math.inf)
    return times


def pick_fastest(times: Mapping[str, Mapping[int, float]], buckets: Sequence[int] | None = None) -> str:
    """The candidate with the least total time relative to the best at each bucket (of `buckets`, default
    all; a bucket at which none was timed does not count)."""
    every = list(next(iter(times.values())).keys()) if buckets is None else list(buckets)
    best = {b: min(t[b] for t in times.values()) for b in every}
    timed = [b for b in every if math.isfinite(best[b])]
    return min(times, key=lambda name: sum(times[name][b] / best[b] for b in timed))


def amx_cutover(amx: Mapping[int, float], avx: Mapping[int, float]) -> int:
    """The smallest bucket from which the AMX path was faster than the AVX-512 one at it and every
    larger bucket (0: never). A bucket at which neither was timed (the twin surely runs that step
    size: measure's `twin`) does not end the run: the layout never takes such a step, so its AMX path
    covers every size from the last one it lost at, untimed ones between included. Where AMX lost at
    every bucket timed and none of them reached AMX_MIN_ROWS, it was never timed where it leads: the
    fixed rule's cut-over, AMX_MIN_ROWS."""
    cut = 0
    for b in sorted(amx, reverse=True):
        if not (math.isfinite(amx[b]) or math.isfinite(avx[b])):
            cut = b if cut else 0
            continue
        if amx[b] >= avx[b]:
            break
        cut = b
    timed = [b for b, t in amx.items() if math.isfinite(t)]
    return cut or (AMX_MIN_ROWS if timed and max(timed) < AMX_MIN_ROWS else 0)


def twin_cutover(twin: Mapping[int, float], base: Mapping[int, float]) -> int:
    """The largest bucket up to which the twin was faster than the base at every bucket (0: never)."""
    cut = 0
    for b in sorted(twin):
        if twin[b] >= base[b]:
            break
        cut = b
    return cut


def layout_and_cutover(base: Mapping[str, Mapping[int, float]], twin: Mapping[int, float] | None) -> tuple[str, int]:
    """The layout and the twin's cut-over (0: no twin). A layout runs only the steps its twin does not,
    so it is chosen by its times above the cut-over the twin has against the fastest layout at each
    bucket (where the twin runs every bucket timed: by the largest one at which a layout was timed);
    the cut-over is then the twin's against that layout. (Chosen over every bucket, in one first start's
    table an 8B's Q4_K down projection took the layout fastest at the 1-64 rows its twin ran, 1.25x
    slower than another at the 512 rows it runs.)"""
    if not twin:
        return pick_fastest(base), 0
    buckets = sorted(twin)
    fastest = {b: min(t[b] for t in base.values()) for b in buckets}
    cut = twin_cutover(twin, fastest)
    runs = [b for b in buckets if b > cut and math.isfinite(fastest[b])]
    timed = [b for b in buckets if math.isfinite(fastest[b])]
    layout = pick_fastest(base, runs or timed[-1:] or None)
    return layout, twin_cutover(twin, base[layout])


@dataclass
class LinearChoice:
    role: str  # "proj" (a decoder projection) or "head" (the LM head)
    layout: str  # one of cpu_linear.LAYOUTS
    twin: str | None  # the quantised twin measured for it, if any
    twin_max_tokens: int  # rows up to which the twin runs (0: never)
    ms: dict[str, dict[int, float]]  # candidate -> bucket -> ms per call
    amx_min_rows: int = 0  # tiled: rows from which the step runs on AMX tiles (0: never)

    def describe(self) -> str:
        """'tiled+amx>=16 + q4_1<=4' (or '+ q4_k<=4', a twin from GGUF blocks named by their types):
        the layout, its AMX cut-over, the twin's."""
        return (self.layout + (f"+amx>={self.amx_min_rows}" if self.amx_min_rows else "")
                + (f" + {self.twin} at every step" if self.twin_max_tokens == EVERY_ROW else
                   f" + {self.twin}<={self.twin_max_tokens}" if self.twin_max_tokens else ""))


@dataclass
class KernelChoice:
    buckets: list[int]  # the step sizes timed (the head and the attention: the decode ones only)
    linears: dict[str, LinearChoice]  # "role:NxK" -> its choice
    decode_attention: str | None  # None: not measured (forced, or one candidate)
    attention_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    seconds: float = 0.0  # measuring time (0 when read from the cache)
    source: str = "measured"  # or "cache"
    # bytes ahead of a weight stream the GGUF GEMMs ask for lines, timed on the loaded model (0: not
    # timed, the kernels' default) and ms per one-row pass at each distance (platform/stream_ahead.py)
    stream_ahead: int = 0
    stream_ahead_ms: dict[int, float] = field(default_factory=dict)
    # where the table is cached (choose_kernels): `remember` writes it again once stream_ahead is timed
    key: dict[str, Any] = field(default_factory=dict, repr=False)
    folder: Path | None = field(default=None, repr=False)

    def plan(self, role: str, out_features: int, in_features: int, spec: str = "") -> LinearChoice | None:
        """The choice for a shape; `spec`: its GGUF twin's (cpu_linear.gguf_twin_spec), if it has one."""
        return self.linears.get(linear_key(role, out_features, in_features, spec))

    def summary(self) -> dict[str, Any]:
        """The table for /v1/scheduler and benchmark JSON: per shape its layout, twin and AMX cut-overs."""
        return {"source": self.source, "seconds": round(self.seconds, 2), "buckets": self.buckets,
                "linears": {k: {"layout": c.layout, "twin": c.twin, "twin_max_tokens": c.twin_max_tokens,
                                "amx_min_rows": c.amx_min_rows} for k, c in self.linears.items()},
                "decode_attention": self.decode_attention}

    def brief(self) -> str:
        """One line: each shape's layout (and its AMX and twin cut-overs), then the decode attention."""
        parts = [f"{key} {c.describe()}" for key, c in self.linears.items()]
        return ", ".join(parts + ([f"decode attention {self.decode_attention}"] if self.decode_attention else []))

    def table(self) -> str:
        """The chosen table, one line per shape with each candidate's ms at every bucket."""
        head = "rows " + " ".join(f"{b:>6d}" for b in self.buckets)
        lines = [f"{'':32s}{head}"]
        for key, c in self.linears.items():
            lines.append(f"{key} -> {c.describe()}")
            for name, ms in c.ms.items():
                lines.append(f"  {name:30s}" + "".join(_cell(ms.get(b)) for b in self.buckets))
        if self.attention_ms:
            lines.append(f"decode attention ({ATTENTION_CONTEXT} tokens of context) -> {self.decode_attention}")
            for name, ms in self.attention_ms.items():
                lines.append(f"  {name:30s}" + "".join(_cell(ms.get(b)) for b in self.buckets))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["key"], data["folder"]
        return data

    def remember(self) -> None:
        """Writes the table to its cache file again (after stream_ahead was timed on the model)."""
        if self.key:
            save_cached(self.key, self, self.folder)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KernelChoice:
        def ints(d: dict) -> dict[str, dict[int, float]]:
            return {n: {int(b): v for b, v in ms.items()} for n, ms in d.items()}
        linears = {k: LinearChoice(**{**c, "ms": ints(c["ms"])}) for k, c in data["linears"].items()}
        return cls(buckets=data["buckets"], linears=linears, decode_attention=data["decode_attention"],
                   attention_ms=ints(data["attention_ms"]), seconds=0.0, source="cache",
                   stream_ahead=data.get("stream_ahead", 0),
                   stream_ahead_ms={int(a): t for a, t in data.get("stream_ahead_ms", {}).items()})


def linear_key(role: str, out_features: int, in_features: int, spec: str = "") -> str:
    """'proj:1536x640', or with a GGUF twin 'proj:1536x640:q5_0:1280+q8_0:256' (its spec)."""
    return f"{role}:{out_features}x{in_features}" + (f":{spec}" if spec else "")


def parse_linear_key(key: str) -> tuple[str, int, int, str]:
    """linear_key's inverse: (role, out_features, in_features, spec)."""
    role, shape, *spec = key.split(":", 2)
    n, k = shape.split("x")
    return role, int(n), int(k), spec[0] if spec else ""


def _cell(ms: float | None) -> str:
    return f"{ms:7.3f}" if ms is not None and math.isfinite(ms) else f"{'-':>7s}"


def _sources_hash() -> str:
    h = hashlib.sha1()
    for path in SOURCES:
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:12]


def choice_key(shapes: Sequence[tuple[str, int, int]], buckets: Sequence[int], dtype: torch.dtype,
               candidates: Mapping[str, Any]) -> dict[str, Any]:
    """Everything that changes which kernel wins; the cache file is named by its hash."""
    return {"version": CHOICE_VERSION, "cpu": cpu_model_name(),
            "flags": hashlib.sha1(cpu_flags_line().encode()).hexdigest()[:12], "torch": torch.__version__,
            "threads": torch.get_num_threads(), "sources": _sources_hash(), "dtype": str(dtype),
            "shapes": [list(s) for s in shapes], "buckets": list(buckets), "candidates": dict(candidates)}


def cache_path(key: Mapping[str, Any], folder: Path | None = None) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (folder or kernel_choice_dir()) / f"{digest}.json"


def load_cached(key: Mapping[str, Any], folder: Path | None = None) -> KernelChoice | None:
    """The cached table for exactly this key, or None (missing, unreadable, or another key)."""
    path = cache_path(key, folder)
    try:
        data = json.loads(path.read_text())
        if data.get("key") != json.loads(json.dumps(key)):
            return None
        return KernelChoice.from_json(data["choice"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_cached(key: Mapping[str, Any], choice: KernelChoice, folder: Path | None = None) -> None:
    path = cache_path(key, folder)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "choice": choice.to_json()}, indent=1))
        tmp.replace(path)
    except OSError as exc:  # a read-only home: measure again next time, but run
        log.warning("could not cache the kernel choice in %s: %s", path.parent, exc)


# ---- candidates ------------------------------------------------------------------------------------
def _linear(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16,
            weightless: bool = False) -> nn.Linear:
    """A random linear of this shape; `weightless`: its weight left on the meta device, for a CpuLinear
    whose GGUF blocks are the weight (random floats of an 8B's shapes cost seconds and GiBs for nothing)."""
    lin = nn.Linear(in_features, out_features, bias=False, device="meta", dtype=dtype)
    if not weightless:
        lin.weight = nn.Parameter(torch.randn(out_features, in_features).mul_(0.02).to(dtype), requires_grad=False)
    return lin


def num_copies(out_features: int, in_features: int) -> int:
    """How many distinct weights of a shape one timed call runs through: enough to fill
    COPIES_BYTES, so each is read from memory as in a real step (a model's weights are far larger
    than the CPU's caches), not from a cache that one small weight called again and again would sit in."""
    return max(1, min(MAX_COPIES, -(-COPIES_BYTES // (2 * out_features * in_features))))


def layout_candidates(in_features: int, kernels: ModuleType | None,
                      dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """The layouts that can run a projection of `dtype` with this many inputs on this machine: for
    bf16, ours (AVX512-BF16), oneDNN's and float32; for float32, plain float32 and bf16 weights on
    our AVX2 GEMM (whose scalar fallback is not worth timing; choose_kernels keeps it only for
    bf16-exact weights)."""
    if dtype == torch.float32:
        return ["float32"] + (["bf16w"] if bf16w_gemm_vectorised(kernels) else [])
    ok = {"tiled": tiled_gemm_vectorised(kernels) and in_features % 2 == 0, "onednn": prepack_available(),
          "float32": True}
    return [name for name in LAYOUTS if ok.get(name)]


def amx_candidate(in_features: int, kernels: ModuleType | None) -> list[str]:
    """[AMX] where our tiled GEMM can run this shape on AMX tiles (K a multiple of 32), else []."""
    return [AMX] if tiled_gemm_amx(kernels) and in_features % 32 == 0 else []


def linear_candidates(lins: Sequence[nn.Linear], layouts: Sequence[str], twin: str | None, spec: str = "",
                      blocks: bool = False, int8: bool = False,
                      gguf_amx: bool = False) -> dict[str, Callable[[int], Callable[[], object]]]:
    """One factory per layout (and for the twin, run at every row count); a call runs x through
    every one of `lins` (copies of one shape) as CpuLinear as the model will hold them, so the op's
    own overhead and the weights' memory traffic are in the figure. `spec`: the twin is one from
    GGUF blocks of these types and row ranges (random blocks: only the layout matters for speed).
    `blocks`: those blocks are the weight (CpuLinear's `blocks`), so each layout is timed with the
    dequantisation of its panels (blocks_gemm) included. `int8`: the GGUF twin on int8 activations;
    `gguf_amx`: a K-quant GGUF twin's steps of 16+ rows on AMX-INT8 tiles, on int8 activations as
    use_int8_activations(amx=True) runs it, on int16 as use_amx_tiles does."""
    def factory(copies: list[CpuLinear]) -> Callable[[int], Callable[[], object]]:
        def make(rows: int) -> Callable[[], object]:
            x = torch.randn(rows, lins[0].in_features).to(lins[0].weight.dtype)  # activations as the model has them
            return lambda: [mod(x) for mod in copies]
        return make

    if blocks:
        packed = [pack_gguf_twin(random_shards(spec, lin.in_features), lin.in_features) for lin in lins]
        mods = {name: [CpuLinear(lin, layout="tiled" if name == AMX else name, amx_min_rows=int(name == AMX),
                                 blocks=b) for lin, b in zip(lins, packed)] for name in layouts}
        mods[twin] = [CpuLinear(lin, twin_max_tokens=1 << 30, layout=layouts[0], blocks=b) for lin, b in zip(lins, packed)]
    else:
        mods = {name: [CpuLinear(lin, layout="tiled", amx_min_rows=1) if name == AMX else CpuLinear(lin, layout=name)
                       for lin in lins] for name in layouts}
        if twin and spec:
            mods[twin] = [CpuLinear(lin, "gguf", 1 << 30, layout=layouts[0],
                                    shards=random_shards(spec, lin.in_features)) for lin in lins]
        elif twin:
            mods[twin] = [CpuLinear(lin, twin, 1 << 30, layout=layouts[0]) for lin in lins]
    if int8 and twin:
        for mod in mods[twin]:
            mod.op_twin = GGUF_INT8_AMX if gguf_amx else GGUF_INT8
    elif gguf_amx and twin and any(t in spec for t in KQUANT_NAMES):
        for mod in mods[twin]:
            mod.op_twin = GGUF_AMX
    return {name: factory(copies) for name, copies in mods.items()}


def attention_candidates(backends: Mapping[str, AttentionBackend], num_heads: int, num_kv_heads: int,
                         head_dim: int, block_size: int, dtype: torch.dtype
                         ) -> dict[str, Callable[[int], Callable[[], object]]]:
    """Each backend's decode at `rows` sequences of ATTENTION_CONTEXT tokens each."""
    per_seq = -(-ATTENTION_CONTEXT // block_size)

    def factory(backend: AttentionBackend) -> Callable[[int], Callable[[], object]]:
        def make(rows: int) -> Callable[[], object]:
            shape = (rows * per_seq, block_size, num_kv_heads, head_dim)
            k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
            meta = DecodeMetadata(block_tables=torch.arange(rows * per_seq).view(rows, per_seq),
                                  context_lens=torch.full((rows,), ATTENTION_CONTEXT), max_context_len=ATTENTION_CONTEXT)
            q = torch.randn(rows, num_heads, head_dim).to(dtype)
            return lambda: backend.decode(q, k, v, meta, head_dim ** -0.5, 0, 0.0)  # no window, no softcap
        return make
    return {name: factory(b) for name, b in backends.items()}


@dataclass
class ChoiceRequest:
    """What `choose_kernels` measures: the model's projection shapes, what may vary, and the step sizes."""
    # (role, out_features, in_features[, spec]), role "proj" or "head"; spec: the shape's twin is one
    # from GGUF blocks (cpu_linear.gguf_twin_spec), timed instead of four_bit's / q8_head's
    shapes: list[tuple]
    buckets: list[int]
    dtype: torch.dtype
    layout: str | None = None  # forced layout (EngineConfig.bf16_gemm), or None: measured
    four_bit: bool = False  # the projections get a 4-bit twin to time
    q8_head: bool = False  # the LM head gets a Q8_0 twin to time
    attention: tuple[int, int, int, int] | None = None  # (heads, kv heads, head_dim, block_size): measured
    amx: bool = False  # AMX may be used (EngineConfig.cpu_amx): the tiled layout's AMX path is timed, and
    # a K-quant GGUF twin (int8 or int16) with its steps of 16+ rows on AMX-INT8 tiles (gguf_int8_amx),
    # also at a prompt chunk's INT8_PREFILL_ROWS
    blocks: bool = False  # the GGUF twins' blocks are the weights (CpuLinear's blocks): timed as such
    # float32: the shapes (as in `shapes`) whose weights are all bf16-exact (bf16_exact_shapes), the
    # only ones that may get bf16w unforced: it gives float32's numbers for those weights alone
    bf16_exact: list[tuple] = field(default_factory=list)
    # the GGUF twins of K-quant blocks are timed on int8 activations (gguf_activations=int8), also at a
    # prompt chunk's INT8_PREFILL_ROWS: one faster than the layout there too runs every step; but those
    # of int16_shapes (as in `shapes`) on int16, as they run (int8-except-down: down_only_shapes)
    int8: bool = False
    int16_shapes: list[tuple] = field(default_factory=list)


def linears_by_shape(model: nn.Module, dtype: torch.dtype = torch.bfloat16,
                     specs: Mapping[str, str] | None = None) -> dict[tuple, list[nn.Linear]]:
    """The CPU linears of `dtype` optimize_cpu_linears will replace, by their (role, out, in);
    (role, out, in, spec) for a module `specs` (module name -> GGUF twin spec) names."""
    found: dict[tuple, list[nn.Linear]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and mod.weight.dtype == dtype and mod.weight.device.type in ("cpu", "meta"):
            role = "head" if name == "lm_head" else "proj" if name.startswith("layers.") else None
            if role:
                spec = (specs or {}).get(name, "")
                found.setdefault((role, mod.out_features, mod.in_features, spec) if spec else
                                 (role, mod.out_features, mod.in_features), []).append(mod)
    return found


def shapes_of(model: nn.Module, dtype: torch.dtype = torch.bfloat16,
              specs: Mapping[str, str] | None = None) -> list[tuple]:
    """The distinct shapes of linears_by_shape, in the model's order."""
    return list(linears_by_shape(model, dtype, specs))


def down_only_shapes(model: nn.Module, dtype: torch.dtype = torch.bfloat16,
                     specs: Mapping[str, str] | None = None) -> list[tuple]:
    """The shapes (as shapes_of) whose every linear is an MLP down projection: those
    gguf_activations=int8-except-down keeps on int16 activations, so timed on them. (A shape shared
    with another projection is timed on int8, as that one runs.)"""
    down = {id(mod) for name, mod in model.named_modules() if is_down_projection(name)}
    return [shape for shape, lins in linears_by_shape(model, dtype, specs).items()
            if all(id(lin) in down for lin in lins)]


def bf16_exact_shapes(model: nn.Module) -> list[tuple]:
    """The float32 shapes (as shapes_of) whose every weight is bf16-exact (cpu_linear.bf16_exact):
    those the bf16w layout computes with float32's own numbers. (A module whose only copy is its
    GGUF blocks has no float weight: its panels are dequantised to float32 whatever the layout.)"""
    return [shape for shape, lins in linears_by_shape(model, torch.float32).items()
            if all(lin.weight.device.type != "meta" and bf16_exact(lin.weight) for lin in lins)]


def choose_kernels(req: ChoiceRequest, kernels: ModuleType | None, remeasure: bool = False,
                   folder: Path | None = None) -> KernelChoice:
    """The cached table for this machine and model, or a new measurement (saved for next time)."""
    attn_names = ((["cpu"] if kernels is not None else []) + ["torch"]) if req.attention else []
    gguf_amx = req.amx and gguf_int8_amx(kernels)  # K-quant twins' steps of 16+ rows on AMX-INT8 tiles
    described = {"layout": req.layout, "four_bit": req.four_bit, "q8_head": req.q8_head,
                 "attention": list(req.attention or ()), "attention_candidates": attn_names,
                 "kernels": kernels is not None, "amx": req.amx, "bf16_exact": [list(s) for s in req.bf16_exact],
                 **({"blocks": True} if req.blocks else {}), **({"int8": True} if req.int8 else {}),
                 **({"int16_shapes": [list(s) for s in req.int16_shapes]} if req.int8 and req.int16_shapes else {}),
                 **({"gguf_amx16": True} if gguf_amx else {})}
    key = choice_key(req.shapes, req.buckets, req.dtype, described)
    if not remeasure:
        cached = load_cached(key, folder)
        if cached is not None:
            cached.key, cached.folder = key, folder
            return cached
    t0 = time.perf_counter()
    torch.manual_seed(0)
    proj_buckets = sorted({*req.buckets, max(PREFILL_ROWS, *req.buckets)})
    linears: dict[str, LinearChoice] = {}
    exact = {tuple(s) for s in req.bf16_exact}
    on_int16 = {tuple(s) for s in req.int16_shapes}
    chunk_timed = False  # some twin was timed at INT8_PREFILL_ROWS (shown in the table)
    with torch.inference_mode():
        for role, n, k, *rest in req.shapes:
            spec = rest[0] if rest else ""
            layouts = [req.layout] if req.layout else layout_candidates(k, kernels, req.dtype)
            if not req.layout and req.dtype == torch.float32 and (role, n, k, *rest) not in exact:
                layouts = [name for name in layouts if name != "bf16w"]  # it would round these weights
            from_blocks = req.blocks and bool(spec)
            if from_blocks and req.dtype == torch.float32:
                layouts = ["float32"]  # a panel dequantised to float32 rows whichever float32 layout is asked
            if req.layout == "tiled" and k % 2:
                layouts = ["onednn"]  # as optimize_cpu_linears does for an odd in_features
            if req.amx and "tiled" in layouts:  # (forced tiled too: its AMX cut-over is timed)
                layouts = [*layouts, *amx_candidate(k, kernels)]
            twin = (gguf_twin_name(spec) if spec else
                    four_bit_twin(k, kernels, req.dtype) if role == "proj" and req.four_bit else
                    "q8_0" if role == "head" and req.q8_head and k % 32 == 0 else None)
            kquant = any(t in spec for t in KQUANT_NAMES)
            int8 = req.int8 and kquant and (role, n, k, *rest) not in on_int16
            # a twin whose many-row steps run on the tiles is timed at a prompt chunk's rows too
            many_rows = role == "proj" and (int8 or (gguf_amx and kquant))
            buckets = proj_buckets if role == "proj" else req.buckets
            if many_rows:
                buckets = sorted({*buckets, INT8_PREFILL_ROWS})
                chunk_timed = True
            copies = num_copies(n, k)
            # AMX never gives up: it is slow at few rows and wins at many, past where it would be dropped
            give_up = {**({twin: TWIN_GIVE_UP} if twin else {}), **({AMX: math.inf} if AMX in layouts else {})}
            lins = [_linear(n, k, req.dtype, weightless=from_blocks) for _ in range(copies)]
            sec = measure(linear_candidates(lins, layouts, twin, spec, from_blocks, int8, gguf_amx), buckets,
                          give_up=give_up or None, twin=twin)
            sec = {name: {b: t / copies for b, t in ts.items()} for name, ts in sec.items()}
            base = {name: t for name, t in sec.items() if name not in (twin, AMX)}
            amx_from = amx_cutover(sec[AMX], base["tiled"]) if AMX in sec else 0
            if amx_from:  # the tiled layout runs each step on the faster of its two paths
                base["tiled"] = {b: sec[AMX][b] if b >= amx_from else t for b, t in base["tiled"].items()}
            layout, cut = layout_and_cutover(base, sec[twin] if twin else None)
            if many_rows and cut == max(buckets):
                cut = EVERY_ROW  # faster at a prompt chunk's rows as well: it runs every step
            linears[linear_key(role, n, k, spec)] = LinearChoice(role, layout, twin, cut, _ms(sec),
                                                                 amx_from if layout == "tiled" else 0)
        attention, attn_ms = None, {}
        if len(attn_names) > 1:
            heads, kv_heads, head_dim, block_size = req.attention
            backends = {"cpu": CpuKernelAttentionBackend(kernels), "torch": TorchAttentionBackend()}
            sec = measure(attention_candidates({n: backends[n] for n in attn_names}, heads, kv_heads, head_dim,
                                               block_size, req.dtype), req.buckets)
            attention, attn_ms = pick_fastest(sec), _ms(sec)
    release_panel_scratch()  # the candidates' panels: this thread may never run a step
    shown = sorted({*proj_buckets, *([INT8_PREFILL_ROWS] if chunk_timed else [])})
    choice = KernelChoice(shown, linears, attention, attn_ms, time.perf_counter() - t0, key=key, folder=folder)
    save_cached(key, choice, folder)
    return choice


def _ms(sec: Mapping[str, Mapping[int, float]]) -> dict[str, dict[int, float]]:
    return {name: {b: round(s * 1e3, 4) for b, s in t.items()} for name, t in sec.items()}
