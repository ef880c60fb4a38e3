"""KV cache groups: which layers share a block table, as vLLM v1's hybrid KV cache manager groups them.

A model whose layers all attend the same way (every layer full, or every layer with one window)
is one group: one block table per request, one KV tensor pair per layer, and a block is a block
of every layer, as it always was. A model that mixes full and windowed layers (Gemma 2 and 3,
Qwen2 with `use_sliding_window`) gets one group per `group_size` layers of one kind, so Gemma 3
270M (3 full + 15 windowed layers) has 1 full group and 5 windowed groups of 3 layers each:

- every group has its own block table per request, so a windowed group can free the blocks its
  layers no longer see while the full group keeps them all (core/block_pool.py);
- layer j of every group uses physical tensor pair j (`KVCacheGroups.layer_slot`), so a block id
  is `group_size` layers' worth of bytes in every group and one pool of block ids serves them all.

Why equal-sized groups sharing tensors rather than one pool per layer kind: a per-kind pool fixes
the split of memory between kinds up front, while a shared pool lets each request take what its
length needs (a short request is mostly full-group blocks, a long one mostly windowed), and every
block id still means one fixed set of bytes. The group size is vLLM's: the smallest kind's layer
count (the largest when the kinds are within 25% of each other, padding the smaller kind); a kind
whose count is not a multiple of it ends with a smaller group whose missing slots go unused.

Pure Python: the scheduler, the simulator and `plan` use it without a model.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroup:
    window: int  # the layers' sliding window in tokens; 0: full attention
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheGroups:
    groups: tuple[KVCacheGroup, ...]  # full-attention groups first
    group_size: int  # layers per group: KV tensor pairs allocated, and layers' worth of bytes per block

    @property
    def windows(self) -> tuple[int, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def layer_slot(self, layer: int) -> tuple[int, int]:
        """(group, tensor slot) of a layer."""
        for gi, g in enumerate(self.groups):
            if layer in g.layers:
                return gi, g.layers.index(layer)
        raise KeyError(f"layer {layer} is in no KV cache group")

    def blocks_per_sequence(self, num_tokens: int, block_size: int) -> int:
        """Blocks a sequence of num_tokens holds while it decodes its last token: every block in a
        full group, only those holding its last `window` positions in a windowed group (at most
        cdiv(window - 1, block_size) + 1, whatever the alignment). What a cache's capacity in
        sequences is counted in."""
        return sum(sequence_blocks(g.window, num_tokens, block_size) for g in self.groups)


def sequence_blocks(window: int, num_tokens: int, block_size: int) -> int:
    """One group's blocks for a sequence of num_tokens decoding its last token (see above)."""
    full = cdiv(num_tokens, block_size)
    return full if window <= 0 else min(full, cdiv(window - 1, block_size) + 1)


def group_layers(layer_windows: Sequence[int]) -> KVCacheGroups:
    """Groups layers by their window (0: full), full-attention kinds first, then windows ascending."""
    if not layer_windows:
        raise ValueError("a model with no layers has no KV cache")
    kinds: dict[int, list[int]] = {}
    for i, w in enumerate(layer_windows):
        kinds.setdefault(int(w), []).append(i)
    if len(kinds) == 1:
        (w, layers), = kinds.items()
        return KVCacheGroups((KVCacheGroup(w, tuple(layers)),), len(layers))
    counts = [len(v) for v in kinds.values()]
    size = min(counts)
    if max(counts) < size * 1.25:  # vLLM: nearly equal kinds pad to the largest instead of splitting it
        size = max(counts)
    groups = [KVCacheGroup(w, tuple(layers[i:i + size])) for w, layers in sorted(kinds.items())
              for i in range(0, len(layers), size)]
    return KVCacheGroups(tuple(groups), size)


def kv_cache_groups(cfg) -> KVCacheGroups:
    """The groups of a ModelConfig's layers (by ModelConfig.layer_window)."""
    return group_layers([cfg.layer_window(i) for i in range(cfg.num_layers)])


def single_group(cfg) -> KVCacheGroups:
    """Every layer in one full-attention group: every block kept for the whole sequence (what a
    runner whose pool never frees windowed blocks, such as a draft model's, allocates)."""
    return KVCacheGroups((KVCacheGroup(0, tuple(range(cfg.num_layers))),), cfg.num_layers)


def describe_groups(groups: KVCacheGroups) -> str:
    """For the start-up log: '1 group of 18 layers' or '6 groups of 3 layers (1 full, 5 window 512)'."""
    n = len(groups.groups)
    if n == 1:
        g = groups.groups[0]
        kind = f", window {g.window}" if g.window else ""
        return f"1 group of {len(g.layers)} layers{kind}"
    full = sum(1 for g in groups.groups if not g.window)
    windows = sorted({g.window for g in groups.groups if g.window})
    return (f"{n} groups of {groups.group_size} layers ({full} full, {n - full} windowed: "
            f"window {', '.join(map(str, windows))})")
