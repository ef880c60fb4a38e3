"""The layers every family of the model registry is built from: RMSNorm (Llama's and Gemma's
forms), rotary embeddings (default, linear, Llama 3, YaRN, Phi-3's long-rope, llama.cpp's frequency
factors; partial rotary), the gated MLP (SiLU or GELU-tanh; a mixture of experts' in model/moe.py),
attention with per-layer options (sliding window, q/k norm, logit soft-capping, the query scale) and
the decoder layer with its norm placements (pre, sandwich, post).

The tensor code is shaped for continuous batching: a flat batch of tokens [T, hidden] (prefill
chunks and decodes of many sequences, concatenated) with per-token positions; no batch dimension,
no padding. Attention goes through one op, `paged_attention`, which finds the step's metadata, KV
caches and backend in the forward context the runner sets (attention/forward_context.py). QKV and
gate/up projections are fused into one matmul each. Each family's numerics follow transformers'
implementation of it, rounding order included where a test can see it (tests/test_model_families.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.attention.paged_attention import paged_attention
from iterserve.config import ModelConfig
from iterserve.model.activations import activation
from iterserve.model.moe import SparseMoeBlock


class RMSNorm(nn.Module):
    """Llama's RMSNorm (normalise in float32, cast back, then scale), or with `unit_offset` Gemma's
    (scale by 1 + w in float32, then cast once). The CPU platform swaps in a one-kernel version of
    either in bf16 runs (platform/cpu_norm.py)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + a, norm(x + a)): a residual add and this norm after it (CpuRMSNorm: one kernel)."""
        x = x + a
        return x, self(x)


# ---- rotary embeddings ------------------------------------------------------------------------------
def rope_parameters(theta: float, dim: int, scaling: dict | None, max_positions: int | None = None
                    ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] float64, attention factor) for a RoPE of base `theta` over the
    first `dim` channels of a head, with the config's scaling: none, linear, llama3, yarn, longrope
    (Phi-3) or freq_factors (llama.cpp's per-frequency divisors, its form of llama3 scaling in GGUF).
    The attention factor multiplies cos and sin (YaRN's and long-rope's temperature). `max_positions`
    (the engine's longest sequence) picks long-rope's long factors when it passes the original
    context, once for the whole run, as llama.cpp does; transformers switches per call by the batch's
    length, which a paged cache that keeps earlier keys cannot. Always on the CPU, also inside a
    `torch.device("meta")` block: a computing op on meta tensors costs seconds of setup in torch."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim
    inv_freq = 1.0 / (theta ** exponents)
    sc = scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / sc["factor"], 1.0
    if kind == "freq_factors":
        return inv_freq / torch.tensor(sc["factors"], dtype=torch.float64, device="cpu"), 1.0
    if kind == "llama3":
        factor, low, high = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old_len = sc["original_max_position_embeddings"]
        low_wl, high_wl = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(is_mid, mid, scaled), 1.0
    if kind == "yarn":
        return _yarn(theta, dim, sc, inv_freq)
    if kind == "longrope":
        original = sc["original_max_position_embeddings"]
        factor = sc["factor"]  # families fill it in (max positions / original) where the config has none
        attention = sc.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        long = max_positions is not None and max_positions > original
        ext = torch.tensor(sc["long_factor" if long else "short_factor"], dtype=torch.float64, device="cpu")
        return inv_freq / ext, attention
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, yarn, longrope)")


def _yarn(theta: float, dim: int, sc: dict, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolate the low frequencies, keep the high ones, a linear ramp
    between the dimensions that turn beta_fast and beta_slow times over the original context."""
    factor = sc["factor"]
    original = sc["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = sc.get("attention_factor")
    if attention is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(sc.get("beta_fast") or 32), correction_dim(sc.get("beta_slow") or 1)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by the factor
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, float(attention)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, looked up by the per-token positions of a step. Built on
    the CPU in float64 and kept in float32 (see rope_parameters); move the module to the model's device."""

    def __init__(self, theta: float, dim: int, scaling: dict | None, max_positions: int) -> None:
        super().__init__()
        inv_freq, attention = rope_parameters(theta, dim, scaling, max_positions)
        t = torch.arange(max_positions, dtype=torch.float64, device="cpu")
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (emb.cos() * attention).float(), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention).float(), persistent=False)

    @classmethod
    def for_config(cls, cfg: ModelConfig, max_positions: int, local: bool = False) -> "RotaryEmbedding":
        """The model's RoPE, or (local) Gemma 3's sliding layers' own: another base, no scaling."""
        if local:
            return cls(cfg.local_rope_theta, cfg.rotary_dim, None, max_positions)
        return cls(cfg.rope_theta, cfg.rotary_dim, cfg.rope_scaling, max_positions)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; HF's rotate-half convention (GGUF weights are un-permuted to match) over the
    first cos.shape[-1] channels (all of them but with partial rotary)."""
    rd = cos.shape[-1]
    if rd != x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
    half = rd // 2
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat((-x2, x1), dim=-1)
    return x * cos.unsqueeze(1) + rot * sin.unsqueeze(1)


Rope = tuple[torch.Tensor, torch.Tensor] | None  # a layer's (cos, sin) for the step's tokens; None: no RoPE


# ---- attention, MLP, decoder layer -------------------------------------------------------------------
class Attention(nn.Module):
    """Fused QKV, optional q/k norm, RoPE, paged attention with this layer's window and soft-cap."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which of the step's KV caches this layer owns
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else self.head_dim ** -0.5
        self.window = cfg.layer_window(layer_idx)
        self.softcap = float(cfg.attn_logit_softcap or 0.0)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset)
        elif cfg.qk_norm == "all":
            self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        elif cfg.qk_norm is not None:
            raise ValueError(f"qk_norm {cfg.qk_norm!r}: use 'head', 'all' or None")

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        T, H, KVH, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(T, KVH, D)
        if self.qk_norm is None:
            qk = qkv[:, :qk_size].view(T, H + KVH, D)
            if rope is not None:
                qk = self.rope(qk, *rope)  # one RoPE call for both
            q, k = qk[:, :H], qk[:, H:]
        else:
            q, k = qkv[:, :self.q_size], qkv[:, self.q_size:qk_size]
            if self.qk_norm == "all":
                q, k = self.q_norm(q).view(T, H, D), self.k_norm(k).view(T, KVH, D)
            else:  # rows of one head each: 2-d, as the CPU norm kernel takes them
                q = self.q_norm(q.reshape(T * H, D)).view(T, H, D)
                k = self.k_norm(k.reshape(T * KVH, D)).view(T, KVH, D)
            if rope is not None:
                q, k = self.rope(q, *rope), self.rope(k, *rope)
        out = paged_attention(q, k, v, self.layer_idx, self.scale, self.window, self.softcap)
        return self.o_proj(out.reshape(T, self.q_size))

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """apply_rope; the CPU platform's CpuAttention runs it as one kernel (platform/cpu_elementwise.py)."""
        return apply_rope(x, cos, sin)


