"""Writes a random mixture-of-experts GGUF in K-quant blocks, laid out as a Q4_K_M file of that shape
would be, without llama.cpp (random_gguf.py's blocks, tokenizer and writer): for memory and speed
measurements of the experts computed from the file's blocks (platform/cpu_moe.py) at real sizes.

    python benchmarks/random_moe_gguf.py /tmp/granite-3b-a800m-q4_k_m.gguf --preset granite-3b-a800m
    python benchmarks/random_moe_gguf.py /tmp/olmoe-1b-7b-q4_k_m.gguf --preset olmoe-1b-7b
    python benchmarks/random_moe_gguf.py /tmp/qwen3-30b-a3b-q4_k_m.gguf --preset qwen3-30b-a3b   # 17.3 GiB

Qwen3-30B-A3B's preset has heads of 128 (q 4096 wide at hidden 2048: `attention.key_length`), a
per-head q/k RMSNorm of width 128, and `expert_weights_norm` true (norm_topk_prob; llama.cpp's
qwen3moe graph renormalises regardless). "qwen3-moe-tiny" is the same layout at 2 layers, 8 experts
and SmolLM2's 49152 tokens, for a test.

The mix is random_gguf.py's Q4_K_M-like one: Q4_K everywhere except attn_v and ffn_down_exps of every
other layer, and the output head (or a tied embedding, which is the head), in Q6_K; the router
(ffn_gate_inp) F32, as llama-quantize keeps it. Expert e's rows are rows e*F .. (e+1)*F of each
stacked [experts, rows, cols] tensor, as llama.cpp's converter stacks them.
"""
from __future__ import annotations

import sys
from pathlib import Path

from gguf import GGMLQuantizationType as QT
from random_gguf import decoder_header, finish, main

PRESETS = {  # the published configs' shapes
    "granite-3b-a800m": dict(arch="granitemoe", hidden=1536, layers=32, heads=24, kv_heads=8, experts=40, top_k=8,
                             expert_ffn=512, vocab=49155, tied=True, rope_theta=10000.0, eps=1e-6,
                             granite=dict(embedding_scale=12.0, residual_scale=0.22, attention_scale=0.015625,
                                          logit_scale=6.0)),
    "olmoe-1b-7b": dict(arch="olmoe", hidden=2048, layers=16, heads=16, kv_heads=16, experts=64, top_k=8,
                        expert_ffn=1024, vocab=50304, tied=False, rope_theta=10000.0, eps=1e-5, qk_norm=True),
    "qwen3-30b-a3b": dict(arch="qwen3moe", hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128,
                          top_k=8, expert_ffn=768, vocab=151936, tied=False, rope_theta=1e6, eps=1e-6,
                          qk_norm="head", norm_topk=True, context=40960),
}
PRESETS["qwen3-moe-tiny"] = {**PRESETS["qwen3-30b-a3b"], "layers": 2, "experts": 8, "vocab": 49152}


def tensors(p: dict) -> list[tuple[str, tuple[int, ...], QT | None]]:
    h, e, f = p["hidden"], p["experts"], p["expert_ffn"]
    d = p.get("head_dim", h // p["heads"])
    q, kv = p["heads"] * d, p["kv_heads"] * d
    out = [("token_embd.weight", (p["vocab"], h), QT.Q6_K if p["tied"] else QT.Q4_K)]
    for i in range(p["layers"]):
        big = QT.Q6_K if i % 2 == 0 else QT.Q4_K
        out += [(f"blk.{i}.attn_norm.weight", (h,), None), (f"blk.{i}.attn_q.weight", (q, h), QT.Q4_K),
                (f"blk.{i}.attn_k.weight", (kv, h), QT.Q4_K), (f"blk.{i}.attn_v.weight", (kv, h), big),
                (f"blk.{i}.attn_output.weight", (h, q), QT.Q4_K)]
        if p.get("qk_norm") == "head":  # Qwen3: one RMSNorm of a head's width, on every head's q and k
            out += [(f"blk.{i}.attn_q_norm.weight", (d,), None), (f"blk.{i}.attn_k_norm.weight", (d,), None)]
        elif p.get("qk_norm"):  # OLMoE: RMSNorm over all heads' q and k
            out += [(f"blk.{i}.attn_q_norm.weight", (q,), None), (f"blk.{i}.attn_k_norm.weight", (kv,), None)]
        out += [(f"blk.{i}.ffn_norm.weight", (h,), None), (f"blk.{i}.ffn_gate_inp.weight", (e, h), None),
                (f"blk.{i}.ffn_gate_exps.weight", (e, f, h), QT.Q4_K),
                (f"blk.{i}.ffn_up_exps.weight", (e, f, h), QT.Q4_K),
                (f"blk.{i}.ffn_down_exps.weight", (e, h, f), big)]
    out.append(("output_norm.weight", (h,), None))
    return out if p["tied"] else out + [("output.weight", (p["vocab"], h), QT.Q6_K)]


def write(path: Path, p: dict, seed: int = 0) -> None:
    w = decoder_header(path, p["arch"], p, p["expert_ffn"], p.get("context", 4096), p["rope_theta"], p["eps"])
    w.add_expert_feed_forward_length(p["expert_ffn"])
    w.add_expert_count(p["experts"])
    w.add_expert_used_count(p["top_k"])
    if "norm_topk" in p:
        w.add_expert_weights_norm(p["norm_topk"])
    if "granite" in p:
        g = p["granite"]
        w.add_embedding_scale(g["embedding_scale"])
        w.add_residual_scale(g["residual_scale"])
        w.add_attention_scale(g["attention_scale"])
        w.add_logit_scale(g["logit_scale"])
    finish(w, p, tensors(p), seed)


if __name__ == "__main__":
    sys.exit(main(__doc__, PRESETS, "granite-3b-a800m", write))
