"""Writes a random-weight Llama as a Hugging Face folder (config.json, safetensors, tokenizer).

Speed measurements of a model shape need no trained weights, and a GPU box may have no model at
all (nothing is fetched from a hub): this makes one in seconds, on the GPU when there is one.

    python benchmarks/random_llama.py /tmp/llama-1b --preset 1b            # 1B-shaped, bf16
    python benchmarks/random_llama.py /tmp/llama-peaked --preset peaked    # small, for equality checks

The tokenizer is a word-level one with one token per id ("t0", "t1", ...), so every id a random
model emits decodes. Presets named "peaked" use large weights, as tests/conftest.py's tiny model
does, so that greedy choices are far from ties and can be compared token for token.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


@dataclass(frozen=True)
class Preset:
    config: dict
    std: float = 0.02  # linear layers
    embed_std: float = 0.02
    dtype: str = "bfloat16"
    extra: dict = field(default_factory=dict)


PRESETS = {
    # Llama-3.2-1B's layer shapes (its own vocabulary is 128256; 49152 keeps the head SmolLM2-sized)
    "1b": Preset(dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=49152, max_position_embeddings=8192,
                      rope_theta=500000.0)),
    # 7B-shaped layers, 8 of Llama-2-7B's 32 (a full 7B does not fit a 5-minute check's disk writes)
    "7b-8layers": Preset(dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=8,
                              num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                              max_position_embeddings=4096)),
    # small, GQA 8/2, large weights: greedy output is stable enough to compare implementations
    "peaked": Preset(dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096),
                     std=0.25, embed_std=1.0, dtype="float32"),
}


def word_level_tokenizer(vocab_size: int):
    """A fast tokenizer whose ids 0..vocab_size-1 are the words t0..tN (0 unk, 1 bos, 2 eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")


@torch.no_grad()
def write_random_llama(out: Path, preset: Preset, device: str = "cpu", seed: int = 0) -> Path:
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**preset.config, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      rms_norm_eps=1e-5, dtype=preset.dtype)
    with torch.device("meta"):  # names and shapes only: no 1B-parameter init on the CPU
        shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    dtype = getattr(torch, preset.dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if "norm" in name:
            tensors[name] = torch.ones(shape, dtype=dtype)
        else:
            std = preset.embed_std if "embed" in name else preset.std
            tensors[name] = (torch.randn(shape, generator=gen, device=device) * std).to(dtype).cpu()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    word_level_tokenizer(cfg.vocab_size).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the random numbers are drawn (default: cuda when present)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = write_random_llama(args.out, PRESETS[args.preset], args.device, args.seed)
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out}: preset {args.preset}, {size / 2**30:.2f} GiB of weights")


if __name__ == "__main__":
    main()
