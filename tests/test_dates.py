"""Relative dates resolved at write time (eventkv.memory.dates): exact renderings against a reference date,
words dateparser reads as dates but which carry no relative marker left alone, and bad references refused."""

import datetime

import pytest

from eventkv.errors import OptionError
from eventkv.memory.dates import reference_date, relative_dates, render_date, resolve_relative_dates


@pytest.mark.parametrize(
    "when, text, resolved",
    [
        (
            "1:56 pm on 8 May, 2023",
            "I went to the climbing gym yesterday and my arms still ache.",
            "I went to the climbing gym yesterday [7 May 2023] and my arms still ache.",
        ),
        (
            "7:55 pm on 9 June, 2023",
            "We fixed the boat last week!",
            "We fixed the boat last week [the week of 2 June 2023]!",
        ),
        (
            "1:14 pm on 25 May, 2023",
            "We plan to visit Hanoi next month. I baked bread last Saturday.",
            "We plan to visit Hanoi next month [June 2023]. I baked bread last Saturday [20 May 2023].",
        ),
        (
            "7:55 pm on 9 June, 2023",
            "I took up the cello three years ago, and my first concert was about ten years ago.",
            "I took up the cello three years ago [2020], and my first concert was about ten years ago [2013].",
        ),
        # the reference's own date: a datetime or a date work as the string does
        (datetime.date(2023, 6, 9), "I did it two days ago.", "I did it two days ago [7 June 2023]."),
        # dateparser reads expressions joined by "and" or a comma as one date: each is read on its own
        (
            "8 May 2023",
            "I quit my job three years ago, and tomorrow I open my own bakery.",
            "I quit my job three years ago [2020], and tomorrow [9 May 2023] I open my own bakery.",
        ),
        ("8 May 2023", "yesterday and tomorrow", "yesterday [7 May 2023] and tomorrow [9 May 2023]"),
        (datetime.datetime(2024, 3, 1, 9, 0), "It opens tomorrow.", "It opens tomorrow [2 March 2024]."),
    ],
)
def test_relative_expressions_are_followed_by_their_date(when, text, resolved):
    assert resolve_relative_dates(text, when) == resolved


def test_words_without_a_relative_marker_are_left_alone():
    # dateparser reads "we" as Wednesday, "now", "the sun" as Sunday and a bare duration as a date;
    # a bare weekday is ambiguous (this week's or last): none is annotated
    text = "We are here now, the sun is out, 4 years of friendship, see you on Friday on the 18th."
    assert relative_dates(text, "8 May 2023") == []
    assert resolve_relative_dates(text, "8 May 2023") == text


def test_the_span_is_the_shortest_one_that_means_the_same_date():
    text = "Yeah, just yesterday, and last night too."
    hits = relative_dates(text, "2023-05-08")
    assert [(h.expression, h.period, h.date) for h in hits] == [
        ("yesterday", "day", datetime.date(2023, 5, 7)),
        ("last night", "day", datetime.date(2023, 5, 7)),
    ]
    assert all(text[h.start : h.end] == h.expression for h in hits)


def test_render_date_and_bad_input():
    d = datetime.date(2023, 6, 2)
    assert [render_date(d, p) for p in ("day", "week", "month", "year")] == [
        "2 June 2023",
        "the week of 2 June 2023",
        "June 2023",
        "2023",
    ]
    with pytest.raises(OptionError, match="period 'hour'"):
        render_date(d, "hour")
    with pytest.raises(OptionError, match="when 'soonish': give a date such as '8 May 2023'"):
        reference_date("soonish")
    with pytest.raises(OptionError, match="when '': give a date"):
        resolve_relative_dates("yesterday", "")


