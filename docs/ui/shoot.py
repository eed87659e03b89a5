"""The screenshots of docs/ui.md, taken from a running server in headless Chromium (Playwright):

    eventkv serve --model smollm2-135m --store /tmp/ui-store --port 8765 \
        --report docs/results/memory-eval-locomo-dev-16k --report docs/results/contract-qwen2.5-coder-1.5b
    eventkv memory import demo --server http://127.0.0.1:8765 --id demo --with-headers
    python docs/ui/shoot.py http://127.0.0.1:8765 demo "Where did Noor sign up for a class?"

Writes docs/ui/memories.png, memory.png (after a query and a side-by-side of three plans), timeline.png
and reports.png. The server needs no token (loopback)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

HERE = Path(__file__).parent


def main(url: str, memory: str, question: str) -> None:
    args = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=args)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{url}/ui")
        page.wait_for_selector("#memory-list table")
        page.screenshot(path=HERE / "memories.png", full_page=True)
        page.goto(f"{url}/ui/memory/{memory}")
        page.wait_for_selector("#timeline-table tbody tr")
        page.fill("#question", question)
        page.get_by_role("button", name="Ask").click()
        page.wait_for_selector("#served-table", timeout=300_000)
        page.wait_for_selector("tr.served", timeout=60_000)
        page.get_by_role("button", name="Compare plans").click()
        page.wait_for_selector("#compare .plan", timeout=300_000)
        page.screenshot(path=HERE / "memory.png", full_page=True)
        page.locator("#timeline").screenshot(path=HERE / "timeline.png")
        page.goto(f"{url}/ui/reports")
        page.wait_for_selector("#reports section")
        page.screenshot(path=HERE / "reports.png")  # the first screen: the figures are large
        browser.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
