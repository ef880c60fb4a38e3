"""The CPU platform: bf16 where the CPU has native bf16 instructions, iterserve's C++ kernels
(decode attention, bf16 / Q4_1 / Q8_0 GEMMs) where they build, weights re-laid out once at load,
and a KV cache sized by a memory budget.
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from iterserve.attention.backend import AttentionBackend
from iterserve.attention.cpu_backend import BatchInvariantCpuAttentionBackend
from iterserve.attention.selector import select_attention_backend
from iterserve.config import EngineConfig, ModelConfig
from iterserve.cpu_info import cpu_flags
from iterserve.model.loader import ModelSource, is_four_bit_checkpoint
from iterserve.platform.base import Platform, kv_blocks_for_budget, parse_dtype
from iterserve.platform.cpu_elementwise import use_cpu_elementwise
from iterserve.platform.cpu_kernels import load_cpu_kernels
from iterserve.platform.cpu_moe import EXPERT_TWIN_MAX_TOKENS, use_cpu_moe, use_invariant_moe, use_moe_blocks
from iterserve.platform.cpu_norm import use_cpu_rms_norm
from iterserve.platform.cpu_linear import (AMX_MIN_ROWS, EVERY_ROW, FLOAT32_LAYOUTS, GGUF_BLOCKS, INVARIANT_FLOAT32,
                                           KQUANTS,
                                           CpuLinear, bf16_gemm_layout, bf16_linears_available, chain_read_ahead,
                                           four_bit_max_tokens, gguf_int8_amx,
                                           gguf_twin_name, gguf_twins_of,
                                           int4_kernel_available, optimize_cpu_linears, tiled_gemm_amx,
                                           tiled_gemm_vectorised, use_amx_tiles, use_gguf_blocks,
                                           use_int8_activations)
from iterserve.platform.kernel_choice import (ChoiceRequest, KernelChoice, batch_buckets, bf16_exact_shapes,
                                              choose_kernels, down_only_shapes, kernel_choice_dir, linears_by_shape,
                                              parse_linear_key, shapes_of)
from iterserve.platform.stream_ahead import choose_stream_ahead
from iterserve.sampling import first_argmax

log = logging.getLogger("iterserve.platform")

Q8_HEAD_MAX_TOKENS = 4  # sampled rows, when not measured; the Q8_0 LM head lost to bf16 from 8 (docs/profile.md)


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """bfloat16 GEMMs beat float32 only with native bf16 instructions (AVX512-BF16 or AMX);
    without them torch emulates bf16 and is slower than float32."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def cpu_dtype(name: str) -> torch.dtype:
    return (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32) if name == "auto" else parse_dtype(name)


def _warn_bf16w_rounding(model: nn.Module) -> None:
    """bf16_gemm=bf16w forced on a float32 run: says when that rounds weights (it changes the outputs)."""
    # (a module whose only copy is its GGUF blocks computes from float32 panels: nothing rounded)
    shapes = [shape for shape, lins in linears_by_shape(model, torch.float32).items()
              if all(lin.weight.device.type != "meta" for lin in lins)]
    rounded = len(shapes) - len(bf16_exact_shapes(model))
    if rounded:
        log.warning("bf16_gemm=bf16w: %d of %d projection shapes have weights that are not bf16-exact and are "
                    "rounded to bf16, so this float32 run's outputs are not float32's (logprobs move by ~1e-2); "
                    "--bf16-gemm auto keeps float32 weights", rounded, len(shapes))


