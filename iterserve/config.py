"""Configuration dataclasses: what the model is, and how the engine schedules and computes it.

Flag names follow vLLM's where the concept is the same (max_num_seqs, block_size, ...), so that a
user's existing knobs mean the same thing here. `EngineConfig` holds every switch that changes what
the engine computes or how; the few that an environment variable may also set (to switch a kernel
in a benchmark or a test without touching its flags) take their default from it, once, when the
config is made.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

DECODE_ATTENTION_CHOICES = ("auto", "torch", "cpu", "triton")  # attention/selector.py's backends
BF16_GEMM_CHOICES = ("auto", "tiled", "onednn", "float32", "bf16w")  # platform/cpu_linear.py's layouts
GGUF_ACTIVATIONS = ("auto", "int16", "int8", "int8-except-down")  # gguf_gemm's activation levels (EngineConfig)
ENV_DEFAULTS = {  # EngineConfig field -> the environment variable its default comes from
    "cpu_kernels": "ITERSERVE_CPU_KERNELS",
    "bf16_gemm": "ITERSERVE_BF16_GEMM",
    "decode_attention": "ITERSERVE_DECODE_ATTENTION",
    "measure_kernels": "ITERSERVE_MEASURE_KERNELS",
    "cpu_amx": "ITERSERVE_CPU_AMX",
    "gguf_activations": "ITERSERVE_GGUF_ACTIVATIONS",
}


def _env(name: str, default: str) -> str:
    return os.environ.get(ENV_DEFAULTS[name]) or default


@dataclass
class ModelConfig:
    """Architecture of a decoder of the model registry (model/registry.py), filled from config.json or
    GGUF metadata by the model's family."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False  # biases on q, k, v
    o_proj_bias: bool = False  # Llama's attention_bias also puts one on o_proj; Qwen2 does not
    # ---- what the families of the model registry (model/families/) vary; defaults are Llama's ----
    architecture: str = "llama"  # the registry's family name
    hidden_act: str = "silu"  # the gated MLP's activation: silu | gelu_pytorch_tanh (Gemma)
    norm_unit_offset: bool = False  # Gemma: RMSNorm scales by (1 + w), rounding once in float32
    # where the decoder layer's norms sit: "pre" (Llama: before attention and MLP), "sandwich" (Gemma 2/3:
    # before and after each), "post" (OLMo 2: after each block's output only, before the residual add)
    norm_placement: str = "pre"
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: "head" (per head: Qwen3, Gemma 3), "all" (OLMo 2)
    attention_scale: float | None = None  # softmax scale; None = head_dim ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden) (rounded to the model's dtype); Granite's own
    residual_multiplier: float = 1.0  # Granite: each block's output is scaled before the residual add
    logits_divisor: float = 1.0  # Granite's logits_scaling
    sliding_window: int | None = None  # keys a windowed layer sees, its own position included
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; () = all full
    local_rope_theta: float | None = None  # Gemma 3: sliding layers' RoPE base (default RoPE, no scaling)
    no_rope_layers: tuple[int, ...] = ()  # SmolLM3: layers whose q and k get no RoPE
    partial_rotary_factor: float = 1.0  # Phi-4-mini: RoPE on the first fraction of each head only
    # ---- mixture of experts (model/moe.py): the MLP of a layer is `num_experts` gated MLPs and a
    # router that sends each token to `num_experts_per_tok` of them; 0 experts: every MLP is dense ----
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's feed-forward width (intermediate_size stays the dense MLPs')
    # how the router turns its logits into the chosen experts' weights, as transformers computes each:
    # softmax over all experts in float32, then top-k (Mixtral, Qwen3-MoE, OLMoE), or top-k of the
    # float32 logits, then softmax over those k (GraniteMoE)
    router_topk_first: bool = False
    router_renormalize: bool = False  # the top-k probabilities divided by their sum (norm_topk_prob; Mixtral always)
    # Mixtral scales each expert's output by the float32 weights; the others round them to the model's dtype first
    router_weights_float32: bool = False
    dense_mlp_layers: tuple[int, ...] = ()  # Qwen3-MoE (decoder_sparse_step, mlp_only_layers): layers with a dense MLP

    def param_counts(self) -> tuple[int, int]:
        """(non-embedding parameters a token is multiplied by, all of those parameters) of the decoder:
        2 FLOPs each per token, for the simulator's analytic profile and the server's step timeout. An
        MoE layer counts the experts a token uses (num_experts_per_tok) and its router."""
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden_size
        dense = 3 * self.hidden_size * self.intermediate_size
        experts = (self.num_experts_per_tok * 3 * self.hidden_size * self.moe_intermediate_size
                   + self.num_experts * self.hidden_size)
        layers = sum(q + kv + o + (experts if self.is_moe_layer(i) else dense) for i in range(self.num_layers))
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return layers, layers + embed

    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer` (0: full causal attention)."""
        if not self.sliding_window:
            return 0
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return 0
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the experts' (model/moe.py) rather than the dense one."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    @property
    def has_windows(self) -> bool:
        return any(self.layer_window(i) for i in range(self.num_layers))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        num_heads = cfg["num_attention_heads"]
        # transformers >= 5 writes rope_parameters (theta inside); older checkpoints rope_theta + rope_scaling
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope or None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            attention_bias=cfg.get("attention_bias", False),
        )


_SIZE_RE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20,
          "G": 1e9, "GB": 1e9, "GIB": 2**30, "T": 1e12, "TB": 1e12, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """'2GiB' -> 2147483648; plain integers are bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    unit = (m.group(2) or "").upper() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: use e.g. 512MiB, 2GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[unit])


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


@dataclass
class SpeculativeConfig:
    """`--speculative-config`: vLLM's keys and meaning, parsed and checked once at start-up (the
    drafting itself: spec_decode/)."""

    method: str = "ngram"
    # the most draft tokens one row verifies in a step; each row's own count adapts below it
    num_speculative_tokens: int = 4
    # ngram (prompt lookup): the longest and shortest n-gram of the context's tail looked up in the
    # request's own tokens (prompt, output, prediction); the longest match wins
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    # draft_model: a registry model (path or name) with the target's vocabulary, run by the same
    # engine on its own KV pool of this many bytes
    model: str | None = None
    draft_kv_cache_memory: str = "256MiB"
    # no speculation in a step whose running requests number more than this: at high batch a
    # step's compute is better spent on other rows. None: never switch off
    disable_by_batch_size: int | None = 8
    # suffix (Arctic's suffix decoding, vLLM's keys): the index's depth, how many finished requests'
    # outputs it keeps, drafts of at most spec_factor x the matched length, and the least estimated
    # probability a drafted continuation may have
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; use one of {', '.join(SPECULATIVE_METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer from 1 to 16, got {k!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method draft_model needs `model` (a path or registry name)")
        if self.method != "draft_model" and self.model:
            raise ValueError(f"speculative_config: `model` is for method draft_model, not {self.method}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative_config: disable_by_batch_size must be >= 1 (or null: never)")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("speculative_config: suffix_decoding_max_tree_depth must be >= 1 and "
                             "suffix_decoding_max_cached_requests >= 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0 or self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("speculative_config: suffix_decoding_min_token_prob must be in [0, 1] and "
                             "suffix_decoding_max_spec_factor > 0")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the flag's JSON text, a dict (a --config file) or a config; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object, e.g. "
                             "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**value)


# A step's token budget when --max-num-batched-tokens is not given, by device. CPU: 512, llama.cpp's
# micro-batch. A CPU's GEMMs run at full speed by 512 rows, so a longer step prefills barely faster (a
# 1B Q4_K_M on the 2-core AMX Xeon: a 2048-token prompt, four of 560 and sixteen of 256 took 1-5 %
# longer at 512 than at 2048, benchmarks/step_budget.py), while it holds four times the activations
# (the 1B served's peak RSS 1,536-1,547 MiB against 1,579-1,658) and stalls every running stream for
# the whole chunk (2.2 s against 6.8 s there for a 2048-token prompt). CUDA: 2048, vLLM's default for
# its OpenAI server (docs/profile.md, "Memory of a served model").
DEFAULT_STEP_TOKENS = {"cpu": 512, "cuda": 2048}


def with_step_budget(config: "EngineConfig", device_type: str) -> "EngineConfig":
    """`config` with max_num_batched_tokens set: its own value, else the device's default. The one
    place the default is chosen; the engine and the simulator call it once they know the device."""
    if config.max_num_batched_tokens is not None:
        return config
    budget = DEFAULT_STEP_TOKENS.get(device_type, DEFAULT_STEP_TOKENS["cuda"])
    return replace(config, max_num_batched_tokens=budget)


@dataclass
class EngineConfig:
    """Everything the engine needs besides the weights. Defaults follow the chat bot case in docs/seed-case.md."""

    model: str = "smollm2-135m"
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with AVX512-BF16/AMX, else float32
    device: str = "auto"  # auto: cuda when available, else cpu
    # weight-only int4 twin of each projection for steps of <= 4 tokens (8 without our bf16 GEMM:
    # cpu_linear.four_bit_max_tokens), and a Q8_0 twin of the LM head
    # for <= 4 sampled rows (CPU, bf16): auto = when the checkpoint is 4-bit already (GGUF Q4_0/Q4_1,
    # whose embedding is Q8_0 or coarser), so it adds no new rounding of the weights. A CPU float32
    # run takes the projections' twin (our Q4_1 kernel) with int4 only, never under auto
    quantization: Literal["auto", "none", "int4"] = "auto"
    # CPU: how gguf_gemm quantises the activations its K-quant blocks (Q4_K, Q5_K, Q6_K) multiply in steps of
    # few rows: int16 (one scale a row: within ~1e-4 of float32), int8 (a scale per 256 inputs, llama.cpp's
    # Q8_K: ~1.3x faster a decode step on AVX2, llama.cpp's accuracy), or int8-except-down: int8 but for the
    # MLP's down projection, whose input (the gated activation) carries the outliers a scale per 256 loses
    # (most of int8's error on Gemma 3); docs/profile.md has all three measured. auto: int8-except-down
    # wherever the int8 kernel is built (AVX2 and AVX-512 hosts; measured: llama.cpp's prompt speed on Zen 3,
    # 1.12x int16's one-row decode on an AMX Xeon, top-1 0.979-0.988 against float32 on Gemma 3), int16
    # where the int8 choices do not apply (CpuPlatform.gguf_activations_for)
    gguf_activations: Literal["auto", "int16", "int8", "int8-except-down"] = field(
        default_factory=lambda: _env("gguf_activations", "auto"))
    # torch.compile the decoder stack (inductor): faster steps after a one-off compilation at startup
    compile: bool = False
    # kernels (defaults from the environment: ENV_DEFAULTS). cpu_kernels: load iterserve's C++ CPU
    # kernels (off: torch and oneDNN paths only); bf16_gemm: the CPU bf16 projections' GEMM (auto:
    # ours where AVX512-BF16 exists and the CPU has no AMX, else oneDNN's; a float32 run takes
    # float32 or bf16w, bf16 weights on our AVX2 GEMM, and auto there is measured); decode_attention: the
    # decode attention backend (auto: Triton on CUDA, the C++ kernel on CPU, else torch)
    cpu_kernels: bool = field(default_factory=lambda: _env("cpu_kernels", "1") != "0")
    bf16_gemm: Literal["auto", "tiled", "onednn", "float32", "bf16w"] = field(default_factory=lambda: _env("bf16_gemm", "auto"))
    decode_attention: Literal["auto", "torch", "cpu", "triton"] = field(
        default_factory=lambda: _env("decode_attention", "auto"))
    # CPU: what "auto" above means is timed once per machine and model shape (platform/kernel_choice.py,
    # cached under ~/.cache/iterserve/kernel_choice), including the 4-bit and Q8_0 twins' cut-overs;
    # off: chosen by the CPU's flags and fixed thresholds. remeasure_kernels: ignore the cached table
    measure_kernels: bool = field(default_factory=lambda: _env("measure_kernels", "1") != "0")
    remeasure_kernels: bool = False
    # CPU with AMX: our tiled bf16 GEMM may run steps of many rows on AMX tiles, from the same weights,
    # from a cut-over timed per shape (fixed when not measured), and gguf_gemm its K-quant shards' steps
    # of 16+ rows on AMX-INT8 tiles (int8 and int16 activations); off: the AVX-512 paths at every size
    cpu_amx: bool = field(default_factory=lambda: _env("cpu_amx", "1") != "0")
    # deterministic inference: a request's greedy text never depends on what shares its step. One
    # kernel and one reduction order per op at every batch size: our row-independent GEMM for every
    # projection (bf16 on AVX512-BF16, else float32: platform/cpu.py), no quantised twins of float
    # weights, every query (prefill ones too) through the per-sequence decode attention kernel, no
    # inductor (docs/benchmarks/batch-invariant.md has its cost)
    batch_invariant: bool = False
    # scheduling
    batching: Literal["continuous", "static"] = "continuous"
    max_num_seqs: int = 16  # docs/seed-case.md
    # per-step token budget (chunked prefill splits longer prompts); None: the device's default
    # (DEFAULT_STEP_TOKENS, resolved by with_step_budget when the engine knows its device)
    max_num_batched_tokens: int | None = None
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    max_batch_size: int = 8  # static batching only (docs/seed-case.md)
    batch_timeout_ms: float = 100.0  # static batching: start a partial batch after this wait
    # KV cache
    block_size: int = 16
    # prefix caching: None = on with continuous batching, off with static (contiguous, unshared KV)
    enable_prefix_caching: bool | None = None
    num_kv_blocks: int | None = None  # overrides the memory budget (tests of preemption)
    kv_cache_memory: str = "1GiB"  # CPU budget for KV blocks
    # the KV cache's format (vLLM's names): auto (the model's dtype; bfloat16 for a CPU run in float32
    # only for lack of fast bf16), bfloat16, float32, fp8 (= fp8_e4m3), fp8_e5m2, or q8_0 (llama.cpp's
    # int8 blocks): attention/kv_cache_dtype.py
    kv_cache_dtype: str = "auto"
    # start-up refuses, before loading, a model whose weights + KV cache + workspace exceed the memory
    # available (iterserve/memory.py); True: load anyway (an estimate can be wrong; swap, a lazy map)
    skip_memory_check: bool = False
    gpu_memory_utilization: float = 0.9
    # limits
    max_model_len: int | None = None  # default: min(model's max positions, 4096)
    max_input_len: int | None = None
    max_output_len: int | None = None
    # structured outputs: JSON schemas allow any whitespace between tokens (vLLM's default), or
    # exactly one space after ':' and ',' (ours: small models loop on whitespace otherwise)
    structured_outputs_any_whitespace: bool = False
    # structured outputs: an object schema that does not state additionalProperties allows no keys
    # besides its own (False, vLLM's xgrammar default and OpenAI's strict schemas), or any (True,
    # JSON Schema's own default: a small model then invents keys until max_tokens cuts the JSON off)
    structured_outputs_allow_additional_properties: bool = False
    # structured outputs: JSON-schema integers and numbers without bounds get digit-bounding ones
    # (True: structured/bounded_numbers.py; a small model otherwise writes digits until max_tokens)
    structured_outputs_bound_numbers: bool = True
    # embeddings (/v1/embeddings): how a prompt's final hidden states become one vector: last, mean
    # or cls (pooling.py); None = the model folder's own sentence-transformers pooling config, else last
    pooling: Literal["last", "mean", "cls"] | None = None
    max_waiting: int | None = None  # queue bound; None = unbounded
    # speculative decoding (SpeculativeConfig above; vLLM's --speculative-config JSON): None = off, except for
    # requests that bring OpenAI's `prediction`, which are looked up with the ngram defaults
    speculative_config: Any = None
    # LoRA adapters (lora/): many adapters on the one base model, their rows batched in every step.
    # lora_modules: name -> PEFT adapter folder, loaded (and checked) at start-up; max_loras: adapters
    # resident at once (the slots a step's rows can use); max_lora_rank: the largest rank accepted
    # (slots are sized for it); max_cpu_loras: adapters kept loaded in CPU memory, resident or not
    # (None: max(max_loras, the start-up adapters)); the rest are read again from their folder
    enable_lora: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # misc
    log_scheduler: bool = False
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default

    def __post_init__(self) -> None:
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.quantization not in ("auto", "none", "int4"):
            raise ValueError(f"quantization must be 'auto', 'none' or 'int4', got {self.quantization!r}")
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(f"gguf_activations must be one of {', '.join(GGUF_ACTIVATIONS)} (--gguf-activations, "
                             f"default from {ENV_DEFAULTS['gguf_activations']}), got {self.gguf_activations!r}")
        if self.gguf_activations not in ("auto", "int16") and self.batch_invariant:
            raise ValueError(f"gguf_activations={self.gguf_activations} is not batch-invariant: from 16 rows a step "
                             "(32 for Q6_K) its int8 kernel sums 8 weight rows at once, in another order than a few "
                             "rows' (the last bits of a row's logits follow the step's size); keep "
                             "--gguf-activations int16 with --batch-invariant")
        for name, choices in (("bf16_gemm", BF16_GEMM_CHOICES), ("decode_attention", DECODE_ATTENTION_CHOICES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} (--{name.replace('_', '-')}, default from "
                                 f"{ENV_DEFAULTS[name]}): use one of {', '.join(choices)}")
        if self.batch_invariant:
            clash = {"compile": self.compile, "quantization=int4": self.quantization == "int4",
                     f"bf16_gemm={self.bf16_gemm}": self.bf16_gemm not in ("auto", "tiled"),
                     f"decode_attention={self.decode_attention}": self.decode_attention not in ("auto", "cpu"),
                     "cpu_kernels off": not self.cpu_kernels}
            bad = [name for name, on in clash.items() if on]
            if bad:
                raise ValueError(f"batch_invariant (--batch-invariant) runs one fixed kernel per op (the C++ CPU "
                                 f"kernels' fixed-order GEMMs and decode attention, no twins, no inductor): drop "
                                 f"{', '.join(bad)}")
        if self.pooling not in (None, "last", "mean", "cls"):
            raise ValueError(f"pooling must be last, mean or cls (or unset: the model's own), got {self.pooling!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.block_size not in (1, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 1, 8, 16, 32, 64, 128, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        parse_size(self.kv_cache_memory)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and self.batching == "static":
            raise ValueError("speculative decoding plans a different number of tokens per row each step, which "
                             "static batching's fixed batches do not do: drop --speculative-config or use "
                             "--batching continuous")
        if self.speculative_config is not None and self.batch_invariant:
            raise ValueError("speculative decoding verifies drafts in multi-token rows, whose kernels differ from "
                             "a single-token step's: --batch-invariant cannot hold with --speculative-config")
        self._check_lora()
        if self.enable_prefix_caching and self.batching == "static":
            raise ValueError("prefix caching shares KV blocks between requests; static batching keeps "
                             "contiguous, unshared KV per sequence: drop --enable-prefix-caching or use "
                             "--batching continuous")

    def _check_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if not self.enable_lora:
            return
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                             "a resident adapter is also kept in CPU memory")
        clash = {"--batching static (its fixed batches would hold adapter slots for their whole run)":
                 self.batching == "static",
                 "--compile (the adapters' per-step row groups would recompile the graph)": self.compile,
                 "--batch-invariant (the adapters' grouped matmuls change with the step's rows)":
                 self.batch_invariant}
        bad = [name for name, on in clash.items() if on]
        if bad:
            raise ValueError(f"--enable-lora does not work with {'; '.join(bad)}")

    @property
    def max_seqs_per_step(self) -> int:
        """Sequences one step can hold: --max-num-seqs with continuous batching, --max-batch-size with static."""
        return self.max_num_seqs if self.batching == "continuous" else self.max_batch_size

    @property
    def prefix_caching(self) -> bool:
        """Whether the block pool shares cached prefixes (the resolved default)."""
        return self.batching == "continuous" and self.enable_prefix_caching is not False

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
