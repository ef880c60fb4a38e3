"""Reading the dashboard page in headless Chromium (window.iterserveDashboard, canvas pixels), for
the single server's tests (test_dashboard.py) and the Ray ingress's (test_serve_ray.py)."""
from __future__ import annotations


def dash(driver) -> dict:
    """The page's state: status, ticks, restarts, connections, and `engines` (one per panel)."""
    return driver.execute_script("return window.iterserveDashboard")


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