def batch_invariant_refusal(kernels: ModuleType | None, dtype: torch.dtype) -> str | None:
    """Why --batch-invariant cannot hold in this run, or None. It needs the C++ kernels (their decode
    attention for every query, and a GEMM whose sum for a row does not depend on the step's other
    rows): in bfloat16 the tiled bf16 GEMM, which needs AVX512-BF16 (elsewhere it is a scalar loop);
    in float32, what a CPU without fast bf16 runs (AVX2-only Zen 3), f32_gemm, on any build."""
    if kernels is None:
        return ("needs iterserve's C++ CPU kernels (their decode attention and fixed-order GEMMs), which are off "
                "or did not build (see the log)")
    if dtype == torch.bfloat16 and not tiled_gemm_vectorised(kernels):
        return ("in bfloat16 needs the C++ kernels' bf16 GEMM built with AVX512-BF16, which this CPU lacks: run "
                "float32 (--dtype auto gives it on such a CPU), whose projections run on f32_gemm")
    if dtype not in (torch.bfloat16, torch.float32):
        return f"runs bfloat16 or float32, not {str(dtype).removeprefix('torch.')}"
    return None


OMP_UNSET_WARNING = (
    "OMP_WAIT_POLICY is unset and torch was loaded before iterserve, so torch's OpenMP threads spin "
    "after each parallel torch op and take cores from iterserve's kernel threads (a 2-core host's "
    "16-row decode step ran 1.3x slower so); export OMP_WAIT_POLICY=PASSIVE, or import iterserve first")


@functools.cache
def warn_spinning_openmp() -> bool:
    """Warns once per process where OMP_WAIT_POLICY is unset: importing iterserve sets it when torch
    is not yet loaded (iterserve/__init__.py), so unset means torch loaded first, with libgomp's
    spinning default. True when it warned."""
    if os.environ.get("OMP_WAIT_POLICY"):
        return False
    log.warning(OMP_UNSET_WARNING)
    return True


