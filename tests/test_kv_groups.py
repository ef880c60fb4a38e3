"""KV cache groups (core/kv_groups.py, core/block_pool.py): windowed layers free the blocks no query
can see again, and everything that counts KV capacity counts it the new way.

- grouping: Gemma 3 270M's 18 layers make 1 full + 5 windowed groups of 3; one kind of layer is one
  group, as before;
- capacity: 1 GiB holds >= 3.5x more 4,096-token Gemma 3 270M sequences (computed, as the start-up
  log and /v1/scheduler report it, and by filling a small cache with real requests);
- exactness: float32 greedy tokens of every windowed family equal transformers' on prompts several
  windows long with out-of-window blocks freed: alone, batched with chunked prefill, under
  preemption, and with prefix-cache hits;
- bf16 through the CPU kernels with windows freed agrees with a runner that keeps every block;
- speculative decoding and static batching on a windowed model give transformers' tokens;
- the pool's invariants after every step of a randomized soak with aborts, and no block left after.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch
from test_model_families import random_model

from iterserve.attention.kv_cache_dtype import FORMATS
from iterserve.config import EngineConfig, ModelConfig
from iterserve.core.block_hash import hash_block_chain
from iterserve.core.block_pool import BlockPool
from iterserve.core.kv_groups import group_layers, kv_cache_groups, single_group
from iterserve.llm import LLM
from iterserve.model.loader import ModelSource, hf_config, load_model, load_tokenizer, resolve_model
from iterserve.platform.base import kv_blocks_for_budget
from iterserve.sampling import SamplingParams

WINDOW = 12
BS = 8  # the engine's smallest block size above 1
PBS = 4  # the pool-only tests' block size
NEW_TOKENS = 12
BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
GEMMA3_270M = dict(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                   sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768)
FAMILIES = {  # every family with windows, windows of WINDOW tokens
    "mistral": ("mistral", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "qwen2": ("qwen2", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
                            tie_word_embeddings=True)),
    "gemma2": ("gemma2", dict(num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
                              attn_logit_softcapping=20.0, final_logit_softcapping=60.0, tie_word_embeddings=True)),
    "gemma3": ("gemma3_text", dict(num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                   tie_word_embeddings=True)),
    "phi3": ("phi3", dict(num_hidden_layers=2, hidden_size=128, sliding_window=WINDOW, pad_token_id=0)),
}


def gemma3_pattern(n: int, window: int) -> list[int]:
    """Gemma 3's layer windows: 5 local, then 1 global."""
    return [0 if i % 6 == 5 else window for i in range(n)]


# ---- grouping -----------------------------------------------------------------------------------
def test_groups_of_each_layout():
    g = group_layers(gemma3_pattern(18, 512))
    assert g.group_size == 3 and g.windows == (0, 512, 512, 512, 512, 512)
    assert g.groups[0].layers == (5, 11, 17) and g.groups[1].layers == (0, 1, 2)
    assert sorted(i for grp in g.groups for i in grp.layers) == list(range(18))
    assert g.layer_slot(17) == (0, 2) and g.layer_slot(6) == (2, 2)
    assert group_layers([0] * 4).windows == (0,) and group_layers([0] * 4).group_size == 4  # as before
    assert group_layers([8] * 2).windows == (8,)  # Mistral: one windowed group
    gemma2 = group_layers([8, 0] * 13)
    assert gemma2.windows == (0, 8) and gemma2.group_size == 13
    qwen2 = group_layers([0] * 21 + [8] * 7)  # max_window_layers=21 of 28
    assert qwen2.windows == (0, 0, 0, 8) and qwen2.group_size == 7
    uneven = group_layers(gemma3_pattern(26, 512))  # Gemma 3 1B: 4 global, 22 local
    assert uneven.group_size == 4 and len(uneven.groups) == 1 + 6 and len(uneven.groups[-1].layers) == 2


