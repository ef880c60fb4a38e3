"""`iterserve tune --simulate`: the grid swept in the capacity simulator first, the best few replayed for real.

The simulator side of `tune` (bench/tune.py is the real sweep): the simulator consumes the measuring
tools' grid points, workloads and result records, never the other way round, so this lives here
and cli.py's cmd_tune dispatches --simulate to it.
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from typing import Sequence

from iterserve.bench import common
from iterserve.bench.client import Slo
from iterserve.bench.summary import write_json
from iterserve.bench.tune import (ConfigResult, GridPoint, TunePlan, best_config, kv_stats, markdown_table, ranked,
                                  run_config, slo_met)
from iterserve.bench.workload import RequestSpec
from iterserve.engine_args import add_engine_args, engine_config_from_args
from iterserve.sim.profile import Profile
from iterserve.config import SpeculativeConfig


def simulate_config(point: GridPoint, profile: Profile, server_args: Sequence[str], specs: Sequence[RequestSpec],
                    slos: Sequence[Slo], spec_acceptance: float | None = None,
                    spec_draft_fraction: float = 1.0) -> ConfigResult:
    """The config's replay in the capacity simulator (iterserve/sim): the engine's scheduler and
    block pool, the profile's step times; a ConfigResult like a real replay's. A point with
    num_speculative_tokens drafts that many per decode row, accepted with `spec_acceptance` per token
    (the rest of a --speculative-config in server_args, such as disable_by_batch_size, is kept)."""
    from iterserve.sim.simulator import simulate  # loads torch (through Request): only when asked for

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    overrides = {"max_num_seqs": point.max_num_seqs, "block_size": point.block_size}
    if point.max_num_batched_tokens is not None:
        overrides["max_num_batched_tokens"] = point.max_num_batched_tokens
    parsed = parser.parse_args(list(server_args))
    config = engine_config_from_args(parsed, **overrides)
    if point.num_speculative_tokens is not None:
        base = config.speculative_config
        spec = (None if not point.num_speculative_tokens else
                dataclasses.replace(base, num_speculative_tokens=point.num_speculative_tokens)
                if base is not None else SpeculativeConfig(**point.speculative_config()))
        try:  # built again so that EngineConfig's checks (no static batching) hold for the point
            config = engine_config_from_args(parsed, **overrides, speculative_config=spec)
        except ValueError as e:
            return ConfigResult(point, "failed", str(e))
    run = simulate(specs, config, profile, slos=slos, spec_acceptance=spec_acceptance,
                   spec_draft_fraction=spec_draft_fraction)
    return ConfigResult(point, "ok", "simulated", run.result.summary(), kv_stats(run.timelines[0].steps, point.block_size),
                        slo_met(run.result), run.stats["wall_s"])


def simulated_choice(simulated: Sequence[ConfigResult], verified: Sequence[ConfigResult]) -> tuple[ConfigResult | None, str]:
    """`tune --simulate`'s answer and where it comes from: the best of the real replays of the
    simulator's finalists (tune's rule on measurements), because the simulator's job is to cut the
    grid to a few candidates and a step-time model cannot see a difference smaller than the host's
    noise (configs it prices alike, such as block sizes at low KV use, tie); the simulated best
    only when nothing was verified or no replay completed."""
    best_real, _ = best_config(verified)
    if best_real is not None:
        return best_real, f"measured best of the {len(verified)} verified"
    best_sim, _ = best_config(simulated)
    return best_sim, "simulated best (nothing verified)" if not verified else "simulated best (no replay completed)"


def predicted_vs_measured(pairs: Sequence[tuple[ConfigResult, ConfigResult]]) -> str:
    """Each verified config: the simulator's prediction next to the real replay, and the error."""
    cols = (("req/s", lambda s: s["request_throughput"]), ("out tok/s", lambda s: s["output_throughput"]),
            ("e2e mean ms", lambda s: s["e2e_ms"]["mean"]), ("e2e p95 ms", lambda s: s["e2e_ms"]["p95"]),
            ("TTFT p50 ms", lambda s: s["ttft_ms"]["median"]))
    head = ["config"] + [f"{name} {kind}" for name, _ in cols for kind in ("sim", "real", "err")] + ["SLO sim/real"]
    rows = [head]
    for sim, real in pairs:
        cells = [sim.point.label()]
        for _, get in cols:
            p = get(sim.summary) if sim.summary else None
            m = get(real.summary) if real.status == "ok" else None
            err = f"{100 * (p - m) / m:+.0f}%" if p is not None and m else "-"
            cells += ["-" if p is None else f"{p:.1f}", "-" if m is None else f"{m:.1f}", err]
        cells.append(f"{'met' if sim.slo_met else 'missed'}/{('met' if real.slo_met else 'missed') if real.status == 'ok' else real.status}")
        rows.append(cells)
    return common.markdown_table(rows)