def kernel_argmax(kernels: ModuleType) -> Callable[[torch.Tensor], torch.Tensor]:
    """first_argmax by the kernels (csrc/argmax.cpp: the same indices, 5-7x torch.max's speed over a
    16-row step's logits) for the float32 [T, V] rows the sampler passes; anything else by torch."""
    def argmax(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.dim() == 2 and x.shape[-1] > 0 and x.stride(-1) == 1:
            return kernels.first_argmax(x)
        return first_argmax(x)
    return argmax


class CpuPlatform(Platform):
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 kv_bf16_for_float32: bool = False) -> None:
        self.kernels: ModuleType | None = load_cpu_kernels() if config.cpu_kernels else None
        warn_spinning_openmp()
        if not config.cpu_kernels:
            log.info("CPU kernels off (cpu_kernels=False): torch and oneDNN paths only")
        if config.batch_invariant:
            refusal = batch_invariant_refusal(self.kernels, dtype)
            if refusal:
                raise ValueError(f"batch_invariant (--batch-invariant) on CPU {refusal}")
            attention: AttentionBackend = BatchInvariantCpuAttentionBackend(self.kernels)
        else:
            attention = select_attention_backend(config.decode_attention, device, self.kernels)
        super().__init__(config, device, dtype, attention,
                         lora_sgmv=self.kernels.lora_sgmv if self.kernels is not None else None,
                         kv_bf16_for_float32=kv_bf16_for_float32,
                         argmax=kernel_argmax(self.kernels) if self.kernels is not None else first_argmax)
        self.layout = bf16_gemm_layout(config.bf16_gemm, self.kernels)  # validates the choice too
        if dtype == torch.float32:  # what a float32 run's projections get unless measured
            if config.bf16_gemm not in ("auto", *FLOAT32_LAYOUTS):
                raise ValueError(f"bf16_gemm={config.bf16_gemm} is a bf16 layout; a float32 run takes auto, "
                                 f"{' or '.join(FLOAT32_LAYOUTS)}")
            self.layout = "float32" if config.bf16_gemm == "auto" else config.bf16_gemm
        if config.batch_invariant:  # one GEMM at every step size (prepare_model)
            self.layout = "tiled" if dtype == torch.bfloat16 else INVARIANT_FLOAT32
        self.int4_max_tokens = 0  # set by prepare_model when the projections get a 4-bit (or GGUF) twin
        self.q8_head_max_tokens = 0  # ... and the LM head a Q8_0 (or GGUF) twin
        self.gguf_twins: dict[str, str] = {}  # module -> its GGUF twin's spec, when built from the file's blocks
        self.gguf_activations = config.gguf_activations  # auto resolved by prepare_model (gguf_activations_for)
        self.kernel_choice: KernelChoice | None = None  # the measured table, when measured
        self.stream_ahead = 0  # the GGUF GEMMs' prefetch distance set for the first model prepared (0: none)
        # our tiled GEMM's AMX path (never under batch_invariant: its rows would round by step size)
        self.amx = config.cpu_amx and not config.batch_invariant and tiled_gemm_amx(self.kernels)
        # gguf_gemm's int8 K-quant shards of 16+ rows on AMX-INT8 tiles (int8 is refused under batch_invariant)
        self.int8_amx = config.cpu_amx and gguf_int8_amx(self.kernels)
        # ... and its int16 ones (use_amx_tiles), not under batch_invariant (a row's sums would round by
        # its step's size); how many modules run so (prepare_model)
        self.int16_amx = self.int8_amx and not config.batch_invariant
        self.int16_amx_modules = 0

    def gguf_block_types(self) -> frozenset[str]:
        """Every block type gguf_gemm and gguf_dequant read, where the C++ kernels built and
        quantization is auto: a GGUF's quantised weights are then kept only as their blocks.
        quantization=none keeps a float copy of them instead (and no twin), as before."""
        if self.kernels is None or self.config.quantization != "auto":
            return frozenset()
        return frozenset(GGUF_BLOCKS)

    def gguf_activations_for(self, model: nn.Module) -> str:
        """gguf_activations, auto resolved: int8-except-down where it applies (the int8 kernel built,
        K-quant blocks that steps of few rows read on gguf_gemm: not under batch_invariant nor in a float32
        run asked for by name), else int16. On Zen 3 it processes prompts 1.1-1.4x as fast as int16 and
        at 16 streams gives 1.26-1.61x llama.cpp's output (two sittings); on a 2-core AMX Xeon, with the
        pool's read-ahead, it decodes a 1B at one row 1.05-1.12x as fast as int16 (level at 16 rows), and
        Gemma 3's top-1 against float32 is 0.979-0.988 (int16 0.988, llama.cpp 0.971; docs/profile.md).
        A 16-core AMX Xeon, before the read-ahead, had it 6-10 % behind int16 at 16 rows."""
        cfg = self.config
        if cfg.gguf_activations != "auto":
            return cfg.gguf_activations
        has_kquants = any(str(shard.qtype) in KQUANTS
                          for shards in (getattr(model, "gguf_sources", None) or {}).values() for shard in shards)
        applies = (has_kquants and self.kernels is not None and self.kernels.gguf_gemm_int8_supported()
                   and not cfg.batch_invariant and not (self.dtype == torch.float32 and cfg.dtype == "float32"))
        return "int8-except-down" if applies else "int16"

    def prepare_model(self, model: nn.Module, source: ModelSource) -> None:
        """The projections and the LM head laid out and given their twins (`_prepare_linears`), then,
        with gguf_activations int8, those reading K-quant blocks put on int8 activations (int8-except-down:
        all but the MLP's down projections)."""
        mode = self.gguf_activations = self.gguf_activations_for(model)
        int8 = mode != "int16"
        if int8 and (self.kernels is None or not self.kernels.gguf_gemm_int8_supported()):
            raise ValueError(f"gguf_activations={mode} needs iterserve's C++ CPU kernels built with AVX2 + FMA + F16C")
        self._prepare_linears(model, source)
        head = getattr(model, "lm_head", None)
        if self.kernels is not None and isinstance(head, CpuLinear):
            head.float_out = True  # the logits widened on the pool (torch's copy woke its OpenMP thread)
        chain_read_ahead(model, self.kernels)
        if int8:
            self._use_int8(model, mode)
        self.int16_amx_modules = use_amx_tiles(model) if self.int16_amx else 0
        if self.int16_amx_modules:
            log.info("CPU: %d projections whose K-quant blocks stay on int16 activations run steps of 16+ rows on "
                     "AMX-INT8 tiles", self.int16_amx_modules)
        choice = self.kernel_choice
        # measured (not with measure_kernels off): the twins' prefetch distance too, one for the process,
        # so the first model's (the target: a draft model, prepared after it, is a small part of a step)
        if choice is not None and not self.stream_ahead:
            self.stream_ahead, ms = choose_stream_ahead(model, self.kernels, choice.stream_ahead)
            if ms:
                choice.stream_ahead, choice.stream_ahead_ms = self.stream_ahead, ms
                choice.remember()

    def _use_int8(self, model: nn.Module, mode: str) -> None:
        """The K-quant twins on int8 activations (int8-except-down: all but the down projections)."""
        n = use_int8_activations(model, except_down=mode == "int8-except-down", amx=self.int8_amx)
        if not n and self.config.gguf_activations == "auto":  # no K-quant module reads gguf_gemm after all
            self.gguf_activations = "int16"
            return
        if not n:
            raise ValueError(f"gguf_activations={mode} applies to a GGUF's K-quant blocks (Q4_K, Q5_K, Q6_K) that steps "
                             "of few rows read (gguf_gemm); this run has none (not a K-quant GGUF, or float32 asked "
                             "for by name: every step computes in float32 then)")
        log.info("CPU: %d projections (head included) read their K-quant blocks on int8 activations (a scale per 256 "
                 "inputs, llama.cpp's Q8_K)%s (gguf_activations=%s%s)", n,
                 "; the MLP's down projections on int16" if mode != "int8" else "", mode,
                 ", chosen by auto: --gguf-activations int16 for the numbers closest to float32"
                 if self.config.gguf_activations == "auto" else "")

    def _prepare_linears(self, model: nn.Module, source: ModelSource) -> None:
        """In bf16: weights laid out once for a bf16 GEMM (ours, oneDNN's, or a float32 copy) and
        (quantization) a 4-bit twin of the projections and a Q8_0 twin of the LM head for steps of
        few tokens, where decoding is bound by reading weights (platform/cpu_linear.py). A GGUF in
        other block types than Q4_0 / Q4_1 (K-quants, Q8_0, Q5_x: `model.gguf_sources`) gives each
        projection and the head whose blocks the kernel reads a twin of those blocks instead
        (quantization auto; `gguf_twins_of`). Which layout and up to how many rows each twin runs
        are timed on this machine for this model's shapes (platform/kernel_choice.py) unless
        measure_kernels is off or a flag forces them. Every twin but torch's int4 one needs the C++
        CPU kernels. In float32: `_prepare_float32`. Either way the modules whose only copy is their
        GGUF blocks (`model.block_modules`) are replaced by ones that compute from them
        (`_use_blocks`)."""
        cfg = self.config
        q = cfg.quantization
        self._log_attention_paths(model.cfg)
        if self.dtype == torch.bfloat16 and self.kernels is not None:
            if tiled_gemm_vectorised(self.kernels) and use_cpu_moe(model):
                log.info("CPU bf16: the experts of mixture-of-experts layers on our tiled bf16 GEMM")
        if self.kernels is not None:
            use_cpu_rms_norm(model)  # eager steps: one kernel per norm instead of eight ops
            use_cpu_elementwise(model)  # eager steps: SiLU-and-multiply and RoPE one kernel each
        blocks = getattr(model, "block_modules", set())
        if self.dtype == torch.float32:
            if cfg.batch_invariant:
                self._prepare_float32_invariant(model)
                use_invariant_moe(model)
            else:
                self._prepare_float32(model)
            return
        if self.dtype != torch.bfloat16 or not bf16_linears_available(self.kernels):
            if q == "int4":
                raise ValueError("quantization=int4 needs a CPU bfloat16 run (oneDNN bf16 and torch's CPU int4 kernel)")
            self._use_blocks(model, None, "float32", 0)
            return
        if cfg.batch_invariant:  # one kernel for every row count: ours, which computes each row alike
            n = optimize_cpu_linears(model, "tiled", 0, 0, self.kernels)
            n += self._use_blocks(model, None, "tiled", 0)
            if any(isinstance(m, nn.Linear) and m.in_features % 2 for m in model.modules()):
                raise ValueError("batch_invariant: a projection has an odd in_features, which our bf16 GEMM cannot run")
            use_invariant_moe(model)
            log.info("CPU bf16, batch-invariant: %d projections on our tiled bf16 GEMM, no quantised twins, every "
                     "query through the decode attention kernel", n)
            return
        # a GGUF's own blocks (K-quants, Q8_0, Q5_x), where the loader handed them over; else as before
        gguf = gguf_twins_of(model) if q == "auto" and self.kernels is not None else {}
        self.gguf_twins = {name: spec for name, (spec, _) in gguf.items()}
        use_int4 = not gguf and (q == "int4" or (q == "auto" and int4_kernel_available()
                                                 and is_four_bit_checkpoint(source)))
        use_q8_head = use_int4 and self.kernels is not None
        plans = None
        if cfg.measure_kernels:
            plans = self._measure(model, use_int4, use_q8_head)
        else:
            gguf_proj = any(name != "lm_head" for name in gguf)
            self.int4_max_tokens = four_bit_max_tokens(self.layout) if use_int4 or gguf_proj else 0
            self.q8_head_max_tokens = Q8_HEAD_MAX_TOKENS if use_q8_head or "lm_head" in gguf else 0
        amx = AMX_MIN_ROWS if plans is None and self.layout == "tiled" and self.amx else 0
        twins = {name: s for name, (_, s) in gguf.items() if name not in blocks}
        n = optimize_cpu_linears(model, self.layout, 0 if blocks else self.int4_max_tokens,
                                 0 if blocks else self.q8_head_max_tokens, self.kernels, plans, amx_min_rows=amx,
                                 gguf_twins=twins)
        n += self._use_blocks(model, plans, self.layout, amx)
        if twins:  # the twins hold the blocks now: the loader's copies of them can go
            used = set(twins) | ({"embed_tokens"} if "lm_head" in twins else set())
            model.gguf_sources = {k: v for k, v in model.gguf_sources.items() if k not in used}
        if gguf:
            types = sorted({gguf_twin_name(spec) for spec in self.gguf_twins.values()})
            log.info("CPU bf16: %d of %d projections (head included) %s the GGUF's own blocks (%s)", len(gguf), n,
                     "compute from" if blocks else "have a twin of", ", ".join(types))
        if plans is None:
            log.info("CPU bf16: %d projections laid out for %s%s%s%s", n,
                     "our tiled bf16 GEMM" if self.layout == "tiled" else self.layout,
                     f" (on AMX tiles from {amx} rows)" if amx else "",
                     f", {'GGUF-block' if gguf else '4-bit'} twin for steps of <= {self.int4_max_tokens} tokens"
                     if self.int4_max_tokens else "",
                     f", {'GGUF-block' if gguf else 'Q8_0'} LM head for <= {self.q8_head_max_tokens} sampled rows"
                     if self.q8_head_max_tokens else "")

    def _log_attention_paths(self, mcfg: ModelConfig) -> None:
        """Says at start-up where this model's attention leaves the C++ kernels for the torch path."""
        if self.config.batch_invariant:  # every query through the decode kernel, window and soft-cap included
            return
        kernel = self.kernels is not None and self.attention.name.startswith("cpu")
        group = mcfg.num_heads // mcfg.num_kv_heads
        if kernel and self.dtype == torch.bfloat16 and (mcfg.head_dim % 32 or group > 24 or
                                                        not self.kernels.bf16_gemm_is_vectorised()):
            log.info("prefill attention runs on torch's SDPA: the C++ prefill kernel needs AVX512-BF16, head_dim a "
                     "multiple of 32 (this model: %d) and at most 24 query heads per KV head (%d)", mcfg.head_dim, group)
        if mcfg.attn_logit_softcap and (not kernel or self.dtype != torch.bfloat16):
            log.info("attention soft-capping on the torch path (%s): scores are computed explicitly in float32, "
                     "slower than the C++ kernels' in-place cap", "prefill" if kernel else "decode and prefill")

    def _prepare_float32(self, model: nn.Module) -> None:
        """float32 (a CPU without fast bf16) means float32's numbers: each projection and the LM head
        keep plain F.linear (MKL), or take bf16 weights on our AVX2 GEMM (bf16w, half the bytes a
        decode step reads) where that was timed faster and the shape's weights are all bf16-exact (a
        bf16 checkpoint: checked once here), so that it computes with the same weights. Elsewhere
        bf16w rounds the weights (echoed prompt logprobs moved by up to 0.03 on SmolLM2's Q4_1 GGUF),
        so only bf16_gemm=bf16w forces it, with a warning. With measure_kernels off and bf16_gemm
        auto, nothing changes: the flags alone do not say which is faster (MKL's own speed varies by
        CPU). quantization=int4 adds a Q4_1 twin of the projections for steps of few rows (its
        cut-over timed too): asked for by the user, never under auto, unlike bf16: its int16
        activations move near-tie greedy tokens (docs/profile.md, Zen 3).
        A GGUF's blocks (`_use_blocks`): steps of many rows dequantise them to float32; steps of few
        rows run gguf_gemm on them (int16 activations), except when float32 was asked for by name
        (--dtype float32), where every step computes in float32 from gguf-py's numbers."""
        cfg = self.config
        q = cfg.quantization
        use_q4 = q == "int4" and self.kernels is not None and self.kernels.q4_gemm_is_vectorised()
        if q == "int4" and not use_q4:
            raise ValueError("quantization=int4 in float32 needs iterserve's Q4 kernel vectorised (AVX2 or "
                             "AVX512-VNNI); torch's CPU int4 kernel takes bfloat16 only")
        forced = cfg.bf16_gemm if cfg.bf16_gemm != "auto" else None
        if forced == "bf16w" and self.kernels is None:
            raise ValueError("bf16_gemm=bf16w needs iterserve's C++ CPU kernels, which are off or did not build")
        if forced == "bf16w":
            _warn_bf16w_rounding(model)
        blocks = getattr(model, "block_modules", set())
        if blocks:
            self.gguf_twins = {name: spec for name, (spec, _) in gguf_twins_of(model).items()}
        plans = None
        if cfg.measure_kernels and self.kernels is not None:
            plans = self._measure(model, use_q4, False)
        elif forced is None and q != "int4":
            self._use_blocks(model, None, "float32", 0)
            return
        else:
            self.int4_max_tokens = four_bit_max_tokens(self.layout) if use_q4 else 0
        n = optimize_cpu_linears(model, self.layout, self.int4_max_tokens, 0, self.kernels, plans, dtype=torch.float32)
        n += self._use_blocks(model, plans, self.layout, 0)
        if plans is None:
            log.info("CPU float32: %d projections laid out for %s%s (not measured)", n, self.layout,
                     f", Q4_1 twin for steps of <= {self.int4_max_tokens} tokens" if self.int4_max_tokens else "")

    def _prepare_float32_invariant(self, model: nn.Module) -> None:
        """batch_invariant in float32, what a CPU without fast bf16 runs (AVX2-only Zen 3): each projection
        and the LM head keep their float32 weights, on f32_gemm (csrc/gemm_f32.cpp), whose sum for an
        output is in one order at every row count (MKL's F.linear, the float32 layout, blocks it by the
        step's rows). A GGUF's modules whose only copy is their blocks: `_use_blocks`."""
        if getattr(model, "block_modules", None):
            self.gguf_twins = {name: spec for name, (spec, _) in gguf_twins_of(model).items()}
        n = optimize_cpu_linears(model, INVARIANT_FLOAT32, 0, 0, self.kernels, dtype=torch.float32)
        n += self._use_blocks(model, None, INVARIANT_FLOAT32, 0)
        log.info("CPU float32, batch-invariant: %d projections (head included) on our fixed-order float32 GEMM%s "
                 "(a GGUF's quantised ones on their blocks), no quantised twins of float weights, every query "
                 "through the decode attention kernel", n,
                 "" if self.kernels.f32_gemm_is_vectorised() else " (its portable loop: slow)")

    def _every_step_on_blocks(self) -> bool:
        """Whether a GGUF's block modules run gguf_gemm at every step size: under batch_invariant in
        float32 unless float32 was asked for by name. gguf_gemm quantises each activation row alone and
        sums exactly in int32 per super-block, so a row's output does not depend on the step's other rows
        (tests/test_batch_invariant.py), and decode steps keep reading the blocks alone, as a float32 run's
        few-row steps do by default. --dtype float32 keeps gguf-py's float32 numbers at every step instead
        (blocks dequantised a panel at a time onto f32_gemm: slower at decode)."""
        cfg = self.config
        return cfg.batch_invariant and self.dtype == torch.float32 and cfg.dtype != "float32"

    def _use_blocks(self, model: nn.Module, plans: dict | None, layout: str, amx: int) -> int:
        """Replaces the modules whose only copy is their GGUF blocks (cpu_linear.use_gguf_blocks): each
        linear in its measured plan, else in `layout` with the default twin cut-overs (none under
        batch_invariant, or in a float32 run asked for by name; every step under `_every_step_on_blocks`).
        Returns the number replaced."""
        blocks = getattr(model, "block_modules", set())
        if not blocks:
            return 0
        every = self._every_step_on_blocks()
        exact = not every and (self.config.batch_invariant or
                               (self.dtype == torch.float32 and self.config.dtype == "float32"))
        default = {"proj": four_bit_max_tokens(layout), "head": Q8_HEAD_MAX_TOKENS}

        def plan_of(name: str, mod: nn.Linear, spec: str) -> tuple[str, int, int]:
            role = "head" if name == "lm_head" else "proj"
            plan = (plans or {}).get((role, mod.out_features, mod.in_features, spec))
            lay, most, amx_rows = plan if plan is not None else (layout, default[role], amx)
            return lay, EVERY_ROW if every else 0 if exact else most, amx_rows

        n = use_gguf_blocks(model, plan_of)
        if every:  # (reported as the step's token budget: no step has more rows)
            budget = self.config.max_num_batched_tokens
            self.int4_max_tokens, self.q8_head_max_tokens = budget, budget
            log.info("%d modules compute from the GGUF's blocks, their only copy (gguf_gemm at every step size)", n)
        else:
            if plans is None:  # (measured: set by _measure)
                self.int4_max_tokens, self.q8_head_max_tokens = (0, 0) if exact else (default["proj"], default["head"])
            log.info("%d modules compute from the GGUF's blocks, their only copy (%s for steps of many rows%s)", n,
                     layout if plans is None else "measured layouts",
                     "" if exact else ", gguf_gemm for few")
        # a MoE layer's experts: not measured (no linears to time); the projections' layout and cut-over
        moe = use_moe_blocks(model, layout, EVERY_ROW if every else 0 if exact else EXPERT_TWIN_MAX_TOKENS, amx)
        if moe:
            log.info("the experts of %d mixture-of-experts layers compute from the GGUF's blocks (%s), their only "
                     "copy: %s", len(moe), ", ".join(sorted(set(moe))),
                     f"per used expert, {layout} GEMM on dequantised panels" if exact else
                     "every step's experts in one gguf_moe_gemm a layer" if every else
                     f"experts with <= {EXPERT_TWIN_MAX_TOKENS} rows in one gguf_moe_gemm a layer, each with more "
                     f"on the {layout} GEMM on dequantised panels")
        return n + len(moe)

    def _measure(self, model: nn.Module, use_int4: bool, use_q8_head: bool
                 ) -> dict[tuple[str, int, int, str], tuple[str, int, int]]:
        """Times the candidates (or reads the cached table), logs the table, and returns the per-shape plan."""
        cfg = self.config
        mcfg = model.cfg
        max_seqs = cfg.max_seqs_per_step
        measure_attention = cfg.decode_attention == "auto" and self.kernels is not None
        auto = cfg.bf16_gemm == "auto"  # the layout is measured (else forced: no candidates to filter)
        req = ChoiceRequest(shapes=shapes_of(model, self.dtype, self.gguf_twins), buckets=batch_buckets(max_seqs),
                            dtype=self.dtype,
                            layout=None if auto else self.layout, four_bit=use_int4,
                            q8_head=use_q8_head, amx=self.amx or self.int8_amx,
                            blocks=bool(getattr(model, "block_modules", None)),
                            int8=self.gguf_activations != "int16",
                            int16_shapes=down_only_shapes(model, self.dtype, self.gguf_twins)
                            if self.gguf_activations == "int8-except-down" else [],
                            attention=(mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim, cfg.block_size)
                            if measure_attention else None,
                            bf16_exact=bf16_exact_shapes(model) if self.dtype == torch.float32 and auto else [])
        choice = self.kernel_choice = choose_kernels(req, self.kernels, remeasure=cfg.remeasure_kernels)
        how = (f"measured in {choice.seconds:.1f} s, cached in {kernel_choice_dir()}" if choice.source == "measured"
               else f"read from the cache in {kernel_choice_dir()} (--remeasure-kernels to time again)")
        log.info("CPU kernel choice (%s); ms per call at each step size:\n%s", how, choice.table())
        log.info("CPU %s kernels chosen: %s", str(self.dtype).removeprefix("torch."), choice.brief())
        if choice.decode_attention and choice.decode_attention != self.attention.name:
            self.attention = select_attention_backend(choice.decode_attention, self.device, self.kernels)
        self.int4_max_tokens = max((c.twin_max_tokens for c in choice.linears.values() if c.role == "proj"), default=0)
        self.q8_head_max_tokens = max((c.twin_max_tokens for c in choice.linears.values() if c.role == "head"),
                                      default=0)
        return {parse_linear_key(key): (c.layout, c.twin_max_tokens, c.amx_min_rows)
                for key, c in choice.linears.items()}

    def num_kv_blocks(self, model_config: ModelConfig, profile_run: Callable[[], None]) -> int:
        return kv_blocks_for_budget(self.config, model_config, self.kv_cache)

    def resolved(self) -> dict[str, Any]:
        layouts = sorted({c.layout for c in self.kernel_choice.linears.values()}) if self.kernel_choice else None
        return {**super().resolved(), "cpu_kernels": self.kernels is not None,
                "bf16_gemm": "/".join(layouts) if layouts else self.layout,
                "quantization": "gguf" if self.gguf_twins else "int4" if self.int4_max_tokens else "none",
                "gguf_twins": sorted({gguf_twin_name(s) for s in self.gguf_twins.values()}),
                "gguf_activations": self.gguf_activations if self.gguf_twins else None,
                "int4_max_tokens": self.int4_max_tokens, "q8_head_max_tokens": self.q8_head_max_tokens,
                "batch_invariant": self.config.batch_invariant, "cpu_amx": self.amx,
                "gguf_int8_amx": self.int8_amx and self.gguf_activations != "int16",
                "gguf_int16_amx": self.int16_amx_modules > 0,
                # bytes ahead of the weight stream the GGUF GEMMs ask for lines (0: the kernels' default)
                "gguf_stream_ahead": self.stream_ahead,
                "kernel_choice": self.kernel_choice.summary() if self.kernel_choice else
                ("fixed (batch_invariant)" if self.config.batch_invariant else "by CPU flags (measure_kernels off)")}