# ---- capacity ------------------------------------------------------------------------------------
def gemma3_270m_config(folder) -> ModelConfig:
    """Gemma 3 270M's config (its dims), read as the engine reads a folder's config.json."""
    from transformers import AutoConfig

    AutoConfig.for_model("gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                         **GEMMA3_270M).save_pretrained(folder)
    return hf_config(ModelSource(folder, "hf", "gemma3-270m-config"))


def test_capacity_rises_3_5x_for_gemma3_270m(tmp_path):
    """--kv-cache-memory 1GiB, 4,096-token sequences of Gemma 3 270M's shape, bf16: the blocks
    (of 3 layers now, 18 before) over the blocks one sequence holds (its window's in windowed groups);
    with an 8-bit cache on top (q8_0: 34 bytes per 32 values; fp8: 1 byte a value), 6.5x and more."""
    cfg = gemma3_270m_config(tmp_path)
    groups = kv_cache_groups(cfg)
    assert groups.windows == (0, 512, 512, 512, 512, 512)
    config = EngineConfig(kv_cache_memory="1GiB", block_size=16)

    def fits(kv_format: str) -> int:
        pool = BlockPool(kv_blocks_for_budget(config, cfg, FORMATS[kv_format]), 16, group_windows=groups.windows)
        assert pool.blocks_per_sequence(4096) == 256 + 5 * 33
        return pool.num_usable_blocks // pool.blocks_per_sequence(4096)

    old_blocks = 2**30 // (2 * 18 * 16 * 1 * 256 * 2)  # every layer in every block, as before
    old = old_blocks // (4096 // 16)
    assert (old, fits("bfloat16")) == (14, 51) and fits("bfloat16") >= 3.5 * old
    assert (fits("q8_0"), fits("fp8_e4m3")) == (97, 103) and min(fits("q8_0"), fits("fp8_e4m3")) >= 6.5 * old
    # one kind of layer: the numbers of today (one group of every layer, no null block)
    same = BlockPool(old_blocks, 16, group_windows=single_group(cfg).windows)
    assert same.num_usable_blocks // same.blocks_per_sequence(4096) == old


@pytest.fixture(scope="module")
def gemma3_270m_shape_dir(tmp_path_factory):
    """A random Gemma 3 with 270M's attention shape (KV bytes per token are the real model's) and a
    small hidden size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("gemma3-270m-shape")
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gemma3_text", vocab_size=49152, hidden_size=64, intermediate_size=128,
                               **GEMMA3_270M)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(folder)
    return folder


def test_engine_reports_capacity_in_log_and_scheduler_endpoint(gemma3_270m_shape_dir, caplog):
    with caplog.at_level(logging.INFO, logger="iterserve"):
        llm = LLM(model=str(gemma3_270m_shape_dir), dtype="bfloat16", kv_cache_memory="1GiB", max_model_len=4096,
                  block_size=16)
    from iterserve.server.dashboard import engine_info

    resolved = engine_info(llm.engine, "gemma3", "gemma3")  # /v1/scheduler's "config"
    assert resolved["max_num_sequences"] == 51 and resolved["num_kv_blocks"] == 2**30 // (2 * 3 * 16 * 256 * 2)
    assert [g["window"] for g in resolved["kv_cache_groups"]] == [0] + [512] * 5
    assert "fits 51 sequences of max_model_len 4096" in caplog.text
    assert "6 groups of 3 layers (1 full, 5 windowed: window 512)" in caplog.text
    assert llm.engine.memory.kv_cache <= 2**30  # each shared tensor counted once
    assert llm.engine.memory.layers_per_block == 3 and "blocks x 16 tokens x 3 layers" in caplog.text
    eight_bit = LLM(model=str(gemma3_270m_shape_dir), dtype="bfloat16", kv_cache_memory="1GiB", max_model_len=4096,
                    block_size=16, kv_cache_dtype="q8_0")
    info = engine_info(eight_bit.engine, "gemma3", "gemma3")
    assert info["max_num_sequences"] == 97 and info["kv_cache_dtype"] == "q8_0"  # 6.9x the 14 of before


@pytest.fixture(scope="module")
def family_loaded(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            model_type, overrides = FAMILIES[name]
            hf = random_model(model_type, {**BASE, **overrides})
            hf.save_pretrained(folder, safe_serialization=True)
            load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(folder)
            model, cfg, tok, _ = load_model(str(folder), torch.float32)
            made[name] = (folder, hf, (model, cfg, tok))
        return made[name]

    return get


def test_filling_a_small_cache_holds_the_predicted_number_of_sequences(family_loaded):
    """Real requests of 64 tokens (Gemma 3's pattern in 6 layers: 5 windowed of window 12, 1 full,
    so 6 groups of 1 layer; blocks of 8) fill a cache of 116 one-layer blocks: as many reach their
    decode at once as the pool predicts for that length (5, where keeping every layer's blocks held
    2), and the scheduler makes the rest wait."""
    _, _, loaded = family_loaded("gemma3")
    length, new_tokens = 64, 16  # each decodes long enough for the others to catch up
    llm = LLM(loaded=loaded, num_kv_blocks=116, block_size=BS, max_model_len=length, max_num_seqs=64,
              max_num_batched_tokens=32)
    eng = llm.engine
    pool = eng.pool
    assert pool.group_windows == (0,) + (WINDOW,) * 5 and pool.blocks_per_sequence(length) == 8 + 5 * 3
    predicted = eng.max_num_sequences()
    old = 116 // (6 * length // BS)  # every layer's blocks of the whole sequence
    assert predicted == 5 and old == 2
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (length - new_tokens,), generator=g).tolist() for _ in range(12)]
    peak = {"full": 0, "waiting": 0}

    def on_step(rec) -> None:
        pool.check_invariants()
        full = sum(1 for r in eng.scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens)
        if full > peak["full"]:
            peak.update(full=full, waiting=eng.scheduler.num_waiting)

    eng.step_listeners.append(on_step)
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                       use_tqdm=False)
    assert all(len(r.token_ids) == new_tokens for r in out)
    assert peak["full"] == predicted and peak["waiting"] > 0
    assert pool.num_free == pool.num_usable_blocks and not pool.tables
    pool.check_invariants()


# ---- exactness against transformers ----------------------------------------------------------------
def hf_greedy_each(hf, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:
            seq = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
            out.append(seq[0, len(p):].tolist())
    return out


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)]


def checked(llm: LLM) -> LLM:
    """Checks the pool's invariants after every step, and records whether a window freed anything."""
    pool = llm.engine.pool
    llm.freed_any = False

    def on_step(rec) -> None:
        pool.check_invariants()
        llm.freed_any |= any(pool.null_block in t for ts in pool.group_tables.values() for t in ts)

    llm.engine.step_listeners.append(on_step)
    return llm


@pytest.mark.parametrize("family", list(FAMILIES))
def test_windowed_family_matches_transformers_with_windows_freed(family, family_loaded):
    _, hf, loaded = family_loaded(family)
    cfg = loaded[1]
    assert cfg.has_windows and cfg.sliding_window == WINDOW
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (70, 83, 97)]  # 6-8 windows
    ref = hf_greedy_each(hf, prompts)

    alone = checked(LLM(loaded=loaded, kv_cache_memory="8MiB", block_size=BS))
    assert [greedy(alone, [p])[0] for p in prompts] == ref
    assert alone.freed_any

    # batched, prompts in chunks of a few tokens (a chunk's first query reads the window before it)
    batched = checked(LLM(loaded=loaded, kv_cache_memory="8MiB", block_size=BS, max_num_batched_tokens=10))
    assert greedy(batched, prompts) == ref and batched.freed_any

    # a cache too small for all three: preempted and recomputed (a model with windows on every layer
    # holds a constant few blocks per sequence: only a cache of about one sequence preempts it)
    windows = kv_cache_groups(cfg).windows
    per_seq = BlockPool(2, BS, group_windows=windows).blocks_per_sequence(max(map(len, prompts)) + NEW_TOKENS)
    tight = checked(LLM(loaded=loaded, num_kv_blocks=2 * per_seq + 3 if 0 in windows else per_seq + 2,
                        block_size=BS, max_num_batched_tokens=16))
    assert greedy(tight, prompts) == ref
    assert tight.engine.scheduler.num_preemptions_total > 0

    # prefix-cache hits: a prompt again, and one that extends another
    longer = prompts[1] + prompts[2][:30]
    (ref_longer,) = hf_greedy_each(hf, [longer])
    cached = checked(LLM(loaded=loaded, kv_cache_memory="8MiB", block_size=BS))
    assert greedy(cached, [prompts[1]]) == [ref[1]]
    assert greedy(cached, [prompts[1], longer]) == [ref[1], ref_longer]
    assert cached.engine.scheduler.prefix_cache_hits >= 2 * (len(prompts[1]) // BS - 1) * BS


# ---- the pool alone --------------------------------------------------------------------------------
def test_windowed_group_frees_blocks_before_the_window_and_hits_need_the_window():
    pool = BlockPool(40, PBS, enable_caching=True, group_windows=(0, 6))
    tokens = list(range(30))
    hashes = hash_block_chain(tokens, PBS)
    assert pool.allocate("a", 30)
    pool.cache_blocks("a", hashes, 30)
    # next token at 30 sees 25..30: blocks 6 (24..27) and 7 on; blocks 0..5 of the windowed group go
    assert pool.remove_skipped_blocks("a", 30) == 6
    assert pool.group_tables["a"][1][:6] == [pool.null_block] * 6 and pool.null_block not in pool.tables["a"]
    pool.check_invariants()
    # the freed blocks stay cached (evictable): a hit of 7 blocks needs blocks 5 and 6 of the window
    # (next token at 28 sees 23..28): block 5 was freed but is still registered
    hit = pool.find_cached_prefix(hashes[:7])
    assert len(hit[0]) == 7 and hit[1][:5] == [pool.null_block] * 5 and pool.null_block not in hit[1][5:]
    assert pool.allocate("b", 29, hit, num_computed_tokens=28)
    pool.check_invariants()
    pool.free("a")
    pool.free("b")
    pool.check_invariants()
    assert pool.num_free == pool.num_usable_blocks
    # once a windowed block is evicted, a hit that needs it is shorter
    pool.reset_prefix_cache()
    assert pool.find_cached_prefix(hashes[:7]) == [[], []]


def test_chunk_keeps_the_window_before_its_first_query():
    pool = BlockPool(20, PBS, group_windows=(6,))
    assert pool.allocate("a", 8)  # a first chunk of 8
    assert pool.remove_skipped_blocks("a", 8) == 0  # the next chunk's first query (8) sees 3..8: block 0
    assert pool.allocate("a", 16)
    assert pool.remove_skipped_blocks("a", 16) == 2  # 16 sees 11..16: blocks 0 (0..3) and 1 (4..7) go
    assert pool.tables["a"][:3] == [0, 0, pool.tables["a"][2]] and pool.tables["a"][2] != 0
    assert pool.fit_tokens("a", 16) == (len(pool.tables["a"]) + pool.num_free) * PBS - 16


def test_randomized_pool_soak_with_windows():
    """Random allocations, window frees, cache registrations, truncations and frees on a pool of
    a full and two windowed groups: invariants hold after each; every block is back at the end."""
    rng = random.Random(0)
    for _ in range(20):
        pool = BlockPool(60, PBS, enable_caching=True, group_windows=(0, 5, 9))
        seqs: dict[str, list[int]] = {}
        computed: dict[str, int] = {}
        for step in range(300):
            op = rng.random()
            rid = f"r{rng.randrange(8)}"
            if rid not in seqs and op < 0.5:
                toks = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
                hashes = hash_block_chain(toks, PBS)
                hit = pool.find_cached_prefix(hashes[: (len(toks) - 1) // PBS])
                k = len(hit[0]) * PBS
                n = rng.randrange(1, len(toks) - k + 1)
                if pool.allocate(rid, k + n, hit, num_computed_tokens=k):
                    seqs[rid], computed[rid] = toks, k + n
            elif rid in seqs and op < 0.75:
                c = computed[rid]
                pool.cache_blocks(rid, hash_block_chain(seqs[rid], PBS), c)
                pool.remove_skipped_blocks(rid, c)
                grow = rng.randrange(1, 8)
                if pool.allocate(rid, c + grow):
                    seqs[rid] += [rng.randrange(3) for _ in range(max(0, c + grow - len(seqs[rid])))]
                    computed[rid] = c + grow
                    # every group covers the new tokens, and a windowed group the window before them
                    for w, t in zip(pool.group_windows, pool.group_tables[rid]):
                        lo = max(0, c - w + 1) if w else 0
                        assert all(t[p // PBS] != pool.null_block or (w == 0 and pool.null_block is None)
                                   for p in range(lo, c + grow))
            elif rid in seqs and op < 0.8:
                pool.truncate(rid, max(1, computed[rid] - rng.randrange(4)))
                computed[rid] = min(computed[rid], len(pool.tables[rid]) * PBS)
            elif rid in seqs:
                pool.free(rid)
                pool.free(rid)  # twice: a no-op
                del seqs[rid], computed[rid]
            pool.check_invariants()
        for rid in list(seqs):
            pool.free(rid)
        pool.check_invariants()
        assert pool.num_free == pool.num_usable_blocks


def test_engine_soak_with_aborts_and_prefix_caching(family_loaded):
    """A tight cache, random prompts that share prefixes, random lengths and aborts, through the
    engine's scheduler: the pool's invariants after every step, no block held at the end."""
    _, _, loaded = family_loaded("gemma3")
    rng = random.Random(1)
    llm = LLM(loaded=loaded, num_kv_blocks=60, block_size=BS, max_num_batched_tokens=24, max_num_seqs=6)
    eng = llm.engine
    heads = [[rng.randrange(3, 49152) for _ in range(30)] for _ in range(3)]
    live: list[str] = []
    for step in range(150):
        if rng.random() < 0.4:
            tail = [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 20))]
            p = rng.choice(heads)[: rng.randrange(4, 30)] + tail
            params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 16), ignore_eos=True)
            live.append(eng.add_request(prompt_token_ids=p, params=params).request_id)
        if live and rng.random() < 0.1:
            eng.abort_request(live.pop(rng.randrange(len(live))))
        eng.step()
        eng.pool.check_invariants()
    while eng.has_unfinished_requests():
        eng.step()
        eng.pool.check_invariants()
    assert not eng.pool.tables and eng.pool.num_free == eng.pool.num_usable_blocks
    assert eng.scheduler.prefix_cache_hits > 0


