"""Memory planned and reported (iterserve/memory.py): weights measured with each storage once (a
tied head, a file's memory map), the estimate read from a checkpoint's headers, the memory available
from /proc and the cgroup, the report on /v1/scheduler and /metrics over real HTTP, and a model that
cannot fit refused before it loads, with the numbers, unless --skip-memory-check."""
from __future__ import annotations

import json
import socket

import httpx
import numpy as np
import pytest
import torch

import iterserve.engine as engine_module
from iterserve.config import EngineConfig
from iterserve.memory import (InsufficientMemory, MemoryPlan, available_memory, model_tensors, weight_bytes,
                              workspace_estimate)
from iterserve.model.loader import load_weights_only, resolve_model
from iterserve.model.weight_estimate import estimate_weight_bytes
from iterserve.platform.base import kv_bytes_per_block

GIB = 2**30


def unique_bytes(model: torch.nn.Module) -> int:
    """What the test counts by hand: parameters and buffers, one per storage."""
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """The tiny Llama of conftest with its head tied to the embedding."""
    from conftest import TINY_CONFIG
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-tied")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "tie_word_embeddings": True})).save_pretrained(folder)
    return folder


# ---- weights, measured and estimated ------------------------------------------------------------------
def test_weight_bytes_count_a_tied_head_once(tied_dir):
    model, cfg = load_weights_only(resolve_model(str(tied_dir)))
    assert cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    resident, mapped = weight_bytes(model_tensors(model))
    assert (resident, mapped) == (unique_bytes(model), 0)
    naive = sum(p.nbytes for _, p in model.named_parameters(remove_duplicate=False))
    assert resident + model.lm_head.weight.nbytes == naive + sum(b.nbytes for b in model.buffers())  # head once
    # the estimate from the safetensors headers: every parameter in float32, the head once
    params = sum(p.nbytes for p in model.parameters())
    assert estimate_weight_bytes(resolve_model(str(tied_dir)), torch.float32, frozenset()) == params
    assert estimate_weight_bytes(resolve_model(str(tied_dir)), torch.bfloat16, frozenset()) == params // 2


def test_engine_reports_the_weights_it_holds(make_engine, tiny_loaded):
    engine = make_engine(kv_cache_memory="16MiB")
    report = engine.memory
    assert report.weights_resident == unique_bytes(tiny_loaded[0]) and report.weights_mapped == 0
    per_block = kv_bytes_per_block(engine.model_config, engine.config.block_size, engine.platform.kv_cache)
    assert report.kv_cache == engine.pool.num_blocks * per_block == report.num_kv_blocks * per_block
    assert report.workspace_estimate == workspace_estimate(engine.config, engine.model_config, engine.dtype) > 0
    assert "GiB resident" in report.log_line() and f"{report.num_kv_blocks} blocks" in report.log_line()


def test_a_memory_mapped_tensor_counts_as_mapped(tmp_path):
    path = tmp_path / "w.bin"
    np.arange(4096, dtype=np.float32).tofile(path)
    mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r+"))
    plain = torch.zeros(1000)
    # a view of the same storage counts once
    assert weight_bytes([mapped, mapped[10:20], plain, plain[:5]]) == (4000, 4096 * 4)


def test_quantised_gguf_weights_count_as_blocks_where_the_platform_keeps_them():
    src = resolve_model("smollm2-135m")
    from iterserve.model.gguf_file import read_index

    index = read_index(src.path)
    dense = estimate_weight_bytes(src, torch.float32)
    blocks = estimate_weight_bytes(src, torch.float32, frozenset({"Q4_1", "Q8_0"}))
    assert dense == sum(int(np.prod(t.shape)) * 4 for t in index.tensors)  # smollm2 has no rope_freqs
    assert blocks < dense / 4  # Q4_1 blocks: 5 bits a weight, against float32's 32


