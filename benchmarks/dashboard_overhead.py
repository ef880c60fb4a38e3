"""Does an open dashboard slow the engine? Step time with no dashboard, with a bare stream reader
(the server's whole cost of /v1/scheduler/stream) and with /dashboard open in headless Chromium
(the stream plus a browser drawing it, on the same machine).

One server; rounds alternate the three conditions (in rotating order) so that machine load drifts hit
all alike. Each round sends its requests at once (by default twice --max-num-seqs, so the queue
fills and the batch refills; ignore_eos, up to --max-tokens each), then reads the round's step
records from /v1/scheduler: the figure is the median duration of full decode steps (batch = max-num-seqs, no prefill), so that batch composition is the same in every
condition. The server's CPU seconds per step (Linux /proc) are recorded too. Usage:

    .venv/bin/python benchmarks/dashboard_overhead.py --model smollm2-135m --rounds 6 --max-tokens 128
    .venv/bin/python benchmarks/dashboard_overhead.py --screenshot docs/dashboard.png  # also the README's picture
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
from PIL import Image  # noqa: E402  (matplotlib's dependency)

from iterserve.bench.browser import open_browser  # noqa: E402
from iterserve.bench.launcher import ServerProcess  # noqa: E402

CONDITIONS = ("none", "stream", "browser")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class StreamReader:
    """Reads /v1/scheduler/stream in a thread and throws the events away, as fast as they come."""

    def __init__(self, base_url: str) -> None:
        self.stop = threading.Event()
        self.bytes = 0
        self.thread = threading.Thread(target=self._run, args=(base_url,), daemon=True)
        self.thread.start()

    def _run(self, base_url: str) -> None:
        with httpx.stream("GET", base_url + "/v1/scheduler/stream", timeout=60) as r:
            for chunk in r.iter_bytes():
                self.bytes += len(chunk)
                if self.stop.is_set():
                    return

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def one_round(srv: ServerProcess, model: str, limit: int, num_requests: int, max_tokens: int,
              screenshot: tuple[float, object] | None = None) -> dict:
    """num_requests at once, max_tokens spread over [max_tokens/2, max_tokens] (the same list every
    round), so requests finish at different steps and the batch refills; `screenshot` = (after
    seconds, callback) runs the callback that far into the round."""
    http = httpx.Client(base_url=srv.base_url, timeout=600)
    before = http.get("/v1/scheduler").json()["step"]
    cpu0, t0 = cpu_seconds(srv.proc.pid), time.perf_counter()
    bodies = [{"model": model, "prompt": PROMPT, "temperature": 0, "ignore_eos": True,
               "max_tokens": max(1, max_tokens // 2 + (max_tokens // 2) * ((7 * i) % num_requests) // num_requests)}
              for i in range(num_requests)]
    timer = threading.Timer(*screenshot) if screenshot else None
    with ThreadPoolExecutor(num_requests) as pool:
        futures = [pool.submit(http.post, "/v1/completions", json=b) for b in bodies]
        if timer:
            timer.start()
        for f in futures:
            f.result().raise_for_status()
    if timer:
        timer.join()
    wall, cpu = time.perf_counter() - t0, cpu_seconds(srv.proc.pid) - cpu0
    steps = http.get("/v1/scheduler", params={"since_step": before}).json()["steps"]
    http.close()
    full = [s["duration"] for s in steps if s["batch_size"] == limit and s["prefill_tokens"] == 0]
    return {"median_step_ms": statistics.median(full) * 1e3 if full else None, "full_steps": len(full),
            "steps": len(steps), "cpu_ms_per_step": cpu / len(steps) * 1e3, "wall_s": wall}


def save_screenshot(driver, path: Path) -> None:
    """The page as a 256-colour PNG (flat colours: small, and the charts stay exact)."""
    img = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    path.parent.mkdir(parents=True, exist_ok=True)
    img.quantize(colors=256).save(path, optimize=True)
    print(f"screenshot: {path} ({path.stat().st_size // 1024} KiB)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per condition")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128, help="longest output; outputs spread over half to all of it")
    ap.add_argument("--requests", type=int, default=None, help="requests per round (default: 2x max-num-seqs)")
    ap.add_argument("--server-args", default="", help="more `iterserve serve` flags, e.g. '--threads 2'")
    ap.add_argument("--screenshot", type=Path, default=None,
                    help="save the dashboard under load here (PNG), in the last browser round")
    ap.add_argument("--screenshot-after", type=float, default=10.0, help="seconds into that round (default 10)")
    args = ap.parse_args()

    n = args.max_num_seqs
    res: dict[str, list[dict]] = {c: [] for c in CONDITIONS}
    with ServerProcess([args.model, "--max-num-seqs", str(n), *args.server_args.split()]) as srv:
        one_round(srv, args.model, n, n, 8)  # warm-up
        driver = open_browser(1400, 1250)
        try:
            for r in range(args.rounds):
                order = CONDITIONS[r % 3:] + CONDITIONS[:r % 3]
                for cond in order:
                    reader = StreamReader(srv.base_url) if cond == "stream" else None
                    shot = None
                    if cond == "browser":
                        driver.get(srv.base_url + "/dashboard")
                        if args.screenshot is not None and r == args.rounds - 1:
                            shot = (args.screenshot_after, lambda: save_screenshot(driver, args.screenshot))
                    out = one_round(srv, args.model, n, args.requests or 2 * n, args.max_tokens, shot)
                    if cond == "browser":
                        out["page_ticks"] = driver.execute_script("return window.iterserveDashboard.ticks")
                        driver.get("about:blank")  # closes the page and its stream
                    if reader is not None:
                        reader.close()
                        out["stream_bytes"] = reader.bytes
                    res[cond].append(out)
                    print(f"round {r + 1} {cond:8s} median full step {out['median_step_ms'] or 0:.2f} ms over "
                          f"{out['full_steps']} steps, server cpu {out['cpu_ms_per_step']:.2f} ms/step", flush=True)
        finally:
            driver.quit()
    med = {c: {k: statistics.median(o[k] for o in res[c] if o[k] is not None) for k in ("median_step_ms", "cpu_ms_per_step")}
           for c in CONDITIONS}
    print(json.dumps({
        "model": args.model, "max_num_seqs": n, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "median_step_ms": {c: round(med[c]["median_step_ms"], 3) for c in CONDITIONS},
        "cpu_ms_per_step": {c: round(med[c]["cpu_ms_per_step"], 3) for c in CONDITIONS},
        "step_ratio_stream_over_none": round(med["stream"]["median_step_ms"] / med["none"]["median_step_ms"], 4),
        "step_ratio_browser_over_none": round(med["browser"]["median_step_ms"] / med["none"]["median_step_ms"], 4),
        "rounds_detail": res}, indent=1))


if __name__ == "__main__":
    main()