def test_simulator_and_plan_count_blocks_by_groups(tmp_path):
    """A profile's recorded model shape gives the simulator's pool (and `plan`, which runs it) the
    engine's groups and block count: Gemma 3 270M's 1 GiB is 21,845 blocks of 3 layers."""
    import dataclasses

    from iterserve.bench.workload import poisson
    from iterserve.sim.profile import Profile
    from iterserve.sim.simulator import SimEngine, simulate
    from iterserve.sim.step_model import LinearStepModel

    cfg = gemma3_270m_config(tmp_path)
    prof = Profile(kind="measured", model="gemma3-270m-shape", dtype="bfloat16",
                   step_model=LinearStepModel([0.004, 0.0002, 0.00002, 0.0, 1e-7, 0.0]),
                   kv_bytes_per_token=2 * 18 * 256 * 2, max_model_len=4096, kv_memory_bytes=2**30,
                   model_shape=json_roundtrip(dataclasses.asdict(cfg)))
    config = EngineConfig(block_size=16)
    assert prof.kv_groups().windows == (0,) + (512,) * 5
    assert prof.num_kv_blocks(config) == 2**30 // (2 * 3 * 16 * 256 * 2)
    eng = SimEngine(config, prof)
    assert eng.pool.group_windows == (0,) + (512,) * 5
    assert eng.pool.num_usable_blocks // eng.pool.blocks_per_sequence(4096) == 51
    specs = poisson(40, 20.0, seed=1, input_len=(1500, 3000), output_len=(8, 64))
    run = simulate(specs, config, prof)
    assert run.result.summary()["completed"] == len(specs)
    # a profile without a shape (written before groups) counts as before: every layer in a block
    old = Profile(kind="measured", model="x", dtype="float32", step_model=prof.step_model,
                  kv_bytes_per_token=1024, max_model_len=2048, kv_memory_bytes=2**20)
    assert old.num_kv_blocks(config) == 2**20 // (1024 * 16)


