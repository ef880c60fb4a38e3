"""LoRA adapters (iterserve/lora/) on the tiny Llama, against PEFT's merged models in transformers.

Adapters are random (both halves: PEFT starts lora_B at zero) and of several ranks and target sets,
one with rsLoRA. Each one's greedy tokens equal PEFT's merged model's; one step mixing adapters and
the base model gives every row what it gets alone; the prefix cache never shares KV between
adapters; with fewer slots than adapters every request still gets its own adapter's output.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from iterserve.bench.random_lora import AdapterSpec, greedy_tokens, make_random_adapter, merged_model
from iterserve.config import EngineConfig
from iterserve.engine import LLMEngine
from iterserve.llm import LLM
from iterserve.lora.adapter import LoRAError
from iterserve.lora.manager import LoRAInUse
from iterserve.request import RequestRejected
from iterserve.sampling import SamplingParams

pytest.importorskip("peft")

SPECS = {  # name -> adapter: ranks 2..16, attention only, MLP only, all seven, rsLoRA
    "attn4": AdapterSpec(rank=4, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    "mlp8": AdapterSpec(rank=8, alpha=16, targets=("gate_proj", "up_proj", "down_proj")),
    "all16rs": AdapterSpec(rank=16, alpha=32, use_rslora=True),
    "mix2": AdapterSpec(rank=2, alpha=4, targets=("q_proj", "v_proj", "down_proj")),
}
MAX_TOKENS = 10
PROMPTS = [[1] + [(97 * i + 13 * j) % 4000 + 50 for j in range(n)] for i, n in enumerate((5, 19, 37))]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("loras")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    return {name: str(make_random_adapter(base, root / name, spec, seed=i))
            for i, (name, spec) in enumerate(SPECS.items())}


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters):
    """PEFT's merged model's greedy tokens for every (adapter, prompt); None: the base model."""
    from transformers import AutoModelForCausalLM

    out = {}
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    out[None] = [greedy_tokens(base, p, MAX_TOKENS) for p in PROMPTS]
    for name, path in adapters.items():
        merged = merged_model(tiny_model_dir, path)
        out[name] = [greedy_tokens(merged, p, MAX_TOKENS) for p in PROMPTS]
    return out


def lora_llm(tiny_model_dir, adapters, **kw) -> LLM:
    kw.setdefault("max_loras", 4)
    kw.setdefault("max_lora_rank", 16)
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="32MiB", enable_lora=True,
                       lora_modules=dict(adapters), **kw)
    return LLM(config=cfg)


def params(name: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, lora_name=name)


def test_every_adapter_matches_peft_merged_model(tiny_model_dir, adapters, expected):
    for name in adapters:  # the test can fail: each adapter moves the greedy tokens off the base model's
        assert expected[name] != expected[None], name
    llm = lora_llm(tiny_model_dir, adapters)
    for name in [None, *adapters]:
        got = [r.token_ids for r in llm.generate(PROMPTS, params(name), use_tqdm=False)]
        assert got == expected[name], name


def test_one_batch_of_16_mixing_four_adapters_and_the_base_model(tiny_model_dir, adapters, expected):
    llm = lora_llm(tiny_model_dir, adapters)
    names = [None, *adapters]
    rows = [(names[i % 5], i % len(PROMPTS)) for i in range(16)]
    steps_with_all = []
    llm.engine.step_listeners.append(lambda rec: steps_with_all.append(rec.batch_size))
    got = llm.generate([PROMPTS[p] for _, p in rows], [params(n) for n, _ in rows], use_tqdm=False)
    assert max(steps_with_all) == 16  # all 16 rows, 5 kinds of them, in one step
    for (name, p), r in zip(rows, got):
        assert r.token_ids == expected[name][p], (name, p)
    assert llm.engine.lora.stats.loads == 4  # four slots, each loaded once
    assert sum(llm.engine.lora.stats.requests.values()) == 12  # 16 rows, 4 of them the base model


def test_prefix_cache_keeps_adapters_apart(tiny_model_dir, adapters, expected):
    llm = lora_llm(tiny_model_dir, adapters, enable_prefix_caching=True)
    eng = llm.engine
    prompt = PROMPTS[2]  # 38 tokens: two full blocks of 16
    a = eng.add_request(params=params("attn4"), prompt_token_ids=prompt)
    b = eng.add_request(params=params("mlp8"), prompt_token_ids=prompt)
    c = eng.add_request(params=params(None), prompt_token_ids=prompt)
    eng.step()
    eng.step()  # their full prompt blocks are now registered in the cache
    tables = [eng.pool.tables[r.request_id] for r in (a, b, c)]
    assert not set(tables[0]) & set(tables[1]) and not set(tables[0]) & set(tables[2]) \
        and not set(tables[1]) & set(tables[2])
    assert len({tuple(r.block_hashes[:2]) for r in (a, b, c)}) == 3
    res = {r.request_id: r for r in llm.run_until_done([a.request_id, b.request_id, c.request_id])}
    assert res[a.request_id].token_ids == expected["attn4"][2]
    assert res[b.request_id].token_ids == expected["mlp8"][2]
    assert res[c.request_id].token_ids == expected[None][2]
    # the same prompt again under attn4 shares attn4's cached blocks; under mix2 it shares nothing
    seen = []
    eng.step_listeners.append(lambda rec: seen.extend(rec.admitted))
    again = llm.generate([prompt, prompt], [params("attn4"), params("mix2")], use_tqdm=False)
    cached = dict(seen)
    assert cached[again[0].request_id] == 32 and cached[again[1].request_id] == 0
    assert again[0].token_ids == expected["attn4"][2] and again[1].token_ids == expected["mix2"][2]
    eng.pool.check_invariants()


def test_two_slots_four_adapters_under_load(tiny_model_dir, adapters, expected):
    llm = lora_llm(tiny_model_dir, adapters, max_loras=2, max_num_seqs=8)
    names = [*adapters, None]
    rows = [(names[i % 5], i % len(PROMPTS)) for i in range(20)]
    resident_counts = []
    llm.engine.step_listeners.append(lambda rec: resident_counts.append(len(llm.engine.lora.resident)))
    got = llm.generate([PROMPTS[p] for _, p in rows], [params(n) for n, _ in rows], use_tqdm=False)
    for (name, p), r in zip(rows, got):
        assert r.finish_reason == "length"
        assert r.token_ids == expected[name][p], (name, p)
    assert max(resident_counts) == 2
    loads = llm.engine.lora.stats.loads
    assert loads >= 4 and llm.engine.lora.info()["loads_total"] == loads


def test_requests_and_unloads(tiny_model_dir, adapters):
    llm = lora_llm(tiny_model_dir, adapters)
    eng = llm.engine
    with pytest.raises(RequestRejected) as e:
        eng.add_request(params=params("nope"), prompt_token_ids=PROMPTS[0])
    assert e.value.status_code == 404
    req = eng.add_request(params=params("mix2"), prompt_token_ids=PROMPTS[0])
    with pytest.raises(LoRAInUse):
        eng.remove_lora("mix2")  # waiting
    eng.step()
    with pytest.raises(LoRAInUse):
        eng.remove_lora("mix2")  # running
    llm.run_until_done([req.request_id])
    eng.remove_lora("mix2")
    assert "mix2" not in eng.lora and "mix2" not in eng.lora.resident
    with pytest.raises(RequestRejected):
        eng.add_request(params=params("mix2"), prompt_token_ids=PROMPTS[0])
    with pytest.raises(LoRAError):
        eng.remove_lora("mix2")


# ---- refusals -------------------------------------------------------------------------------------------
def _edited(src: str, dst, config: dict | None = None, tensors=None):
    """A copy of adapter folder `src` with its config updated and/or its tensors replaced."""
    dst.mkdir()
    cfg = json.loads(open(f"{src}/adapter_config.json").read())
    cfg.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    t = load_file(f"{src}/adapter_model.safetensors")
    save_file(tensors(t) if tensors else t, str(dst / "adapter_model.safetensors"))
    return dst


def test_bad_adapters_are_refused_and_nothing_changes(tiny_model_dir, adapters, tmp_path):
    src = adapters["mix2"]
    key = next(k for k in load_file(f"{src}/adapter_model.safetensors") if "q_proj.lora_A" in k)
    bad = {
        "rank 16 is above --max-lora-rank 8": adapters["all16rs"],
        "DoRA": _edited(src, tmp_path / "dora", {"use_dora": True}),
        "bias": _edited(src, tmp_path / "bias", {"bias": "all"}),
        "modules_to_save": _edited(src, tmp_path / "mts", {"modules_to_save": ["lm_head"]}),
        "not one the base model has": _edited(src, tmp_path / "target", tensors=lambda t: {
            k.replace("q_proj", "w_proj"): v for k, v in t.items()}),
        "another base model": _edited(src, tmp_path / "shape", tensors=lambda t: {
            k: (v[:, :32].contiguous() if k == key else v) for k, v in t.items()}),
        "layer 7": _edited(src, tmp_path / "layer", tensors=lambda t: {
            k.replace("layers.1.", "layers.7."): v for k, v in t.items()}),
        "embedding, LM head": _edited(src, tmp_path / "embed", tensors=lambda t: {
            **t, "base_model.model.lm_head.lora_A.weight": torch.zeros(2, 64)}),
        "does not exist": tmp_path / "missing",
    }
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(open(f"{src}/adapter_config.json").read())
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file at all")
    bad["cannot be read"] = corrupt
    llm = lora_llm(tiny_model_dir, {"attn4": adapters["attn4"]}, max_lora_rank=8, max_loras=1)
    eng = llm.engine
    before = eng.lora.names()
    for why, path in bad.items():
        with pytest.raises(LoRAError, match=why):
            eng.lora.load("x", str(path))
        with pytest.raises(ValueError, match=why):  # at start-up: the engine does not start
            LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB",
                                   enable_lora=True, lora_modules={"x": str(path)}, max_lora_rank=8))
    assert eng.lora.names() == before
    out = llm.generate([PROMPTS[0]], params("attn4"), use_tqdm=False)
    assert len(out[0].token_ids) == MAX_TOKENS


def test_config_refuses_what_lora_does_not_run_with():
    for kw in ({"batching": "static"}, {"compile": True}, {"lora_modules": {"a": "b"}, "enable_lora": False}):
        with pytest.raises(ValueError):
            EngineConfig(**{"enable_lora": True, **kw})


def test_no_adapter_rows_no_lora_batch(tiny_model_dir, adapters):
    """A step without adapter rows hands the model no LoRA batch (the hooks return at once); a long
    step gathers each slot's rows, a decode-sized one takes the masked path."""
    from iterserve.core.scheduler import ScheduledRequest, SchedulerOutput
    from iterserve.request import Request

    llm = lora_llm(tiny_model_dir, adapters)
    runner, lora = llm.engine.runner, llm.engine.lora
    p = PROMPTS[2]
    sched = SchedulerOutput([ScheduledRequest(Request("r0", p, params(None)), len(p), 0, [0, 1, 2], p, sample=True)])
    assert runner.prepare(sched).lora is None
    lora.ensure_resident("attn4", set())
    sched.scheduled.append(ScheduledRequest(Request("r1", p, params("attn4")), len(p), 0, [3, 4, 5], p, sample=True))
    decode = SchedulerOutput([ScheduledRequest(Request(f"d{i}", p, params(n)), 1, 5, [i], [7], sample=True)
                              for i, n in enumerate([None, "attn4", None])])
    slot = lora.slot("attn4")
    if lora.sgmv is not None:  # the C++ kernel's form, long and short steps alike
        batch = runner.prepare(sched).lora
        assert batch.row_slot.tolist() == [-1] * len(p) + [slot] * len(p) and not batch.groups and not batch.masks
        assert runner.prepare(decode).lora.row_slot.tolist() == [-1, slot, -1]
    lora.sgmv = None  # the torch paths
    batch = runner.prepare(sched).lora
    assert [s for s, _ in batch.groups] == [slot] and not batch.masks and batch.row_slot is None
    assert batch.groups[0][1].tolist() == list(range(len(p), 2 * len(p)))
    batch = runner.prepare(decode).lora
    assert not batch.groups and batch.masks[3].shape == (3, 4 * 3 * 16)
    assert batch.masks[3].sum(dim=1).tolist() == [0, 3 * 16, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_sgmv_kernel_matches_torch_paths(dtype, monkeypatch, variant_kernels):
    """csrc/lora.cpp's lora_sgmv (the native build and, on an AVX-512 host, the AVX2 one) against
    both torch paths (masked, gathered) and a float64 reference: fused modules of 1, 2 and 3
    projections with odd widths, rows of three slots and none."""
    from types import SimpleNamespace

    from iterserve.lora import layers
    from iterserve.lora.manager import SlotWeights

    kernels = variant_kernels
    gen = torch.Generator().manual_seed(0)
    slots, rank, in_f = 3, 4, 37
    shapes = {"o_proj": [29], "gate_up_proj": [23, 23], "qkv_proj": [41, 13, 11]}  # S = 1, 2, 3
    modules = {}
    for name, outs in shapes.items():
        bounds = [sum(outs[:i]) for i in range(len(outs) + 1)]
        a = torch.randn(slots, len(outs) * rank, in_f, generator=gen)
        b = torch.zeros(slots, len(outs) * rank, bounds[-1])
        for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):  # block-diagonal, as the manager lays it out
            b[:, j * rank:(j + 1) * rank, lo:hi] = torch.randn(slots, rank, hi - lo, generator=gen)
        modules[(0, name)] = SlotWeights(a.to(dtype), b.to(dtype), [True] * slots, list(zip(bounds, bounds[1:])))
    row_slots = [-1, 0, 2, 2, 1, -1, 0, 2, 2, 2, 1]
    manager = SimpleNamespace(modules=modules, max_loras=slots, max_rank=rank, dtype=dtype, sgmv=None)
    cpu = torch.device("cpu")
    masked = layers.LoRABatch.build(row_slots, manager, cpu)
    monkeypatch.setattr(layers, "DENSE_MAX_ROWS", 0)
    gathered = layers.LoRABatch.build(row_slots, manager, cpu)
    manager.sgmv = kernels.lora_sgmv
    kernel = layers.LoRABatch.build(row_slots, manager, cpu)
    assert masked.masks and gathered.groups and kernel.row_slot is not None
    base = [i for i, s in enumerate(row_slots) if s < 0]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for key, w in modules.items():
        x = torch.randn(len(row_slots), in_f, generator=gen).to(dtype)
        out0 = torch.randn(len(row_slots), w.b.shape[2], generator=gen).to(dtype)
        want = out0.double()
        for r, s in enumerate(row_slots):
            if s >= 0:
                want[r] += (x[r].double() @ w.a[s].double().t()) @ w.b[s].double()
        for batch in (masked, gathered, kernel):
            got = batch.apply(key, x, out0.clone())
            assert torch.equal(got[base], out0[base])  # rows without an adapter untouched
            assert ((got.double() - want).abs().max() / want.abs().max()).item() < tol, (key, batch)


def test_adapter_folder_gone_fails_only_its_requests(tiny_model_dir, adapters, expected, tmp_path):
    """An adapter that fell out of the CPU cache and whose folder went away since: its request ends
    with an error naming it; the base model's and another adapter's requests finish as always."""
    import shutil

    names = list(adapters)
    copy = shutil.copytree(adapters[names[1]], tmp_path / "gone")
    llm = lora_llm(tiny_model_dir, {names[0]: adapters[names[0]], "gone": str(copy)}, max_loras=1, max_cpu_loras=1)
    llm.engine.lora._cpu.pop("gone", None)  # as if the CPU cache had dropped it
    shutil.rmtree(copy)
    got = llm.generate([PROMPTS[0]] * 3, [params(names[0]), params("gone"), params(None)], use_tqdm=False)
    assert got[0].token_ids == expected[names[0]][0] and got[2].token_ids == expected[None][0]
    assert got[1].finish_reason == "error" and "gone" in (got[1].error or "")
