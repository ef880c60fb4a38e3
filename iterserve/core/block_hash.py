"""Content address of a full KV block: the hash the prefix cache looks blocks up by.

Pure Python with no torch import, so that a router (which never loads a model) can compute the very
same hashes from token ids and send a request where its prefix is cached.

A block's hash is chained: sha256 over the pickled tuple (parent block's hash, the block's token
ids, extra key). The chain makes a block's identity its whole prefix, not just its own tokens, so
equal hashes mean equal token prefixes. Collisions cannot return wrong KV in practice: a sha256
collision is cryptographically negligible (vLLM's `--prefix-caching-hash-algo sha256` makes the
same argument); we use sha256 instead of Python's `hash()` because the latter is 64 bits and salted
per process (a router and a server would disagree).

The extra key holds whatever else changes a block's KV for the same tokens (e.g. a future LoRA
adapter id, a multimodal input's hash); None when nothing does.
"""
from __future__ import annotations

import hashlib
import pickle
from collections.abc import Hashable, Sequence

BlockHash = bytes
NONE_HASH: BlockHash = b""  # parent of a sequence's first block


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_key: Hashable | None = None) -> BlockHash:
    """sha256 of pickle((parent_hash, tuple(token_ids), extra_key)); parent None = first block."""
    payload = (parent_hash or NONE_HASH, tuple(int(t) for t in token_ids), extra_key)
    return hashlib.sha256(pickle.dumps(payload, protocol=5)).digest()


def hash_block_chain(token_ids: Sequence[int], block_size: int, extra_key: Hashable | None = None,
                     parent_hashes: Sequence[BlockHash] = ()) -> list[BlockHash]:
    """Hashes of every full block of token_ids (a partial last block has none).

    parent_hashes: hashes already known for the first blocks (a request's chain grows as it
    generates); they are kept and only the blocks after them are hashed.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    hashes = list(parent_hashes)
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_key)
        hashes.append(parent)
    return hashes
