"""A tiny Qwen3 whose greedy output is known in advance: a scripted model for parser tests that run
the real engine and server.

Every attention and MLP block writes zero into the residual stream, so the final hidden state is
the current token's embedding (normalised): the next token depends on the current one only. Given
token chains a -> b -> c ..., each chain token gets an orthonormal embedding and the LM head row of
its successor that same direction, so a's logits are 80 for b and 0 for every other token. Every
other weight is random, the architecture and the loader are the real ones. A token may have one
successor, so a script must not repeat a token (the builder says so if it does). The tokenizer is
the embedded SmolLM2's plus `<think>` and `</think>` as added tokens (single tokens, as in Qwen3),
with a small Qwen3-style chat template: `enable_thinking=false` puts an empty think block in the prompt.
"""
from __future__ import annotations

import torch

THINK_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}")


def thinking_tokenizer():
    from iterserve.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("smollm2-135m"))
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINK_TEMPLATE
    return tok


def save_scripted_qwen3(folder, chains: list[list[int]], tokenizer, seed: int = 0) -> None:
    """chains: token id sequences; each token's greedy successor is the next in its chain."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    successor: dict[int, int] = {}
    for chain in chains:
        for a, b in zip(chain, chain[1:]):
            if successor.setdefault(a, b) != b:
                raise ValueError(f"token {a} ({tokenizer.decode([a])!r}) would need two successors")
    tokens = sorted(set(successor) | set(successor.values()))
    hidden = 64
    if len(tokens) > hidden:
        raise ValueError(f"{len(tokens)} scripted tokens: at most {hidden}")
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=tokenizer.eos_token_id)
    model = Qwen3ForCausalLM(cfg)
    basis = torch.linalg.qr(torch.randn(hidden, hidden))[0]  # orthonormal rows
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.25)
        for layer in model.model.layers:  # nothing is added to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        head.zero_()
        row = {t: basis[i] for i, t in enumerate(tokens)}
        for t in tokens:
            emb[t] = row[t]
        for a, b in successor.items():
            head[b] += 10.0 * row[a]  # the normalised hidden state has length 8: logit 80
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