def test_loading_a_gguf_leaves_torch_symbolic_machinery_unimported():
    """Materialising a model's small tensors through empty_like of meta tensors ran torch's Python
    reference of the op, which imports sympy: ~400 modules and ~35 MiB resident for a server's life
    (docs/profile.md). In a fresh process, since the rest of the suite may import it."""
    import subprocess
    import sys

    code = ("import sys; from iterserve.llm import LLM; from iterserve.sampling import SamplingParams; "
            "llm = LLM('smollm2-135m', kv_cache_memory='16MiB', max_model_len=256); "
            "llm.generate(['Hi'], SamplingParams(max_tokens=2), use_tqdm=False); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sympy', 'mpmath')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


# ---- available memory ---------------------------------------------------------------------------------
def fake_host(tmp_path, cgroup_line: str, files: dict[str, str]):
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 16000000 kB\nMemFree: 1000 kB\nMemAvailable: 8000000 kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for name, text in files.items():
        (cgroup / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroup / name).write_text(text)
    return proc, cgroup


def test_available_memory_is_capped_by_the_cgroup(tmp_path):
    v2 = fake_host(tmp_path / "v2", "0::/job", {"job/memory.max": "3000000000", "job/memory.current": "1000000000"})
    assert available_memory(*v2) == 2_000_000_000
    unlimited = fake_host(tmp_path / "max", "0::/job", {"job/memory.max": "max", "job/memory.current": "5"})
    assert available_memory(*unlimited) == 8_000_000 * 1024
    v1 = fake_host(tmp_path / "v1", "4:memory:/job", {"memory/job/memory.limit_in_bytes": "500",
                                                      "memory/job/memory.usage_in_bytes": "200"})
    assert available_memory(*v1) == 300
    v1_unlimited = fake_host(tmp_path / "v1u", "4:memory:/", {"memory/memory.limit_in_bytes": str(2**63 - 4096),
                                                               "memory/memory.usage_in_bytes": "200"})
    assert available_memory(*v1_unlimited) == 8_000_000 * 1024
    assert available_memory(tmp_path / "nowhere", tmp_path / "nowhere") is None


# ---- the check before loading -------------------------------------------------------------------------
def test_plan_check():
    fits = MemoryPlan(weights=GIB, kv_cache=GIB, workspace=GIB, available=4 * GIB)
    fits.check()
    MemoryPlan(weights=GIB, kv_cache=10**15, workspace=0, available=None).check()  # unknown: no refusal
    with pytest.raises(InsufficientMemory, match=r"needs about 3\.0 GiB \(weights 1\.0, KV cache 1\.0, "
                                                 r"workspace 1\.0\) but 2\.5 GiB is available"):
        MemoryPlan(weights=GIB, kv_cache=GIB, workspace=GIB, available=int(2.5 * GIB)).check()


@pytest.fixture
def no_loading(monkeypatch):
    """load_model fails the test if the engine reaches it."""
    def refuse(*args, **kwargs):
        raise AssertionError("load_model was called: the model should have been refused before loading")

    monkeypatch.setattr(engine_module, "load_model", refuse)


def test_too_large_a_kv_cache_is_refused_before_loading(tiny_model_dir, no_loading):
    with pytest.raises(InsufficientMemory) as refused:
        engine_module.LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory="10T"))
    msg = str(refused.value)
    kv = float(msg.split("KV cache ")[1].split(",")[0])
    assert kv == pytest.approx(10e12 / GIB, rel=1e-3)
    for words in ("model needs about", "weights 0.0", "workspace", "GiB is available", "--kv-cache-memory",
                  "--skip-memory-check"):
        assert words in msg


def test_serve_exits_with_the_numbers(tiny_model_dir, no_loading, capsys):
    from iterserve.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["serve", str(tiny_model_dir), "--kv-cache-memory", "10T", "--port", str(port)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err[-1].startswith("error: model needs about") and "GiB is available" in err[-1]
    assert not any(line.startswith("Traceback") for line in err)


def test_skip_memory_check_lets_the_model_load(tiny_model_dir, monkeypatch):
    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(engine_module, "load_model", reached)  # loading 10T of KV cache is not the point
    with pytest.raises(Reached):
        engine_module.LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory="10T",
                                             skip_memory_check=True))


# ---- /v1/scheduler and /metrics, over real HTTP -------------------------------------------------------
def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} missing")


def test_scheduler_and_metrics_carry_the_memory(tiny_model_dir, tiny_loaded):
    from http_server import HttpServer

    with HttpServer([str(tiny_model_dir), "--kv-cache-memory", "16MiB", "--served-model-name", "tiny"],
                    tiny_loaded) as srv:
        memory = httpx.get(srv.url + "/v1/scheduler", timeout=30).json()["memory"]
        text = httpx.get(srv.url + "/metrics", timeout=30).text
        report = srv.engine.engine.memory
    assert memory == json.loads(json.dumps(report.to_dict()))
    assert memory["weights_resident"] == unique_bytes(tiny_loaded[0]) and memory["kv_cache"] > 0
    assert metric(text, "iterserve:memory_weights_bytes", kind="resident") == memory["weights_resident"]
    assert metric(text, "iterserve:memory_weights_bytes", kind="mapped") == 0
    assert metric(text, "iterserve:memory_kv_cache_bytes", model_name="tiny") == memory["kv_cache"]
    assert metric(text, "iterserve:memory_workspace_bytes") == memory["workspace_estimate"]
    assert metric(text, "iterserve:memory_available_bytes") > 0


