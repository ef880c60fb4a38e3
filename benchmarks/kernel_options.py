"""Kernel choices behind a CPU decode step, measured one by one so that a change can be judged
before it is wired in. Every layer gets its own random weights of the embedded model's shapes, so
the weights stream from memory as in a real step (one hot matrix repeated would sit in cache).

    python benchmarks/kernel_options.py linears --rows 1 2 4 8 16      # the 120 projections
    python benchmarks/kernel_options.py linears --rows 8 16 --inductor-woq  # + inductor's AMX int4
    python benchmarks/kernel_options.py lm-head --rows 1 2 4 8 16 --numerics
    python benchmarks/kernel_options.py attention --batch 1 4 8 16 --context 100 500
    python benchmarks/kernel_options.py prefill-attention --chunk 256:256 512:512 1024:1024 256:1024
    python benchmarks/kernel_options.py prefill-attention --chunk 1024:1024 --window 256 --softcap 50
    python benchmarks/kernel_options.py gguf-twins --rows 1 2 4 8                 # GGUF block twins
    python benchmarks/kernel_options.py gguf-twins --shapes 262144x640 --types Q8_0 Q5_0 --sampler

- linears: ms for all 30 layers' projections (QKV, O, gate-up, down) at M rows: oneDNN bf16 with
  the weight prepacked (what steps use where our bf16 kernel is not vectorised), torch's int4
  kernel, our Q4_1 kernel (iterserve/csrc: what steps of <= 4 rows use where it is vectorised),
  our tiled bf16 kernel (what larger steps use where AVX512-BF16 exists), the same on AMX tiles
  (where the CPU has AMX: what the chooser gives steps from its cut-over), and, with --inductor-woq,
  inductor's C++/AMX template for the int4 op (max-autotune, frozen weights; one shape, gate-up,
  hot in cache: it needs a compiled graph per weight).
- lm-head: the 49152 x 576 head in bf16 (oneDNN and ours) against an int8 per-channel twin
  (_weight_int8pack_mm) and our Q8_0 kernel (the GGUF's layout: int8 weights, a float scale per 32), with the error of
  each against float32; --numerics loads the embedded model and compares bf16 and int8 with float32
  logits on a few prompts.
- attention: one layer's decode attention per call: the torch path (block gather + SDPA) against
  our kernel (blocks read in place).
- prefill-attention: one layer's causal attention of a prompt chunk of n tokens at context ctx
  (n == ctx: a fresh prompt; n < ctx: a chunk after a cached prefix): the torch path (SDPA per
  chunk, after a block gather when there is a prefix) against our kernel (blocks read in place);
  the two take turns, best of the rounds.
- gguf-twins: ms per call of one projection shape at M rows: our bf16 GEMM (`tiled`; oneDNN's
  prepacked weight where ours is not vectorised), the min-max Q4_1 twin (q4_gemm) and a twin from
  GGUF blocks of each type (gguf_gemm: Q4_K, Q5_K, Q6_K as stored, Q8_0 / Q5_0 / ... repacked four
  blocks to a group), random blocks, enough distinct copies of each that they stream from memory;
  the candidates take turns, best of the rounds; for an LM head (>= --head-rows outputs) also the
  head's old twin, Q8_0 rebuilt from the float weight (q8_0_gemm). Defaults: 640x2048 (a small model's down
  projection), 2048x2048, and Gemma 3 270M's 262144 x 640 LM head (K-quants need K % 256 == 0:
  none there; llama.cpp stores such a head as Q8_0). --sampler adds greedy and top-p sampling over
  that many logits; --numerics FILE.gguf a real model's decode logits, teacher-forced, with no twin,
  with the twins of its blocks and with the min-max twins, against float32. Prints the CPU's model
  and flags first.
Both attention commands take --window W (a sliding window, as Mistral's and Gemma's) and --softcap
C (Gemma 2's logit cap); 0, the default, turns either off.
Columns of our kernels appear when they build (platform/cpu_kernels.py). Results are printed; the
figures quoted in docs/profile.md and docs/benchmarks/kernel-choice.md came from these commands.
"""
from __future__ import annotations

