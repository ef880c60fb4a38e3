"""Helpers for the model tests: logits straight from iterserve's model through the runner's own
batch layout, and greedy references from transformers.

Logits are taken by building the step exactly as the engine does (a scheduler output with each
request's block table from a BlockPool; ModelRunner.prepare turns it into input ids, positions and
AttentionMetadata) and then asking the model for the rows we want, instead of only the sampled ones.
"""
from __future__ import annotations

import torch

from iterserve.attention.selector import select_attention_backend
from iterserve.config import EngineConfig
from iterserve.core.block_pool import BlockPool
from iterserve.core.scheduler import ScheduledRequest, SchedulerOutput
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.request import Request
from iterserve.runner import ModelRunner
from iterserve.sampling import SamplingParams


class PooledRunner:
    """A ModelRunner with the block pool that a scheduler would hold for it."""

    def __init__(self, runner: ModelRunner, pool: BlockPool) -> None:
        self.runner, self.pool = runner, pool


def new_runner(loaded, num_blocks: int = 64, block_size: int = 16) -> PooledRunner:
    """The CPU engine's runner (with the decode attention an EngineConfig picks) over its own pool."""
    model, cfg, _ = loaded
    dtype = next(model.parameters()).dtype
    device = torch.device("cpu")
    switches = EngineConfig()
    attention = select_attention_backend(switches.decode_attention, device,
                                         load_cpu_kernels() if switches.cpu_kernels else None)
    return PooledRunner(ModelRunner(model, cfg, num_blocks, block_size, device, dtype, attention),
                        BlockPool(num_blocks, block_size))


def make_request(rid: str, token_ids: list[int]) -> Request:
    return Request(rid, token_ids, SamplingParams(temperature=0, max_tokens=1))


@torch.inference_mode()
def run_step(pr: PooledRunner, items: list[tuple[Request, int]], all_rows: bool = False) -> torch.Tensor:
    """Computes `n` more tokens of each request in ONE step. Returns the logits of each request's
    last token this step ([len(items), vocab]), or of every token (all_rows)."""
    runner, scheduled = pr.runner, []
    for req, n in items:
        start = req.num_computed_tokens
        assert pr.pool.allocate(req.request_id, start + n), "test cache too small"
        scheduled.append(ScheduledRequest(req, n, start, pr.pool.tables[req.request_id], req.token_slice(start, n),
                                          sample=start + n == req.num_tokens))
    inp = runner.prepare(SchedulerOutput(scheduled))
    if all_rows:  # every token in the request's own order (prepare puts single-token rows first)
        rows = torch.cat([torch.arange(inp.last_index[i] - n + 1, inp.last_index[i] + 1)
                          for i, (_, n) in enumerate(items)])
    else:
        rows = torch.tensor(inp.last_index)
    logits = runner.compute_logits(inp, rows)
    for req, n in items:
        req.num_computed_tokens += n
    return logits


def sequence_logits(loaded, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, computed alone in one prefill: [len, vocab]."""
    runner = new_runner(loaded, num_blocks=len(token_ids) // 16 + 2)
    return run_step(runner, [(make_request("alone", token_ids), len(token_ids))], all_rows=True)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """transformers' own tokenising chat template (the engine goes through text + encode)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


@torch.inference_mode()
def hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int, pad_id: int):
    """transformers greedy generate for a left-padded batch, never stopping at EOS.
    Returns (new token ids per prompt, raw logits per prompt [max_new_tokens, vocab])."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=pad_id, output_logits=True,
                            return_dict_in_generate=True)
    new = out.sequences[:, width:]
    assert new.shape[1] == max_new_tokens
    logits = torch.stack(out.logits, dim=1).float()  # [B, steps, vocab]
    return new.tolist(), list(logits)


def hf_llama_from(loaded):
    """transformers' LlamaForCausalLM with the very weights of a Llama-family model iterserve loaded
    (its fused qkv / gate_up projections split back): transformers' forward pass on iterserve's
    dequantisation of a GGUF file, without transformers' own GGUF loader (half a minute for SmolLM2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model, cfg, _ = loaded
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                         rope_scaling=cfg.rope_scaling, max_position_embeddings=cfg.max_position_embeddings,
                         tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.attention_bias)
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    state = {}
    for name, p in model.named_parameters():
        p = p.detach().float()
        if name.endswith("qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            state |= {base + "q_proj.weight": p[:q], base + "k_proj.weight": p[q:q + kv],
                      base + "v_proj.weight": p[q + kv:]}
        elif name.endswith("gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            state |= {base + "gate_proj.weight": p[:inter], base + "up_proj.weight": p[inter:]}
        else:
            state[name] = p
    hf = LlamaForCausalLM(hf_cfg).eval()
    lm_head = state.pop("lm_head.weight", None)
    missing, unexpected = hf.model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    if lm_head is not None and not cfg.tie_word_embeddings:
        hf.lm_head.weight.data.copy_(lm_head)
    return hf
