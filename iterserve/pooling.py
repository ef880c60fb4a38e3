"""Embeddings from the decoder: a prompt's final hidden states pooled into one L2-normalised vector.

An embedding request is a prefill-only request (`SamplingParams.pooling` set): the scheduler runs
its prompt as it runs any other (chunked prefill, the token budget, steps shared with generation);
the runner hands the engine, for the positions the pooling method reads, the final-norm hidden
states (the ones the LM head would read); the engine adds them up and ends the request, which frees
its KV blocks, as soon as the prompt is computed. No token is sampled.

Methods (vLLM's, lower-case): `last` (the last prompt token's state: Qwen3-Embedding's convention,
and the default), `mean` (every prompt token's state, averaged), `cls` (the first token's). Each is
a mean over a range of prompt positions, [lo, hi), so one code path sums the rows of each chunk
and divides once at the end. A method that reads positions before the prompt's last one must
compute them: admission takes no prefix-cached blocks for them (Request.max_cached_tokens).

Which method: `--pooling` (EngineConfig.pooling), else the model folder's own sentence-transformers
pooling config (`modules.json` -> the Pooling module's folder, usually `1_Pooling/config.json`),
else `last`. `dimensions` (Matryoshka truncation, then normalising again) only where the model says
it was trained for it (`matryoshka_dimensions` or `is_matryoshka` in its config.json, vLLM's rule).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("iterserve.pooling")

POOLING_METHODS = ("last", "mean", "cls")
# sentence-transformers' Pooling config keys -> our methods (the others have no equivalent here)
ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request. `method` None: the engine's (set when the request is added)."""

    dimensions: int | None = None  # keep the first `dimensions` values, then normalise again
    normalize: bool = True  # L2
    method: str | None = None

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in POOLING_METHODS:
            raise ValueError(f"pooling method must be one of {', '.join(POOLING_METHODS)}, got {self.method!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")


@dataclass(frozen=True)
class PoolingConfig:
    """What the engine resolved at start-up. `method` None: embeddings are refused, `error` says why."""

    method: str | None
    source: str  # "--pooling", the config file it came from, or "default"
    matryoshka: bool = False  # `dimensions` allowed
    matryoshka_dimensions: tuple[int, ...] | None = None  # if the model lists them: only these
    error: str | None = None

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> str | None:
        """Why `dimensions` cannot be served, or None."""
        if dimensions is None:
            return None
        if not self.matryoshka:
            return ("this model does not support dimensions: its config names no matryoshka_dimensions "
                    "(truncating an embedding it was not trained to truncate gives poor results)")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            return f"dimensions must be one of {list(self.matryoshka_dimensions)}, got {dimensions}"
        if not 1 <= dimensions <= hidden_size:
            return f"dimensions must be between 1 and the model's {hidden_size}, got {dimensions}"
        return None


def resolve_pooling(flag: str | None, folder: Path | None) -> PoolingConfig:
    """The engine's pooling: `flag` (--pooling) wins over the folder's sentence-transformers config;
    a pipeline with layers after pooling (Dense) refuses embeddings either way."""
    config = _read_json(folder / "config.json") if folder is not None else None
    dims = (config or {}).get("matryoshka_dimensions")
    matryoshka = bool(dims) or bool((config or {}).get("is_matryoshka", False))
    dims = tuple(int(d) for d in dims) if isinstance(dims, list) and dims else None
    if flag is not None and flag not in POOLING_METHODS:
        raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}, got {flag!r}")
    pooling_dir, dense = _sentence_transformers_modules(folder) if folder is not None else (None, [])
    if dense:
        return PoolingConfig(None, "modules.json", error=(
            f"this model's sentence-transformers pipeline has layers after pooling ({', '.join(dense)}), "
            "which iterserve does not run: its embeddings would be wrong"))
    if flag is not None:
        return PoolingConfig(flag, "--pooling", matryoshka, dims)
    st = _read_json(pooling_dir / "config.json") if pooling_dir is not None else None
    if st is not None:
        where = f"{pooling_dir.name}/config.json"
        on = [k for k, v in st.items() if k.startswith("pooling_mode_") and v is True]
        methods = {ST_MODES.get(k) for k in on}
        if len(on) == 1 and None not in methods:
            return PoolingConfig(methods.pop(), where, matryoshka, dims)
        return PoolingConfig(None, where, error=(
            f"the model's pooling ({', '.join(on) or 'none'} in {where}) is not one iterserve computes "
            f"(one of {', '.join(ST_MODES)}): start the server with --pooling last|mean|cls"))
    return PoolingConfig("last", "default", matryoshka, dims)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _sentence_transformers_modules(folder: Path) -> tuple[Path | None, list[str]]:
    """(the Pooling module's folder, the names of modules after it that change the vector: Dense ...)."""
    default = folder / "1_Pooling"
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError):
        return (default if default.is_dir() else None), []
    pooling, dense = None, []
    for m in modules if isinstance(modules, list) else []:
        kind = str(m.get("type", "")) if isinstance(m, dict) else ""
        if kind.endswith(".Pooling"):
            pooling = folder / str(m.get("path", "1_Pooling"))
        elif pooling is not None and not kind.endswith((".Normalize",)):
            dense.append(kind.rsplit(".", 1)[-1] or "?")
    return pooling, dense


def pooled_range(method: str, num_prompt_tokens: int) -> tuple[int, int]:
    """The prompt positions [lo, hi) whose hidden states the method averages."""
    if method == "last":
        return num_prompt_tokens - 1, num_prompt_tokens
    if method == "cls":
        return 0, 1
    return 0, num_prompt_tokens


def finish(total: torch.Tensor, count: int, params: PoolingParams) -> list[float]:
    """The request's embedding: the mean of its pooled states, truncated to `dimensions`, normalised."""
    vec = total.float() / count
    if params.dimensions is not None:
        vec = vec[: params.dimensions]
    if params.normalize:
        vec = torch.nn.functional.normalize(vec, p=2, dim=0)
    return vec.tolist()