import argparse
import os
from typing import NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from iterserve.attention.cpu_backend import CpuKernelAttentionBackend  # noqa: E402
from iterserve.bench.common import best_time  # noqa: E402
from iterserve.attention.metadata import DecodeMetadata, PrefillMetadata  # noqa: E402
from iterserve.attention.torch_attention import decode_attention, prefill_attention  # noqa: E402
from iterserve.platform.cpu_kernels import load_cpu_kernels  # noqa: E402
from iterserve.platform.cpu_linear import (GGUF_BLOCKS, GROUP_SIZE, KQUANTS, RandomShard, pack_bf16, pack_gguf_twin,  # noqa: E402
                                           pack_int4, pack_q4_1, pack_q8_0, prepack_available,
                                           tiled_gemm_vectorised)
from iterserve.cpu_info import cpu_flags_line, cpu_model_name  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 576, 1536, 9, 3, 64, 30, 49152
SHAPES = [((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def best_ms(fn, rounds: int = 5, inner: int = 1) -> float:
    return best_time(fn, rounds, inner) * 1e3


def linears(args) -> None:
    torch.manual_seed(0)
    kernels = load_cpu_kernels()
    layers = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            w = torch.randn(n, k) * 0.02
            layers.append((k, torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 16), pack_int4(w),
                           pack_q4_1(w) if kernels else None, pack_bf16(w) if kernels else None, n))
    for m in args.rows:
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (HIDDEN, INTER)}

        def bf16() -> None:
            for k, packed, *_ in layers:
                torch.ops.mkldnn._linear_pointwise(xs[k], packed, None, "none", [], "")

        def int4() -> None:
            for k, _, (q, sz), *_ in layers:
                torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], q, GROUP_SIZE, sz)

        def q4_1() -> None:
            for k, _, _, q4, *_ in layers:
                kernels.q4_gemm(xs[k], *q4)

        def bf16_ours() -> None:
            for k, *_, wb, n in layers:
                kernels.bf16_gemm(xs[k], wb, n)

        def bf16_ours_amx() -> None:  # the same weight tiles on AMX (every row count)
            for k, *_, wb, n in layers:
                kernels.bf16_gemm(xs[k], wb, n, 1)

        line = f"rows {m:3d}: bf16 prepacked {best_ms(bf16):6.2f} ms   torch int4 {best_ms(int4):6.2f} ms"
        if kernels:
            line += f"   ours Q4_1 {best_ms(q4_1):6.2f} ms   ours bf16 {best_ms(bf16_ours):6.2f} ms"
        if kernels and kernels.bf16_gemm_amx_available():
            line += f"   ours bf16 on AMX {best_ms(bf16_ours_amx):6.2f} ms"
        print(line + f"   (all {len(layers)} projections)", flush=True)
    if args.inductor_woq:
        inductor_woq(args.rows)


def inductor_woq(rows: list[int]) -> None:
    n, k = SHAPES[2]
    w = torch.randn(n, k) * 0.02

    class Int4(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            q, sz = pack_int4(w)
            self.register_buffer("q", q)
            self.register_buffer("sz", sz)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.q, GROUP_SIZE, self.sz)

    mod = Int4().eval()
    packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 16)
    with torch.no_grad(), torch._inductor.config.patch(freezing=True, max_autotune=True,
                                                        max_autotune_gemm_backends="CPP,ATEN"):
        compiled = torch.compile(mod, dynamic=False)
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            compiled(x)
            t_c, t_e = best_ms(lambda: compiled(x), inner=100), best_ms(lambda: mod(x), inner=100)
            t_b = best_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), inner=100)
            print(f"gate-up {n}x{k}, hot, rows {m:3d}: inductor int4 template {t_c * 1e3:6.0f} us   torch int4 "
                  f"{t_e * 1e3:6.0f} us   bf16 prepacked {t_b * 1e3:6.0f} us", flush=True)


