"""The CPU's feature flags, read once from /proc/cpuinfo (no torch import: benchmark clients use it too)."""
from __future__ import annotations

import functools


@functools.cache
def cpu_flags_line() -> str:
    """The first `flags` (x86) or `Features` (Arm) line of /proc/cpuinfo; "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The flags as the kernel names them (avx512_bf16, amx_tile, ...)."""
    return frozenset(cpu_flags_line().partition(":")[2].split())
