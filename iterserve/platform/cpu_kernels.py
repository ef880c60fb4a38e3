"""Builds and loads iterserve's C++ CPU kernels (`iterserve/csrc/`, one .cpp per kernel family;
iterserve/csrc/README.md says what each file holds and how long the build takes).

The build happens on first use, with gcc and ninja (a declared dependency), and is cached by torch
(TORCH_EXTENSIONS_DIR, by default under ~/.cache). Every .cpp is one of torch's ninja sources, so
ninja compiles one object per file and links them into one extension (one module to load); ninja
records each object's headers (gcc -MMD), so a change to one family's file, or to a header, rebuilds
only the objects that include it, then relinks.

For that the build folder must stay the same when the sources change: its name is a hash of what
decides the machine code other than the sources (the machine, the CPU's feature flags that
-march=native sees, the compile flags, torch's version and this checkout's csrc/ path), never of the
sources' contents. So a build made on another CPU, with other flags or from another checkout is
never loaded, while an edit to a kernel is rebuilt in place. How torch 2.13 behaves then
(torch/utils/cpp_extension.py, `_jit_compile`): its JIT_EXTENSION_VERSIONER hashes the .cpp files
only within one process, and a process's first load always runs ninja, which rebuilds whatever
changed since the last build and is a no-op otherwise, so the extension loaded is the one built from
the sources on disk (headers included, through ninja's own dependency records). Two processes
starting at once share the folder through torch's FileBaton (a lock file in it): one builds, the
other waits and then loads the same build. (A process that finds the baton taken does not run ninja
itself: sources edited *during* another process's build are built by the next process to start.)
A process killed mid-build leaves the baton's file behind, and torch then waits on it for ever; with
a folder that outlives edits that would block every later start, so a lock older than STALE_LOCK_S
(far longer than a build) is removed first.

It is compiled for the CPU it runs on (-march=native). `load_cpu_kernels(variant="avx2")` builds a
named variant (VARIANTS: -march=native with instruction sets turned off, e.g. the AVX2 + FMA paths an
AVX-512 host would otherwise never run) in a folder of its own, so that the branches a CI host of
another CPU generation takes are tested here too. The CPU platform loads the default build when the
engine starts, never at a first request: the native one, or the variant ITERSERVE_CPU_KERNELS_VARIANT
names (tests run a whole engine on the AVX2 build that way; every `load_cpu_kernels()` of the process
then returns it).

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
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch
from torch.utils.cpp_extension import _get_build_directory, load

from iterserve.cpu_info import cpu_flags, cpu_flags_line

log = logging.getLogger("iterserve.kernels")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# the compiled sources (one object each) and every file they are built from, headers included
KERNEL_SOURCES = sorted(CSRC.glob("*.cpp"))
KERNEL_FILES = sorted([*KERNEL_SOURCES, *CSRC.glob("*.h")])
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)  # a tuple: torch's load() appends its libraries to the list it is given, and a
# module-level list grown so would change build_tag, and so the folder, of the next variant loaded
# named builds: compile flags after CFLAGS. "avx2": what an AVX2-only CPU (Zen 3) builds, on a newer one:
# every AVX-512 subset, AMX and AVX-VNNI off, so lanes.h's AVX2 + FMA branches are the ones compiled
VARIANTS: dict[str, tuple[str, ...]] = {
    "native": (),
    "avx2": ("-mno-avx512f", "-mno-avx512bw", "-mno-avx512vl", "-mno-avx512dq", "-mno-avx512cd",
             "-mno-avx512vnni", "-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8",
             "-mno-avxvnni"),
    # an AMX host without AVX512-VBMI (none known; the AMX K-quant kernel folds Q4_K by vpermb where it
    # has it): the fold it falls back to, run on the tiles in tests on hosts that have VBMI
    "amx-no-vbmi": ("-mno-avx512vbmi",),
}
# the CPU flags (/proc/cpuinfo's names) a variant's build needs to run
VARIANT_NEEDS: dict[str, frozenset[str]] = {"native": frozenset(), "avx2": frozenset({"avx2", "fma", "f16c"}),
                                             "amx-no-vbmi": frozenset({"amx_int8", "amx_tile", "avx512bw"})}
VARIANT_ENV = "ITERSERVE_CPU_KERNELS_VARIANT"  # the build load_cpu_kernels() returns; default native
STALE_LOCK_S = 1800.0  # a build lock this old is a killed build's (a first build takes ~40 s to minutes)


def build_tag(cflags: Sequence[str]) -> str:
    """A short hash of what decides the build's machine code besides the sources: the machine and the
    CPU flags -march=native sees, the compile flags, torch's version, and which checkout's sources
    (a folder shared by two checkouts would load one's build for the other's process). Not the
    sources' contents: ninja rebuilds what changed in the same folder (see the module docstring)."""
    key = "\n".join([platform.machine(), cpu_flags_line(), " ".join(cflags), " ".join(LDFLAGS),
                     torch.__version__, str(CSRC)])
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def _clear_stale_lock(name: str) -> None:
    """Removes torch's build lock (FileBaton's file) when a killed build left it: torch would wait on it."""
    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale build lock (%.0f s old, a killed build's): %s", age, lock)
        lock.unlink(missing_ok=True)


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


def load_cpu_kernels(variant: str | None = None) -> ModuleType | None:
    """The compiled module, or None when the build failed (logged once). variant: one of VARIANTS,
    built with its flags after the default ones, in its own folder (the flags are in build_tag);
    None: ITERSERVE_CPU_KERNELS_VARIANT's, else native, so that an engine and every kernel call it
    makes use one build."""
    return _load_variant(variant or default_variant())


def default_variant() -> str:
    """The build `load_cpu_kernels()` returns: ITERSERVE_CPU_KERNELS_VARIANT (one of VARIANTS), else native."""
    name = os.environ.get(VARIANT_ENV, "") or "native"
    if name not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}={name!r}: use one of {', '.join(VARIANTS)}")
    return name


@functools.cache
def _load_variant(variant: str) -> ModuleType | None:
    """load_cpu_kernels, cached by the variant's name (load_cpu_kernels() and ("native") alike)."""
    missing = VARIANT_NEEDS[variant] - cpu_flags()
    if missing:  # its code would stop on an illegal instruction
        log.warning("CPU kernels: this CPU lacks %s for the %s build; using the torch path instead",
                    ", ".join(sorted(missing)), variant)
        return None
    cflags = [*CFLAGS, *VARIANTS[variant]]
    name = f"iterserve_cpu_{build_tag(cflags)}"
    try:
        _put_ninja_on_path()
        _clear_stale_lock(name)
        log.info("loading CPU kernels (built on first use, which takes a while once)")
        return load(name=name, sources=[str(p) for p in KERNEL_SOURCES],
                    extra_cflags=cflags, extra_ldflags=list(LDFLAGS), extra_include_paths=[str(CSRC)], verbose=False)
    except Exception as exc:  # no compiler / ninja, or an unsupported platform: keep the torch path
        log.warning("CPU kernels unavailable, using the torch path instead: %s", str(exc).strip()[:500])
        return None
