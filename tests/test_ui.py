"""The memory inspector (``/ui``, :mod:`eventkv.service.ui`) in a real browser: the system's headless Chromium
driven by Playwright against one in-process server (:class:`service_fixtures.LiveApp` on 127.0.0.1, the tiny
Llama in float32).

What is checked: the token flow (401 without a token, the token box, the list once a token is given), the
timeline's paging and filter, a query's served set against the timeline's highlighted rows, the side-by-side
of plans, writes through the JSON routes (a patch, a stale page's 409, a forget behind its confirmation), a
restricted token's 403, the reports page, axe-core's accessibility rules, and that the pages make no request
beyond the server (the browser resolves no other host).

``EVENTKV_UI_SCREENSHOTS=DIR``: full-page PNG screenshots of the pages are saved in ``DIR`` (nothing is written
otherwise). Skipped where Chromium (``chromium`` on the PATH) or Playwright is missing: no browser is
downloaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip("no system Chromium on the PATH (`chromium`): the browser tests need one", allow_module_level=True)

from service_fixtures import CHROMIUM_OFFLINE  # noqa: E402

expect = sync_api.expect

FULL = "f" * 32  # every namespace
RESTRICTED = "r" * 32  # namespace "other" only
KEY = "eventkv-token"  # where ui.js keeps the tab's token (sessionStorage)
ARGS = list(CHROMIUM_OFFLINE)
WAIT = 60_000  # ms: a fragment on a loaded 2-core machine
ANSWER_WAIT = 240_000  # ms: the first query also loads the dense selector's embedding model

N_EVENTS = 230
ACTS = ("fed the cat", "painted the fence", "baked rye bread", "swam in the lake", "read a novel", "fixed the bike")
VIOLIN = 42  # the one event about a violin: the query's best bm25 match, on the timeline's first page
HEADERS = (0, 50, 100, 150, 200)  # events tagged "header"
PATCHED = 20  # patched by the fixture through the update route
PATCH_TEXT = "Day 20: I repaired the garden gate."
SECRET_TEXTS = ("The vault code is 4711.", "The spare key is under the blue pot.", "Nobody knows about the tunnel.")
OTHER_TEXTS = ("A note in the other namespace.", "Another note there.")


def event_text(i: int) -> str:
    if i == VIOLIN:
        return f"Day {i}: I found an old violin in the attic."
    return f"Day {i}: I {ACTS[i % len(ACTS)]}."


def write_report(folder: Path) -> None:
    """A run folder as ``eventkv serve --report`` takes: a summary with a markdown table and one PNG figure."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.md").write_text(
        "# A tiny run\n\nTwo plans on three questions.\n\n"
        "| plan | accuracy | rows served |\n|---|---:|---:|\n| rows-original | 0.67 | 812 |\n| text | 1.00 | 640 |\n",
        encoding="utf-8",
    )
    fig = Figure(figsize=(3, 2), dpi=60)
    fig.add_subplot().plot([0, 1, 2], [0.2, 0.5, 0.4])
    fig.savefig(folder / "figure.png", format="png")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The live server, its memories written over HTTP: ``m1`` (default; 230 events, five tagged
    ``header``, event ``e20`` patched), ``secret`` (default) and ``o1`` (namespace ``other``)."""
    import httpx
    from service_fixtures import LiveApp

    from eventkv.service.app import Settings, create_app
    from eventkv.testing import tiny_lm

    report = tmp_path_factory.mktemp("reports") / "tiny-run"
    write_report(report)
    store = tmp_path_factory.mktemp("store")
    tokens = {FULL: None, RESTRICTED: frozenset({"other"})}
    # a context past the history's ~6,300 positions: the rows-original plan reads at the original positions
    app = create_app(Settings(tiny_lm("llama", max_context=16384), store, tokens=tokens, reports=(report,)))
    with LiveApp(app) as live, httpx.Client(base_url=live.url, timeout=600) as http:
        auth = {"Authorization": f"Bearer {FULL}"}

        def add(mid: str, events: list[dict], ns: str = "default") -> None:
            headers = {**auth, "X-EventKV-Namespace": ns}
            http.post("/v1/memories", json={"id": mid}, headers=headers).raise_for_status()
            for at in range(0, len(events), 512):
                body = {"events": events[at : at + 512], "prefill": True}
                http.post(f"/v1/memories/{mid}/events", json=body, headers=headers).raise_for_status()

        add(
            "m1",
            [
                dict(id=f"e{i}", text=event_text(i), role="user", tags=["header"] if i in HEADERS else [])
                for i in range(N_EVENTS)
            ],
        )
        http.post(
            f"/v1/memories/m1/events/e{PATCHED}/update", json={"text": PATCH_TEXT}, headers=auth
        ).raise_for_status()
        add("secret", [dict(id=f"s{i}", text=t) for i, t in enumerate(SECRET_TEXTS)])
        add("o1", [dict(id=f"o{i}", text=t) for i, t in enumerate(OTHER_TEXTS)], ns="other")
        live.http = http
        live.auth = auth
        yield live


@pytest.fixture(scope="module")
def seen():
    """Every request the pages made (URLs) and every failed one (URL, failure), across the module."""
    return {"requests": [], "failed": []}


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        expect.set_options(timeout=WAIT)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture()
def tabs(browser, server, seen):
    """``open(path, token=FULL)``: a new tab (its own sessionStorage) on ``path`` of the server, given
    ``token`` before its scripts run (None: no token); every request recorded in ``seen``."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(WAIT)
    context.on("request", lambda r: seen["requests"].append(r.url))
    context.on("requestfailed", lambda r: seen["failed"].append((r.url, r.failure)))

    def open_tab(path: str, token: str | None = FULL):
        page = context.new_page()
        if token is not None:  # kept unless the tab already holds one (a 401 clears it: ui.js)
            key, value = json.dumps(KEY), json.dumps(token)
            page.add_init_script(f"if (!sessionStorage.getItem({key})) sessionStorage.setItem({key}, {value});")
        page.goto(server.url + path)
        return page

    yield open_tab
    context.close()


