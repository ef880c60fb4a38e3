"""Every C++ kernel file compiles for each kind of x86-64 host we ship to, not only this one.

The kernels pick their instruction-set branch at compile time (-march=native: AVX-512 with VNNI,
BF16 and AMX, AVX2 + FMA, or plain C++), so a host runs one branch and a mistake in another (an
intrinsic outside its #if, a helper that only one branch declares) would only show on a host of that
kind. This compiles each iterserve/csrc/*.cpp with g++ for the branches a host may not build itself:
x86-64 (the scalar fallback) and sapphirerapids (AVX-512 with VNNI and BF16, and AMX). The AVX2 + FMA
branch is built and run on every host: natively on an AVX2 one, as the kernels' AVX2 variant on an
AVX-512 one (tests/conftest.py's kernel_variant); znver4's AVX-512 set is sapphirerapids' without AMX.
`-c -O0` rather than -fsyntax-only: an intrinsic used without its instruction set is an error only
when gcc generates the code. Parsing torch's headers is most of each compile, so the torch headers
every source includes first (through kernel_common.h and kernels.h) are precompiled once per target
and given with -include: the same declarations as the real build, ahead of the file's own lines. Slow
(under a minute on 2 cores per target, bindings.cpp's torch/extension.h the most of it).
"""
from __future__ import annotations

import os
import re
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


def _shared_torch_headers() -> list[str]:
    """The torch headers (<ATen/...>, <c10/...>) that kernel_common.h and kernels.h include, in order:
    what every source reads before its own code, so what one precompiled header can hold."""
    headers: list[str] = []
    for name in ("kernel_common.h", "kernels.h"):
        text = (CSRC / name).read_text()
        headers += [h for h in re.findall(r"^#include <((?:ATen|c10)/[^>]+)>", text, re.M) if h not in headers]
    return headers


def _precompile_torch_headers(gcc: list[str], folder: Path) -> Path:
    """torch_headers.h (the _shared_torch_headers) and its .gch beside it, built with the sources' own
    command line (gcc only uses a .gch made with the same target and macros; -Winvalid-pch says if not)."""
    header = folder / "torch_headers.h"
    header.write_text("".join(f"#include <{h}>\n" for h in _shared_torch_headers()))
    done = subprocess.run([*gcc, "-x", "c++-header", str(header), "-o", f"{header}.gch"],
                          capture_output=True, text=True)
    assert done.returncode == 0, f"the torch headers did not precompile:\n{done.stderr[-3000:]}"
    return header


def test_shared_torch_headers_are_found() -> None:
    """The precompiled header holds torch's tensor type: were kernel_common.h's torch includes spelt
    otherwise, it would be empty and the target check would still pass, only as slowly as before."""
    assert "ATen/core/Tensor.h" in _shared_torch_headers()


@pytest.mark.parametrize("target", TARGETS)
def test_csrc_compiles_for(target: str, tmp_path: Path) -> None:
    flags = [f for f in CFLAGS if not f.startswith(("-march", "-O"))]
    gcc = ["g++", "-std=c++20", "-O0", "-fPIC", *flags, f"-march={target}", *_include_flags(),
           "-DTORCH_EXTENSION_NAME=iterserve_target_check", "-Winvalid-pch"]
    header = _precompile_torch_headers(gcc, tmp_path)

    def compile_one(source: Path) -> str | None:
        cmd = [*gcc, "-include", str(header), "-c", str(source), "-o", str(tmp_path / f"{source.stem}.o")]
        done = subprocess.run(cmd, capture_output=True, text=True)
        return None if done.returncode == 0 else f"{source.name}:\n{done.stderr[-3000:]}"

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one g++ per core
        failures = [f for f in pool.map(compile_one, KERNEL_SOURCES) if f is not None]
    assert not failures, f"-march={target}: " + "\n".join(failures)
