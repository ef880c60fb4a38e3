"""The CPU's feature flags, read once from /proc/cpuinfo (no torch import: benchmark clients use it too)."""
from __future__ import annotations

import functools
import platform


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


@functools.cache
def cpu_model_name() -> str:
    """The first `model name` line of /proc/cpuinfo (x86), else the machine's architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("model name")), "")
    except OSError:
        line = ""
    return line.partition(":")[2].strip() or platform.machine()
