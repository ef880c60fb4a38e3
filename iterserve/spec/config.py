"""`--speculative-config`: vLLM's keys and meaning, parsed and checked once at start-up."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    # the most draft tokens one row verifies in a step; each row's own count adapts below it
    num_speculative_tokens: int = 4
    # ngram (prompt lookup): the longest and shortest n-gram of the context's tail looked up in the
    # request's own tokens (prompt, output, prediction); the longest match wins
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    # draft_model: a registry model (path or name) with the target's vocabulary, run by the same
    # engine on its own KV pool of this many bytes
    model: str | None = None
    draft_kv_cache_memory: str = "256MiB"
    # no speculation in a step whose running requests number more than this: at high batch a
    # step's compute is better spent on other rows. None: never switch off
    disable_by_batch_size: int | None = 8
    # suffix (Arctic's suffix decoding, vLLM's keys): the index's depth, how many finished requests'
    # outputs it keeps, drafts of at most spec_factor x the matched length, and the least estimated
    # probability a drafted continuation may have
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; use one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer from 1 to 16, got {k!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method draft_model needs `model` (a path or registry name)")
        if self.method != "draft_model" and self.model:
            raise ValueError(f"speculative_config: `model` is for method draft_model, not {self.method}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative_config: disable_by_batch_size must be >= 1 (or null: never)")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("speculative_config: suffix_decoding_max_tree_depth must be >= 1 and "
                             "suffix_decoding_max_cached_requests >= 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0 or self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("speculative_config: suffix_decoding_min_token_prob must be in [0, 1] and "
                             "suffix_decoding_max_spec_factor > 0")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the flag's JSON text, a dict (a --config file) or a config; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object, e.g. "
                             "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**value)
