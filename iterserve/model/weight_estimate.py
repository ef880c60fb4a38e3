"""How many bytes a checkpoint's weights will take once loaded, read from its tensor table alone.

The engine's memory plan (iterserve/memory.py) needs this before loading, to refuse a model that
cannot fit instead of being killed by the OOM killer half-way through. Only headers are read: the
safetensors files' tensor shapes, a GGUF's tensor table (model/gguf_file.py's cached index).
"""
from __future__ import annotations

import torch

from iterserve.model.gguf_arch import GGUF_ARCHS
from iterserve.model.gguf_file import FLOAT_TYPES, read_index
from iterserve.model.loader import ModelSource, expert_types, gguf_to_hf_name, hf_family, hf_weight_files


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def estimate_weight_bytes(src: ModelSource, dtype: torch.dtype, block_types: frozenset[str] = frozenset()) -> int:
    """Bytes of the weights the loader will keep in `dtype`, from the checkpoint's headers.

    Every tensor the model takes counts as numel x dtype size, except, in a GGUF, the 2-d weights
    stored in one of `block_types` (Platform.gguf_block_types): the loader keeps those as their
    blocks only, so they count at their stored size, as do a MoE layer's stacked 3-d expert tensors
    where all three are in them (model/loader.py block_modules). A tensor the family drops is not counted; a
    tied head stored in the checkpoint anyway is (an over-estimate, never under)."""
    elem = torch.empty((), dtype=dtype).element_size()
    if src.kind == "gguf":
        index = read_index(src.path)
        arch = GGUF_ARCHS[index.get("general.architecture")]
        # a MoE layer's stacked experts stay blocks when all three of its tensors are in block_types
        blocked = {m for m, ts in expert_types(index, arch).items() if set(ts.values()) <= block_types}
        total = 0
        for t in index.tensors:
            name = gguf_to_hf_name(t.name, arch)
            if name is None:
                continue  # folded into the RoPE tables
            expert = len(t.shape) == 3 and name.removeprefix("model.").rsplit(".", 2)[0] in blocked
            quantised = (len(t.shape) == 2 or expert) and t.qtype not in FLOAT_TYPES
            total += t.nbytes if quantised and t.qtype in block_types else _numel(t.shape) * elem
        return total
    from safetensors import safe_open

    rename = hf_family(src).rename
    total = 0
    for f in hf_weight_files(src):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                name = rename(key)
                if name is not None and "rotary_emb" not in name:
                    total += _numel(sf.get_slice(key).get_shape()) * elem
    return total