def cmd_tune_simulated(args: argparse.Namespace, plan: TunePlan) -> int:
    """The whole grid in the simulator, then the best few replayed for real, side by side."""
    points, specs, slos, out, raw_dir = plan.points, plan.specs, plan.slos, plan.out, plan.raw_dir
    info = {**plan.info, "workload": plan.workload}
    profile = Profile.load(args.simulate)
    server_args = shlex.split(args.server_args)
    t0 = time.perf_counter()
    acceptance = getattr(args, "spec_acceptance", None)
    simulated = [simulate_config(p, profile, server_args, specs, slos, acceptance,
                                 getattr(args, "spec_draft_fraction", 1.0)) for p in points]
    print(f"tune: simulated {len(points)} configs in {time.perf_counter() - t0:.1f} s ({profile.describe()})",
          file=sys.stderr)
    table = markdown_table(simulated)
    print(table)
    finalists = ranked(simulated)[:max(args.verify, 0)]
    pairs = []
    for sim in finalists:
        print(f"tune: verifying {sim.point.label()} by real replay", file=sys.stderr)
        real = run_config(sim.point, args.model, server_args, specs, slos, max(s.arrival_s for s in specs)
                          + args.run_grace, args.endpoint, args.ignore_eos, raw_dir / "logs")
        pairs.append((sim, real))
    comparison = predicted_vs_measured(pairs) if pairs else ""
    best_sim, met = best_config(simulated)
    measured = [real for _, real in pairs]
    chosen, source = simulated_choice(simulated, measured)
    lines = [f"simulated best: {best_sim.point.label()} ({'meets' if met else 'misses'} the SLOs)"
             if best_sim else "no simulated configuration completed"]
    if best_sim is not None and best_sim.point.num_speculative_tokens is not None:
        k = best_sim.point.num_speculative_tokens
        lines.append(f"speculative decoding: the simulator chose num_speculative_tokens={k}" + (
            " (off: drafting did not pay on this workload)" if not k else
            f" at acceptance {acceptance:g} per draft token") + "")
    if chosen is not None:
        lines.append(f"chosen: {chosen.point.label()} ({source}; "
                     f"{'meets' if chosen.slo_met else 'misses'} the SLOs"
                     f"{' as measured' if any(chosen is r for r in measured) else ', as simulated'})")
    if comparison:
        print("\npredicted (sim) vs measured (real):\n" + comparison)
    for line in lines:
        print(f"- {line}")
    head = {**info, "model": args.model, "slos": [s.text for s in slos], "profile": args.simulate,
            "profile_describes": profile.describe(), "conclusion": lines,
            "chosen": chosen.point.label() if chosen else None}
    for path, full in ((raw_dir / "tune.json", True), (out / "tune.json", False)):
        write_json(path, {**head, "simulated": [r.to_dict(with_requests=full) for r in simulated],
                          "verified": [r.to_dict(with_requests=full) for r in measured]})
    (out / "tune.md").write_text(table + "\n\n" + comparison + "\n\n" + "\n".join(f"- {x}" for x in lines) + "\n")
    print(f"wrote {out / 'tune.json'}, {out / 'tune.md'}; raw records in {raw_dir}", file=sys.stderr)
    return 0 if simulated else 1
