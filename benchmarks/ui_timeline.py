"""The memory inspector on a long history: how long its fragments take on a memory of ``--events`` events
(default 20,000) against one of ``--small`` events (default 200), measured in one run.

1. Build: two memories in one store root (``ROOT/default/long``, ``ROOT/default/short``) on the tiny random
   Llama of the tests (the inspector's cost is the event table, not the model), each event one invented
   sentence (``Day N: ...`` from small word lists, seeded), every 50th a group header (tag ``header``), one
   event in 500 patched; the events are added in batches of 500 and not prefilled (a 20,000-event history's
   rows are not what the pages read).
2. Fragments: an app (``create_app``) under uvicorn on 127.0.0.1 and a free port; over HTTP (httpx, one
   connection), ``--reps`` times each (median ms, and the bytes of the answer): the memory list, the
   memory's summary, the timeline's first page, its last page, a text filter, and an event's patch
   history. Each is a read of the committed table through a read-only connection (every event row
   checked), the filtering and paging, and the template's rendering of one page (100 events).
3. Browser (with ``--browser``, where Playwright and Chromium are installed): headless Chromium opens
   the long memory's page and the milliseconds from navigation to the timeline's first page on screen,
   and from a click on "last" to the last page on screen, are printed (median of ``--reps``).

Printed: the CPU, then one line per fragment and memory, then, each on a line of its own, ``timeline first
page, long / short: N.NNx`` and the same for the filter (the cost of the history's length, measured in
this run).

    python benchmarks/ui_timeline.py --events 20000 --browser
"""

from __future__ import annotations

import argparse
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

WORDS = (
    "fed the cat",
    "painted the fence",
    "called my sister",
    "read a book on birds",
    "baked bread",
    "went to the lake",
    "fixed the bike",
    "planted tomatoes",
    "wrote to an old friend",
    "walked along the river",
)


def build(root: Path, mid: str, n: int, lm, seed: int = 0) -> None:
    from eventkv.memory import EventMemory, MemoryEvent

    rng = random.Random(seed)
    with EventMemory.create(root / "default" / mid, lm, namespace="default") as mem:
        for start in range(0, n, 500):
            events = []
            for i in range(start, min(n, start + 500)):
                if i % 50 == 0:
                    events.append(
                        MemoryEvent(f"[session {i // 50 + 1} begins]", id=f"s{i // 50 + 1}", tags=("header",))
                    )
                else:
                    events.append(MemoryEvent(f"Day {i}: I {rng.choice(WORDS)} and {rng.choice(WORDS)}.", id=f"e{i}"))
            mem.add(events)
        for i in range(1, n, 500):
            if i % 50:
                mem.update(f"e{i}", f"Day {i}: in fact I {rng.choice(WORDS)}.")


def timed(fn, reps: int) -> tuple[float, int]:
    out, size = [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        size = fn()
        out.append(1000 * (time.perf_counter() - t0))
    return statistics.median(out), size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--small", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--browser", action="store_true", help="also time the page in headless Chromium (Playwright)")
    args = ap.parse_args()

    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from service_fixtures import LiveApp
    from service_scale import cpu_model

    from eventkv.service.app import Settings, create_app
    from eventkv.testing import tiny_lm

    print(f"CPU: {cpu_model()}; python {platform.python_version()}")
    lm = tiny_lm("llama")
    root = Path(tempfile.mkdtemp(prefix="eventkv-ui-bench-"))
    try:
        for mid, n in (("long", args.events), ("short", args.small)):
            t0 = time.perf_counter()
            build(root, mid, n, lm)
            print(f"built {mid}: {n} events in {time.perf_counter() - t0:.1f} s")
        app = create_app(Settings(lm, root))
        medians: dict[tuple[str, str], float] = {}
        with LiveApp(app) as live, httpx.Client(base_url=live.url, timeout=600) as http:
            for mid in ("long", "short"):
                n = args.events if mid == "long" else args.small
                last = -(-(n + n // 500) // 100)
                parts = {
                    "memory list": "/ui/part/memories",
                    "summary": f"/ui/part/memory/{mid}/summary",
                    "timeline first page": f"/ui/part/memory/{mid}/timeline",
                    "timeline last page": f"/ui/part/memory/{mid}/timeline?page={last}",
                    "filter": f"/ui/part/memory/{mid}/timeline?q=painted+the+fence",
                    "patch history": f"/ui/part/memory/{mid}/event/e1/history",
                }
                for name, path in parts.items():

                    def get(path=path) -> int:
                        r = http.get(path)
                        r.raise_for_status()
                        return len(r.content)

                    ms, size = timed(get, args.reps)
                    medians[(mid, name)] = ms
                    print(f"{mid:>5} ({n} events)  {name:<20} {ms:8.1f} ms  {size / 1024:7.1f} KiB")
            if args.browser:
                browse(live.url, args.reps)
        for name in ("timeline first page", "filter"):
            ratio = medians[("long", name)] / medians[("short", name)]
            print(f"{name}, long / short: {ratio:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def browse(url: str, reps: int) -> None:
    chromium = shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("browser: skipped (playwright is not installed)")
        return
    if chromium is None:
        print("browser: skipped (no chromium)")
        return
    args = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=args)
        opened, paged = [], []
        for _ in range(reps):
            page = browser.new_page()
            t0 = time.perf_counter()
            page.goto(f"{url}/ui/memory/long")
            page.wait_for_selector("#timeline-table tbody tr", timeout=120_000)
            opened.append(1000 * (time.perf_counter() - t0))
            t0 = time.perf_counter()
            page.get_by_role("button", name="last").click()
            page.wait_for_function(
                "document.querySelector('.pager span').textContent.startsWith('page ' + "
                "document.querySelector('.pager span').textContent.split(' of ')[1].split(' ')[0])"
            )
            paged.append(1000 * (time.perf_counter() - t0))
            page.close()
        browser.close()
    print(
        f"browser: open the long memory's page to its timeline on screen {statistics.median(opened):.0f} ms; "
        f"'last' to the last page on screen {statistics.median(paged):.0f} ms"
    )


if __name__ == "__main__":
    main()
