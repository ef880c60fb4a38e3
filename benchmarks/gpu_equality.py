"""Greedy output of iterserve against transformers on one device, float32 or bfloat16.

    python benchmarks/gpu_equality.py --device cuda --dtype float32    # every token equal
    python benchmarks/gpu_equality.py --device cuda --dtype bfloat16   # top-1 agreement >= 0.9

iterserve generates greedily (chat prompts when the tokenizer has a template, else fixed token
ids); transformers, in float32 on the same device, then scores each prompt + generated sequence in
one forward pass ("teacher forcing"). At every generated position iterserve's token must be
transformers' argmax given the same prefix: in float32 all of them (which is the same as equal
greedy sequences), in bfloat16 a share of at least --min-agreement, and every miss a near tie
(within --max-gap of the top logit). Chosen-token log-probabilities are compared too (float32:
within 1e-3, as the CPU tests). Prints one JSON line; exits 1 when the check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from iterserve.llm import LLM  # noqa: E402
from iterserve.model.loader import resolve_model  # noqa: E402
from iterserve.sampling import SamplingParams  # noqa: E402
from iterserve.testing import CHATS  # noqa: E402



@dataclass
class Agreement:
    model: str
    device: str
    dtype: str
    tokens: int  # generated positions compared
    agree: int  # iterserve's token == transformers' argmax
    max_gap: float  # largest (top logit - logit of iterserve's token) over the misses
    max_logprob_diff: float
    ok: bool = False

    @property
    def rate(self) -> float:
        return self.agree / self.tokens


def load_reference(model: str, device: str):
    from transformers import AutoModelForCausalLM

    src = resolve_model(model)
    kw = {"gguf_file": src.path.name} if src.kind == "gguf" else {}
    return AutoModelForCausalLM.from_pretrained(str(src.folder), dtype=torch.float32, **kw).to(device).eval()


def make_prompts(llm: LLM, count: int) -> list[list[int]]:
    eng = llm.engine
    if getattr(eng.tokenizer, "chat_template", None):
        return [eng.encode_prompt(messages=m) for m in CHATS[:count]]
    vocab = eng.model_config.vocab_size
    return [[3 + (37 * i + 11 * j) % (vocab - 3) for j in range(8 + 13 * i)] for i in range(count)]


@torch.inference_mode()
def compare(model: str, device: str, dtype: str, new_tokens: int, num_prompts: int = len(CHATS)) -> Agreement:
    kv = {"gpu_memory_utilization": 0.3} if device.startswith("cuda") else {"kv_cache_memory": "256MiB"}
    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=16, **kv)
    prompts = make_prompts(llm, num_prompts)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    results = llm.generate(prompts, params, use_tqdm=False)
    del llm
    ref = load_reference(model, device)
    agree = total = 0
    max_gap = max_lp = 0.0
    for prompt, res in zip(prompts, results):
        ids = torch.tensor([prompt + res.token_ids], device=device)
        logits = ref(ids).logits[0, len(prompt) - 1:-1].float().cpu()  # predicts each generated token
        ours = torch.tensor(res.token_ids)
        chosen = logits[torch.arange(len(ours)), ours]
        hits = logits.argmax(-1) == ours
        agree += int(hits.sum())
        total += len(ours)
        if not hits.all():
            max_gap = max(max_gap, float((logits.max(-1).values - chosen)[~hits].max()))
        ref_lp = logits.log_softmax(-1)[torch.arange(len(ours)), ours]
        max_lp = max(max_lp, float((torch.tensor([lp[0] for lp in res.logprobs]) - ref_lp).abs().max()))
    return Agreement(model, device, dtype, total, agree, max_gap, max_lp)


def judge(a: Agreement, min_agreement: float, max_gap: float) -> Agreement:
    if a.dtype in ("float32", "fp32", "float"):
        a.ok = a.agree == a.tokens and a.max_logprob_diff < 1e-3
    else:
        a.ok = a.rate >= min_agreement and a.max_gap <= max_gap
    return a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--min-agreement", type=float, default=0.9, help="half precision: share of equal tokens")
    ap.add_argument("--max-gap", type=float, default=1.0, help="half precision: a miss's logit gap to the top")
    args = ap.parse_args()
    a = judge(compare(args.model, args.device, args.dtype, args.tokens), args.min_agreement, args.max_gap)
    print(f"{a.model} on {a.device} in {a.dtype}: {a.agree}/{a.tokens} tokens agree ({a.rate:.1%}), "
          f"largest miss gap {a.max_gap:.3f}, chosen-token logprob diff {a.max_logprob_diff:.2e}: "
          f"{'OK' if a.ok else 'FAIL'}", file=sys.stderr)
    print(json.dumps(asdict(a) | {"rate": a.rate}))
    sys.exit(0 if a.ok else 1)


if __name__ == "__main__":
    main()
