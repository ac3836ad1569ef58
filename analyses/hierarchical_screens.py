"""Screenshots of the app with a hierarchical model (issue 32), in real headless Chromium, to check by eye: a Swin's
attention distance per stage, its rollout on the image through the windows and patch mergings with one query's
window per head, its position bias by offset, and Compare beside the embedded ViT against depth in image widths.

    python analyses/hierarchical_screens.py [--model swin_tiny_patch4_window7_224] [--out test-output/hierarchical]

The model is built with random weights (no download); the app listens on 127.0.0.1 only. Needs Debian's chromium
(``scripts/install-chromium.sh``) and the requirements' playwright.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(port: int) -> subprocess.Popen:
    """``streamlit run app.py`` on 127.0.0.1:port, once its health check answers."""
    server = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"), "--server.headless",
                               "true", "--server.address", "127.0.0.1", "--server.port", str(port),
                               "--browser.gatherUsageStats", "false"], cwd=ROOT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).read() == b"ok":
                return server
        except OSError:
            time.sleep(0.5)
    server.terminate()
    raise SystemExit("streamlit did not come up within 120 s")


def settle(page, timeout_s: float = 600) -> None:
    """Wait until Streamlit has finished the run: nothing stale on the page, no spinner, a figure drawn."""
    deadline = time.time() + timeout_s
    page.wait_for_timeout(1500)
    busy = "[data-stale='true'], [data-testid='stSpinner'], [data-testid='stStatusWidget']"
    while page.locator(busy).count() and time.time() < deadline:
        page.wait_for_timeout(500)
    page.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=60000)
    page.wait_for_timeout(2000)
    errors = page.locator("[data-testid='stException']")
    if errors.count():
        raise SystemExit(f"the app raised: {errors.first.inner_text()[:400]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="swin_tiny_patch4_window7_224")
    ap.add_argument("--out", default=str(ROOT / "test-output" / "hierarchical"))
    args = ap.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("Debian's chromium is not installed: run scripts/install-chromium.sh")
    from playwright.sync_api import sync_playwright

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = serve(port)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 2000})
            page.goto(f"http://127.0.0.1:{port}/", wait_until="domcontentloaded")
            page.get_by_text("Top-5 predictions").wait_for(timeout=120000)
            slider = page.get_by_role("slider").first  # the held-out scenes: the fewest, so Compare is quick
            slider.focus()
            slider.press("Home")
            settle(page)
            page.get_by_text("Name", exact=True).first.click()
            box = page.get_by_label("Model name", exact=False).first
            box.fill(args.model)
            box.press("Enter")
            page.get_by_text("hierarchical", exact=False).first.wait_for(timeout=300000)
            shots = []
            for view in ("Attention distance", "Attention maps", "Position embeddings", "Compare"):
                page.get_by_text(view, exact=True).first.click()
                try:
                    settle(page)
                    if view == "Compare":  # beside the embedded ViT (the second model's picker offers the hybrid)
                        page.locator(".st-key-m2-ref [data-testid='stSelectbox']").first.click()
                        page.get_by_role("option", name="ref-vit").click()
                        settle(page)
                except Exception:
                    page.screenshot(path=str(out / "failed.png"), full_page=True)
                    raise
                path = out / f"{view.lower().replace(' ', '_')}.png"
                page.screenshot(path=str(path), full_page=True)
                shots.append(path)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    for path in shots:
        print(path)


if __name__ == "__main__":
    main()
