"""Every C++ kernel file compiles for each kind of x86-64 host we ship to, not only this one.

The kernels pick their instruction-set branch at compile time (-march=native: AVX-512 with VNNI,
BF16 and AMX, AVX2 + FMA, or plain C++), so a host runs one branch and a mistake in another (an
intrinsic outside its #if, a helper that only one branch declares) would only show on a host of that
kind. This compiles each iterserve/csrc/*.cpp with g++ for the branches a host may not build itself:
x86-64 (the scalar fallback) and sapphirerapids (AVX-512 with VNNI and BF16, and AMX). The AVX2 + FMA
branch is built and run on every host: natively on an AVX2 one, as the kernels' AVX2 variant on an
AVX-512 one (tests/conftest.py's kernel_variant); znver4's AVX-512 set is sapphirerapids' without AMX.
`-c -O0` rather than -fsyntax-only: an intrinsic used without its instruction set is an error only
when gcc generates the code. Slow (a minute or two on 2 cores: torch's headers per file and target).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from iterserve.platform.cpu_kernels import CFLAGS, CSRC, KERNEL_SOURCES

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")]

TARGETS = ("x86-64", "sapphirerapids")


def _include_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths
    return [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"], str(CSRC)]]


def test_every_kernel_source_is_built() -> None:
    """The loader's sources are exactly csrc's .cpp files (a new family file is built, none twice)."""
    assert KERNEL_SOURCES == sorted(CSRC.glob("*.cpp")) and len(KERNEL_SOURCES) > 1


@pytest.mark.parametrize("target", TARGETS)
def test_csrc_compiles_for(target: str, tmp_path: Path) -> None:
    flags = [f for f in CFLAGS if not f.startswith(("-march", "-O"))]
    march, includes = [f"-march={target}"], _include_flags()

    def compile_one(source: Path) -> str | None:
        cmd = ["g++", "-std=c++20", "-O0", "-fPIC", *flags, *march, *includes,
               "-DTORCH_EXTENSION_NAME=iterserve_target_check", "-c", str(source),
               "-o", str(tmp_path / f"{source.stem}.o")]
        done = subprocess.run(cmd, capture_output=True, text=True)
        return None if done.returncode == 0 else f"{source.name}:\n{done.stderr[-3000:]}"

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one g++ per core
        failures = [f for f in pool.map(compile_one, KERNEL_SOURCES) if f is not None]
    assert not failures, f"-march={target}: " + "\n".join(failures)
