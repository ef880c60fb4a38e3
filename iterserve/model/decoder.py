"""The decoder-only causal LM every family of the model registry runs as: embedding, decoder layers
(model/layers.py), final norm, LM head, with the per-family options of its ModelConfig.

One class rather than one per family: the families differ in options (norm form and placement, q/k
norm, windows, soft-caps, multipliers, RoPE variants), not in structure, and the CPU platform's
speed paths (GEMM layouts and twins, the norm kernel, the kernel chooser) and `--compile` find the
same module names in every one of them. Parameter names follow Hugging Face's, except for the fused
`qkv_proj` and `gate_up_proj`, which `load_weights` fills from the separate q/k/v and gate/up
tensors (Phi-3 stores them fused already).
"""
from __future__ import annotations

import re
import types
from collections.abc import Collection, Iterable

import torch
from torch import nn

from iterserve.config import ModelConfig
from iterserve.model.layers import DecoderLayer, RMSNorm, Rope, RotaryEmbedding

# an expert's projection: "layers.3.mlp.experts.5.gate_proj.weight" (one expert: Hugging Face's
# per-expert tensors) or "layers.3.mlp.experts.gate_proj.weight" (all experts stacked: GGUF's)
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj)\.weight$")


class DecoderForCausalLM(nn.Module):
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
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # which RoPE table each layer reads: 0 the model's, 1 the sliding layers' own (Gemma 3), -1 none
        self.rope_of_layer = [-1 if i in cfg.no_rope_layers else 1 if cfg.local_rope_theta and cfg.layer_window(i)
                              else 0 for i in range(cfg.num_layers)]
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.rotary = nn.ModuleList()  # filled by build_tables, once the model is on its device
        self._compiled_stack = None  # set by compile_decoder()

    def build_tables(self, device: torch.device | str) -> None:
        """The RoPE tables and the embedding scale: computed, never loaded, so built on `device` once
        the model has left the meta device and taken its dtype (model/loader.py calls it)."""
        self.rotary = nn.ModuleList([RotaryEmbedding.for_config(self.cfg, self.max_positions)]
                                    + ([RotaryEmbedding.for_config(self.cfg, self.max_positions, local=True)]
                                       if 1 in self.rope_of_layer else [])).to(device)
        # float32, cast to the activations' dtype per step (as Gemma's scaled embedding does)
        self.register_buffer("embed_scale", torch.tensor(self.cfg.embedding_multiplier, device=device),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Returns float32 logits [len(logits_indices), vocab] for the flat tokens that get sampled.
        Call it inside the step's forward_context (ModelRunner does)."""
        x = (self._compiled_stack or self.decoder_stack)(input_ids, positions)
        return self.logits(self.norm(x[logits_indices]))

    def forward_with_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
                            hidden_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s logits, and the final-norm hidden states [len(hidden_indices), hidden] of the flat
        rows `hidden_indices` (what the LM head reads; embeddings pool them), from one pass."""
        x = (self._compiled_stack or self.decoder_stack)(input_ids, positions)
        hidden = self.norm(x[hidden_indices])
        if not len(logits_indices):  # a step of embedding requests only
            return torch.empty(0, self.cfg.vocab_size, device=x.device), hidden
        return self.logits(self.norm(x[logits_indices])), hidden

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-norm hidden states."""
        if h.shape[0] == 0:  # a step of prompt chunks that sample nothing: no head call
            return h.new_zeros(0, self.cfg.vocab_size, dtype=torch.float32)
        logits = self.lm_head(h).float()
        cfg = self.cfg
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_logit_softcap:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits

    def decoder_stack(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of every token of the step after the last layer. Tensors in,
        tensors out: the part `torch.compile` takes (attention state comes from forward_context)."""
        x = self.embed_tokens(input_ids)
        if self.cfg.embedding_multiplier != 1.0:
            x = x * self.embed_scale.to(x.dtype)
        ropes: list[Rope] = [r(positions, x.dtype) for r in self.rotary]
        for layer, which in zip(self.layers, self.rope_of_layer):
            x = layer(x, ropes[which] if which >= 0 else None)
        return x

    def compile_decoder(self) -> None:
        """Compiles `decoder_stack` with inductor, dynamic in the step's token count: norms, RoPE,
        activations, residual adds and casts fuse into a few kernels per layer; projections and
        attention stay opaque ops. Compilation happens at the first calls (see ModelRunner.warm_up)."""
        # No guards on the parameters (hundreds of id checks per call): they never change after
        # loading. No size asserts either: the graph would check every input's and opaque op
        # output's shape on each call; the ops' fake shapes are covered by tests/test_compile.py
        # instead. The fused kernels run on the calling thread (cpp.threads 1): each is a few
        # microseconds of work, and waking the OpenMP pool for it costs more than it saves
        # (docs/profile.md). The parameters go unguarded, and dynamo keeps its graphs on the
        # function's code object: a code object of its own per model, or a second model in this
        # process would run the first's graph (its layer count and constants baked in).
        if self.cfg.num_experts:
            # the experts a step runs are data read on the host (model/moe.py): a graph break in every
            # MoE layer, and the resumed graphs, their module guards skipped as below, would be
            # reused across layers (measured: wrong tokens from the second step on)
            raise ValueError("--compile does not run mixture-of-experts models (their experts are chosen per "
                             "step on the host); run them without --compile")
        f = type(self).decoder_stack
        own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
        self._compiled_stack = torch.compile(
            types.MethodType(own, self), dynamic=True,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "size_asserts": False,
                     "cpp.threads": 1})

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], skip: Collection[str] = ()) -> None:
        """Copies HF-named tensors (`model.` prefix optional) into the parameters, filling fused
        ones shard by shard. Each source tensor is dropped after its copy, so no second full copy
        stays in memory. Every parameter must be filled, and every tensor must have a place.
        `skip`: parameters that are not loaded here (a GGUF's weights kept as their blocks)."""
        params = {n: p for n, p in self.named_parameters() if n not in skip}
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
            expert = _EXPERT.search(name)
            if expert is not None:
                loaded.add(self._load_expert(params, name, tensor, expert))
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
        missing += [n for n, p in params.items() if n.endswith(("w13_weight", "w2_weight"))
                    and n not in missing and not _experts_filled(n, p.shape[0], loaded)]
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))

    @staticmethod
    def _load_expert(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, m: re.Match) -> str:
        """Copies one expert's projection, or every expert's stacked, into the stacked w13 (gate rows,
        then up rows) or w2 parameter; returns the loaded-key of the filled part."""
        prefix, expert, proj = m.group(1), m.group(2), m.group(3)
        target = f"{prefix}.{'w2_weight' if proj == 'down_proj' else 'w13_weight'}"
        if target not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in the model (a layer with a dense MLP?)")
        p = params[target]
        if expert is not None and int(expert) >= p.shape[0]:
            raise ValueError(f"{name}: expert {expert}, but the model has {p.shape[0]} experts")
        inter = p.shape[1] // 2
        rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter), "down_proj": slice(None)}[proj]
        dest = p[:, rows] if expert is None else p[int(expert), rows]
        if dest.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
        dest.copy_(tensor)
        return f"{target}#{'all' if expert is None else expert}.{proj}"


def _experts_filled(name: str, num_experts: int, loaded: set[str]) -> bool:
    """Whether every expert's part of a stacked expert parameter was loaded (w13: gate and up)."""
    if f"{name}#None" in loaded:  # the stacked parameter itself (GraniteMoE's input_linear / output_linear)
        return True
    projs = ("down_proj",) if name.endswith("w2_weight") else ("gate_proj", "up_proj")
    return all(f"{name}#all.{p}" in loaded or all(f"{name}#{e}.{p}" in loaded for e in range(num_experts))
               for p in projs)
