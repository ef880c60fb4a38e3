"""Writes a random-weight GraniteMoE as a Hugging Face folder (config.json, safetensors, tokenizer).

The simulator's MoE term (iterserve/sim/moe.py) is checked against real runs of an MoE model's shape;
that needs no trained weights, and a GPU box may have no model at all (nothing is fetched from a
hub). Random router weights route close to uniformly, which is the simulator's analytic assumption:
`iterserve profile` measures the router's own distinct-experts curve either way.

    python benchmarks/random_moe.py runs/granite-a800m --preset granite-3b-a800m   # issue 45's shape, bf16
    python benchmarks/random_moe.py runs/moe-small --preset small                  # CPU-sized, float32

The tokenizer is random_llama.py's word-level one (every id decodes).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from random_llama import Preset, word_level_tokenizer  # noqa: E402

PRESETS = {
    # ibm-granite/granite-3.0-3b-a800m's shape: 32 layers, 40 experts of width 512, top-8
    "granite-3b-a800m": Preset(dict(hidden_size=1536, intermediate_size=512, num_hidden_layers=32,
                                    num_attention_heads=24, num_key_value_heads=8, vocab_size=49155,
                                    num_local_experts=40, num_experts_per_tok=8, max_position_embeddings=4096)),
    # small enough to profile and serve on a couple of CPU cores, with enough experts that a decode
    # batch of 1-32 rows touches visibly different numbers of them
    "small": Preset(dict(hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=4096, num_local_experts=32, num_experts_per_tok=4,
                         max_position_embeddings=2048), dtype="float32"),
}


@torch.no_grad()
def write_random_moe(out: Path, preset: Preset, device: str = "cpu", seed: int = 0) -> Path:
    """Built by transformers and saved by its save_pretrained, so the tensors carry the checkpoint
    names transformers writes for GraniteMoE (its in-memory expert layout differs by version)."""
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    cfg = GraniteMoeConfig(**preset.config, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    dtype = getattr(torch, preset.dtype)
    with torch.device(device):
        model = GraniteMoeForCausalLM._from_config(cfg, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * (preset.embed_std if "embed" in name
                                                                          else preset.std))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    word_level_tokenizer(cfg.vocab_size).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="granite-3b-a800m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the random numbers are drawn (default: cuda when present)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = write_random_moe(args.out, PRESETS[args.preset], args.device, args.seed)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out}: preset {args.preset}, {size / 2**30:.2f} GiB of weights")


if __name__ == "__main__":
    main()
