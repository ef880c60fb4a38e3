"""Where a step's time goes: torch profiler over N engine steps of one kind, grouped into a few
buckets (GEMMs, attention, the rest). Three kinds:

- decode-only steps at a fixed batch size and context length (`--batch`, `--context`);
- prefill steps (`--prefill 1024`): one fresh prompt of that many tokens per step, alone;
- mixed steps (`--mixed 8:256 8:512`): D running decodes plus one prompt chunk of C tokens, the
  step a long prompt arriving under load makes (each step a fresh prompt, so the prefix cache
  never hits).

    python benchmarks/profile_step.py --batch 1 16 --context 16 512 --extra '{"dtype": "float32"}'
    python benchmarks/profile_step.py --batch --prefill 1024 --mixed 8:256 8:512

Buckets: `gemm` = aten::mm/addmm/linear kernels, oneDNN prepacked linears, the int4/int8
weight-only kernels and our Q4_1/Q8_0 kernels (inside iterserve::cpu_linear); `attention` = SDPA,
the block gather (index_select), the KV write (index_copy_) and our decode kernel (inside
iterserve::paged_attention); `sampling` = argmax/softmax/topk; `other` = every remaining op (norms, RoPE,
residual adds, casts, views: per-op overhead). Self CPU time, summed over the step's ops; the
wall time per step (without the profiler) is printed next to it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from decode_speed import drain, start_decode_batch  # noqa: E402  (sibling script)

from iterserve.llm import LLM  # noqa: E402
from iterserve.sampling import SamplingParams  # noqa: E402

BUCKETS = {
    # iterserve::cpu_linear's and ::paged_attention's self time is our C++ kernels (iterserve/csrc,
    # not seen by the profiler) plus the ops' Python wrappers
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "aten::_weight_int4pack_mm_for_cpu",
             "aten::_weight_int8pack_mm", "iterserve::cpu_linear"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::index_select", "aten::index_copy_",
                  "iterserve::paged_attention"),
    "sampling": ("aten::argmax", "aten::softmax", "aten::_softmax", "aten::topk", "aten::sort"),
}


def summarise(prof, steps: int) -> dict:
    """Self CPU ms per step by bucket, op count and the top ops, from a profile of `steps` steps."""
    ops = {e.key: (e.self_cpu_time_total / 1e3 / steps, e.count // steps) for e in prof.key_averages()}
    total = sum(ms for ms, _ in ops.values())
    buckets = {name: sum(ops[k][0] for k in keys if k in ops) for name, keys in BUCKETS.items()}
    buckets["other"] = total - sum(buckets.values())
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:8]
    return {"profiled_cpu_ms_per_step": total, "ops_per_step": sum(c for _, c in ops.values()),
            "buckets_ms": buckets, "top_ops": [(k, round(ms, 2), c) for k, (ms, c) in top]}


def profile_decode(llm: LLM, batch: int, context: int, steps: int) -> dict:
    eng = llm.engine
    start_decode_batch(llm, batch, context, 3 + 2 * steps)
    eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    return {"batch": batch, "context": context, "wall_ms_per_step": wall_ms} | summarise(prof, steps)


_fresh = itertools.count()


def add_prompt(llm: LLM, n: int) -> None:
    """A one-token greedy request whose n-token prompt no earlier one shares (no prefix-cache hit)."""
    base = 5000 + 97 * next(_fresh)
    llm.engine.add_request(params=SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                           prompt_token_ids=[(base + 13 * j) % 40000 + 100 for j in range(n)])


def time_prompt_step(llm: LLM, chunk: int, decodes: int) -> float:
    """Seconds of one step carrying a fresh `chunk`-token prompt beside the `decodes` running
    decodes; fails if the step did not hold the whole chunk. Shared by ab_prefill and ab_rms_norm."""
    eng = llm.engine
    add_prompt(llm, chunk)
    t0 = time.perf_counter()
    eng.step()
    dt = time.perf_counter() - t0
    assert eng.records[-1].prefill_tokens == chunk and eng.records[-1].decode_tokens == decodes, \
        "the step did not hold the whole chunk: raise max_num_batched_tokens"
    return dt


def profile_prompt_steps(llm: LLM, decodes: int, chunk: int, steps: int) -> dict:
    """Steps of `decodes` running decodes (context 64) plus one fresh `chunk`-token prompt each; the
    wall time is the best step of `steps` (a shared host's noise only adds), the profile the mean."""
    if decodes:
        start_decode_batch(llm, decodes, 64, 4 + 3 * steps)

    def one() -> float:
        return time_prompt_step(llm, chunk, decodes)

    one()
    wall_ms = min(one() for _ in range(steps)) * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            one()
    drain(llm)
    return {"decodes": decodes, "chunk": chunk, "wall_ms_per_step": wall_ms} | summarise(prof, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 16], help="decode batch sizes (none: skip decode)")
    ap.add_argument("--context", type=int, nargs="+", default=[16, 512], help="prompt tokens per sequence")
    ap.add_argument("--prefill", type=int, nargs="*", default=[], help="prompt lengths of prefill-only steps")
    ap.add_argument("--mixed", nargs="*", default=[], metavar="D:C",
                    help="steps of D decodes plus one C-token prompt chunk")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--extra", default="{}", help="JSON of EngineConfig fields (e.g. dtype, quantization)")
    args = ap.parse_args()
    kinds = [(0, n) for n in args.prefill] + [tuple(int(x) for x in m.split(":")) for m in args.mixed]
    extra = json.loads(args.extra)
    if kinds:  # a step must hold the largest chunk and its decodes whole
        extra.setdefault("max_num_batched_tokens", max(2048, max(d + c for d, c in kinds)))
    llm = LLM(args.model, kv_cache_memory="1GiB", **extra)
    profile_decode(llm, 1, 16, 3)  # warm-up
    rows = []
    for ctx in args.context:
        for b in args.batch:
            r = profile_decode(llm, b, ctx, args.steps)
            rows.append(r)
            bk = "  ".join(f"{k} {v:5.1f}" for k, v in r["buckets_ms"].items())
            print(f"batch {b:3d} context {ctx:4d}: {r['wall_ms_per_step']:6.1f} ms/step wall | profiled ms/step: "
                  f"{bk} | {r['ops_per_step']} ops/step", flush=True)
    for d, c in kinds:
        r = profile_prompt_steps(llm, d, c, args.steps)
        rows.append(r)
        bk = "  ".join(f"{k} {v:5.1f}" for k, v in r["buckets_ms"].items())
        print(f"{d:3d} decodes + {c:4d}-token chunk: {r['wall_ms_per_step']:6.1f} ms/step wall (best) | profiled "
              f"ms/step: {bk} | {r['ops_per_step']} ops/step", flush=True)
        print("   top ops:", r["top_ops"], flush=True)
    print(json.dumps({"config": json.loads(args.extra), "engine": llm.engine.resolved_config(), "rows": rows}))


if __name__ == "__main__":
    main()