def int8_twin(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
    return (w.float() / scale).round().clamp(-127, 127).to(torch.int8), scale.squeeze(1).bfloat16()


def q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 of w: (int8 [N, K], scale per 32 [N, K/32] f32, the dequantised weight)."""
    n, k = w.shape
    g = w.float().view(n, k // 32, 32)
    d = g.abs().amax(-1).clamp(min=1e-8) / 127
    q = (g / d.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return q.view(n, k), d.contiguous(), (q.float() * d.unsqueeze(-1)).view(n, k)


class Head(NamedTuple):
    """One LM head in every form measured: Q8_0 values, as the GGUF's head holds them."""
    packed: torch.Tensor  # bf16, prepacked for oneDNN
    int8: torch.Tensor  # per-channel int8 twin
    int8_scales: torch.Tensor
    q8: torch.Tensor  # Q8_0: int8 [N, K] and a scale per 32
    q8_scales: torch.Tensor
    weight: torch.Tensor  # float32, dequantised: the reference
    tiled: torch.Tensor  # bf16 for our kernel


def make_head() -> Head:
    q, d, w = q8_0(torch.randn(VOCAB, HIDDEN) * 0.05)
    return Head(torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 16), *int8_twin(w), q, d, w,
                pack_bf16(w.bfloat16()))


def lm_head(args) -> None:
    torch.manual_seed(0)
    kernels = load_cpu_kernels()
    heads = [make_head() for _ in range(args.copies)]  # used in turn: each call reads its weights from memory
    for m in args.rows:
        x = torch.randn(m, HIDDEN, dtype=torch.bfloat16)

        def bf16(h: Head) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, h.packed, None, "none", [], "")

        def int8(h: Head) -> torch.Tensor:
            return torch.ops.aten._weight_int8pack_mm(x, h.int8, h.int8_scales)

        def q8(h: Head) -> torch.Tensor:
            return kernels.q8_0_gemm(x, h.q8, h.q8_scales)

        def bf16_ours(h: Head) -> torch.Tensor:
            return kernels.bf16_gemm(x, h.tiled, VOCAB)

        def per_call(kernel) -> float:
            return best_ms(lambda: [kernel(h) for h in heads]) / len(heads)

        line = f"rows {m:3d}: bf16 prepacked {per_call(bf16):5.2f} ms   int8 per-channel {per_call(int8):5.2f} ms"
        if kernels:
            ref = x.float() @ heads[0].weight.t()
            err_q8, err_bf = ((kernel(heads[0]).float() - ref).abs().max() for kernel in (q8, bf16))
            line += f"   ours bf16 {per_call(bf16_ours):5.2f} ms   ours Q8_0 {per_call(q8):5.2f} ms   (max error vs float32: Q8_0 {err_q8:.4f}, bf16 {err_bf:.4f})"
        print(line + "   per head call", flush=True)
    if args.numerics:
        head_numerics()


def head_numerics() -> None:
    from iterserve.llm import LLM
    from iterserve.sampling import SamplingParams

    llm = LLM("smollm2-135m", dtype="float32")
    model = llm.engine.runner.model
    hidden: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: hidden.append(inp[0].detach().float()))
    prompts = ["The capital of France is", "def fibonacci(n):", "In 1492, Columbus", "Photosynthesis is the process",
               "Once upon a time there was a"]
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    hook.remove()
    x, w = torch.cat(hidden), model.embed_tokens.weight.detach().float()
    ref = x @ w.t()
    q, s = int8_twin(w)
    for name, y in (("bf16", (x.bfloat16() @ w.bfloat16().t()).float()),
                    ("int8 per-channel", torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q, s).float())):
        agree = (y.argmax(-1) == ref.argmax(-1)).float().mean().item()
        d = (y - ref).abs()
        print(f"{name:17s} vs float32 over {len(x)} positions: top-1 agreement {agree:.1%}, "
              f"mean |dlogit| {d.mean():.4f}, max {d.max():.3f}")


