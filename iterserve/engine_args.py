"""The command-line surface that `iterserve generate` and `iterserve serve` share: the engine flags
(declared once, named as vLLM names them, each one an EngineConfig field), the OpenMP wait policy
that must be set before torch loads, and log set-up. Imports neither torch nor the engine, so that
`--help` is fast and --omp-wait can still take effect.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import fields

from iterserve.config import BF16_GEMM_CHOICES, DECODE_ATTENTION_CHOICES, GGUF_ACTIVATIONS, EngineConfig

# --omp-wait: the environment libgomp reads when torch loads (so it is applied before any torch import)
OMP_WAIT = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"},
            "spin": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "200000"}}


def apply_omp_wait(choice: str) -> None:
    """passive is already applied: importing the package filled OMP_WAIT_POLICY where the environment
    left it unset (iterserve/__init__.py; an exported value wins). spin is an explicit request and
    overrides it, where torch is not loaded yet."""
    choice = getattr(choice, "value", choice)  # `serve` wraps defaults it lets a --config file replace
    if choice == "passive":
        return
    if "torch" in sys.modules:  # too late: main() in a process that loaded torch (tests), or a --config file
        if not all(os.environ.get(k) == v for k, v in OMP_WAIT[choice].items()):
            logging.getLogger("iterserve").warning("--omp-wait %s ignored: torch was loaded before it", choice)
        return
    os.environ.update(OMP_WAIT[choice])


ENGINE_ENV_HELP = (
    "Environment: ITERSERVE_CPU_KERNELS=0, ITERSERVE_BF16_GEMM, ITERSERVE_DECODE_ATTENTION and "
    "ITERSERVE_MEASURE_KERNELS=0 set the defaults of --no-cpu-kernels, --bf16-gemm, --decode-attention and "
    "--no-measure-kernels (a flag given wins). ITERSERVE_CPU_KERNELS_VARIANT=avx2 runs the C++ kernels' AVX2 "
    "build on an AVX-512 CPU (what an AVX2-only one runs).")


class _LoRAModules(argparse.Action):
    """--lora-modules name=path ... -> {name: path} (EngineConfig.lora_modules)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        out: dict[str, str] = {}
        for item in values:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                parser.error(f"{option_string} takes NAME=PATH items, got {item!r}")
            if name in out:
                parser.error(f"{option_string} names {name!r} twice")
            out[name] = path
        setattr(namespace, self.dest, out)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.epilog = f"{p.epilog} {ENGINE_ENV_HELP}" if p.epilog else ENGINE_ENV_HELP
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default=d.dtype, help="auto (bfloat16 on CUDA and on CPUs with native bf16: AVX512-BF16 or AMX; float32 on other CPUs), float32, bfloat16, float16. "
                        "float32 computes with the checkpoint's weights as float32: bf16 weights (--bf16-gemm bf16w) only "
                        "where they are bf16-exact already, unless forced")
    g.add_argument("--device", default=d.device, help="auto, cpu or cuda[:N]")
    g.add_argument("--quantization", choices=["auto", "none", "int4"], default=d.quantization,
                   help="int4: keep a 4-bit copy of each projection for steps of <= 4 tokens (8 where iterserve's bf16 "
                        "GEMM is not vectorised) and a Q8_0 copy of the LM head for <= 4 sampled rows (CPU bf16): "
                        "decoding few sequences is bound by reading weights, and these read a quarter / half of the "
                        "bytes. auto (default): only when the checkpoint is a 4-bit GGUF already, so no new "
                        "rounding; none: bf16/float32 weights only. A float32 run (a CPU without fast bf16) "
                        "gets the projections' 4-bit copy with int4 only, never by auto: its int16 activations "
                        "move near-tie greedy tokens")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the decoder layers: inductor fuses norms, RoPE, activations and adds, so "
                        "steps are faster, after a compilation at startup that takes about a minute on a small "
                        "CPU (less when inductor's on-disk cache has the graphs)")
    g.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction, default=d.cpu_kernels,
                   help="use iterserve's C++ CPU kernels (decode attention, bf16 / 4-bit / Q8_0 GEMMs; built on "
                        "first use); --no-cpu-kernels keeps to the torch and oneDNN paths, to compare or to step "
                        "around a broken compiler (default: on unless ITERSERVE_CPU_KERNELS=0)")
    g.add_argument("--gguf-activations", choices=list(GGUF_ACTIVATIONS), default=d.gguf_activations,
                   help="CPU, GGUF K-quant weights (Q4_K, Q5_K, Q6_K): int16 quantises each activation row with "
                        "one scale (closest to float32), int8 with a scale per 256 inputs as llama.cpp "
                        "does (about 1.3x faster decode on AVX2 hosts, 1.3-1.7x faster prompt chunks, llama.cpp's "
                        "accuracy), int8-except-down int8 but for the MLP's down projection, whose input carries the "
                        "outliers int8 loses most on (most of int8's speed, close to int16's accuracy); auto: "
                        "int8-except-down wherever the int8 kernel is built (AVX2 + FMA + F16C), int16 under "
                        "--batch-invariant and with --dtype float32 (no int8 then); int16 for the numbers closest to "
                        "float32; the int8 choices not with --batch-invariant (default: $ITERSERVE_GGUF_ACTIVATIONS, "
                        "else auto)")
    g.add_argument("--bf16-gemm", choices=list(BF16_GEMM_CHOICES), default=d.bf16_gemm,
                   help="the GEMM of the CPU bf16 projections: tiled (ours, where AVX512-BF16 exists), onednn "
                        "(on AMX tiles where the CPU has them), float32 (a float32 copy of each weight), or auto: "
                        "the fastest per shape as timed on this machine (--measure-kernels), else by CPU flags "
                        "(ours unless the CPU has AMX). A float32 run (a CPU without fast bf16) takes float32 "
                        "(plain F.linear), bf16w (bf16 weights on our AVX2 float32 GEMM: half the bytes read; "
                        "forced, it rounds weights that are not bf16-exact, with a warning: outputs then differ "
                        "from float32's) or auto: timed, bf16w only for weights that are bf16-exact (a bf16 "
                        "checkpoint), else float32 (default: $ITERSERVE_BF16_GEMM, else auto)")
    g.add_argument("--measure-kernels", action=argparse.BooleanOptionalAction, default=d.measure_kernels,
                   help="CPU: choose each projection's GEMM (ours, oneDNN's: AMX where present, float32; in a "
                        "float32 run float32, or bf16w for bf16-exact weights), the "
                        "4-bit / Q8_0 copies' cut-overs and the decode attention by timing them at start-up for "
                        "this model's shapes (a few seconds, once: cached under ~/.cache/iterserve/kernel_choice "
                        "per CPU, torch, sources and model); --no-measure-kernels decides by CPU flags and fixed "
                        "thresholds (default: on unless ITERSERVE_MEASURE_KERNELS=0). --bf16-gemm and "
                        "--decode-attention other than auto still force their choice")
    g.add_argument("--cpu-amx", action=argparse.BooleanOptionalAction, default=d.cpu_amx,
                   help="CPU with AMX: let our tiled bf16 GEMM run steps of many rows (prefill chunks, large "
                        "decode batches) on AMX tiles from the same weight copy, from a row count timed per shape "
                        "with --measure-kernels (else from 16 rows), and a GGUF's K-quant blocks run steps of 16+ rows on "
                        "AMX-INT8 tiles (int8 activations: the numbers of the many-row kernel they replace; int16: "
                        "within its rounding, 2-4x its speed); --no-cpu-amx keeps the AVX-512 paths at every size "
                        "(default: on unless ITERSERVE_CPU_AMX=0; off under --batch-invariant but for int8's, "
                        "which that refuses)")
    g.add_argument("--remeasure-kernels", action="store_true",
                   help="time the kernel candidates again instead of reading the cached table (after a BIOS, "
                        "memory or load change)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="deterministic inference: the same request gives the same greedy text whatever shares its "
                        "step and whatever the load (one kernel and reduction order per op at every batch size: "
                        "our fixed-order GEMM for every projection: bf16 with AVX512-BF16, else float32 (AVX2 "
                        "CPUs such as Zen 3; a GGUF's blocks there on gguf_gemm at every step unless --dtype "
                        "float32), no 4-bit / Q8_0 copies, every query through the per-sequence attention "
                        "kernel). Needs the C++ CPU kernels; slower (docs/benchmarks/batch-invariant.md)")
    g.add_argument("--decode-attention", choices=list(DECODE_ATTENTION_CHOICES), default=d.decode_attention,
                   help="decode attention backend: torch (portable), cpu (the C++ kernel), triton (CUDA), or auto: "
                        "the device's kernel when it is there, else torch (default: $ITERSERVE_DECODE_ATTENTION, "
                        "else auto)")
    g.add_argument("--batching", choices=["continuous", "static"], default=d.batching,
                   help="continuous: iteration-level scheduling (default); static: fill-or-timeout batches "
                        "that run to their slowest member, for comparison")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most sequences in one step (continuous batching); default 16, as in docs/seed-case.md")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step; longer prompts are prefilled in chunks (default: 512 on "
                        "CPU, llama.cpp's micro-batch: a CPU prefills only a few percent faster in longer steps, which "
                        "hold more activation memory and stall running streams longer; 2048 on CUDA, as vLLM)")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy,
                   help="fcfs: first come first served; priority: lower 'priority' value first, arrival breaks ties")
    g.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="static batching: batch size (default 8)")
    g.add_argument("--batch-timeout", dest="batch_timeout_ms", type=float, default=d.batch_timeout_ms,
                   help="static batching: ms the oldest request waits before a partial batch starts")
    g.add_argument("--block-size", type=int, default=d.block_size, choices=[1, 8, 16, 32, 64, 128],
                   help="tokens per KV cache block (default 16)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="share the KV of a repeated prompt prefix (system prompt, chat history) between "
                        "requests: full blocks are looked up by a hash of their tokens and kept, "
                        "evictable, after their request ends. Default: on with continuous batching; "
                        "static batching keeps its contiguous, unshared KV (it is the baseline) and "
                        "refuses it")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="number of KV blocks, each of one KV cache group's layers (every layer unless the model "
                        "mixes full and sliding-window layers); overrides the memory budget")
    g.add_argument("--kv-cache-memory", default=d.kv_cache_memory, help="CPU memory for KV blocks, e.g. 512MiB, 2GiB")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                   help="the KV cache's format (vLLM's names): auto (default: the model's dtype, but bfloat16 on a "
                        "CPU without fast bf16 unless --dtype float32 is asked for), bfloat16, float32, fp8 "
                        "(= fp8_e4m3), fp8_e5m2 (one byte a value, scale 1.0), or q8_0 (llama.cpp's int8 blocks: a "
                        "float16 scale per 32 values). An 8-bit cache holds ~2x the tokens in --kv-cache-memory "
                        "(docs/benchmarks/kv-cache-dtype.md: accuracy and speed)")
    g.add_argument("--skip-memory-check", action="store_true",
                   help="load the model even when its weights, KV cache and workspace (estimated from the "
                        "checkpoint before loading) exceed the memory available; by default start-up refuses "
                        "such a model with the numbers rather than meet the kernel's OOM killer half-way")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="CUDA: share of GPU memory for weights, activations and KV blocks (default 0.9)")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: min(model, 4096))")
    g.add_argument("--max-input-len", type=int, default=None, help="reject prompts longer than this many tokens")
    g.add_argument("--max-output-len", type=int, default=None, help="reject max_tokens above this")
    g.add_argument("--structured-outputs-any-whitespace", action=argparse.BooleanOptionalAction,
                   default=d.structured_outputs_any_whitespace,
                   help="JSON-schema outputs: allow any whitespace between JSON tokens (vLLM's default; "
                        "vLLM's disable_any_whitespace turns it off). Off by default here: a small model "
                        "under a flexible grammar can spend its whole budget on newlines and never close "
                        "the object; off, the JSON is written with one space after ':' and ','. A schema's "
                        "own \"x-guidance\" options win either way")
    g.add_argument("--structured-outputs-allow-additional-properties", action=argparse.BooleanOptionalAction,
                   default=d.structured_outputs_allow_additional_properties,
                   help="JSON-schema outputs: an object schema that does not state additionalProperties "
                        "allows keys besides its own (JSON Schema's default). Off by default, as in vLLM's "
                        "default backend and OpenAI's strict schemas: such an object gets exactly its own "
                        "keys (a small model otherwise invents keys until max_tokens cuts the JSON off). A "
                        "schema that states additionalProperties is kept as written either way")
    g.add_argument("--structured-outputs-bound-numbers", action=argparse.BooleanOptionalAction,
                   default=d.structured_outputs_bound_numbers,
                   help="JSON-schema outputs: an integer without minimum / maximum is held to the 64-bit range "
                        "(at most 19 digits) and a number to +-1e15 in steps of 1e-6, so that a small model "
                        "cannot write digits until max_tokens. On by default; bounds a schema states are kept")
    g.add_argument("--pooling", choices=["last", "mean", "cls"], default=d.pooling,
                   help="how /v1/embeddings pools the prompt's final hidden states: last (the last token's, "
                        "Qwen3-Embedding's convention), mean (all tokens'), cls (the first token's). Default: "
                        "the model folder's own sentence-transformers config (modules.json, 1_Pooling/), "
                        "else last. The vector is L2-normalised")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, vLLM's keys: method ngram (prompt lookup in the request's own "
                        "tokens), suffix (a suffix index over them and recent requests' outputs) or draft_model "
                        "(with \"model\": a smaller model of the same vocabulary); num_speculative_tokens (the most "
                        "drafts a row verifies per step, default 4; each row adapts below it to its acceptance); "
                        "prompt_lookup_min/max; disable_by_batch_size (no drafts above this many running "
                        "requests, default 8; null: never off). Greedy output is unchanged and sampled output "
                        "keeps its distribution (docs/speculative.md). Without it, a request's OpenAI "
                        "`prediction` still drafts. Example: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
    lo = p.add_argument_group("LoRA adapters (docs/server.md)")
    lo.add_argument("--enable-lora", action="store_true",
                    help="serve LoRA adapters on the base model: a request names its adapter in 'model', and one "
                         "step batches rows of many adapters (and of the base model) together. Continuous "
                         "batching only; not with --compile or --batch-invariant")
    lo.add_argument("--lora-modules", nargs="+", action=_LoRAModules, default=d.lora_modules, metavar="NAME=PATH",
                    help="adapters to load at start-up: PEFT adapter folders (adapter_config.json + "
                         "adapter_model.safetensors), each served under NAME. One that does not fit the base "
                         "model (rank, targets, shapes) stops the start-up; more can be added while serving "
                         "with POST /v1/load_lora_adapter")
    lo.add_argument("--max-loras", type=int, default=d.max_loras,
                    help="adapters resident at once, i.e. used by the running requests of one step (default 1). "
                         "A request whose adapter is not resident waits for a slot, as it waits for KV blocks; "
                         "a slot whose adapter no running request uses is reloaded, least recently used first")
    lo.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                    help="the largest adapter rank accepted; every slot is sized (and every adapter padded) to "
                         f"it, so a lower one costs less per adapter row (default {d.max_lora_rank})")
    lo.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras,
                    help="adapters kept loaded in CPU memory, resident or not (at least --max-loras); the least "
                         "recently used beyond it are read again from their folder when next needed (default: "
                         "all those given with --lora-modules, at least --max-loras)")
    g.add_argument("--log-scheduler", action="store_true",
                   help="log one line per engine step: batch size, tokens, KV blocks, admitted requests "
                        "with their prefix-cache hit tokens, finished/preempted requests")
    g.add_argument("--threads", dest="num_threads", type=int, default=None, help="torch math threads on CPU")
    g.add_argument("--omp-wait", choices=sorted(OMP_WAIT), default="passive",
                   help="how idle OpenMP math threads wait between ops. passive (default): they sleep at "
                        "once, safe when other processes share the cores. spin: they spin briefly first "
                        "(OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT=200000): faster steps on otherwise idle "
                        "cores, much slower ones when another process keeps a core busy")
    g.add_argument("--seed", type=int, default=d.seed, help="engine seed")


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw.update(overrides)
    return EngineConfig(**kw)


def engine_flags_from_args(args: argparse.Namespace) -> list[str]:
    """The engine flags `args` holds that differ from their defaults, as command-line words: what a
    tool that measured in process passes on to an `iterserve serve` it starts with the same engine."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    words: list[str] = []
    for action in p._actions:  # argparse has no public listing of a parser's options
        if not action.option_strings or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            words.append(action.option_strings[0] if value else action.option_strings[1])
        elif isinstance(action, argparse._StoreTrueAction):
            words.append(action.option_strings[0])
        elif isinstance(value, dict):
            words += [action.option_strings[0], *(f"{k}={v}" for k, v in value.items())]
        elif value is not None:
            words += [action.option_strings[0], str(value)]
    return words


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