def json_roundtrip(d: dict) -> dict:
    """As a profile file stores it (tuples become lists)."""
    import json

    return json.loads(json.dumps(d))


def test_windowed_model_with_speculative_decoding_and_static_batching(family_loaded):
    """Gemma 3's groups with n-gram drafts (rejected drafts' blocks trimmed from every group) and with
    static batching (each group's blocks reserved for the whole sequence): transformers' tokens."""
    _, hf, loaded = family_loaded("gemma3")
    g = torch.Generator().manual_seed(9)
    motif = torch.randint(3, 49152, (15,), generator=g).tolist()
    prompts = [motif * 5, torch.randint(3, 49152, (70,), generator=g).tolist()]  # drafts find the motif
    ref = hf_greedy_each(hf, prompts)
    spec = checked(LLM(loaded=loaded, kv_cache_memory="8MiB", block_size=BS,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 4}))
    assert greedy(spec, prompts) == ref and spec.freed_any
    assert sum(r.spec_draft_tokens for r in spec.engine.records) > 0
    static = checked(LLM(loaded=loaded, kv_cache_memory="8MiB", block_size=BS, batching="static", max_batch_size=2,
                         batch_timeout_ms=0))
    assert greedy(static, prompts) == ref
    assert static.engine.pool.num_free == static.engine.pool.num_usable_blocks


