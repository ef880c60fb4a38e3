"""A screenshot of /dashboard on the Ray ingress under load: one panel per replica.

Starts `iterserve serve MODEL --replicas N --threads-per-replica T` (a local Ray cluster), opens
/dashboard in headless Chromium, keeps `--clients` closed-loop clients sending completions of
varied lengths for `--seconds`, and saves the page as a small PNG near the end of the load. Prints
what each panel received (ticks, steps, gaps), which must match the replicas' own step counts.
About a minute plus the cluster's start at the defaults; the server's log goes under runs/.

    .venv/bin/python benchmarks/dashboard_replicas.py --screenshot docs/dashboard-replicas.png
"""
from __future__ import annotations

import argparse
import io
import os
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
from PIL import Image  # noqa: E402  (matplotlib's dependency)

from iterserve.bench.browser import open_browser  # noqa: E402
from iterserve.bench.launcher import ServerProcess  # noqa: E402

PROMPT = "Client {i} asks for a story about a lighthouse keeper, part {n}."


def wait_for(fn, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := fn():
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def client_loop(base_url: str, model: str, i: int, max_tokens: int, stop: threading.Event) -> None:
    """One closed-loop client: a completion, then the next, lengths spread over [max_tokens/4, max_tokens]."""
    with httpx.Client(base_url=base_url, timeout=300) as http:
        n = 0
        while not stop.is_set():
            tokens = max(1, max_tokens // 4 + (3 * max_tokens // 4) * ((7 * i + 3 * n) % 11) // 10)
            http.post("/v1/completions", json={"model": model, "prompt": PROMPT.format(i=i, n=n), "max_tokens": tokens,
                                               "temperature": 0, "ignore_eos": True}).raise_for_status()
            n += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads-per-replica", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--clients", type=int, default=12, help="concurrent closed-loop clients")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--seconds", type=float, default=40.0, help="how long the load runs")
    ap.add_argument("--screenshot", type=Path, help="save the page under load here (PNG, 256 colours)")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1450)
    args = ap.parse_args()

    log = Path("runs/dashboard_replicas/server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    serve_args = [args.model, "--replicas", str(args.replicas),
                  "--threads-per-replica", str(args.threads_per_replica), "--max-num-seqs", str(args.max_num_seqs)]
    with ServerProcess(serve_args, log_path=log, startup_timeout=300) as srv:
        replicas = lambda: httpx.get(srv.base_url + "/v1/scheduler", timeout=10).json()["replicas"]  # noqa: E731
        wait_for(lambda: len(replicas()) == args.replicas, f"{args.replicas} replicas")
        driver = open_browser(args.width, args.height)
        try:
            driver.get(srv.base_url + "/dashboard")
            dash = lambda: driver.execute_script("return window.iterserveDashboard")  # noqa: E731
            wait_for(lambda: dash()["status"] == "live" and len(dash()["engines"]) == args.replicas, "the panels")
            stop = threading.Event()
            clients = [threading.Thread(target=client_loop, args=(srv.base_url, args.model, i, args.max_tokens, stop),
                                        daemon=True) for i in range(args.clients)]
            for c in clients:
                c.start()
            time.sleep(args.seconds)
            if args.screenshot:
                img = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
                args.screenshot.parent.mkdir(parents=True, exist_ok=True)
                img.quantize(colors=256).save(args.screenshot, optimize=True)
                print(f"screenshot: {args.screenshot} ({args.screenshot.stat().st_size // 1024} KiB)", flush=True)
            stop.set()
            for c in clients:
                c.join(timeout=300)
            def caught_up() -> dict[str, int] | None:  # the page and /v1/scheduler read the same reports
                steps = {r["replica"]: r["step"] for r in replicas() if r["running"] == 0}
                engines = dash()["engines"]
                return steps if len(steps) == len(engines) and \
                    all(engines[rid]["lastStep"] == s for rid, s in steps.items()) else None

            steps = wait_for(caught_up, "the panels to see every step", timeout=60)
            for rid, st in sorted(dash()["engines"].items()):
                print(f"replica {rid}: {st['ticks']} ticks, {st['steps']} steps seen (replica at step {steps[rid]}), "
                      f"{st['gaps']} gaps, {st['blockUpdates']} block map updates", flush=True)
        finally:
            driver.quit()


if __name__ == "__main__":
    main()
