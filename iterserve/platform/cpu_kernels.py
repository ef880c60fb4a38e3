"""Builds and loads iterserve's C++ CPU kernels (`iterserve/csrc/cpu_kernels.cpp`).

The build happens on first use, with gcc and ninja (a declared dependency), and is cached by torch
(TORCH_EXTENSIONS_DIR, by default under ~/.cache): the first build takes tens of seconds, later
loads a fraction of a second. It is compiled for the CPU it runs on (-march=native), so the cache
key includes the CPU's feature flags, and the sources' contents (torch's own check does not cover
headers). The CPU platform loads it when the engine starts, never at a first request.

Nothing depends on it being there: when the build fails (no compiler, an unusual platform),
`load_cpu_kernels()` logs why once and returns None, and callers keep their torch path.
EngineConfig.cpu_kernels=False (ITERSERVE_CPU_KERNELS=0) keeps the platform from loading it at all.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

from torch.utils.cpp_extension import load

from iterserve.cpu_info import cpu_flags_line

log = logging.getLogger("iterserve.kernels")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCE = CSRC / "cpu_kernels.cpp"  # includes work_pool.h
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def _build_tag() -> str:
    """A short hash of what -march=native sees and of every file in csrc/: a build made on another CPU
    or from other sources is never loaded (torch's own check looks at the .cpp only, not headers)."""
    key = platform.machine().encode() + cpu_flags_line().encode()
    for path in sorted(CSRC.iterdir()):
        key += path.name.encode() + path.read_bytes()
    return hashlib.sha1(key).hexdigest()[:12]


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary sits next to a venv's python, which
    is not on PATH when the venv was not activated."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    """The compiled module, or None when the build failed (logged once)."""
    try:
        _put_ninja_on_path()
        log.info("loading CPU kernels (built on first use, which takes a while once)")
        return load(name=f"iterserve_cpu_{_build_tag()}", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)], verbose=False)
    except Exception as exc:  # no compiler / ninja, or an unsupported platform: keep the torch path
        log.warning("CPU kernels unavailable, using the torch path instead: %s", str(exc).strip()[:500])
        return None
