"""How far ahead of a weight stream the GGUF GEMMs ask for lines, chosen by timing the loaded model.

A one-row step reads every projection's blocks once, and the kernels ask for the lines a fixed
distance ahead of the block they read (kernel_common.h's prefetch_stream). The best distance moved
with the host: 4 KiB beat whole rows 16 rows ahead on a 2-core Zen 5 (2026-12-02); Zen 3 saw nothing
between 4 and 32 KiB; on a 2-core AMX Xeon 2 KiB read the 1B's one-row projections 8-9 % faster
than 4 KiB and the 8B's 12-14 % (docs/profile.md). So it is timed, once per model shape and machine,
like the kernel choice it is cached with.

Only the model's own weights say which distance wins: they sit in the page cache in 2 MiB pages
(gguf_file.map_file), larger than any cache. Random copies in anonymous 4 KiB pages, the way the
kernel choice times its candidates, read at 18 GB/s where the mapped file reads 24, and put the
distances 4 % apart instead of 9. The timing is one pass of one activation row through every
projection with a twin, in the order a step runs them, each distance in turn, best of ROUNDS passes:
what a decode step's projections do, without the rest of the step.
"""
from __future__ import annotations

import logging
import time
from types import ModuleType

import torch
from torch import nn

from iterserve.platform.cpu_linear import CpuLinear, twin_modules

log = logging.getLogger("iterserve.platform")

CANDIDATES = (2048, 3072, 4096)  # bytes ahead; 4096 is the kernels' own default
ROUNDS = 3  # passes at each distance, in turns, after one warm-up pass each


def time_stream_ahead(modules: list[CpuLinear], kernels: ModuleType, candidates: tuple[int, ...] = CANDIDATES,
                      rounds: int = ROUNDS) -> dict[int, float]:
    """Best seconds of one one-row pass through `modules` at each distance, the distances taking turns
    (so a burst of another process's work lands on all of them). Leaves the kernels' distance as it found it."""
    rows = [torch.zeros(1, m.in_features, dtype=torch.bfloat16) for m in modules]
    was = kernels.stream_ahead()
    best = dict.fromkeys(candidates, float("inf"))
    try:
        with torch.inference_mode():
            for r in range(rounds + 1):
                for ahead in candidates:
                    kernels.set_stream_ahead(ahead)
                    t0 = time.perf_counter()
                    for mod, x in zip(modules, rows):
                        mod(x)
                    if r:  # the first pass at each distance warms up
                        best[ahead] = min(best[ahead], time.perf_counter() - t0)
    finally:
        kernels.set_stream_ahead(was)
    return best


def choose_stream_ahead(model: nn.Module, kernels: ModuleType | None, known: int = 0) -> tuple[int, dict[int, float]]:
    """Sets the GEMMs' distance for this model: `known` (a cached choice) where given, else the fastest
    of CANDIDATES timed on the model (time_stream_ahead). Returns the distance and the ms per pass
    timed (empty when nothing was timed). Nothing to choose without the kernels or without a model
    whose projections read twins: the default stays."""
    if kernels is None:
        return 0, {}
    if known:
        kernels.set_stream_ahead(known)
        return known, {}
    modules = twin_modules(model)
    if not modules:
        return 0, {}
    sec = time_stream_ahead(modules, kernels)
    ahead = min(sec, key=sec.get)
    kernels.set_stream_ahead(ahead)
    ms = {a: round(s * 1e3, 3) for a, s in sec.items()}
    log.info("CPU: the GGUF GEMMs ask for their weights' lines %d bytes ahead (one-row pass through %d projections, "
             "ms at each distance: %s)", ahead, len(modules), ", ".join(f"{a}: {t}" for a, t in ms.items()))
    return ahead, ms
