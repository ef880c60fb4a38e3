"""What a benchmark run leaves behind: a small summary for git, and its raw records under runs/.

A result that is committed is read next to the docs, so it holds what a reader needs to trust a
figure and rerun it: the table, the configuration, the host, the commit and the command, in a few
KB. The per-request and per-step records a run produces are large (a re-run would rewrite tens of
thousands of lines of diff) and go to a folder of their own under `runs/`, which git ignores; the
summary names that folder, and the tools can re-read it (e.g. `iterserve compare --replot`).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
from datetime import datetime, timezone
from pathlib import Path, PurePath
from typing import Any, Sequence

from iterserve.bench.common import load_average
from iterserve.cpu_info import cpu_flags

RAW_ROOT = Path("runs")
# The CPU flags that decide which kernels run (and so what a figure means on another host).
SPEED_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"})
_REPO = Path(__file__).resolve().parents[2]


def default_raw_dir(tool: str) -> Path:
    """runs/<tool>-<UTC date and time>: one folder per run, so that runs never overwrite each other."""
    return RAW_ROOT / f"{tool}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"


def git_commit() -> str | None:
    """HEAD of the checkout this package runs from, "+dirty" when tracked files differ; None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(_REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(_REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_info() -> dict[str, Any]:
    """The machine as a result needs it: CPU model, cores, the kernel-deciding flags, versions."""
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "isa": sorted(cpu_flags() & SPEED_FLAGS),
            "python": platform.python_version(), "torch": _version("torch"),
            "transformers": _version("transformers"), "platform": platform.platform()}


def run_info(command: Sequence[str] | None) -> dict[str, Any]:
    """Date (UTC), commit, host, command line (None when not run from one) and load average at the
    start of a run."""
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
            "host": host_info(), "command": None if command is None else shlex.join(command),
            "loadavg_at_start": load_average()}


def without_machine_paths(data: Any) -> Any:
    """`data` with this machine's home folder written `~` and the checkout's folder `.`: results go
    into git, and where a model or a peer lived on the machine that measured them is nobody's
    business (and true of no other machine)."""
    home, here = str(Path.home()), str(Path(__file__).resolve().parents[2])
    if isinstance(data, PurePath):
        data = str(data)
    if isinstance(data, str):
        return data.replace(here, ".").replace(home, "~")
    if isinstance(data, dict):
        return {without_machine_paths(k): without_machine_paths(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [without_machine_paths(v) for v in data]
    return data


def _depth(data: Any) -> int:
    """How deep containers nest in `data`: 0 for a scalar, 1 for a list or object of scalars."""
    values = data.values() if isinstance(data, dict) else data if isinstance(data, list) else None
    return 0 if values is None else 1 + max(map(_depth, values), default=0)


def _indented(data: Any, level: int = 0) -> str:
    """JSON indented one space a level, with each record of at most two levels (a table row, one
    system's metrics in a cell with its load averages) on one line: a summary in git reads and
    diffs a record per line, not a line per number."""
    pad = " " * level
    if _depth(data) <= 2:
        return json.dumps(data)
    if isinstance(data, dict):
        items = [f"{pad} {json.dumps(k)}: {_indented(v, level + 1)}" for k, v in data.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    return "[\n" + ",\n".join(f"{pad} {_indented(v, level + 1)}" for v in data) + "\n" + pad + "]"


def write_json(path: Path, data: Any, *, compact: bool = False) -> Path:
    """Writes `data` as JSON (indented for summaries that are diffed; compact for raw records),
    without machine paths."""
    data = without_machine_paths(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, separators=(",", ":")) if compact else _indented(data) + "\n"
    path.write_text(text)
    return path
