"""Starting and stopping an `iterserve serve` process on loopback, for compare / tune / tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float, name: str = "the server") -> None:
    """Returns once `base_url`/health answers 200; RuntimeError when proc exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not become healthy within {timeout_s:.0f} s")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`with ServerProcess(["--model", "smollm2-135m", "--max-num-seqs", "16"]) as srv: srv.base_url`.

    The server's stderr goes to `log_path` (or a pipe drained at exit) so a failed start can say why.
    """

    def __init__(self, args: list[str], port: int | None = None, log_path: str | Path | None = None,
                 startup_timeout: float = 180.0, env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.args = [sys.executable, "-m", "iterserve.cli", "serve", *args,
                     "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerProcess":
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "w")
            out = self._log_file
        else:
            out = subprocess.DEVNULL
        self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT if self._log_file else subprocess.PIPE,
                                     env=self.env, text=True)
        try:
            wait_healthy(self.base_url, self.proc, self.startup_timeout, "iterserve serve")
        except RuntimeError as e:
            exited = self.proc.poll() is not None
            self.stop()
            raise RuntimeError(f"{e}: {self._tail()}" if exited else str(e)) from None
        return self

    def _tail(self) -> str:
        if self.log_path and self.log_path.exists():
            lines = self.log_path.read_text().strip().splitlines()
        elif self.proc and self.proc.stderr:
            lines = self.proc.stderr.read().strip().splitlines()
        else:
            lines = []
        return lines[-1] if lines else "(no output)"

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log_file:
            self._log_file.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
