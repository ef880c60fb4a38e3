"""A Llama-family decoder in plain PyTorch, shaped for continuous batching.

The forward pass takes a flat batch of tokens (prefill chunks and decodes of many sequences,
concatenated) with per-token positions; there is no batch dimension and no padding. Attention goes
through one op, `paged_attention`, which finds the step's metadata, KV caches and backend in the
forward context that the runner sets (attention/forward_context.py). QKV and gate/up projections
are fused into one matmul each.
Parameter names follow Hugging Face's, except for the fused `qkv_proj` and `gate_up_proj`, which
`load_weights` fills from the separate q/k/v and gate/up tensors.
"""
from __future__ import annotations

import math
import types
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.attention.paged_attention import paged_attention
from iterserve.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's order of operations: normalise in float32, cast back, then scale
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies with the config's theta and scaling (none, linear, llama3, and
    llama.cpp's per-frequency divisors `freq_factors`, its form of llama3 scaling in GGUF).
    Always computed on the CPU, also inside a `torch.device("meta")` block: a computing op on meta
    tensors costs seconds of one-time setup inside torch."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / sc["factor"]
    if kind == "freq_factors":
        return inv_freq / torch.tensor(sc["factors"], dtype=torch.float64, device="cpu")
    if kind == "llama3":
        factor, low, high = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old_len = sc["original_max_position_embeddings"]
        low_wl, high_wl = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, looked up by the per-token positions of a step.
    Built on the CPU in float32 (see rope_inv_freq); move the module to the model's device."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float64, device="cpu")
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; HF's rotate-half convention (GGUF weights are un-permuted to match)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat((-x2, x1), dim=-1)
    return x * cos.unsqueeze(1) + rot * sin.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which of the step's KV caches this layer owns
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        qk = apply_rope(qkv[:, :qk_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # one RoPE call for both
        v = qkv[:, qk_size:].view(T, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, self.layer_idx, self.scale)
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # HF tensor name fragment -> (fused parameter, shard index)
    packed = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        # an explicit (uninitialised) weight skips the random init: weights are always loaded, and a
        # normal_() on the meta device costs seconds of first-use setup inside torch
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings)
        self._compiled_stack = None  # set by compile_decoder()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Returns logits [len(logits_indices), vocab] for the flat tokens that get sampled. Call it
        inside the step's forward_context (ModelRunner does)."""
        x = (self._compiled_stack or self.decoder_stack)(input_ids, positions)
        return self.lm_head(self.norm(x[logits_indices])).float()

    def decoder_stack(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of every token of the step after the last layer. Tensors in,
        tensors out: the part `torch.compile` takes (attention state comes from forward_context)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x

    def compile_decoder(self) -> None:
        """Compiles `decoder_stack` with inductor, dynamic in the step's token count: norms, RoPE,
        SiLU, residual adds and casts fuse into a few kernels per layer; projections and attention
        stay opaque ops. Compilation happens at the first calls (see ModelRunner.warm_up)."""
        # No guards on the parameters (hundreds of id checks per call): they never change after
        # loading. No size asserts either: the graph would check every input's and opaque op
        # output's shape on each call; the ops' fake shapes are covered by tests/test_compile.py
        # instead. The fused kernels run on the calling thread (cpp.threads 1): each is a few
        # microseconds of work, and waking the OpenMP pool for it costs more than it saves
        # (docs/profile.md). The parameters go unguarded, and dynamo keeps its graphs on the
        # function's code object: a code object of its own per model, or a second model in this
        # process would run the first's graph (its layer count and constants baked in).
        f = type(self).decoder_stack
        own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
        self._compiled_stack = torch.compile(
            types.MethodType(own, self), dynamic=True,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "size_asserts": False,
                     "cpp.threads": 1})

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors into the parameters, filling fused ones shard by shard.
        Each source tensor is dropped after its copy, so no second full copy stays in memory."""
        params = dict(self.named_parameters())
        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        offsets = {"qkv_proj": [0, q, q + kv, q + 2 * kv],
                   "gate_up_proj": [0, cfg.intermediate_size, 2 * cfg.intermediate_size]}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            target, shard = name, None
            for frag, (fused, idx) in self.packed.items():
                if f".{frag}." in name:
                    target, shard = name.replace(frag, fused), idx
                    break
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            p = params[target]
            if shard is None:
                if p.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(p.shape)}")
                p.copy_(tensor)
            else:
                lo, hi = offsets[target.split(".")[-2]][shard:shard + 2]
                if tensor.shape[0] != hi - lo:
                    raise ValueError(f"{name}: checkpoint rows {tensor.shape[0]} != expected {hi - lo}")
                p[lo:hi].copy_(tensor)
            loaded.add(f"{target}#{shard}")
        missing = [n for n in params if not any(k.split("#")[0] == n for k in loaded)]
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))