def screenshot(page, name: str) -> None:
    """A full-page PNG of ``page`` as ``<name>.png`` in ``$EVENTKV_UI_SCREENSHOTS`` (nothing when unset)."""
    folder = os.environ.get("EVENTKV_UI_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)


def memory_rows(page) -> dict[str, str]:
    """The memory list's ids and event counts."""
    cells = page.locator("#memory-list tbody tr").evaluate_all(
        "rows => rows.map(r => [r.cells[0].innerText.trim(), r.cells[1].innerText.trim()])"
    )
    return dict(cells)


def timeline_ids(page) -> list[str]:
    return page.locator("#timeline-table tbody tr").evaluate_all("rows => rows.map(r => r.dataset.event)")


def pager(page):
    return page.locator("#timeline nav.pager span")


def wait_for(page, selector: str) -> None:
    """Wait for ``selector`` or an error in ``#status`` (failing with its message)."""
    page.locator(f"{selector}, #status.error").first.wait_for(timeout=ANSWER_WAIT)
    error = page.locator("#status.error")
    assert error.count() == 0, error.inner_text()


def ask(page, question: str) -> None:
    """Ask ``question`` (4 answer tokens) and wait for the answer and the timeline's served rows."""
    page.fill("#question", question)
    page.fill("#max_new_tokens", "4")
    page.click("#ask button[type=submit]")
    wait_for(page, "#served-table")
    expect(page.locator("#served")).not_to_have_value("")


def test_no_token_is_refused_until_one_is_given(tabs, server):
    page = tabs("/ui", token=None)
    expect(page.locator("#token-box")).to_be_visible()
    expect(page.locator("#token-message")).to_contain_text("this server asks for a bearer token")
    expect(page.locator("#status")).to_have_text("")  # nothing is asked before the token form is answered
    page.fill("#token", "w" * 32)  # a wrong token: refused, and the form comes back
    page.click("#token-form button[type=submit]")
    expect(page.locator("#status")).to_contain_text("HTTP 401")
    expect(page.locator("#token-message")).to_contain_text("missing or wrong bearer token")
    expect(page.locator("#token-box")).to_be_visible()
    expect(page.locator("#memory-list")).to_contain_text("not shown: missing or wrong bearer token")
    assert page.locator("#memory-list a").count() == 0
    main = page.locator("main").inner_text()
    assert "m1" not in main and "secret" not in main

    page.fill("#token", FULL)
    page.click("#token-form button[type=submit]")
    expect(page.locator("#memory-list a")).to_have_count(2)
    expect(page.locator("#token-box")).to_be_hidden()
    expect(page.locator("#status")).to_have_text("token kept for this tab")
    stats = server.http.get("/v1/memories/m1", headers=server.auth).json()["stats"]
    assert stats["events"] == N_EVENTS + 1  # the patch holds text too
    assert memory_rows(page) == {"m1": str(N_EVENTS + 1), "secret": str(len(SECRET_TEXTS))}
    assert page.evaluate(f"sessionStorage.getItem({json.dumps(KEY)})") == FULL
    screenshot(page, "memories")


def test_timeline_pages_and_filter(tabs):
    total = N_EVENTS + 1  # the patch is a row of the timeline
    page = tabs("/ui/memory/m1")
    expect(pager(page)).to_have_text(f"page 1 of 3 · {total} of {total} events")
    assert timeline_ids(page) == [f"e{i}" for i in range(100)]
    headers = page.locator("#timeline-table tbody tr.header").evaluate_all("rows => rows.map(r => r.dataset.event)")
    assert headers == ["e0", "e50"]
    patched = page.locator(f'#timeline-table tr[data-event="e{PATCHED}"]')
    expect(patched).to_contain_text("superseded")
    expect(patched).to_contain_text(f"patched by e{PATCHED}~1")

    page.locator("#timeline nav.pager button", has_text="next").click()
    expect(pager(page)).to_have_text(f"page 2 of 3 · {total} of {total} events")
    assert timeline_ids(page) == [f"e{i}" for i in range(100, 200)]
    screenshot(page, "timeline-page-2")

    page.locator("#timeline nav.pager button", has_text="last").click()
    expect(pager(page)).to_have_text(f"page 3 of 3 · {total} of {total} events")
    assert timeline_ids(page) == [f"e{i}" for i in range(200, N_EVENTS)] + [f"e{PATCHED}~1"]
    last = page.locator(f'#timeline-table tr[data-event="e{PATCHED}~1"]')
    expect(last).to_contain_text(PATCH_TEXT)
    expect(last).to_contain_text(f"patches e{PATCHED}")
    assert page.locator("#timeline nav.pager button", has_text="next").count() == 0

    # a filter starts at its first page (not the last page clamped): id, text, role and tags are searched
    ones = [f"e{i}" for i in range(N_EVENTS) if f"e{i}".startswith("e1")]
    page.fill("#filter", "E1")
    expect(pager(page)).to_have_text(f"page 1 of 2 · {len(ones)} of {total} events")
    assert timeline_ids(page) == ones[:100]
    page.locator("#timeline nav.pager button", has_text="next").click()
    expect(pager(page)).to_have_text(f"page 2 of 2 · {len(ones)} of {total} events")
    assert timeline_ids(page) == ones[100:]
    page.fill("#filter", "rye bread")
    bread = [f"e{i}" for i in range(N_EVENTS) if "rye bread" in event_text(i)]
    expect(pager(page)).to_have_text(f"page 1 of 1 · {len(bread)} of {total} events")
    assert timeline_ids(page) == bread
    page.fill("#filter", "header")
    expect(pager(page)).to_have_text(f"page 1 of 1 · {len(HEADERS)} of {total} events")
    assert timeline_ids(page) == [f"e{i}" for i in HEADERS]
    page.fill("#filter", "violin")
    expect(pager(page)).to_have_text(f"page 1 of 1 · 1 of {total} events")
    assert timeline_ids(page) == [f"e{VIOLIN}"]


def test_query_shows_served_set_on_the_timeline(tabs):
    page = tabs("/ui/memory/m1")
    expect(pager(page)).to_contain_text("page 1 of 3")
    assert page.locator("#timeline-table tr.served").count() == 0
    ask(page, "Where did I find the old violin?")

    expect(page.locator("#answer-text")).not_to_be_empty()
    served_rows = page.locator("#served-table tbody tr")
    count = int(page.locator("#served-count").inner_text())
    assert served_rows.count() == count
    assert count >= 1
    # the form leaves k and the budget empty: the default plan, its budget resolved in the plan shown
    expect(page.locator("#answer")).to_contain_text("k=None, budget=None, budget_rows=1600")
    served = served_rows.evaluate_all("rows => rows.map(r => r.dataset.event)")
    assert f"e{VIOLIN}" in served
    assert page.locator("#served").input_value() == ",".join(served)

    # the timeline (page 1: e0..e99) highlights exactly the served events it shows, each with its place
    on_page = [eid for eid in served if eid in {f"e{i}" for i in range(100)}]
    highlighted = page.locator("#timeline-table tbody tr.served")
    expect(highlighted).to_have_count(len(on_page))
    assert sorted(highlighted.evaluate_all("rows => rows.map(r => r.dataset.event)")) == sorted(on_page)
    colours = highlighted.evaluate_all("rows => rows.map(r => getComputedStyle(r.cells[2]).backgroundColor)")
    assert set(colours) == {"rgb(255, 224, 138)"}  # the served colour, group headers included
    place = served.index(f"e{VIOLIN}") + 1
    expect(page.locator(f'#timeline-table tr[data-event="e{VIOLIN}"]')).to_contain_text(f"served #{place}")
    expect(page.locator("#timeline svg.strip rect.hit").first).to_be_attached()

    # the bm25 column: a rank for every served event, the violin first
    heads = page.locator("#served-table thead th").all_inner_texts()
    col = next(n for n, h in enumerate(heads) if h.strip().startswith("bm25"))
    ranks = served_rows.evaluate_all(f"rows => rows.map(r => r.cells[{col}].innerText.trim())")
    assert all(re.match(r"^#\d+\b", r) for r in ranks), ranks
    assert re.match(r"#1\b", ranks[served.index(f"e{VIOLIN}")]), ranks
    # the summary's figure of the recent queries is drawn once the memory changes or the page reloads
    page.reload()
    expect(page.locator("#summary figure svg")).to_be_attached()


def test_compare_plans_side_by_side(tabs):
    from eventkv.service.ui.pages import DEFAULT_PLANS, PLANS

    page = tabs("/ui/memory/m1")
    expect(pager(page)).to_contain_text("page 1 of 3")
    ticked = page.locator("#ask input[name=plan]:checked").evaluate_all("xs => xs.map(x => x.value)")
    assert ticked == list(DEFAULT_PLANS)
    ask(page, "What did I bake?")
    page.locator("#ask button", has_text="Compare plans").click()
    wait_for(page, "#compare .plan")
    cards = page.locator("#compare .plan")
    expect(cards).to_have_count(3)
    assert cards.evaluate_all("xs => xs.map(x => x.dataset.plan)") == list(DEFAULT_PLANS)
    for n, key in enumerate(DEFAULT_PLANS):
        card = cards.nth(n)
        expect(card.locator("h3")).to_have_text(PLANS[key][0])
        assert card.locator(".answer").inner_text().strip() != ""
        assert re.search(r"\d+ events · \d+ rows", card.inner_text())
    expect(page.locator("#compare")).to_contain_text("3 plans read out in one batched pass")
    screenshot(page, "memory-query-compare")


def test_patch_through_the_update_form(tabs):
    page = tabs("/ui/memory/m1")
    row = page.locator('#timeline-table tr[data-event="e10"]')
    expect(row).to_contain_text("live")
    row.locator("summary", has_text="update").click()
    row.locator("textarea[name=text]").fill("Day 10: I baked bread with my aunt.")
    row.locator("button", has_text="Patch").click()
    expect(page.locator("#status")).to_contain_text("e10 patched — the memory is at version")
    assert "error" not in (page.locator("#status").get_attribute("class") or "")
    expect(row).to_contain_text("superseded")
    expect(row).to_contain_text("patched by e10~1")
    expect(row.locator("button", has_text="forget")).to_have_count(0)  # only the patch takes verbs now


def test_stale_page_gets_409(tabs, server):
    a = tabs("/ui/memory/m1")
    b = tabs("/ui/memory/m1")
    for page in (a, b):
        expect(pager(page)).to_contain_text("page 1 of 3")
    version = server.http.get("/v1/memories/m1", headers=server.auth).json()["version"]

    a.locator('#timeline-table tr[data-event="e11"] button', has_text="pin").click()
    expect(a.locator("#status")).to_contain_text(f"e11 pinned — the memory is at version {version + 1}")
    expect(a.locator('#timeline-table tr[data-event="e11"]')).to_contain_text("pinned")

    b.locator('#timeline-table tr[data-event="e12"] button', has_text="pin").click()
    status = b.locator("#status")
    expect(status).to_contain_text("HTTP 409")
    expect(status).to_contain_text(f"the memory is at version {version + 1}, the write expected {version}")
    expect(status).to_have_class(re.compile(r"\berror\b"))
    record = server.http.get("/v1/memories/m1/events/e12", headers=server.auth).json()
    assert record["pinned"] is False


def test_forget_behind_its_confirmation(tabs, server):
    page = tabs("/ui/memory/m1")
    page.locator("#timeline nav.pager button", has_text="last").click()
    expect(pager(page)).to_contain_text("page 3 of 3")
    target = "e225"
    records = server.http.get(
        "/v1/memories/m1/events", params={"include_superseded": "true", "include_deleted": "true"}, headers=server.auth
    ).json()
    seq = next(r["seq"] for r in records if r["id"] == target)
    later = sum(1 for r in records if r["seq"] > seq and r["row_start"] is not None)
    assert later >= N_EVENTS - 226

    messages = []

    def accept(dialog):
        messages.append((dialog.type, dialog.message))
        dialog.accept()

    page.once("dialog", accept)
    row = page.locator(f'#timeline-table tr[data-event="{target}"]')
    row.locator("button", has_text="forget").click()
    expect(page.locator("#status")).to_contain_text(
        f"{target} forgotten — the memory is at version", timeout=ANSWER_WAIT
    )
    assert len(messages) == 1 and messages[0][0] == "confirm"
    assert messages[0][1].startswith(f"Forget {target}?")
    assert f"The {later} later events with rows are prefilled again" in messages[0][1]

    # the timeline reloads on the page it was on: the row says forgotten
    expect(pager(page)).to_contain_text("page 3 of 3")
    expect(row).to_contain_text("forgotten")
    expect(row).to_contain_text("(forgotten: text and rows erased)")
    assert event_text(225) not in row.inner_text()
    assert server.http.get(f"/v1/memories/m1/events/{target}", headers=server.auth).json()["forgotten"] is True


def test_restricted_token_sees_only_its_namespace(tabs):
    page = tabs("/ui?ns=default", token=RESTRICTED)
    expect(page.locator("#status")).to_contain_text("HTTP 403")
    expect(page.locator("#status")).to_contain_text("not granted namespace 'default'")
    expect(page.locator("#token-box")).to_be_hidden()  # the token is right, its grant is not
    assert page.locator("#memory-list a").count() == 0
    text = page.locator("main").inner_text()
    assert "m1" not in text and "secret" not in text

    page = tabs("/ui/memory/m1?ns=default", token=RESTRICTED)
    expect(page.locator("#status")).to_contain_text("HTTP 403")
    page.wait_for_load_state("networkidle")
    body = page.content()
    assert "Day 1:" not in body and "violin" not in body and "painted the fence" not in body
    assert page.locator("#timeline-table").count() == 0
    for part in ("#summary", "#timeline"):  # each refused fragment's place says why, not "loading..."
        expect(page.locator(part)).to_contain_text("not shown: this token is not granted namespace 'default'")

    page = tabs("/ui?ns=other", token=RESTRICTED)
    expect(page.locator("#memory-list a")).to_have_count(1)
    assert memory_rows(page) == {"o1": str(len(OTHER_TEXTS))}
    expect(page.locator("h1")).to_contain_text("other")
    assert page.locator("#status").inner_text().strip() == ""


def test_reports_page(tabs):
    page = tabs("/ui/reports")
    report = page.locator("#reports section")
    expect(report).to_have_count(1)
    expect(report.locator("h2")).to_have_text("tiny-run")
    img = report.locator("img.figure")
    expect(img).to_have_count(1)
    assert img.get_attribute("src").startswith("data:image/png;base64,")
    assert img.evaluate("i => i.complete && i.naturalWidth") == 180  # 3 in at 60 dpi: the PNG decoded
    assert img.get_attribute("alt") == "figure figure.png of tiny-run"
    table = report.locator(".summary table")
    expect(table).to_have_count(1)
    assert table.locator("th").all_inner_texts() == ["plan", "accuracy", "rows served"]
    rows = table.locator("tbody tr").evaluate_all("rs => rs.map(r => [...r.cells].map(c => c.innerText))")
    assert rows == [["rows-original", "0.67", "812"], ["text", "1.00", "640"]]
    expect(report.locator(".summary h1")).to_have_text("A tiny run")
    screenshot(page, "reports")


CHECKS = {"resultTypes": ["violations", "incomplete"]}  # axe-core's options: the passes are counted only


def test_accessibility(tabs):
    axe_module = pytest.importorskip("axe_playwright_python.sync_playwright", reason="axe-playwright-python missing")
    axe = axe_module.Axe()
    found = {}

    page = tabs("/ui", token=None)  # the token box
    expect(page.locator("#token-box")).to_be_visible()
    found["/ui without a token"] = axe.run(page, options=CHECKS)

    page = tabs("/ui")
    expect(page.locator("#memory-list a")).to_have_count(2)
    found["/ui"] = axe.run(page, options=CHECKS)

    page = tabs("/ui/memory/m1")
    expect(pager(page)).to_contain_text("page 1 of 3")
    ask(page, "Where did I find the old violin?")
    page.locator("#ask button", has_text="Compare plans").click()
    wait_for(page, "#compare .plan")
    expect(page.locator("#timeline-table tbody tr.served").first).to_be_visible()
    page.locator('#timeline-table tr[data-event="e1"] summary', has_text="update").click()
    found["/ui/memory/m1 after a query and a side-by-side"] = axe.run(page, options=CHECKS)

    page = tabs("/ui/reports")
    expect(page.locator("#reports img.figure")).to_have_count(1)
    found["/ui/reports"] = axe.run(page, options=CHECKS)

    assert all(len(r.response["passes"]) > 30 for r in found.values())  # the rules ran
    bad = {k: r.generate_report() for k, r in found.items() if r.violations_count}
    assert not bad, "\n\n".join(f"{k}:\n{v}" for k, v in bad.items())
    # what axe cannot decide alone (e.g. an aria-label on a div without a role) is held to the same bar
    unsure = {
        k: [(x["id"], x["impact"], [n["target"] for n in x["nodes"]]) for x in r.response["incomplete"]]
        for k, r in found.items()
    }
    assert {k: [x for x in v if x[1] in ("serious", "critical")] for k, v in unsure.items()} == {k: [] for k in found}


def test_no_request_leaves_the_server(tabs, server, seen):
    """Every request of every page of this module went to the server: no CDN, no font, no telemetry (run
    last; alone, it loads the three pages first)."""
    for path in ("/ui", "/ui/memory/m1", "/ui/reports"):
        page = tabs(path)
        page.wait_for_load_state("networkidle")
    urls = [u for u in seen["requests"] if not u.startswith("data:")]
    assert any(u.startswith(server.url + "/ui/part/memories") for u in urls)
    assert any(u == server.url + "/ui/static/htmx.min.js" for u in urls)
    outside = sorted({u for u in urls if not u.startswith(server.url + "/")})
    assert outside == []
    failed = [(u, why) for u, why in seen["failed"] if not u.startswith(server.url + "/")]
    assert failed == []