def smaps_field(address: int, field: str) -> list[str]:
    """The words after `field` (e.g. "Rss:") of the mapping in /proc/self/smaps that holds `address`;
    [] where none holds it."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            a, b = (int(x, 16) for x in head.split("-"))
            inside = a <= address < b
        elif inside and line.startswith(field):
            return line.split()[1:]
    return []


def test_release_mapped_pages_unmaps_a_files_pages_and_nothing_else(tmp_path):
    """A read-only file map's whole pages leave the process's RSS (they stay in the page cache and
    read back the same); memory of the process's own is never touched."""
    import mmap
    import warnings

    from iterserve.memory import release_mapped_pages

    path = tmp_path / "blocks.bin"
    payload = np.random.default_rng(0).integers(0, 256, 64 * mmap.PAGESIZE, dtype=np.uint8)
    path.write_bytes(payload.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: the test only reads it
        mapped = torch.frombuffer(mm, dtype=torch.uint8)

    def rss_of_map() -> int:
        return int(smaps_field(mapped.data_ptr(), "Rss:")[0]) * 1024

    assert int(mapped.sum()) == int(payload.sum())  # every page read: resident
    assert rss_of_map() == 64 * mmap.PAGESIZE
    part = mapped[100:100 + 40 * mmap.PAGESIZE]  # not page-aligned: its 39 whole pages go
    own = torch.from_numpy(payload.copy())
    assert release_mapped_pages([part, own]) == 39 * mmap.PAGESIZE
    assert rss_of_map() == 25 * mmap.PAGESIZE
    assert torch.equal(own, torch.from_numpy(payload)) and torch.equal(mapped, torch.from_numpy(payload))


def advised_large(t: torch.Tensor) -> bool:
    """Whether t's first two whole 2 MiB pages lie in mappings advised as huge pages (VmFlags `hg`)."""
    from iterserve.model.gguf_file import LARGE_PAGE

    first_whole = -(-t.data_ptr() // LARGE_PAGE) * LARGE_PAGE
    return all("hg" in smaps_field(at, "VmFlags:") for at in (first_whole, first_whole + LARGE_PAGE))


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="needs Linux's MADV_HUGEPAGE")
def test_the_kv_cache_asks_for_large_pages(make_engine):
    """Each layer's K and V cache is zeroed, and its whole 2 MiB pages are advised as huge pages
    (VmFlags `hg`) before their first touch; a tensor too small for one whole page is just zeros."""
    from iterserve.memory import zeros_in_large_pages
    from iterserve.model.gguf_file import LARGE_PAGE

    engine = make_engine(kv_cache_memory="64MiB")
    caches = [t for pair in engine.runner.kv_caches for t in pair]
    assert len({t.data_ptr() for t in caches}) == len(caches)
    for t in caches:
        assert t.nbytes >= 3 * LARGE_PAGE and not t.any()
        assert advised_large(t)
    small = zeros_in_large_pages((3, 5), torch.bfloat16)
    assert small.shape == (3, 5) and small.dtype == torch.bfloat16 and not small.any()


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="needs Linux's MADV_HUGEPAGE")
def test_repacked_gguf_blocks_ask_for_large_pages():
    """A 32-input GGUF type's twin is the model's own copy (repacked four blocks to a group), read
    every step: its whole 2 MiB pages are advised as huge pages, whether one shard or several make it;
    and it is the same bytes as before."""
    from test_kquant import random_blocks

    from iterserve.model.gguf_file import LARGE_PAGE, QuantShard
    from iterserve.platform.cpu_linear import pack_gguf_twin, pack_gguf_x4

    rows, cols = 8192, 1024  # Q8_0: 8.5 MiB
    q8 = torch.from_numpy(random_blocks("Q8_0", rows, cols))
    q4 = torch.from_numpy(random_blocks("Q4_1", rows, cols, seed=1))
    one, _ = pack_gguf_twin([QuantShard(0, rows, cols, "Q8_0", q8)], cols)
    two, meta = pack_gguf_twin([QuantShard(0, rows, cols, "Q8_0", q8), QuantShard(rows, rows, cols, "Q4_1", q4)], cols)
    for buf in (one, two):
        assert buf.nbytes >= 3 * LARGE_PAGE
        assert advised_large(buf)
    assert torch.equal(one.view(-1), pack_gguf_x4(q8, "Q8_0").view(-1))
    assert torch.equal(two[int(meta[1, 3]):].view(-1), pack_gguf_x4(q4, "Q4_1").view(-1))


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="needs Linux's MADV_HUGEPAGE")
def test_laid_out_weights_ask_for_large_pages():
    """A checkpoint's weight laid out for our GEMMs (tiled bf16, bf16w, a float32 widening) is a copy of
    the model's own, read every step: its whole 2 MiB pages are advised as huge pages; the layout's
    bytes are those of the plain transpose. A float32 weight the float32 layout takes as it is."""
    from iterserve.platform.cpu_linear import float32_weight, pack_bf16, pack_bf16_f32

    w = torch.randn(4096, 1024).bfloat16()  # 8 MiB
    tiled, wide, widened = pack_bf16(w), pack_bf16_f32(w), float32_weight(w)
    for t in (tiled, wide, widened):
        assert advised_large(t)
    assert torch.equal(widened, w.float())
    plain = w.float()
    assert float32_weight(plain) is plain
    assert torch.equal(tiled, w.reshape(256, 16, 512, 2).transpose(1, 2))
    order = torch.arange(16).reshape(2, 8).t().reshape(16)  # a tile's outputs 0, 8, 1, 9, ...
    assert torch.equal(wide.transpose(1, 2)[:, torch.argsort(order)].reshape(4096, 1024), w)