def test_temporal_dates_benchmark_on_the_demo_file(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from eventkv.studies.materialization.memory_eval import DEMO_DATA

    data = json.loads(Path(DEMO_DATA).read_text())
    conv = data[0]["conversation"]
    turn = conv["session_2"][0]
    turn["text"] = "I started training for the half marathon last week."
    data[0]["qa"].append(
        {
            "question": "When did it start?",
            "answer": "the week of 10 March 2024",
            "evidence": [turn["dia_id"]],
            "category": 2,
        }
    )
    path = tmp_path / "dates.json"
    path.write_text(json.dumps(data))
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "temporal_dates.py"
    out = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    from eventkv.options import DIALOGUE_FORMATS

    convs = DIALOGUE_FORMATS.get("locomo")(str(path))
    n = sum(1 for c in convs for q in c.questions if q.category == 2 and q.evidence)
    assert lines[0] == f"temporal questions with evidence: {n}"
    assert lines[1].startswith("  with a relative expression in an evidence turn: 1 (")
    assert lines[2].startswith("  best F1 of a date string in the evidence turns: session dates ")


def test_a_dated_text_has_its_day_in_front_and_its_relative_dates_resolved():
    from eventkv.memory.dates import dated_text

    said = datetime.date(2023, 5, 8)
    assert dated_text("I went yesterday.", said) == "[8 May 2023] I went yesterday [7 May 2023]."
    assert dated_text("I went yesterday.", "2023-05-08", resolve=False) == "[8 May 2023] I went yesterday."
    assert dated_text("We met at noon.", "1:56 pm on 8 May, 2023") == "[8 May 2023] We met at noon."
    with pytest.raises(OptionError, match="when 'someday'"):
        dated_text("I went yesterday.", "someday")


def test_an_event_said_at_a_date_is_stored_dated(tmp_path):
    from dataclasses import replace

    from eventkv.memory import EventMemory, MemoryEvent
    from eventkv.testing import tiny_lm

    ev = MemoryEvent("I adopted a puppy last week.", role="Noor", when=datetime.date(2023, 5, 8))
    assert ev.when == "2023-05-08T00:00:00" and ev.text == "I adopted a puppy last week."
    assert ev.stored_text() == "[8 May 2023] I adopted a puppy last week [the week of 1 May 2023]."
    assert replace(ev, id="p").stored_text() == ev.stored_text()  # the ISO form reads back to the same day
    assert MemoryEvent.coerce({"text": "Back home.", "when": "2023-05-09"}).stored_text() == "[9 May 2023] Back home."
    assert MemoryEvent("No date.").stored_text() == "No date."
    with pytest.raises(OptionError, match="when 'soonish'"):
        MemoryEvent("I went yesterday.", when="soonish")
    with EventMemory.create(tmp_path / "m", tiny_lm("llama"), namespace="t") as mem:
        mem.add([ev, MemoryEvent("Biscuit is the puppy's name.", id="name")])
        patch = mem.update("name", "We renamed him Pretzel yesterday.", when="2023-06-02")
        texts = {r.id: r.text for r in mem.list(include_superseded=True)}
        assert texts["e1"] == "[8 May 2023] I adopted a puppy last week [the week of 1 May 2023]."
        assert texts["name"] == "Biscuit is the puppy's name."
        assert texts[patch.id] == "[2 June 2023] We renamed him Pretzel yesterday [1 June 2023]."
        with pytest.raises(OptionError, match="when 'later'"):
            mem.update("name", "Again.", when="later")
        assert mem.version == 2  # the refused update wrote nothing


def test_dated_events_over_http_the_client_and_the_mcp_tools(tmp_path):
    pytest.importorskip("fastapi")
    import httpx
    from service_fixtures import LiveApp

    from eventkv.client import Client
    from eventkv.mcp.tools import AddMemory, UpdateMemory, add, update
    from eventkv.memory import EventMemory, MemoryEvent
    from eventkv.service.app import create_app
    from eventkv.service.state import Settings
    from eventkv.testing import tiny_lm

    lm = tiny_lm("llama")
    with LiveApp(create_app(Settings(lm, tmp_path / "store"))) as live:
        with Client.create(live.url, "dated") as client:
            client.add([MemoryEvent("I moved yesterday.", id="m", when=datetime.date(2023, 5, 8))])
            client.add({"text": "Still unpacking.", "id": "u", "when": "2023-05-09"})
            client.update("u", "Unpacked two days ago.", when="2023-05-12")
            texts = {r.id: r.text for r in client.list(include_superseded=True)}
            assert texts == {
                "m": "[8 May 2023] I moved yesterday [7 May 2023].",
                "u": "[9 May 2023] Still unpacking.",
                "u~1": "[12 May 2023] Unpacked two days ago [10 May 2023].",
            }
            base = f"{live.url}/v1/memories/dated"
            r = httpx.post(f"{base}/events", json={"events": [{"text": "Hi.", "when": "someday"}]}, timeout=30)
            assert r.status_code == 422 and r.json()["code"] == "invalid_option", r.text
            assert "when 'someday'" in r.json()["message"]
            r = httpx.post(f"{base}/events/m/update", json={"text": "Moved.", "when": "later"}, timeout=30)
            assert r.status_code == 422 and "when 'later'" in r.json()["message"], r.text
            assert client.version == 3  # the refused writes wrote nothing
    with EventMemory.create(tmp_path / "mcp", lm, namespace="t") as mem:
        add(mem, AddMemory(text="I went hiking last week.", id="h", when="2023-05-08"), "mcp")
        update(mem, UpdateMemory(event_id="h", text="I went hiking yesterday.", when="2023-05-08"), "mcp")
        assert [r.text for r in mem.history("h")] == [
            "[8 May 2023] I went hiking last week [the week of 1 May 2023].",
            "[8 May 2023] I went hiking yesterday [7 May 2023].",
        ]


def test_a_when_that_names_no_one_day_is_refused():
    for relative in ("yesterday", "3 days ago", "next Friday", "May 2023"):
        with pytest.raises(OptionError, match="give the day itself"):
            reference_date(relative)
    assert reference_date("1:56 pm on 8 May, 2023") == datetime.datetime(2023, 5, 8, 13, 56)
    # an expression right before a comma is read (dateparser's search alone misses it)
    assert resolve_relative_dates("Last week, we met.", "2023-05-08") == "Last week [the week of 1 May 2023], we met."
    assert resolve_relative_dates("Next month, I move.", "2023-05-08") == "Next month [June 2023], I move."