def test_shared_decode_kv_counts_no_null_block():
    """Two decode rows of a window-only model whose first entries were freed name the null block:
    not KV they share (step records and the simulator's step model price shared KV cheaper)."""
    from iterserve.core.scheduler import ScheduledRequest, SchedulerOutput
    from iterserve.request import Request

    def row(rid: str, table: list[int]) -> ScheduledRequest:
        req = Request(rid, list(range(20)), SamplingParams(max_tokens=1))
        return ScheduledRequest(req, 1, 19, table, [0], sample=True)

    out = SchedulerOutput([row("a", [0, 0, 5, 6, 7]), row("b", [0, 0, 8, 9, 10])])
    assert out.shared_decode_kv(4, null_block=0) == 0
    assert out.shared_decode_kv(4) == 8  # block 0 read as a real block by both rows (one group)


def test_bf16_kernels_with_windows_freed_agree_with_every_block_kept(tmp_path):
    """bf16 through the engine's own loading (the CPU platform's attention kernels, whose reads of
    a window must never reach a freed block): the greedy tokens of a grouped engine, prompts in
    chunks, are the argmax of a one-group runner that keeps every block (model_utils, one prefill)."""
    from model_utils import sequence_logits

    model_type, overrides = FAMILIES["gemma3"]
    hf = random_model(model_type, {**BASE, **overrides, "sliding_window": 32, "head_dim": 64})
    hf.save_pretrained(tmp_path, safe_serialization=True)
    load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (150, 190)]
    llm = checked(LLM(model=str(tmp_path), dtype="bfloat16", kv_cache_memory="16MiB", block_size=16,
                      max_num_batched_tokens=40))
    eng = llm.engine
    assert len(eng.kv_groups.groups) == 6
    outs = greedy(llm, prompts)
    assert llm.freed_any
    for p, out in zip(prompts, outs):
        logits = sequence_logits((eng.model, eng.model_config, eng.tokenizer), p + out[:-1])[len(p) - 1:]
        # teacher-forced on our own tokens, so a bf16 near-tie flips one position, not the rest (24 of
        # 24 agreed where this was written); a read of a freed block would garble every later position
        assert sum(a != b for a, b in zip(logits.argmax(-1).tolist(), out)) <= 1
