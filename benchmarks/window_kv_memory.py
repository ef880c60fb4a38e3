"""Gemma 3's KV memory for a long chat: every layer's blocks kept (iterserve before KV cache groups)
against what the block pool holds now that windowed groups free their out-of-window blocks (vLLM's
hybrid KV cache manager, core/kv_groups.py), and against the least that must be held.

A random-weight Gemma 3 with the 270M model's attention shape (18 layers, 5 local : 1 global, window
512, 1 KV head of 256, so KV bytes per token are the real model's) and a small hidden size (block
counts do not depend on it) serves one chat of `--prompt-tokens` + `--output-tokens` through the
engine. Every step, the pool's blocks held by the chat are read (each block is one group's 3 layers);
"kept" is what keeping every layer's blocks for the whole sequence would hold, "needed" the global
layers' blocks plus, for each local layer, only the blocks holding a position the next query can
still see (the last `window` positions). Bytes per block per layer are the bf16 cache's.

    .venv/bin/python benchmarks/window_kv_memory.py [--prompt-tokens 4000] [--output-tokens 96]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("ITERSERVE_MEASURE_KERNELS", "0")

import torch  # noqa: E402

from iterserve.cpu_info import cpu_flags_line, cpu_model_name  # noqa: E402
from iterserve.llm import LLM  # noqa: E402
from iterserve.model.loader import load_tokenizer, resolve_model  # noqa: E402
from iterserve.sampling import SamplingParams  # noqa: E402

GEMMA3_270M_ATTENTION = dict(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                             sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768)


def build_model(folder: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gemma3_text", vocab_size=49152, hidden_size=64, intermediate_size=128,
                               **GEMMA3_270M_ATTENTION)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--output-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, help="write the summary as JSON here too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp))
        llm = LLM(model=tmp, dtype="float32", block_size=args.block_size, max_model_len=8192,
                  kv_cache_memory="2GiB")
        eng = llm.engine
        cfg, bs = eng.model_config, args.block_size
        windowed = [i for i in range(cfg.num_layers) if cfg.layer_window(i)]
        n_global, n_local, window = cfg.num_layers - len(windowed), len(windowed), cfg.sliding_window
        per_layer_block = 2 * bs * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16
        layers_per_block = eng.kv_groups.group_size
        peak = {"kept": 0, "freed": 0, "tokens": 0}

        def on_step(rec) -> None:
            for rid, table in eng.pool.tables.items():
                tokens = eng.requests[rid].num_computed_tokens if rid in eng.requests else 0
                held = len(table)  # table entries: blocks per layer when every layer keeps every block
                # a local layer's next query (position `tokens`) sees positions tokens - window + 1 ..
                first_visible = max(0, tokens - window + 1)
                local_blocks = held - first_visible // bs
                kept = held * cfg.num_layers
                freed = held * n_global + local_blocks * n_local
                now = len(eng.pool.held_blocks(rid)) * layers_per_block
                if kept > peak["kept"]:
                    peak.update(kept=kept, freed=freed, now=now, tokens=tokens, held=held, local_blocks=local_blocks,
                                pool_blocks=len(eng.pool.held_blocks(rid)))

        eng.step_listeners.append(on_step)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, 49152, (args.prompt_tokens,), generator=g).tolist()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True),
                     use_tqdm=False)
    mib = lambda layer_blocks: layer_blocks * per_layer_block / 2**20  # noqa: E731
    summary = {
        "model": "Gemma 3 270M attention shape (18 layers: 15 local with window 512, 3 global; 1 KV head x 256)",
        "tokens_in_cache": peak["tokens"], "block_size": bs, "blocks_held_per_layer": peak["held"],
        "local_layer_blocks_in_window": peak["local_blocks"],
        "kv_cache_groups": f"{len(eng.kv_groups.groups)} groups of {layers_per_block} layers",
        "pool_blocks_held": peak["pool_blocks"],
        "kv_mib_all_layers_kept": round(mib(peak["kept"]), 2), "kv_mib_held": round(mib(peak["now"]), 2),
        "kv_mib_needed": round(mib(peak["freed"]), 2),
        "ratio_kept_to_held": round(peak["kept"] / peak["now"], 2),
        "host": {"cpu": cpu_model_name(), "flags": cpu_flags_line()},
        "command": "benchmarks/window_kv_memory.py " + " ".join(sys.argv[1:]),
    }
    print(f"{summary['tokens_in_cache']} tokens in cache, {bs}-token blocks: {peak['held']} blocks per layer")
    print(f"  all layers kept : {summary['kv_mib_all_layers_kept']:7.2f} MiB (bf16; before KV cache groups)")
    print(f"  held now        : {summary['kv_mib_held']:7.2f} MiB ({peak['pool_blocks']} pool blocks of "
          f"{layers_per_block} layers, {summary['kv_cache_groups']})")
    print(f"  needed          : {summary['kv_mib_needed']:7.2f} MiB "
          f"({n_global} global layers x {peak['held']} blocks + {n_local} local x {peak['local_blocks']})")
    print(f"  ratio kept/held : {summary['ratio_kept_to_held']}x")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
