"""Reading the dashboard page in headless Chromium (window.iterserveDashboard, canvas pixels) and
sending load for it to show: for the single server's tests (test_dashboard.py) and the Ray
ingress's (test_serve_ray.py)."""
from __future__ import annotations

import threading

import httpx


def dash(driver) -> dict:
    """The page's state: status, ticks, restarts, connections, and `engines` (one per panel); while a
    navigation is still loading the script, a placeholder whose status is "loading"."""
    return driver.execute_script("return window.iterserveDashboard") or {"status": "loading", "ticks": 0, "engines": {}}


def engine(driver, replica: str = "") -> dict | None:
    """One panel's state (ticks, steps, gaps, lastStep, redraws, blocks...): the single server's
    engine by default, else the replica's; None before the page has it."""
    return dash(driver)["engines"].get(replica)


def has_colour(driver, selector: str, rgb: tuple[int, int, int]) -> bool:
    """Whether the canvas (CSS selector) has a pixel of this colour (the drawing, not just a
    counter, happened)."""
    return driver.execute_script("""
        const c = document.querySelector(arguments[0]), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        for (let i = 0; i < d.length; i += 4) if (d[i] === arguments[1] && d[i+1] === arguments[2] && d[i+2] === arguments[3]) return true;
        return false;""", selector, *rgb)


def send_load(base_url: str, n: int = 12, max_tokens: int = 120, headers: dict | None = None,
              model: str = "tiny") -> threading.Thread:
    """n completions at once (with --max-num-seqs 4: 4 run, the rest wait), in a background thread."""
    def one(i: int) -> None:
        body = {"model": model, "prompt": f"Request number {i} asks for a fairly long answer about batching.",
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        r = httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text

    def all_of_them() -> None:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    t = threading.Thread(target=all_of_them, daemon=True)
    t.start()
    return t