class MLP(nn.Module):
    """act(gate(x)) * up(x) -> down, gate and up in one matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hidden_act = cfg.hidden_act
        self.act = activation(cfg.hidden_act)
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up from [T, 2F]; the CPU platform's CpuMLP runs SiLU's as one kernel
        (platform/cpu_elementwise.py)."""
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.act(gate) * up


NORM_PLACEMENTS = {  # the layer's norms by Hugging Face's names, in each placement
    "pre": ("input_layernorm", "post_attention_layernorm"),  # the second is the MLP's pre-norm
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        if cfg.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"norm_placement {cfg.norm_placement!r}: use one of {', '.join(NORM_PLACEMENTS)}")
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = SparseMoeBlock(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg)
        self.placement = cfg.norm_placement
        for name in NORM_PLACEMENTS[cfg.norm_placement]:
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset))
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        m = self.residual_multiplier
        if self.placement == "pre":
            a = self.self_attn(self.input_layernorm(x), rope)
            x, h = self.post_attention_layernorm.add_and_norm(x, a if m == 1.0 else a * m)
            f = self.mlp(h)
        elif self.placement == "sandwich":
            a = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope))
            x, h = self.pre_feedforward_layernorm.add_and_norm(x, a if m == 1.0 else a * m)
            f = self.post_feedforward_layernorm(self.mlp(h))
        else:  # post
            a = self.post_attention_layernorm(self.self_attn(x, rope))
            x = x + (a if m == 1.0 else a * m)
            f = self.post_feedforward_layernorm(self.mlp(x))
        return x + (f if m == 1.0 else f * m)
