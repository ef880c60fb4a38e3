"""Headless Chromium for the dashboard's tests, its benchmark and its screenshot (needs the dev
extra's selenium; imported only by those).

Debian's `chromium` and `chromium-driver` packages, driven by Selenium with the driver's path given,
so Selenium never tries to download a browser or a driver. When either is missing, `ensure_chromium`
installs both with apt-get (the tests run as root on a fresh machine, as `make test` does in CI).
"""
from __future__ import annotations

import os
import shutil
import subprocess

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

PACKAGES = {"chromium": "chromium", "chromium-driver": "chromedriver"}  # Debian package -> executable


def ensure_chromium() -> tuple[str, str]:
    """(browser, driver) paths; installs Debian's packages first when one is missing."""
    missing = [pkg for pkg, exe in PACKAGES.items() if shutil.which(exe) is None]
    if missing:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise RuntimeError(f"headless Chromium is missing: run `apt-get install -y {' '.join(missing)}` "
                               "(Debian/Ubuntu) as root, then run again")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES], check=True,
                       env=env, stdout=subprocess.DEVNULL)
    return shutil.which("chromium"), shutil.which("chromedriver")


def open_browser(width: int = 1280, height: int = 1000):
    """A headless Chromium WebDriver; quit() it when done."""
    binary, driver = ensure_chromium()
    opts = Options()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-extensions", "--no-first-run", f"--window-size={width},{height}"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=opts)
