"""The simulator's MoE term against real runs of an MoE model, in one process (issue 45).

Profiles the model (`measure_profile`: the grid's steps, with the router's distinct experts counted),
then for each max-num-seqs runs a batch of requests through the real engine (offline, all arriving
at once, fixed output lengths) and simulates the same requests with the same engine flags. Prints,
per max-num-seqs: the engine's forward time (its steps' durations summed: what the step model
predicts) against the simulated one, and the step model's error on the real run's own steps, with
the MoE term and with a refit that lacks it (the same samples, moe_experts zeroed): what the term buys.
It also counts the real run's distinct experts per step (SparseMoeBlock.expert_counts) against the
profile's expectation for each step's tokens: the term's input, which a loaded host cannot blur.

    python benchmarks/random_moe.py runs/moe-small --preset small
    python benchmarks/sim_moe_check.py runs/moe-small --dtype float32 --seqs 1,4,16 --out runs/sim-moe
    # on a GPU, issue 45's shape (bf16): random_moe.py --preset granite-3b-a800m, then
    python benchmarks/sim_moe_check.py runs/granite-a800m --seqs 8,32,128 --requests 256 --out runs/sim-moe-gpu

Writes --out/profile.json and --out/check.json; numbers from a loaded machine are noise.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from iterserve.bench.workload import RequestSpec
from iterserve.config import EngineConfig
from iterserve.llm import LLM
from iterserve.model.moe import count_experts
from iterserve.sampling import SamplingParams
from iterserve.sim.measure import ProfileGrid, measure_profile
from iterserve.sim.profile import Profile
from iterserve.sim.simulator import simulate
from iterserve.sim.step_model import LinearStepModel, errors_by_kind, features_of, record_features


def without_moe_term(prof: Profile) -> Profile:
    """The same profile refitted as if the model were dense: no experts column, no routing."""
    samples = [{**s, "moe_experts": 0.0} for s in prof.samples]
    m = prof.step_model
    model = LinearStepModel.fit([features_of(s) for s in samples], [s["seconds"] for s in samples],
                                m.twin_max_tokens, m.head_max_seqs)
    return dataclasses.replace(prof, step_model=model, moe=None, samples=samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--seqs", default="1,4,16", help="max-num-seqs values to run and simulate")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="profile passes over the grid")
    ap.add_argument("--out", type=Path, default=Path("runs/sim-moe-check"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    base = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)
    grid = ProfileGrid(decode_batches=sorted({1, 2, 4, 8, 16, 32} | {int(s) for s in args.seqs.split(",")}))
    prof = measure_profile(base, grid, args.repeats, progress=False)
    prof.save(args.out / "profile.json")
    dense = without_moe_term(prof)
    print(prof.describe())
    print(f"fit: mean |error| {prof.fit['mean_abs_rel_err']:.1%}; " + (prof.moe.describe() if prof.moe else "dense"))

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1000, args.input_len).tolist() for _ in range(args.requests)]
    specs = [RequestSpec(i, 0.0, args.input_len, args.output_len) for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rows = []
    for seqs in (int(s) for s in args.seqs.split(",")):
        cfg = dataclasses.replace(base, max_num_seqs=seqs)
        llm = LLM(config=cfg)
        llm.generate(prompts[:2], params)  # warm
        llm.engine.records.clear()
        counters = count_experts(llm.engine.runner.model)
        counted: list[tuple[int, int, int]] = []  # (decode, prefill tokens, distinct experts over the layers)

        def grab(rec) -> None:
            counted.append((rec.decode_tokens, rec.prefill_tokens, sum(sum(c) for c in counters)))
            for c in counters:
                c.clear()

        llm.engine.step_listeners.append(grab)
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        steps = [dataclasses.asdict(r) for r in llm.engine.records]
        forward = sum(s["duration"] for s in steps)
        row = {"max_num_seqs": seqs, "real_wall_s": wall, "real_forward_s": forward, "real_steps": len(steps)}
        if prof.moe is not None and counted:
            real_e = sum(e for _, _, e in counted)
            expected_e = sum(prof.moe.step_experts(d, p) for d, p, _ in counted)
            row["experts"] = {"real": real_e, "expected": expected_e, "error": expected_e / real_e - 1}
            print(f"max-num-seqs {seqs}: distinct experts over the run's {len(counted)} steps: real {real_e}, "
                  f"expected {expected_e:.0f} ({expected_e / real_e - 1:+.1%})")
        for label, p in (("moe", prof), ("no_moe_term", dense)):
            run = simulate(specs, cfg, p)
            sim_forward = sum(float(s["duration"]) for s in run.timelines[0].steps)
            errs = errors_by_kind(p.step_model, ((record_features(s, p.moe), s["duration"]) for s in steps))
            row[label] = {"sim_forward_s": sim_forward, "sim_duration_s": run.result.summary()["duration_s"],
                          "forward_error": sim_forward / forward - 1, "step_errors": errs}
        rows.append(row)
        m, d = row["moe"], row["no_moe_term"]
        print(f"max-num-seqs {seqs}: real forward {forward:.2f} s ({len(steps)} steps, wall {wall:.2f} s); simulated "
              f"{m['sim_forward_s']:.2f} s ({m['forward_error']:+.1%}), without the MoE term "
              f"{d['sim_forward_s']:.2f} s ({d['forward_error']:+.1%}); decode steps' mean error "
              f"{m['step_errors'].get('decode', {}).get('mean', float('nan')):+.1%} vs "
              f"{d['step_errors'].get('decode', {}).get('mean', float('nan')):+.1%}")
        del llm
    (args.out / "check.json").write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
