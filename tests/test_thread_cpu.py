"""benchmarks/thread_cpu.py: per-thread CPU of a live process from /proc, as peer_matrix reads the server."""
import os
import sys
import threading
import time

import pytest

import thread_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_split_credits_a_busy_worker_not_the_idle_main_thread():
    pid = os.getpid()
    seen: dict = {}

    def worker() -> None:  # spins, then reads the process while it is still alive
        _spin(0.3)
        seen["tid"], seen["after"] = threading.get_native_id(), thread_cpu.snapshot(pid)

    before, t0 = thread_cpu.snapshot(pid), time.monotonic()
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    out = thread_cpu.split(before, seen["after"], pid, time.monotonic() - t0)
    assert seen["after"][seen["tid"]] >= 0.2
    assert out["main_thread_share"] is not None and out["main_thread_share"] < 0.5
    assert out["cpu_s"] >= out["main_thread_cpu_s"] >= 0


def test_main_thread_work_is_its_share():
    pid = os.getpid()
    before, t0 = thread_cpu.snapshot(pid), time.monotonic()
    _spin(0.3)
    out = thread_cpu.split(before, thread_cpu.snapshot(pid), pid, time.monotonic() - t0)
    assert out["main_thread_cpu_s"] >= 0.2
    assert out["main_thread_share"] > 0.5


def test_a_process_that_is_gone_reads_as_empty():
    assert thread_cpu.snapshot(2 ** 22 + 12345) == {}
