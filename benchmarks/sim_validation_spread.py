"""How far apart two real measurements of the same replay are: the noise floor of sim_validation.py.

Two runs of `benchmarks/sim_validation.py` (same workloads, seeds and flags) replay identical
requests against identical servers; what differs between their real columns is the host: another
tenant, the memory bandwidth the VM gets, a slow stretch. No simulator can be closer to a real run
than two real runs are to each other, so this prints, per point and target, real A, real B and their
spread (B - A) / A next to each run's simulation error, and counts the targets whose real-vs-real
spread is already above the target.

    .venv/bin/python benchmarks/sim_validation_spread.py runs/sim-validation runs/sim-validation2

Each argument is a run's --out folder (or its validation.json). Prints markdown. For the very same
requests, run B with `sim_validation.py --rates-of A/validation.json` (the loads are otherwise
fractions of each run's own simulated capacity); the multi-turn points are the same either way.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TARGETS = {"throughput": 0.05, "e2e_mean": 0.10, "e2e_p95": 0.10, "ttft_p50": 0.15}


def load(path: Path) -> dict:
    return json.loads((path / "validation.json" if path.is_dir() else path).read_text())


def rel(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not a else (b - a) / a


def spread_table(a: dict, b: dict) -> tuple[str, int, int, float]:
    """The markdown table; how many targets the real-vs-real spread exceeds, of how many compared;
    the largest spread."""
    key = lambda r: (r["workload"], r["load"], r["mode"])  # noqa: E731
    rows_b = {key(r): r for r in b["runs"] if not r.get("error")}
    head = ("| workload | load | mode | " + " | ".join(f"{k}: real A / real B / spread (target {t:.0%}); sim error A, B"
                                                      for k, t in TARGETS.items()) + " |")
    lines = [head, "|" + "---|" * (3 + len(TARGETS))]
    over = compared = 0
    worst = 0.0
    for ra in a["runs"]:
        rb = rows_b.get(key(ra))
        if ra.get("error") or rb is None:
            continue
        cells = []
        for k, t in TARGETS.items():
            (real_a, sim_a), (real_b, sim_b) = ra["errors"][k], rb["errors"][k]
            s = rel(real_a, real_b)
            if s is None:
                cells.append("-")
                continue
            compared += 1
            over += abs(s) > t
            worst = max(worst, abs(s))
            ea, eb = rel(real_a, sim_a), rel(real_b, sim_b)
            cells.append(f"{real_a:.3g} / {real_b:.3g} / {'**' if abs(s) > t else ''}{s:+.0%}{'**' if abs(s) > t else ''}; "
                         f"{'-' if ea is None else f'{ea:+.0%}'}, {'-' if eb is None else f'{eb:+.0%}'}")
        lines.append(f"| {ra['workload']} | {ra['load']} | {ra['mode']} | " + " | ".join(cells) + " |")
    return "\n".join(lines), over, compared, worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_a", type=Path, help="a sim_validation.py --out folder or its validation.json")
    p.add_argument("run_b", type=Path)
    args = p.parse_args(argv)
    a, b = load(args.run_a), load(args.run_b)
    text, over, compared, worst = spread_table(a, b)
    caps_a, caps_b = a.get("capacity") or {}, b.get("capacity") or {}
    if caps_a != caps_b:  # the loads are fractions of each run's own simulated capacity unless --rates-of
        print("note: the runs offered different loads (capacity req/s "
              + ", ".join(f"{k} {caps_a.get(k, '?')} vs {caps_b.get(k, '?')}" for k in sorted(set(caps_a) | set(caps_b)))
              + "; `sim_validation.py --rates-of A/validation.json` replays A's); multi-turn is sized by conversations\n")
    print(f"Real vs real: run A (commit {a.get('commit')}, {a.get('host', {}).get('cpu', '?')}) and run B "
          f"(commit {b.get('commit')})\n")
    print(text)
    print(f"\nthe two real runs differ by more than the target in {over} of {compared} targets "
          f"(largest spread {worst:.0%}); targets met by the simulation: A {a.get('targets_met')}, B {b.get('targets_met')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
