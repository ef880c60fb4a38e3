"""Where a decode step's wall time goes, without the profiler: the step timed as it runs, then with
kinds of C++ kernel calls replaced by outputs made once ("nulled": the projections, attention with
its KV write, the norms / RoPE / SiLU), so that what is left is the rest's own time, Python included.
The profiler (profile_step.py) puts ~2x on each op's Python wrapper and cannot see where the time
between the ops goes; this shows it: e.g. the 1B Q4_K_M's 16-row step on the 2-core AMX Xeon
(2026-12-06) took ~2 ms with every kernel nulled, where the profile had read ~6 ms of Python.

    python benchmarks/step_split.py --model FILE.gguf --batch 16 --context 128

Prints, per configuration, the median ms per step over --rounds rounds of --steps steps, and for
the real step each kernel kind's wall time inside it (timed around its calls: perf_counter, ~1 us a
call). Nulled outputs are zeros of the right shape: the numbers computed are meaningless, the
step's structure (calls, shapes, sampling of zeros) is the real one's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import drain, start_decode_batch  # noqa: E402  (sibling script)
from machine import figures_line, machine_figures  # noqa: E402

import iterserve.attention.cpu_backend as attention_backend  # noqa: E402
import iterserve.platform.cpu_elementwise as elementwise  # noqa: E402
import iterserve.platform.cpu_linear as cpu_linear  # noqa: E402
import iterserve.platform.cpu_norm as cpu_norm  # noqa: E402
from iterserve.llm import LLM  # noqa: E402

# (owner, attribute, kind): the calls each kind names; cpu_linear._cpu_linear is looked up per call
CALLS = [(cpu_linear, "_cpu_linear", "projections"),
         (attention_backend.CpuKernelAttentionBackend, "decode", "attention"),
         (attention_backend.CpuKernelAttentionBackend, "write_kv", "attention"),
         (elementwise.CpuMLP, "act_and_mul", "elementwise"), (elementwise.CpuAttention, "rope", "elementwise"),
         (cpu_norm.CpuRMSNorm, "forward", "elementwise"), (cpu_norm.CpuRMSNorm, "add_and_norm", "elementwise")]
KINDS = ("projections", "attention", "elementwise")

_zeros: dict[tuple, torch.Tensor] = {}


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One zero tensor per shape and dtype, made once: a nulled call's output."""
    key = (tuple(shape), dtype)
    if key not in _zeros:
        _zeros[key] = torch.zeros(*shape, dtype=dtype)
    return _zeros[key]


NULLS: dict[str, Callable] = {  # what each call returns when its kind is nulled
    "_cpu_linear": lambda x, packed, layout, out_features, *a, **k: zeros((x.shape[0], out_features), x.dtype),
    "decode": lambda self, q, *a, **k: zeros(q.shape, q.dtype),
    "write_kv": lambda self, *a, **k: None,
    "act_and_mul": lambda self, g: zeros((g.shape[0], g.shape[1] // 2), g.dtype),
    "rope": lambda self, x, cos, sin: x,
    "forward": lambda self, x: x,
    "add_and_norm": lambda self, x, a: (x, x),
}


def install(nulled: set[str], spent: dict[str, float], originals: dict) -> None:
    """Each call of CALLS timed into spent[kind], or nulled where its kind is in `nulled`."""
    for owner, name, kind in CALLS:
        real = originals[(owner, name)]
        if kind in nulled:
            setattr(owner, name, NULLS[name])
            continue

        def timed(*a, _real=real, _kind=kind, **k):
            t = time.perf_counter()
            out = _real(*a, **k)
            spent[_kind] += time.perf_counter() - t
            return out
        setattr(owner, name, timed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model path or name, as `iterserve serve` takes it")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--kv-cache-dtype", default="auto", help="as `iterserve serve --kv-cache-dtype` takes it")
    args = ap.parse_args()
    print(figures_line(machine_figures()))
    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    originals = {(owner, name): getattr(owner, name) for owner, name, _ in CALLS}
    configs = [("real", set()), ("projections nulled", {"projections"}), ("all kernels nulled", set(KINDS))]
    for label, nulled in configs:
        spent: dict[str, float] = defaultdict(float)
        install(nulled, spent, originals)
        walls, parts = [], defaultdict(list)
        for _ in range(args.rounds + 1):  # the first round warms up
            start_decode_batch(llm, args.batch, args.context, 2 + args.steps)
            engine.step()
            spent.clear()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            walls.append((time.perf_counter() - t0) * 1e3 / args.steps)
            for kind in KINDS:
                parts[kind].append(spent[kind] * 1e3 / args.steps)
            drain(llm)
        line = f"{label}: {statistics.median(walls[1:]):.1f} ms a step"
        timed = [k for k in KINDS if k not in nulled]
        if timed:
            line += " (" + ", ".join(f"{k} {statistics.median(parts[k][1:]):.1f}" for k in timed) + ")"
        print(line, flush=True)
    for (owner, name), real in originals.items():
        setattr(owner, name, real)
    return 0


if __name__ == "__main__":
    sys.exit(main())
