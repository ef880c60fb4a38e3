"""Writes a random Llama-shaped GGUF in K-quant blocks, as a Q4_K_M file of that shape would be laid
out, without llama.cpp (no f16 file of twice the size first, no llama-quantize): for memory, load
time and speed measurements at sizes no test model has.

    python benchmarks/random_gguf.py /tmp/llama-8b-q4_k_m.gguf --preset 8b     # Llama-3.1-8B's shapes
    python benchmarks/random_gguf.py /tmp/llama-1b-q4_k_m.gguf --preset 1b

The mix is Q4_K_M's: Q4_K everywhere except attn_v and ffn_down of every other layer and the output
head, in Q6_K. Blocks are random bytes with sane float16 scales (0.01), so the numbers are noise but
every value is a valid level; only shapes and bytes matter for speed and memory. The tokenizer is
SmolLM2's (read from the embedded model) with its vocabulary padded by plain tokens ("pad123") to the
preset's size, so every id a random model emits decodes. One tensor at a time is made and written.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

PRESETS = {  # hidden, layers, heads, kv heads, ffn, vocab
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256),
}
SCALE_AT = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}  # byte offsets of a block's float16 scales


def random_blocks(rows: int, cols: int, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.array([0.01], dtype=np.float16).view(np.uint8)
    for at in SCALE_AT[qtype]:
        data[..., at:at + 2] = scale
    return data.reshape(rows, -1)


def tensors(p: dict) -> list[tuple[str, tuple[int, int] | tuple[int], QT | None]]:
    """(name, (rows, cols) or (n,), type: None for F32) in llama.cpp's order."""
    h, kv = p["hidden"], p["kv_heads"] * p["hidden"] // p["heads"]
    out = [("token_embd.weight", (p["vocab"], h), QT.Q4_K)]
    for i in range(p["layers"]):
        big = QT.Q6_K if i % 2 == 0 else QT.Q4_K
        out += [(f"blk.{i}.attn_norm.weight", (h,), None), (f"blk.{i}.attn_q.weight", (h, h), QT.Q4_K),
                (f"blk.{i}.attn_k.weight", (kv, h), QT.Q4_K), (f"blk.{i}.attn_v.weight", (kv, h), big),
                (f"blk.{i}.attn_output.weight", (h, h), QT.Q4_K), (f"blk.{i}.ffn_norm.weight", (h,), None),
                (f"blk.{i}.ffn_gate.weight", (p["ffn"], h), QT.Q4_K), (f"blk.{i}.ffn_up.weight", (p["ffn"], h), QT.Q4_K),
                (f"blk.{i}.ffn_down.weight", (h, p["ffn"]), big)]
    return out + [("output_norm.weight", (h,), None), ("output.weight", (p["vocab"], h), QT.Q6_K)]


def add_tokenizer(w: gguf.GGUFWriter, vocab: int) -> None:
    """SmolLM2's tokenizer (from the embedded model), padded with plain tokens to `vocab` entries."""
    from iterserve.model.loader import resolve_model

    src = gguf.GGUFReader(str(resolve_model("smollm2-135m").path))
    tok = {k: f.contents() for k, f in src.fields.items() if k.startswith("tokenizer.")}
    pad = vocab - len(tok["tokenizer.ggml.tokens"])
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(list(tok["tokenizer.ggml.tokens"]) + [f"pad{i}" for i in range(pad)])
    w.add_token_types(list(tok["tokenizer.ggml.token_type"]) + [gguf.TokenType.NORMAL] * pad)
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        getattr(w, f"add_{key.replace('unknown', 'unk').replace('padding', 'pad')}")(tok[f"tokenizer.ggml.{key}"])
    w.add_chat_template(tok["tokenizer.chat_template"])


def write_tensors(w: gguf.GGUFWriter, specs: list[tuple[str, tuple[int, ...], QT | None]], seed: int = 0) -> None:
    """Writes the header, metadata and tensors (name, shape: (n,), (rows, cols) or (experts, rows, cols),
    type: None for F32 ones), made one at a time, and closes the file."""
    for name, shape, qtype in specs:
        if qtype is None:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape)) // block * size
            w.add_tensor_info(name, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8), nbytes,
                              raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, qtype in specs:
        if qtype is None:  # norms ones; a MoE router random, so that tokens spread over the experts
            w.write_tensor_data(np.ones(shape, dtype=np.float32) if len(shape) == 1 else
                                rng.standard_normal(shape, dtype=np.float32))
        else:
            rows = int(np.prod(shape[:-1]))
            w.write_tensor_data(random_blocks(rows, shape[-1], qtype, rng).reshape(*shape[:-1], -1))
    w.close()


def decoder_header(path: Path, arch: str, p: dict, ffn: int, context: int, rope_theta: float,
                   eps: float) -> gguf.GGUFWriter:
    """A writer with the decoder's shape keys every preset here has (random_moe_gguf.py adds its
    experts' and Granite's keys before `finish`)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(p["layers"])
    w.add_context_length(context)
    w.add_embedding_length(p["hidden"])
    w.add_feed_forward_length(ffn)
    w.add_head_count(p["heads"])
    w.add_head_count_kv(p["kv_heads"])
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(eps)
    w.add_vocab_size(p["vocab"])
    if "head_dim" in p:  # a head width that is not hidden / heads (Qwen3's 128 at hidden 2048, 32 heads)
        w.add_key_length(p["head_dim"])
        w.add_value_length(p["head_dim"])
    w.add_rope_dimension_count(p.get("head_dim", p["hidden"] // p["heads"]))
    return w


def finish(w: gguf.GGUFWriter, p: dict, table: list, seed: int) -> None:
    """The file type, the padded tokenizer and the tensors, one at a time."""
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    add_tokenizer(w, p["vocab"])
    write_tensors(w, table, seed)


def write(path: Path, p: dict, seed: int = 0) -> None:
    w = decoder_header(path, "llama", p, p["ffn"], 8192, 500000.0, 1e-5)
    finish(w, p, tensors(p), seed)


def main(doc: str | None = None, presets: dict | None = None, default: str = "8b", write_fn=write) -> int:
    """The command line of this script and of random_moe_gguf.py: PATH --preset NAME."""
    presets = presets or PRESETS
    ap = argparse.ArgumentParser(description=doc or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path)
    ap.add_argument("--preset", choices=sorted(presets), default=default)
    args = ap.parse_args()
    write_fn(args.path, presets[args.preset])
    print(f"wrote {args.path} ({args.path.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
