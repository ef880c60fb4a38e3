"""`iterserve profile MODEL`: time real engine steps over a grid of shapes and fit a step model.

Each grid point is one step laid out by hand: some decode rows at a KV context length, and/or one
prefill chunk (from position 0, or after a context for a later chunk). A few decode steps give their rows the same first KV blocks, as prefix
caching does for requests with one system prompt (a block read twice in a step is cheaper). The
engine's own `ModelRunner.execute` runs it (attention over the paged cache, the LM head and sampling: what the
engine times as a step), once to warm up and then once in each of `repeats` passes over the grid; the
median is kept. The KV cache holds whatever the slots held before: step time does not depend on the
values.
On a mixture-of-experts model every timed step also counts the distinct experts each MoE layer ran
(SparseMoeBlock.expert_counts): the step model's `moe_experts`, and the profile's measured curves of
distinct experts per decode batch size and per prompt chunk length (sim/moe.py).
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from iterserve.config import EngineConfig
from iterserve.core.kv_groups import single_group
from iterserve.core.scheduler import ScheduledRequest, SchedulerOutput
from iterserve.engine import LLMEngine
from iterserve.model.moe import count_experts
from iterserve.platform.base import kv_bytes_per_block
from iterserve.request import Request
from iterserve.sampling import SamplingParams
from iterserve.sim.moe import measured_curve, moe_routing
from iterserve.sim.profile import Profile, cpu_machine, git_commit, now_iso
from iterserve.sim.step_model import LinearStepModel, StepFeatures, step_features


@dataclass
class StepShape:
    """One step to time: its rows as (tokens already computed, tokens computed now), and how many
    leading KV tokens every row shares (the same blocks in each row's table; 0: none)."""

    rows: list[tuple[int, int]]
    shared: int = 0


@dataclass
class ProfileGrid:
    """The step shapes to time. Mixed steps put `mixed_decode` decode rows next to a prefill chunk."""

    decode_batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    context_lens: list[int] = field(default_factory=lambda: [128, 512, 1024])
    prefill_chunks: list[int] = field(default_factory=lambda: [16, 64, 256, 1024])
    chunk_context: int = 512  # a later chunk of a long prompt: this many tokens already computed
    mixed_decode: list[int] = field(default_factory=lambda: [4, 15])
    mixed_chunks: list[int] = field(default_factory=lambda: [64, 512])
    # short chunks after chunk_context cached tokens, alone and next to mixed_decode rows: what a
    # prefix-cache hit leaves to compute (a chat turn after its cached history)
    later_chunks: list[int] = field(default_factory=lambda: [64, 256])
    # decode batches whose rows share their first `shared_prefix` tokens' blocks (a common system
    # prompt under prefix caching), at each context length above it
    shared_prefix: int = 384
    shared_batches: list[int] = field(default_factory=lambda: [4, 16, 32])

    def shapes(self, max_tokens: int, max_len: int, cuts: tuple[int, ...] = ()) -> list[StepShape]:
        """Each step to time. `cuts`: the engine's cut-overs between weight copies; the decode
        batches on both sides of each are added, so the fit sees both regimes."""
        out: list[list[tuple[int, int]]] = []
        batches = sorted(set(self.decode_batches) | {b for c in cuts if c for b in (c, c + 1)})
        for ctx in self.context_lens:
            for b in batches:
                if ctx < max_len and b <= max_tokens:
                    out.append([(ctx, 1)] * b)
        for chunk in self.prefill_chunks:
            if chunk <= min(max_tokens, max_len):
                out.append([(0, chunk)])
        later = min(self.prefill_chunks[-1], max_tokens)
        if self.chunk_context + later <= max_len:
            out.append([(self.chunk_context, later)])
        for b in self.mixed_decode:
            for chunk in self.mixed_chunks:
                if b + chunk <= max_tokens and chunk < max_len:
                    out.append([(256, 1)] * b + [(0, chunk)])
        ctx = self.chunk_context
        for chunk in self.later_chunks:
            if ctx + chunk <= max_len and chunk <= max_tokens:
                out.append([(ctx, chunk)])
                out += [[(ctx, 1)] * b + [(ctx, chunk)] for b in self.mixed_decode if b + chunk <= max_tokens]
        shapes = [StepShape(rows) for rows in out]
        if self.shared_prefix:
            shapes += [StepShape([(ctx, 1)] * b, self.shared_prefix) for ctx in self.context_lens
                       for b in self.shared_batches if self.shared_prefix < ctx < max_len and 1 < b <= max_tokens]
        return shapes


def time_step(engine: LLMEngine, shape: StepShape, rng: np.random.Generator,
              warmup: bool = True, experts: list[list[int]] | None = None) -> tuple[StepFeatures, float] | None:
    """The step's features and one timed run of it (after an untimed one if `warmup`). `experts`: the
    MoE layers' counters (`count_experts`), read into the features' moe_experts."""
    pool, vocab, rows = engine.pool, engine.model_config.vocab_size, shape.rows
    block_size = engine.config.block_size
    reqs = []
    for i, (done, n) in enumerate(rows):
        ids = rng.integers(0, vocab, done + n).tolist()
        req = Request(f"profile-{i}", ids, SamplingParams(max_tokens=1, temperature=0.0))
        req.num_computed_tokens = done
        reqs.append(req)
    try:
        if not all(pool.allocate(r.request_id, r.num_tokens) for r in reqs):
            return None  # does not fit this cache: skipped
        # shared: the leading blocks of the first row's table in every row's (copies: the pool frees its own)
        lead = pool.tables[reqs[0].request_id][:shape.shared // block_size]
        tables = [lead + pool.tables[r.request_id][len(lead):] for r in reqs]
        sched = SchedulerOutput([ScheduledRequest(r, n, done, t, r.token_slice(done, n), sample=True)
                                 for r, (done, n), t in zip(reqs, rows, tables)])
        if warmup:
            engine.runner.execute(sched)
        for counts in experts or ():
            counts.clear()
        t0 = time.perf_counter()
        engine.runner.execute(sched)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        features = step_features(sched, block_size)
        if experts:
            features = dataclasses.replace(features, moe_experts=float(sum(sum(c) for c in experts)))
        return features, seconds
    finally:
        for r in reqs:
            pool.free(r.request_id)


def measure_profile(config: EngineConfig, grid: ProfileGrid | None = None, repeats: int = 5,
                    progress: bool = True, seed: int = 0) -> Profile:
    """Times every shape of the grid `repeats` times, in `repeats` passes over the whole grid (each in
    its own shuffled order, one warm-up run per shape in the first) rather than all repeats of a shape
    back to back: a shared machine's speed drifts over minutes, and passes spread a slow stretch over
    all shapes instead of biasing the few timed during it. The median per shape is kept."""
    grid = grid or ProfileGrid()
    engine = LLMEngine(config)
    rng = np.random.default_rng(seed)
    # the engine's cut-overs to its quantised weight copies (CPU platform only; 0: none)
    twin_max = int(getattr(engine.platform, "int4_max_tokens", 0) or 0)
    head_max = int(getattr(engine.platform, "q8_head_max_tokens", 0) or 0)
    shapes = grid.shapes(engine.config.max_num_batched_tokens, engine.max_model_len, (twin_max, head_max))
    experts = count_experts(engine.runner.model)
    features: dict[int, StepFeatures] = {}
    runs: dict[int, list[float]] = {}
    expert_runs: dict[int, list[float]] = {}  # each pass's rows carry new random tokens: new routes
    t_start = time.perf_counter()
    for rep in range(max(repeats, 1)):
        order = list(range(len(shapes)))
        if rep:
            rng.shuffle(order)
        for k in order:
            if rep and k not in features:
                continue  # did not fit the cache
            got = time_step(engine, shapes[k], rng, warmup=rep == 0, experts=experts)
            if got is None:
                continue
            features[k] = got[0]
            runs.setdefault(k, []).append(got[1])
            expert_runs.setdefault(k, []).append(got[0].moe_experts)
            if progress:
                f = got[0]
                print(f"profile: pass {rep + 1}/{repeats} [{k + 1}/{len(shapes)}] seqs {f.seqs:3d} tokens {f.tokens:5d} "
                      f"(prefill {f.prefill_tokens:5d}) decode kv {f.decode_kv:6d} (shared {f.decode_kv_shared:5d}): "
                      f"{got[1] * 1e3:8.1f} ms" + (f", {f.moe_experts:.0f} experts" if experts else ""),
                      file=sys.stderr)
    keys = sorted(features)
    feats = [dataclasses.replace(features[k], moe_experts=statistics.fmean(expert_runs[k])) for k in keys]
    secs = [statistics.median(runs[k]) for k in keys]
    model = LinearStepModel.fit(feats, secs, twin_max, head_max)
    pred = np.array([model.predict(f) for f in feats])
    rel = np.abs(pred - np.array(secs)) / np.array(secs)
    mcfg = engine.model_config
    moe = moe_routing(mcfg, engine.dtype.itemsize,
                      measured_curve([(f.seqs, f.moe_experts) for f in feats if not f.prefill_tokens], len(experts)),
                      measured_curve([(f.tokens, f.moe_experts) for f in feats if f.seqs == 1 and f.prefill_tokens],
                                     len(experts))) if experts else None
    # every layer's K and V for one token (the profile's unit), in the cache's format (--kv-cache-dtype)
    per_token = kv_bytes_per_block(mcfg, 1, engine.platform.kv_cache, single_group(mcfg))
    machine = {**cpu_machine(), "device": str(engine.device), "torch_threads": torch.get_num_threads(),
               "torch": torch.__version__}
    if engine.device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(engine.device)
    return Profile(
        kind="measured", model=config.model, dtype=str(engine.dtype).removeprefix("torch."), step_model=model,
        kv_bytes_per_token=int(per_token), max_model_len=engine.max_model_len,
        kv_memory_bytes=engine.pool.num_blocks * config.block_size * int(per_token)
        if engine.device.type == "cuda" else None,
        model_shape=dataclasses.asdict(mcfg), engine_flags=dataclasses.asdict(engine.config), machine=machine,
        commit=git_commit(), created=now_iso(),
        fit={"points": len(secs), "repeats": repeats, "mean_abs_rel_err": float(rel.mean()),
             "max_abs_rel_err": float(rel.max()), "profiling_s": time.perf_counter() - t_start},
        samples=[{**dataclasses.asdict(f), "seconds": s} for f, s in zip(feats, secs)], moe=moe,
        note="measured: median of repeated ModelRunner.execute calls per step shape, fitted by "
             "non-negative least squares on relative error")
