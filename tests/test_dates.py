"""Relative dates resolved at write time (eventkv.memory.dates): exact renderings against a reference date,
words dateparser reads as dates but which carry no relative marker left alone, and bad references refused."""

import datetime

import pytest

from eventkv.errors import EventKVError, OptionError
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
    with pytest.raises(EventKVError, match="cannot read 'soonish' as a date"):
        reference_date("soonish")
    with pytest.raises(EventKVError, match="cannot read '' as a date"):
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