def attention(args) -> None:
    torch.manual_seed(0)
    bs, num_blocks = 16, 4096
    k_cache, v_cache = (torch.randn(num_blocks, bs, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
    kernels = load_cpu_kernels()
    for ctx in args.context:
        for b in args.batch:
            nblk = -(-ctx // bs)
            tables = torch.randperm(num_blocks)[:b * nblk].view(b, nblk)
            meta = DecodeMetadata(block_tables=tables, context_lens=torch.full((b,), ctx), max_context_len=ctx)
            q = torch.randn(b, HEADS, HEAD_DIM, dtype=torch.bfloat16)
            extra = (args.window, args.softcap)
            torch_us = best_ms(lambda: decode_attention(q, k_cache, v_cache, meta, 0.125, *extra), rounds=7, inner=200) * 1e3
            line = f"context {ctx:4d} batch {b:3d}: torch (gather + SDPA) {torch_us:6.0f} us"
            if kernels:
                ours = CpuKernelAttentionBackend(kernels)
                us = best_ms(lambda: ours.decode(q, k_cache, v_cache, meta, 0.125, *extra), rounds=7, inner=200) * 1e3
                line += f"   ours {us:6.0f} us"
            print(line + "   per layer", flush=True)


def prefill_attention_options(args) -> None:
    torch.manual_seed(0)
    bs = 16
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.bf16_gemm_is_vectorised():
        raise SystemExit("the prefill kernel needs the CPU kernels built with AVX512-BF16")
    ours = CpuKernelAttentionBackend(kernels)
    for spec in args.chunk:
        n, ctx = (int(x) for x in spec.split(":"))
        nblk = -(-ctx // bs)
        k_cache, v_cache = (torch.randn(nblk + 4, bs, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
        meta = PrefillMetadata(block_tables=torch.randperm(nblk + 4)[:nblk].unsqueeze(0), query_lens=[n],
                               context_lens=[ctx])
        q = torch.randn(n, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
        extra = (args.window, args.softcap)
        calls = {"torch": lambda: prefill_attention(q, k, v, k_cache, v_cache, meta, 0.125, *extra),
                 "ours": lambda: ours.prefill(q, k, v, k_cache, v_cache, meta, 0.125, *extra)}
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(args.rounds):  # in turns, so a noisy moment hits both
            for name, fn in calls.items():
                best[name] = min(best[name], best_ms(fn, rounds=1))
        print(f"chunk {n:5d} at context {ctx:5d}: torch (SDPA) {best['torch']:7.2f} ms   ours {best['ours']:7.2f} ms"
              f"   ({best['torch'] / best['ours']:.2f}x) per layer", flush=True)


def gguf_twins(args) -> None:
    """Each GGUF block twin against bf16 and the min-max Q4_1 twin, per shape and row count."""
    import math

    torch.manual_seed(0)
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the GGUF twins need iterserve's CPU kernels, which did not build here")
    flags = [f for f in cpu_flags_line().split() if f.startswith(("avx", "amx", "f16c", "fma"))]
    print(f"CPU: {cpu_model_name()}; {os.cpu_count()} cores; flags: {' '.join(flags)}")
    print(f"gguf_gemm path: {kernels.gguf_gemm_isa()}; torch threads {torch.get_num_threads()}", flush=True)
    tiled = tiled_gemm_vectorised(kernels)
    avx2 = load_cpu_kernels("avx2") if args.avx2 and kernels.gguf_gemm_isa() == "avx512-vnni" else None
    if args.avx2 and avx2 is None:
        print("--avx2: no AVX2 build to compare here (it needs an AVX-512 VNNI native build)")
    for spec in args.shapes:
        n, k = (int(v) for v in spec.lower().split("x"))
        # enough distinct copies that even the smallest twin's bytes stream from memory (64 MiB)
        copies = max(1, min(args.max_copies, math.ceil((64 << 20) / (n * k * 0.5625))))
        w = torch.randn(n, k) * 0.02
        cands = {}
        if tiled:
            packed = [pack_bf16(w.bfloat16()) for _ in range(copies)]
            cands["bf16 (ours, tiled)"] = lambda x, ws=packed: [kernels.bf16_gemm(x, t, n) for t in ws]
        elif prepack_available():  # oneDNN's bf16 reorder needs AVX-512 (or AVX-NE-CONVERT)
            packed = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 16) for _ in range(copies)]
            cands["bf16 (oneDNN)"] = lambda x, ws=packed: [
                torch.ops.mkldnn._linear_pointwise(x, t, None, "none", [], "") for t in ws]
        if k % 64 == 0:
            q4 = [pack_q4_1(w) for _ in range(copies)]
            cands["q4_1 (min-max)"] = lambda x, ws=q4: [kernels.q4_gemm(x, *t) for t in ws]
        if n >= args.head_rows:  # the LM head's twin until now: Q8_0 rebuilt from the float weight
            q8 = [pack_q8_0(w) for _ in range(copies)]
            cands["q8_0 (rebuilt, float)"] = lambda x, ws=q8: [kernels.q8_0_gemm(x, *t) for t in ws]
        for qtype in args.types:
            if k % GGUF_BLOCKS[qtype][1]:
                continue
            twins = [pack_gguf_twin([RandomShard(0, n, k, qtype)], k) for _ in range(copies)]
            cands[qtype.lower()] = lambda x, ws=twins: [kernels.gguf_gemm(x, b, m, n) for b, m in ws]
            if qtype in KQUANTS and kernels.gguf_gemm_int8_supported():
                cands[qtype.lower() + " int8 x"] = lambda x, ws=twins: [kernels.gguf_gemm(x, b, m, n, True) for b, m in ws]
                if kernels.gguf_gemm_amx_available():  # steps of 16+ rows on AMX-INT8 tiles (the engine's default)
                    cands[qtype.lower() + " int8 x, amx"] = lambda x, ws=twins: [
                        kernels.gguf_gemm(x, b, m, n, True, True) for b, m in ws]
                if avx2 is not None:  # the same sums on the AVX2 build's 256-bit loop
                    cands[qtype.lower() + " int8 x, avx2"] = lambda x, ws=twins: [
                        avx2.gguf_gemm(x, b, m, n, True) for b, m in ws]
        skipped = [q for q in args.types if k % GGUF_BLOCKS[q][1]]
        print(f"\n{n} x {k}, {copies} cop{'y' if copies == 1 else 'ies'}: ms per call"
              + (f" ({', '.join(skipped)}: K is not a multiple of 256)" if skipped else ""))
        print(f"  {'rows':22s}" + "".join(f"{m:>9d}" for m in args.rows))
        table = {name: [] for name in cands}
        for m in args.rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            best = dict.fromkeys(cands, float("inf"))
            for name in cands:
                cands[name](x)  # warm-up
            for _ in range(args.rounds):  # in turns, so a noisy moment hits every candidate
                for name, fn in cands.items():
                    best[name] = min(best[name], best_ms(lambda: fn(x), rounds=1) / copies)
            for name in cands:
                table[name].append(best[name])
        for name, ms in table.items():
            print(f"  {name:22s}" + "".join(f"{v:9.3f}" for v in ms), flush=True)
        del cands
    if args.sampler:
        sampler_cost(args)
    if args.numerics:
        gguf_numerics(args.numerics, llamacpp_url=args.llamacpp_url)


def llamacpp_teacher_forced(url: str, ids: list[int], n_prompt: int) -> tuple[list[int], list[float | None]]:
    """llama-server's greedy token and its logprob of `ids[n]` at every position n >= n_prompt, each
    asked as its own completion of ids[:n] (its prompt cache reuses the prefix): the same positions
    the engines are teacher-forced on. None where ids[n] is not among its 20 most likely."""
    import httpx

    top, lp = [], []
    with httpx.Client(timeout=300) as client:
        for n in range(n_prompt, len(ids)):
            r = client.post(f"{url}/completion", json={"prompt": ids[:n], "n_predict": 1, "n_probs": 20,
                                                        "temperature": 0, "cache_prompt": True})
            r.raise_for_status()
            probs = r.json()["completion_probabilities"][0]["top_logprobs"]
            top.append(int(probs[0]["id"]))
            lp.append(next((float(p["logprob"]) for p in probs if int(p["id"]) == ids[n]), None))
    return top, lp


NUMERICS_PROMPTS = ("The history of the Roman Empire begins with",  # the first: the 48 positions of earlier sittings
                    "def fibonacci(n):\n    \"\"\"Return", "My favourite recipe for bread is",
                    "Question: Why is the sky blue?\nAnswer:", "In 1905 Albert Einstein published")


def gguf_numerics(path: str, steps: int = 48, llamacpp_url: str | None = None) -> None:
    """A GGUF model decoding, teacher-forced on float32's greedy tokens (float32 holds the file's values
    exactly) after each of NUMERICS_PROMPTS (`steps` positions each: 240 in all, so that one run's top-1
    moves by 0.004 a position, not the 0.02 of the first prompt's 48 alone, also printed): where bf16
    is the default dtype, bf16 with no twin (a float copy), with the file's blocks as the weights
    (quantization auto, the default: gguf_gemm for decode steps), the same on int8 activations
    (--gguf-activations int8, then int8-except-down) and with the min-max 4-bit / Q8_0 twins rebuilt
    from the float weights (quantization int4); elsewhere (AVX2) the default float32 run on the blocks,
    int16, int8 and int8-except-down activations: top-1 agreement and |logprob difference| of float32's
    token; with `llamacpp_url`, llama-server on the same file and positions."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests"))
    from model_utils import make_request, new_runner, run_step

    from iterserve.config import EngineConfig
    from iterserve.engine import LLMEngine

    def logits(engine, ids: list[int], n_prompt: int) -> torch.Tensor:
        runner = new_runner((engine.model, engine.model_config, engine.tokenizer), num_blocks=len(ids) // 16 + 2)
        req = make_request("seq", ids)
        got = [run_step(runner, [(req, n_prompt)])[0]]
        got += [run_step(runner, [(req, 1)])[0] for _ in range(len(ids) - n_prompt)]
        return torch.stack(got).float().log_softmax(-1)

    base = dict(model=path, kv_cache_memory="64MiB", measure_kernels=False, max_num_seqs=4)
    ref = LLMEngine(EngineConfig(**base, dtype="float32", quantization="none"))
    seqs = []  # (ids, prompt length, float32's log-probabilities at each position)
    for prompt in NUMERICS_PROMPTS:
        ids = ref.tokenizer(prompt)["input_ids"]
        n_prompt = len(ids)
        for _ in range(steps):  # float32's greedy continuation
            ids.append(int(logits(ref, ids, len(ids))[0].argmax()))
        seqs.append((ids, n_prompt, logits(ref, ids[:-1], n_prompt)))
    del ref
    want = torch.cat([w for _, _, w in seqs])
    tokens = torch.cat([torch.tensor(ids[n:]) for ids, n, _ in seqs])
    rows = torch.arange(len(want))

    def report(label: str, top: torch.Tensor, diffs: torch.Tensor, note: str = "") -> None:
        agree = top == want.argmax(-1)
        print(f"{label:44s} vs float32 over {len(want)} positions: top-1 {agree.float().mean():.3f} "
              f"(first prompt's {steps}: {agree[:steps].float().mean():.3f}), |logprob diff| of float32's "
              f"token mean {diffs.mean():.4f} max {diffs.max():.3f}{note}", flush=True)

    if llamacpp_url:
        top, lp = [], []
        for ids, n_prompt, _ in seqs:
            t, v = llamacpp_teacher_forced(llamacpp_url, ids, n_prompt)
            top += t
            lp += v
        diffs = torch.tensor([abs(v - want[i, tokens[i]].item()) for i, v in enumerate(lp) if v is not None])
        report("llama.cpp (llama-server, same file)", torch.tensor(top), diffs,
               f" ({len(diffs)} positions where it is in llama.cpp's top 20)")
    from iterserve.cpu_info import cpu_flags

    if "avx512_bf16" in cpu_flags() or "amx_bf16" in cpu_flags():  # bf16 is the default dtype here
        runs = [("bf16, no twin", dict(dtype="bfloat16", quantization="none")),
                ("bf16, the file's blocks (default: int16)", dict(dtype="bfloat16", gguf_activations="int16")),
                ("bf16, the blocks, int8 activations", dict(dtype="bfloat16", gguf_activations="int8")),
                ("bf16, the blocks, int8 but down", dict(dtype="bfloat16", gguf_activations="int8-except-down")),
                ("bf16 + min-max int4 / Q8_0 twins", dict(dtype="bfloat16", quantization="int4"))]
    else:  # float32 is (AVX2): the blocks on gguf_gemm in decode steps
        runs = [("float32 auto, the blocks, int16 activations", dict(dtype="auto", gguf_activations="int16")),
                ("float32 auto, the blocks, int8 activations", dict(dtype="auto", gguf_activations="int8")),
                ("float32 auto, the blocks, int8 but down (default)",
                 dict(dtype="auto", gguf_activations="int8-except-down"))]
    for label, kw in runs:
        eng = LLMEngine(EngineConfig(**base, **kw))
        got = torch.cat([logits(eng, ids[:-1], n_prompt) for ids, n_prompt, _ in seqs])
        report(label + " (decode steps: 1 row)", got.argmax(-1), (got[rows, tokens] - want[rows, tokens]).abs())
        del eng


def sampler_cost(args) -> None:
    """Greedy and top-p sampling over a vocabulary of the largest shape's outputs, per step."""
    from iterserve.sampling import Sampler, SamplingParams

    n = max(int(s.lower().split("x")[0]) for s in args.shapes)
    sampler = Sampler(n)
    print()
    for m in args.rows:
        logits = torch.randn(m, n, dtype=torch.bfloat16)  # as the head returns them
        for label, params in (("greedy", SamplingParams(temperature=0)),
                              ("top-p 0.9, T 0.8", SamplingParams(temperature=0.8, top_p=0.9))):
            ms = best_ms(lambda: sampler(logits, [params] * m, [[]] * m, [0] * m, [None] * m), rounds=5)
            print(f"sampler, {m} rows x {n} logits, {label}: {ms:.3f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("linears", help="the 120 decoder projections: bf16 prepacked vs torch int4 vs ours")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--inductor-woq", action="store_true", help="also inductor's int4 template (compiles, ~1 min)")
    p.set_defaults(fn=linears)
    p = sub.add_parser("lm-head", help="the LM head: bf16 prepacked vs an int8 twin vs our Q8_0")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--copies", type=int, default=6, help="distinct heads used in turn (cache eviction)")
    p.add_argument("--numerics", action="store_true", help="logit error of both on the embedded model")
    p.set_defaults(fn=lm_head)
    p = sub.add_parser("attention", help="one layer's decode attention: torch path vs our kernel")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--context", type=int, nargs="+", default=[100, 500])
    p.add_argument("--window", type=int, default=0, help="sliding window in tokens (0: none)")
    p.add_argument("--softcap", type=float, default=0.0, help="attention-logit soft-cap (0: none)")
    p.set_defaults(fn=attention)
    p = sub.add_parser("prefill-attention", help="one layer's prompt-chunk attention: torch SDPA vs our kernel")
    p.add_argument("--chunk", nargs="+", default=["256:256", "512:512", "1024:1024", "256:1024"], metavar="N:CTX",
                   help="chunk tokens : context tokens (the chunk's included)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--window", type=int, default=0, help="sliding window in tokens (0: none)")
    p.add_argument("--softcap", type=float, default=0.0, help="attention-logit soft-cap (0: none)")
    p.set_defaults(fn=prefill_attention_options)
    p = sub.add_parser("gguf-twins", help="twins from GGUF blocks vs bf16 and the min-max Q4_1 twin")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--shapes", nargs="+", default=["640x2048", "2048x2048", "262144x640"], metavar="NxK",
                   help="outputs x inputs")
    p.add_argument("--types", nargs="+", default=["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0"],
                   choices=sorted(GGUF_BLOCKS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--max-copies", type=int, default=128)
    p.add_argument("--avx2", action="store_true", help="on an AVX-512 VNNI host, also the AVX2 build's int8 loop")
    p.add_argument("--head-rows", type=int, default=32768,
                   help="shapes with this many outputs are LM heads: also time the Q8_0 twin rebuilt from floats")
    p.add_argument("--sampler", action="store_true", help="also the sampler over that many logits")
    p.add_argument("--numerics", metavar="GGUF", help="also a GGUF model's logits with each twin vs float32")
    p.add_argument("--llamacpp-url", help="with --numerics: a llama-server serving the same file, asked the same positions")
    p.set_defaults(fn=gguf_twins)
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
