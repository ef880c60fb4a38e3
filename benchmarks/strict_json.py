"""Strict JSON objects by default, measured: the held-out object schemas of iterserve/testing.py
(STRICT_JSON_CASES, none stating additionalProperties) on the embedded model in float32, through
`iterserve serve` and the official openai client, once as served by default (strict: such an object
gets only its schema's keys) and once with --structured-outputs-allow-additional-properties (JSON
Schema's permissive default, the behaviour before strict became the default).

    .venv/bin/python benchmarks/strict_json.py [--model smollm2-135m] [--max-tokens 96] [--out runs/strict_json.json]

For each mode: how many answers are valid JSON that passes the schema, how many of those have only
the schema's keys, and how many ended by max_tokens (cut-off JSON). Greedy decoding, so a rerun on the
same machine gives the same texts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jsonschema  # noqa: E402
import openai  # noqa: E402

from iterserve.bench.launcher import ServerProcess  # noqa: E402
from iterserve.testing import STRICT_JSON_CASES, schema_keys_only  # noqa: E402


def run_cases(base_url: str, model: str, max_tokens: int) -> list[dict]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)

    def one(case: tuple[str, dict]) -> dict:
        prompt, schema = case
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        text, reason = out.choices[0].message.content, out.choices[0].finish_reason
        try:
            value = json.loads(text)
            jsonschema.validate(value, schema)
            valid = True
        except (ValueError, jsonschema.ValidationError):
            value, valid = None, False
        return {"prompt": prompt, "text": text, "finish_reason": reason, "valid": valid,
                "keys_only": valid and schema_keys_only(value, schema)}

    with ThreadPoolExecutor(len(STRICT_JSON_CASES)) as pool:
        return list(pool.map(one, STRICT_JSON_CASES))


def summary(results: list[dict]) -> dict:
    return {"cases": len(results), "valid": sum(r["valid"] for r in results),
            "only_schema_keys": sum(r["keys_only"] for r in results),
            "cut_by_max_tokens": sum(r["finish_reason"] == "length" for r in results)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=None, help="write the texts and the summary here (JSON)")
    args = ap.parse_args(argv)
    report = {}
    for mode, flags in (("strict (default)", []),
                        ("permissive (--structured-outputs-allow-additional-properties)",
                         ["--structured-outputs-allow-additional-properties"])):
        with ServerProcess([args.model, "--dtype", "float32", "--max-model-len", "1024", *flags]) as srv:
            results = run_cases(srv.base_url, args.model, args.max_tokens)
        report[mode] = {"summary": summary(results), "results": results}
        print(f"{mode}: {json.dumps(report[mode]['summary'])}")
        for r in results:
            print(f"  {r['finish_reason']:6} valid={r['valid']!s:5} keys_only={r['keys_only']!s:5} {r['text'][:100]!r}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
