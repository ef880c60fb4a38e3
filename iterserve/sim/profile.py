"""A step-time profile: the fitted (or analytic) step model plus what it was measured on.

Saved as JSON so that `simulate`, `tune --simulate` and `plan` can run anywhere from it. The
machine, model, dtype, engine flags and commit are kept with it, because a step model is only true
for that combination; an analytic profile says `"estimate": true` and which assumptions it made.
A mixture-of-experts model's profile also keeps its routing (`moe`: experts, top-k, the measured
distinct-experts curve, sim/moe.py); a profile without that key is a dense model's, as every profile
written before it was.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iterserve.bench.common import load_average
from iterserve.config import EngineConfig, ModelConfig, parse_size
from iterserve.core.kv_groups import KVCacheGroup, KVCacheGroups, kv_cache_groups
from iterserve.cpu_info import cpu_flags
from iterserve.sim.moe import MoeRouting
from iterserve.sim.overhead import NO_OVERHEAD, ServerOverhead
from iterserve.sim.step_model import LinearStepModel, StepTimeModel, errors_by_kind, features_of, model_from_dict

FORMAT = "iterserve-step-profile/1"
# the flags that decide which CPU kernels a step runs (so two machines' profiles can be told apart)
RELEVANT_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "asimd", "sve")


@dataclass
class Profile:
    kind: str  # "measured" or "analytic"
    model: str
    dtype: str
    step_model: StepTimeModel
    kv_bytes_per_token: int  # K and V of every layer, for one token
    max_model_len: int  # the engine's default for this model
    kv_memory_bytes: int | None = None  # memory for KV blocks; None: the engine flags' --kv-cache-memory
    estimate: bool = False
    model_shape: dict[str, Any] = field(default_factory=dict)
    engine_flags: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    commit: str | None = None
    created: str = ""
    fit: dict[str, Any] = field(default_factory=dict)  # how well the model fits its own samples
    samples: list[dict[str, Any]] = field(default_factory=list)  # measured steps: features and seconds
    note: str = ""
    server_overhead: ServerOverhead | None = None  # None: not measured, the simulator charges none
    # a server's own steps during the overhead measurement (features and seconds, as `samples`)
    in_service_samples: list[dict[str, Any]] = field(default_factory=list)
    moe: MoeRouting | None = None  # an MoE model's routing (the step's expected distinct experts); None: dense

    @property
    def device_type(self) -> str:
        """"cuda" for a GPU's profile (analytic, or measured on CUDA), else "cpu": whose default step
        budget (config.DEFAULT_STEP_TOKENS) a simulated engine without --max-num-batched-tokens takes."""
        gpu = "gpu" in self.machine or str(self.machine.get("device", "")).startswith("cuda")
        return "cuda" if gpu else "cpu"

    @property
    def overhead(self) -> ServerOverhead:
        return self.server_overhead or NO_OVERHEAD

    def kv_groups(self) -> KVCacheGroups:
        """The model's KV cache groups (core/kv_groups.py), from its recorded shape: full and windowed
        layers grouped as the engine groups them. A profile without a shape is one group of every
        layer, every block kept (what profiles written before groups counted)."""
        shape = {f.name: self.model_shape[f.name] for f in dataclasses.fields(ModelConfig)
                 if f.name in self.model_shape}
        try:
            return kv_cache_groups(ModelConfig(**shape))
        except (TypeError, ValueError):
            return KVCacheGroups((KVCacheGroup(0, (0,)),), 1)  # per-token bytes are then one "layer"

    def num_kv_blocks(self, config: EngineConfig) -> int:
        """As the engine sizes its cache: --num-kv-blocks, else the memory over the bytes per block
        (one KV cache group's layers: kv_bytes_per_token covers every layer)."""
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        memory = self.kv_memory_bytes if self.kv_memory_bytes is not None else parse_size(config.kv_cache_memory)
        groups = self.kv_groups()
        per_block = self.kv_bytes_per_token * config.block_size * groups.group_size // groups.num_layers
        return max(1, memory // per_block)

    def describe(self) -> str:
        label = "ESTIMATE (analytic roofline)" if self.estimate else "measured"
        if self.server_overhead is not None:
            label += ", with server overhead"
        where = self.machine.get("gpu") or self.machine.get("cpu_model") or "?"
        moe = f", MoE {self.moe.num_experts} experts top-{self.moe.top_k}" if self.moe is not None else ""
        return f"{self.model} {self.dtype}{moe} on {where}: {label}"

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "kind": self.kind, "estimate": self.estimate, "note": self.note,
                "model": self.model, "dtype": self.dtype, "model_shape": self.model_shape,
                "engine_flags": self.engine_flags, "machine": self.machine, "commit": self.commit,
                "created": self.created, "kv_bytes_per_token": self.kv_bytes_per_token,
                "max_model_len": self.max_model_len, "kv_memory_bytes": self.kv_memory_bytes,
                "step_model": self.step_model.to_dict(), "fit": self.fit, "samples": self.samples,
                "server_overhead": self.server_overhead.to_dict() if self.server_overhead else None,
                "in_service_samples": self.in_service_samples,
                "moe": self.moe.to_dict() if self.moe is not None else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Profile":
        if d.get("format") != FORMAT:
            raise ValueError(f"not an iterserve step profile (format {d.get('format')!r}, want {FORMAT!r})")
        return cls(kind=d["kind"], model=d["model"], dtype=d["dtype"],
                   step_model=model_from_dict(d["step_model"]), kv_bytes_per_token=int(d["kv_bytes_per_token"]),
                   max_model_len=int(d["max_model_len"]), kv_memory_bytes=d.get("kv_memory_bytes"),
                   estimate=bool(d.get("estimate")), model_shape=d.get("model_shape") or {},
                   engine_flags=d.get("engine_flags") or {}, machine=d.get("machine") or {},
                   commit=d.get("commit"), created=d.get("created", ""), fit=d.get("fit") or {},
                   samples=d.get("samples") or [], note=d.get("note", ""),
                   server_overhead=ServerOverhead.from_dict(d["server_overhead"]) if d.get("server_overhead") else None,
                   in_service_samples=d.get("in_service_samples") or [],
                   moe=MoeRouting.from_dict(d["moe"]) if d.get("moe") else None)

    def in_service_errors(self) -> dict[str, dict[str, float]]:
        """The step model on the server's own steps (`in_service_samples`), per kind of step
        (`step_model.errors_by_kind`)."""
        return errors_by_kind(self.step_model, ((features_of(s), s["seconds"]) for s in self.in_service_samples))

    def calibrated(self) -> "Profile":
        """This profile with its linear step model refitted on the grid's samples and the server's
        in-service steps together, each set carrying half the weight (what `iterserve profile
        --calibrate` saves): the grid spans the shapes, the in-service steps carry what serving adds
        to a step on shared cores."""
        if not isinstance(self.step_model, LinearStepModel) or not self.in_service_samples:
            raise ValueError("calibration needs a measured (linear) profile with in-service steps "
                             "(`iterserve profile MODEL --server-overhead`)")
        both = self.samples + self.in_service_samples
        # as much weight to the in-service steps in all as to the grid's few shapes, however many there are
        share = len(self.samples) / len(self.in_service_samples)
        m = self.step_model
        model = LinearStepModel.fit([features_of(s) for s in both], [s["seconds"] for s in both],
                                    m.twin_max_tokens, m.head_max_seqs,
                                    weights=[1.0] * len(self.samples) + [share] * len(self.in_service_samples))
        return dataclasses.replace(self, step_model=model, fit={**self.fit, "calibrated_on_in_service_steps":
                                                                len(self.in_service_samples)})

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read profile {path}: {e}") from None
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError) as e:
            raise ValueError(f"profile {path} is incomplete: missing or bad {e}") from None


def cpu_machine() -> dict[str, Any]:
    """This machine as far as step times care: CPU model, core count, the kernels' flags."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    flags = cpu_flags()
    return {"cpu_model": model or platform.processor(), "cpus": os.cpu_count(),
            "cpu_flags": [f for f in RELEVANT_CPU_FLAGS if f in flags], "platform": platform.platform(),
            "loadavg": load_average()}


def git_commit() -> str | None:
    """The checkout's commit (with -dirty when it has changes), or None outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=here,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
