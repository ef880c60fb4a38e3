"""How a server process's CPU divides between its main thread and the rest, from /proc (Linux).

iterserve's main thread runs the event loop (HTTP, validation, SSE chunks); the engine thread and
the kernels' work pool do the steps. vLLM moves its API server into a process of its own so that
the API side cannot slow the engine; issue 35 asked to measure that side at 32+ streams before
splitting ours. `peer_matrix.py` takes a snapshot around every iterserve cell."""
from __future__ import annotations

import os
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def snapshot(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each of the process's threads; {} off Linux or when it ended."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)": state is field 0
        except OSError:  # the thread ended between the listing and the read
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def split(before: dict[int, float], after: dict[int, float], pid: int, seconds: float) -> dict[str, Any]:
    """The process's CPU over a window: seconds, cores busy on average, and the main thread's share.
    Threads that started inside the window count from zero; ones that ended in it are not seen."""
    used = {tid: cpu - before.get(tid, 0.0) for tid, cpu in after.items()}
    total = sum(used.values())
    main = used.get(pid, 0.0)
    return {"cpu_s": round(total, 2), "cores": round(total / seconds, 2) if seconds > 0 else None,
            "main_thread_cpu_s": round(main, 2),
            "main_thread_share": round(main / total, 4) if total > 0 else None}
