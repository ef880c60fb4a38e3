"""lm-evaluation-harness against iterserve and against transformers, on the same loglikelihood task.

lm-evaluation-harness's `local-completions` model scores each choice of a multiple-choice question by
the loglikelihood of its tokens after the question, read from `/v1/completions` with `echo` and
`logprobs` (the prompt's own token logprobs). This runs a small multiple-choice task written here to a
local file (no download) once against `iterserve serve` (float32) and once against transformers
directly (lm-eval's `hf` model over the same GGUF file, float32), and compares the accuracies and
every choice's loglikelihood.

    pip install "lm_eval[api]"   # not a dependency of iterserve: a separate environment is fine
    .venv/bin/python benchmarks/lm_eval_loglikelihood.py [--model smollm2-135m] [--out runs/lm_eval.json]
    .venv/bin/python benchmarks/lm_eval_loglikelihood.py --kv-cache-dtype bfloat16 --kv-cache-dtype q8_0 \
        --kv-cache-dtype fp8_e4m3     # the 8-bit KV caches against the bf16 one, same task, bf16 model

Not a test: lm-evaluation-harness takes longer than the suite allows to import and set up.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from iterserve.bench.launcher import ServerProcess  # noqa: E402
from iterserve.model.loader import load_tokenizer, resolve_model  # noqa: E402

TASK = "iterserve_mc"
QUESTIONS = [
    ("The capital of France is", [" Paris", " London", " Berlin", " Madrid"], 0),
    ("The capital of Japan is", [" Seoul", " Tokyo", " Beijing", " Bangkok"], 1),
    ("Water freezes at a temperature of", [" 100 degrees", " 50 degrees", " 0 degrees", " 10 degrees"], 2),
    ("The largest planet in the solar system is", [" Mars", " Venus", " Earth", " Jupiter"], 3),
    ("A week has", [" seven days", " five days", " ten days", " three days"], 0),
    ("The opposite of hot is", [" warm", " cold", " big", " fast"], 1),
    ("Bees make", [" milk", " silk", " honey", " wool"], 2),
    ("The colour of the sky on a clear day is", [" green", " red", " yellow", " blue"], 3),
    ("Two plus two equals", [" four", " five", " three", " six"], 0),
    ("The author of Romeo and Juliet is", [" Charles Dickens", " William Shakespeare", " Mark Twain",
                                           " Jane Austen"], 1),
    ("The chemical symbol for water is", [" CO2", " O2", " H2O", " NaCl"], 2),
    ("A baby cat is called a", [" puppy", " calf", " foal", " kitten"], 3),
    ("The sun rises in the", [" east", " west", " north", " south"], 0),
    ("Ice is frozen", [" air", " water", " sand", " oil"], 1),
    ("The number of legs of a spider is", [" two", " four", " eight", " six"], 2),
    ("The first month of the year is", [" March", " December", " June", " January"], 3),
    ("Fish breathe with their", [" gills", " lungs", " fins", " scales"], 0),
    ("The currency of the United States is the", [" euro", " dollar", " yen", " pound"], 1),
    ("The Earth goes around the", [" Moon", " Mars", " Sun", " stars"], 2),
    ("A triangle has", [" four sides", " five sides", " six sides", " three sides"], 3),
    ("The tallest animal in the world is the", [" giraffe", " elephant", " horse", " mouse"], 0),
    ("Plants need sunlight to make", [" stones", " food", " metal", " plastic"], 1),
    ("The boiling point of water at sea level is", [" 0 degrees Celsius", " 50 degrees Celsius",
                                                    " 100 degrees Celsius", " 200 degrees Celsius"], 2),
    ("The language spoken in Brazil is", [" Spanish", " French", " English", " Portuguese"], 3),
    ("A doctor works in a", [" hospital", " bakery", " garage", " farm"], 0),
    ("The fastest land animal is the", [" turtle", " cheetah", " cow", " snail"], 1),
    ("Snow is", [" black", " green", " white", " red"], 2),
    ("The longest river in Africa is the", [" Amazon", " Thames", " Danube", " Nile"], 3),
    ("An apple a day keeps the", [" doctor away", " teacher away", " cat away", " rain away"], 0),
    ("The freezing point of water in Fahrenheit is", [" 0 degrees", " 32 degrees", " 100 degrees",
                                                       " 212 degrees"], 1),
]


def write_task(folder: Path) -> None:
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")


def evaluate(model: str, model_args: dict, task_dir: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                                  task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                                  batch_size=1)
    res = out["results"][TASK]
    lls = [[r[0][0] for r in s["resps"]] for s in sorted(out["samples"][TASK], key=lambda s: s["doc_id"])]
    return {"acc": res["acc,none"], "acc_norm": res["acc_norm,none"], "loglikelihoods": lls,
            "seconds": time.perf_counter() - t0}


def compare_kv_formats(args: argparse.Namespace, runs: dict[str, dict]) -> int:
    """Accuracy and loglikelihoods of each KV cache format against the first one's."""
    ref_name, ref = next(iter(runs.items()))
    report = {"task": TASK, "questions": len(QUESTIONS), "model": args.model, "dtype": "bfloat16", "runs": runs}
    for name, r in runs.items():
        diff = max(abs(a - b) for x, y in zip(r["loglikelihoods"], ref["loglikelihoods"]) for a, b in zip(x, y))
        report[f"max_abs_loglikelihood_diff_{name}_vs_{ref_name}"] = diff
        print(f"--kv-cache-dtype {name:9} acc {r['acc']:.4f}  acc_norm {r['acc_norm']:.4f}  ({r['seconds']:.1f} s)  "
              f"largest |loglikelihood difference| vs {ref_name}: {diff:.3e}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=None, help="write both runs' results here (JSON)")
    ap.add_argument("--kv-cache-dtype", action="append", metavar="DTYPE",
                    help="instead: iterserve in bf16 once per KV cache format given (repeatable; the first is the "
                         "reference, e.g. --kv-cache-dtype bfloat16 --kv-cache-dtype q8_0), compared with each other")
    args = ap.parse_args(argv)
    src = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_task(tmp)
        tokenizer = tmp / "tokenizer"
        load_tokenizer(src).save_pretrained(str(tokenizer))

        def served_run(*flags: str) -> dict:
            with ServerProcess([args.model, "--max-model-len", "1024", *flags]) as srv:
                return evaluate("local-completions", {
                    "model": args.model, "base_url": f"{srv.base_url}/v1/completions", "num_concurrent": 8,
                    "max_retries": 1, "tokenized_requests": True, "tokenizer_backend": "huggingface",
                    "tokenizer": str(tokenizer)}, tmp)

        if args.kv_cache_dtype:
            return compare_kv_formats(args, {kv: served_run("--dtype", "bfloat16", "--kv-cache-dtype", kv)
                                             for kv in args.kv_cache_dtype})
        served = served_run("--dtype", "float32")
        hf_args = ({"pretrained": str(src.folder), "gguf_file": src.path.name, "tokenizer": str(tokenizer)}
                   if src.kind == "gguf" else {"pretrained": str(src.path)})
        direct = evaluate("hf", {**hf_args, "dtype": "float32", "device": "cpu"}, tmp)
    diff = max(abs(a - b) for x, y in zip(served["loglikelihoods"], direct["loglikelihoods"]) for a, b in zip(x, y))
    report = {"task": TASK, "questions": len(QUESTIONS), "iterserve": served, "transformers": direct,
              "max_abs_loglikelihood_diff": diff}
    for name in ("iterserve", "transformers"):
        r = report[name]
        print(f"{name:12} acc {r['acc']:.4f}  acc_norm {r['acc_norm']:.4f}  ({r['seconds']:.1f} s)")
    print(f"largest |loglikelihood difference| over {sum(map(len, served['loglikelihoods']))} choices: {diff:.2e}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if served["acc"] == direct["acc"] and served["acc_norm"] == direct["acc_norm"] else 1


if __name__ == "__main__":
    sys.exit(main())
