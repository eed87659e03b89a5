"""The memory inspector without a browser: its timeline pages, history strip, snapshot reuse, reports and the
fragments' auth over HTTP, and ``eventkv memory import`` into a live server."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("jinja2")
pytest.importorskip("fastapi")

from cli_fixtures import run_cli  # noqa: E402
from service_fixtures import LiveApp  # noqa: E402

from eventkv.memory import EventMemory, MemoryEvent  # noqa: E402
from eventkv.service.app import Settings, create_app  # noqa: E402
from eventkv.service.middleware import is_public  # noqa: E402
from eventkv.service.ui import views  # noqa: E402
from eventkv.testing import tiny_lm  # noqa: E402

FULL, OTHER = "f" * 32, "o" * 32


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


@pytest.fixture
def mem(tmp_path, lm):
    with EventMemory.create(tmp_path / "default" / "m", lm, namespace="default") as m:
        m.add([MemoryEvent(f"Day {i}: the heron came back.", id=f"e{i}") for i in range(250)])
        m.update("e7", "Day 7: the heron did not come.")
        m.delete("e9")
        yield m


def test_timeline_pages_filters_and_marks_served(mem):
    records = mem.list(include_superseded=True, include_deleted=True)
    assert len(records) == 251  # 250 events and one patch
    first = views.timeline(records, 1)
    assert (first.page, first.pages, first.total, len(first.rows)) == (1, 3, 251, 100)
    last = views.timeline(records, 99)  # past the end: the last page
    assert (last.page, len(last.rows)) == (3, 51)
    e7 = next(r for r in first.rows if r.record.id == "e7")
    assert e7.patched_by == ("e7~1",) and e7.state == "superseded"
    assert next(r for r in first.rows if r.record.id == "e9").state == "deleted"
    hit = views.timeline(records, 1, "DAY 12:")
    assert [r.record.id for r in hit.rows] == ["e12"] and hit.matched == 1
    served = views.timeline(records, 1, "", ["e3", "e200"], served_only=True)
    assert [(r.record.id, r.served) for r in served.rows] == [("e3", 1), ("e200", 2)]


def test_the_strip_bins_the_whole_history_and_counts_served_events(mem):
    mem.prefill()
    records = mem.list(include_superseded=True, include_deleted=True)
    bins = views.strip(records, ["e0", "e1", "e249"], bins=10)
    assert len(bins) == 10 and sum(b.events for b in bins) == 251
    assert bins[0].served == 2 and bins[-1].served == 1 and sum(b.served for b in bins) == 3
    assert abs(sum(b.width for b in bins) - 100) < 1e-9


def test_snapshots_are_reused_until_a_commit(tmp_path, mem):
    cache = views.Snapshots(size=2)
    d = mem.directory
    a = cache.read(d)
    assert cache.read(d) is a  # unchanged store: the same snapshot
    mem.add("Day 300: a new bird.")
    b = cache.read(d)
    assert b is not a and b.version == a.version + 1 and b.stats.events == a.stats.events + 1


def test_a_report_renders_its_markdown_and_embeds_its_figures(tmp_path):
    folder = tmp_path / "run"
    (folder / "figures").mkdir(parents=True)
    (folder / "summary.md").write_text("| arm | F1 |\n|---|---|\n| rows | 0.5 |\n\n<script>alert(1)</script>\n")
    (folder / "figures" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\nfake")
    rep = views.read_report(folder)
    assert "<table>" in rep.html and "<td>0.5</td>" in rep.html
    assert "<script>" not in rep.html and "&lt;script&gt;" in rep.html  # shown as text, never run
    assert rep.figures == [("a.png", "data:image/png;base64,iVBORw0KGgpmYWtl")]


def test_the_shells_are_public_and_the_fragments_are_not():
    assert is_public("/ui") and is_public("/ui/memory/m") and is_public("/ui/static/htmx.min.js")
    assert not is_public("/ui/part/memories") and not is_public("/ui/part/memory/m/timeline")
    assert not is_public("/uix") and not is_public("/v1/memories")


def test_fragments_need_the_token_and_the_namespace_grant(tmp_path, lm):
    app = create_app(Settings(lm, tmp_path, tokens={FULL: None, OTHER: frozenset({"other"})}))
    with LiveApp(app) as live, httpx.Client(base_url=live.url, timeout=120) as http:
        full = {"Authorization": f"Bearer {FULL}"}
        assert http.post("/v1/memories", json={"id": "m"}, headers=full).status_code == 201
        http.post("/v1/memories/m/events", json={"events": [{"text": "The heron is back."}]}, headers=full)
        page = http.get("/ui/memory/m")
        assert page.status_code == 200 and "heron" not in page.text  # the shell holds no data
        assert http.get("/ui/static/htmx.min.js").status_code == 200
        assert http.get("/ui/part/memory/m/timeline").status_code == 401
        r = http.get("/ui/part/memory/m/timeline", headers=full)
        assert r.status_code == 200 and "The heron is back." in r.text
        restricted = {"Authorization": f"Bearer {OTHER}"}
        for path in ("/ui/part/memories", "/ui/part/memory/m/timeline", "/ui/part/memory/m/summary"):
            r = http.get(path, headers=restricted)
            assert r.status_code == 403 and r.json()["code"] == "forbidden" and "heron" not in r.text
        r = http.get("/ui/part/memories", headers={**restricted, "X-EventKV-Namespace": "other"})
        assert r.status_code == 200 and "0 memories" in r.text
        r = http.post(
            "/ui/part/memory/m/query", data={"question": "Who is back?", "k": "0"}, headers=full
        )  # the JSON route's limits
        assert r.status_code == 422 and "k" in r.json()["message"]
        r = http.post("/ui/part/memory/m/compare", data={"question": "Who?", "plan": "text"}, headers=full)
        assert r.status_code == 422 and "two or more" in r.json()["message"]


def test_memory_import_builds_a_memory_from_a_conversation(tmp_path, lm, monkeypatch, capsys):
    from eventkv.studies.materialization.dialogue import load_locomo
    from eventkv.studies.materialization.memory_eval import DEMO_DATA

    turns = load_locomo(DEMO_DATA)[0].turns
    sessions = len({t.session for t in turns})
    app = create_app(Settings(lm, tmp_path))
    run = (monkeypatch, capsys)
    with LiveApp(app) as live, httpx.Client(base_url=live.url, timeout=120) as http:
        code, out, err = run_cli(
            monkeypatch, capsys, "memory", "import", "demo", "--server", live.url, "--id", "demo", "--with-headers"
        )
        assert code in (0, None), err
        assert f"{len(turns) + sessions} events" in out and "/ui/memory/demo?ns=default" in out
        events = http.get("/v1/memories/demo/events").json()
        assert len(events) == len(turns) + sessions
        assert sum("header" in e["tags"] for e in events) == sessions
        assert all(e["segment"] is not None for e in events)  # prefilled as added
        code, _, err = run_cli(
            monkeypatch, capsys, "memory", "import", "demo", "--server", live.url, "--id", "x", "--conversation", "9"
        )
        assert code == 2 and "--conversation" in err and "Traceback" not in err
        # an import stopped part-way resumes: the memory holds a prefix of the events, the rest are added
        args = ("memory", "import", "demo", "--server", live.url, "--id", "part", "--with-headers")
        code, out, _ = run_cli(monkeypatch, capsys, *args, "--max-turns", "5")
        assert code in (0, None) and "6 events" in out  # a session header and 5 turns
        code, out, _ = run_cli(monkeypatch, capsys, *args)
        assert code in (0, None) and f"{len(turns) + sessions} events" in out
        assert [e["id"] for e in http.get("/v1/memories/part/events").json()] == [
            e["id"] for e in http.get("/v1/memories/demo/events").json()
        ]
        code, _, err = run_cli(monkeypatch, capsys, "memory", "import", "demo", "--server", live.url, "--id", "demo")
        assert code == 2 and "with other events" in err  # the same id, built without headers
        # a memory keeps its row format: a resumed import adds in it; another --rows is refused, naming it
        http.post("/v1/memories", json={"id": "q4", "rows": "int4"})  # created empty, before any import
        code, _, err = run_cli(*run, "memory", "import", "demo", "--server", live.url, "--id", "q4", "--rows", "int8")
        assert code == 2 and "stores its rows as int4, not --rows int8" in err and "Traceback" not in err
        code, out, err = run_cli(
            *run, "memory", "import", "demo", "--server", live.url, "--id", "q4", "--max-turns", "3"
        )
        assert code in (0, None) and "3 events (3 added)" in out, err
        assert http.get("/v1/memories/q4").json()["rows"] == "int4"
        code, out, err = run_cli(
            *run, "memory", "import", "demo", "--server", live.url, "--id", "q4", "--max-turns", "3"
        )
        assert code in (0, None) and "3 events (none added: it held them all)" in out, err
        for bad, says in (
            (("--server", "127.0.0.1:9", "--id", "y"), "--server '127.0.0.1:9': give the server's URL"),
            (("--server", "http://127.0.0.1:9", "--id", "y"), "cannot be reached"),
            (("--server", live.url, "--id", "bad id"), "--id 'bad id'"),
        ):
            code, out, err = run_cli(monkeypatch, capsys, "memory", "import", "demo", *bad)
            assert code == 2 and says in err and "Traceback" not in out + err, err


def test_a_plan_the_memory_refuses_is_shown_on_its_card_and_the_others_answer(tmp_path, lm):
    app = create_app(Settings(lm, tmp_path))
    with LiveApp(app) as live, httpx.Client(base_url=live.url, timeout=300) as http:
        http.post("/v1/memories", json={"id": "long"})
        events = [{"text": f"Day {i}: the heron came back to the pond."} for i in range(220)]
        assert http.post("/v1/memories/long/events", json={"events": events, "prefill": True}).status_code == 201
        stats = http.get("/v1/memories/long").json()["stats"]
        assert stats["history_end"] > lm.profile.max_context  # original positions: the question falls past the context
        form = {"question": "When did the heron come back?", "k": "2", "max_new_tokens": "3"}
        r = http.post(
            "/ui/part/memory/long/compare",
            content="&".join([*(f"{k}={v}" for k, v in form.items()), "plan=rows-original", "plan=rows-contiguous"]),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert r.status_code == 200, r.text
        assert "1 of 2 plans read out" in r.text
        original = r.text.split('data-plan="rows-original"')[1].split('data-plan="rows-contiguous"')[0]
        contiguous = r.text.split('data-plan="rows-contiguous"')[1]
        assert "not served:" in original and "contiguous" in original  # the memory's message names the fix
        assert "not served:" not in contiguous and "2 events" in contiguous
