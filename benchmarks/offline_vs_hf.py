"""Offline throughput: iterserve (continuous batching, paged KV) vs transformers `generate` in static
batches of 8, same model, same prompts, same machine, one run.

    python benchmarks/offline_vs_hf.py --num-requests 64 --seed 0 --threads 2

Workload: prompts of 50-500 tokens of real prose (iterserve.bench.workload.build_prompts), output
lengths uniform in 16-256, greedy, ignore_eos, all submitted at once. transformers runs batches of 8
in arrival order, left-padded, float32 (and/or bfloat16: --hf-dtype), max_new_tokens = the batch's longest output; only each
request's own tokens count as useful output (what a static batcher would return to its clients).
Prints output tokens/s of both and the ratio, and writes the numbers as a summary (--out: results,
workload totals, host, commit, command) and every request's lengths and output token ids under
--raw-dir (default: a new folder under runs/, ignored by git).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from iterserve.bench.common import load_average  # noqa: E402
from iterserve.bench.summary import default_raw_dir, run_info, write_json  # noqa: E402
from iterserve.bench.workload import RequestSpec, all_at_once, build_prompts  # noqa: E402
from iterserve.llm import LLM  # noqa: E402
from iterserve.model.loader import load_tokenizer, resolve_model  # noqa: E402
from iterserve.sampling import SamplingParams  # noqa: E402


def make_workload(n: int, seed: int, tokenizer) -> tuple[list[RequestSpec], list[list[int]]]:
    specs = build_prompts(all_at_once(n, seed=seed, input_len=(50, 500), output_len=(16, 256)), tokenizer)
    prompts = [tokenizer.encode(s.prompt, add_special_tokens=False) for s in specs]
    return specs, prompts


def run_iterserve(model: str, prompts: list[list[int]], out_lens: list[int], dtype: str = "auto",
                  engine_args: dict | None = None) -> dict:
    llm = LLM(model, dtype=dtype, **(engine_args or {}))
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in out_lens]
    first_step = llm.engine.step_count
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - t0
    recs = list(llm.engine.records)[-(llm.engine.step_count - first_step):]
    useful = sum(r.completion_tokens for r in results)
    return {"dtype": str(llm.engine.dtype).removeprefix("torch."), "engine": llm.engine.resolved_config(), "wall_s": wall, "output_tokens": useful,
            "output_tok_s": useful / wall, "steps": len(recs), "mean_batch": sum(r.batch_size for r in recs) / max(1, len(recs)),
            "token_ids": [r.token_ids for r in results]}


def run_transformers(source, prompts: list[list[int]], out_lens: list[int], tokenizer,
                     batch_size: int, dtype: str = "float32") -> dict:
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source.folder), gguf_file=source.path.name,
                                                 dtype=getattr(torch, dtype))
    model.eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every row runs to max_new_tokens
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def generate(batch: list[list[int]], max_new: int) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                 do_sample=False, pad_token_id=pad)
        return out[:, width:].tolist()

    generate([prompts[0][:16]], 4)  # warm-up
    t0 = time.perf_counter()
    token_ids: list[list[int]] = []
    computed = 0
    for start in tqdm(range(0, len(prompts), batch_size), desc="transformers", unit="batch"):
        batch, lens = prompts[start:start + batch_size], out_lens[start:start + batch_size]
        rows = generate(batch, max(lens))
        computed += len(rows) * max(lens)
        token_ids += [row[:n] for row, n in zip(rows, lens)]  # a client gets only its own tokens
    wall = time.perf_counter() - t0
    useful = sum(out_lens)
    return {"dtype": dtype, "wall_s": wall, "output_tokens": useful, "output_tok_s": useful / wall,
            "generated_tokens_incl_padding": computed, "token_ids": token_ids}


def agreement(a: list[list[int]], b: list[list[int]], k: int = 16) -> int:
    """Requests whose first k greedy tokens agree: a sanity check that both ran the same model."""
    return sum(x[:k] == y[:k] for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a GGUF file or the embedded smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="workload seed (lengths and prompt offsets)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both systems")
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--dtype", default="auto", help="iterserve's --dtype (auto: bfloat16 on CPUs with "
                    "native bf16, else float32)")
    ap.add_argument("--hf-dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                    help="transformers runs, one per dtype (float32 is what transformers uses by default)")
    ap.add_argument("--engine-args", default="{}", help="JSON of extra EngineConfig fields for iterserve")
    ap.add_argument("--out", default="results/offline_vs_hf.json", help="the summary (JSON)")
    ap.add_argument("--raw-dir", type=Path, help="every request's lengths and output token ids go to "
                    "offline_vs_hf.json here (default: a new folder under runs/)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    if source.kind != "gguf":
        raise SystemExit("this benchmark loads the model into transformers through gguf_file=: give a .gguf")
    tokenizer = load_tokenizer(source)
    specs, prompts = make_workload(args.num_requests, args.seed, tokenizer)
    out_lens = [s.output_len for s in specs]
    info = run_info(["python", "benchmarks/offline_vs_hf.py", *sys.argv[1:]])
    raw_dir = args.raw_dir or default_raw_dir("offline_vs_hf")
    print(f"{len(prompts)} requests: prompt tokens {sum(map(len, prompts))} "
          f"({min(map(len, prompts))}-{max(map(len, prompts))}), output tokens {sum(out_lens)} "
          f"({min(out_lens)}-{max(out_lens)}); torch threads {torch.get_num_threads()}; load {info['loadavg_at_start']}")

    it = run_iterserve(args.model, prompts, out_lens, args.dtype, json.loads(args.engine_args))
    print(f"iterserve ({it['dtype']}): {it['output_tok_s']:8.1f} output tok/s  ({it['output_tokens']} tokens in "
          f"{it['wall_s']:.1f} s, {it['steps']} steps, mean batch {it['mean_batch']:.1f})", flush=True)
    hf_runs = []
    for dtype in args.hf_dtype:
        hf = run_transformers(source, prompts, out_lens, tokenizer, args.hf_batch_size, dtype)
        hf["ratio"] = it["output_tok_s"] / hf["output_tok_s"]
        hf["first16_agree"] = agreement(it["token_ids"], hf["token_ids"])
        hf_runs.append(hf)
        print(f"transformers ({dtype}): {hf['output_tok_s']:8.1f} output tok/s  ({hf['output_tokens']} useful of "
              f"{hf['generated_tokens_incl_padding']} generated, {hf['wall_s']:.1f} s, batches of {args.hf_batch_size})")
        print(f"ratio iterserve/transformers-{dtype}: {hf['ratio']:.2f}x   (first 16 greedy tokens agree for "
              f"{hf['first16_agree']}/{len(prompts)} requests)", flush=True)

    prompt_lens = [len(p) for p in prompts]
    result = {
        **info, "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch_threads": torch.get_num_threads(), "loadavg_at_end": load_average(),
        "raw": str(raw_dir / "offline_vs_hf.json"),
        "workload": {"num_requests": len(prompts), "seed": args.seed,
                     "prompt_tokens": {"total": sum(prompt_lens), "min": min(prompt_lens), "max": max(prompt_lens)},
                     "output_tokens": {"total": sum(out_lens), "min": min(out_lens), "max": max(out_lens)}},
        "iterserve": {k: v for k, v in it.items() if k != "token_ids"},
        "transformers": [{k: v for k, v in hf.items() if k != "token_ids"} for hf in hf_runs],
    }
    raw = {"prompt_tokens": prompt_lens, "output_tokens": out_lens,
           "token_ids": {"iterserve": it["token_ids"], **{f"transformers-{hf['dtype']}": hf["token_ids"]
                                                          for hf in hf_runs}}}
    write_json(raw_dir / "offline_vs_hf.json", raw, compact=True)
    write_json(Path(args.out), result)
    print(f"wrote {args.out}; raw records in {raw_dir}")


if __name__ == "__main__":
    main()
