"""The event schema: every field of every event is checked for type and range at
the boundary; the message names the record, the field, the bad value and what is allowed."""

from __future__ import annotations

import pytest
from cli_fixtures import run_cli

from eventkv.errors import EventKVError
from eventkv.kv.log import Event, EventLog, tokenize
from eventkv.kv.prefill import prefill

BAD_LINES = [
    (b'{"id": "e1", "text": "caf\xe9"}', "is not UTF-8 text (byte 0xe9 at offset 54, line 2): save it as UTF-8"),
    (b'{"id": "e1", "text": ""}', 'has text = "": give the event\'s text as a non-empty string'),
    (b'{"id": "e1", "text": " \\n "}', 'has text = " \\n ": give the event\'s text as a non-empty string'),
    (b'{"id": "e1", "text": null}', "has text = null: give the event's text"),
    (b'{"id": "e1", "text": 7}', "has text = 7: give the event's text"),
    (b'{"id": "e1", "text": "hi", "budget": "abc"}', 'has budget = "abc": give a whole number of positions >= 1'),
    (b'{"id": "e1", "text": "hi", "budget": "3"}', 'has budget = "3": give a whole number'),
    (b'{"id": "e1", "text": "hi", "budget": [3]}', "has budget = [3]: give a whole number"),
    (b'{"id": "e1", "text": "hi", "budget": 2.5}', "has budget = 2.5: give a whole number"),
    (b'{"id": "e1", "text": "hi", "budget": 0}', "has budget = 0: give a whole number of positions >= 1"),
    (b'{"id": "e1", "text": "hi", "budget": -4}', "has budget = -4: give a whole number"),
    (b'{"id": "e1", "text": "hi", "budget": true}', "has budget = true: give a whole number"),
    (b'{"id": 3, "text": "hi"}', "has id = 3: give a non-empty string"),
    (b'{"id": "", "text": "hi"}', 'has id = "": give a non-empty string'),
    (b'{"id": "a,b", "text": "hi"}', 'has id = "a,b": give a non-empty string without commas'),
    (b'{"id": " e1", "text": "hi"}', 'has id = " e1": give a non-empty string without commas or surrounding spaces'),
    (b'{"id": "e1", "text": "hi", "role": 5}', "has role = 5: give a non-empty string"),
    (b'{"id": "e1", "text": "hi", "role": ""}', 'has role = "": give a non-empty string'),
    (
        b'{"id": "e1", "text": "hi", "budjet": 5}',
        "has an unknown key 'budjet': the keys of an event are id, text, role, budget",
    ),
    (b'{"id": "e1"}', "has no 'text'"),
    (b'{"text": "hi"}', "has no 'id'"),
    (b"[1, 2]", "is list [1, 2]: an event is a JSON object"),
    (b'"e1"', 'is str "e1": an event is a JSON object'),
]


@pytest.mark.parametrize("line, message", BAD_LINES, ids=[m[:30] for _, m in BAD_LINES])
def test_bad_event_lines_are_refused_with_the_field_and_value(tmp_path, line, message):
    p = tmp_path / "events.jsonl"
    p.write_bytes(b'{"id": "e0", "text": "fine"}\n' + line + b"\n")
    with pytest.raises(EventKVError) as exc:
        EventLog.from_jsonl(p)
    msg = str(exc.value)
    assert message in msg
    assert "\n" not in msg.replace("\\n", "")
    if b"\xe9" not in line:
        assert msg.startswith(f"{p}:2 ")  # the line is named


def test_good_events_keep_their_values(tmp_path):
    p = tmp_path / "events.jsonl"
    p.write_text(
        '{"id": "e0", "text": "Dana lives in Lyon.", "role": "user", "budget": 12}\n\n'
        '{"id": "e1", "text": "café au lait", "role": null}\n',
        encoding="utf-8",
    )
    log = EventLog.from_jsonl(p)
    assert log.events == [Event("e0", "Dana lives in Lyon.", "user", 12), Event("e1", "café au lait")]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(id="e1", text=""), "event 'e1' has text = \"\""),
        (dict(id="e1", text="hi", budget=2.5), "event 'e1' has budget = 2.5"),
        (dict(id="e1", text="hi", budget=0), "event 'e1' has budget = 0"),
        (dict(id="", text="hi"), 'an event has id = ""'),
        (dict(id=7, text="hi"), "an event has id = 7"),
    ],
)
def test_library_events_are_checked_the_same_way(kwargs, message):
    with pytest.raises(EventKVError, match="^" + message.replace("(", r"\(")):
        Event(**kwargs)


def test_log_level_checks():
    with pytest.raises(EventKVError, match="duplicate event id 'a'"):
        EventLog([Event("a", "x"), Event("a", "y")])
    with pytest.raises(EventKVError, match="reserved for the header"):
        EventLog([Event("<header>", "x")])
    with pytest.raises(EventKVError, match="instruction 3: give the task instruction as a string"):
        EventLog([Event("a", "x")], instruction=3)
    with pytest.raises(EventKVError, match=r"is not an Event"):
        EventLog([{"id": "a", "text": "x"}])


@pytest.mark.parametrize("chunk_size", [-1, 0, 2.5, True, "8"])
def test_prefill_refuses_a_bad_chunk_size(chunk_size):
    from eventkv.testing import tiny_lm

    lm = tiny_lm("llama")
    tlog = tokenize(EventLog([Event("a", "some history")]), lm.tokenizer, lm.profile)
    with pytest.raises(EventKVError, match=r"^chunk_size \S+: give a positive number of tokens per forward"):
        prefill(lm.model, tlog, chunk_size=chunk_size)


@pytest.mark.parametrize(
    "line, message",
    [
        (BAD_LINES[0][0], "is not UTF-8 text (byte 0xe9 at offset 25, line 1)"),
        BAD_LINES[1],
        BAD_LINES[5],
        BAD_LINES[7],
        BAD_LINES[8],
    ],
)
def test_cli_query_gives_one_line_and_exit_2_before_loading(tmp_path, monkeypatch, capsys, line, message):
    p = tmp_path / "events.jsonl"
    p.write_bytes(line + b"\n")
    store = tmp_path / "store"
    code, _, err = run_cli(
        monkeypatch,
        capsys,
        "query",
        "--model",
        "no-such-model-is-loaded",
        "--log",
        str(p),
        "--serve",
        "e1",
        "-q",
        "what?",
        "--store",
        str(store),
    )
    assert code == 2
    assert err.startswith("error: ") and "Traceback" not in err
    assert message in err.replace("\n", "")
    assert not store.exists()


TASK_LINES = [
    (b'{"prompt": 5, "answer": "x"}', "has prompt = 5: give the prompt as a non-empty string"),
    (b'{"prompt": "p", "answer": " "}', 'has answer = " ": give the answer as a non-empty string'),
    (b'{"prompt": "p", "answer": "x", "case_sensitive": "no"}', 'has case_sensitive = "no": give true or false'),
    (
        b'{"prompt": "p", "answer": "x", "options": ["a", "b"]}',
        'has options = ["a", "b"]: give a list of distinct non-empty strings that includes the answer',
    ),
    (b'{"prompt": "p", "answer": "x", "options": ["x", "X"]}', 'has options = ["x", "X"]: give a list of distinct'),
    (b'{"prompt": "p", "answer": "x", "options": ["x", 3]}', "has options[1] = 3: give a list"),
    (b'{"prompt": "p", "answer": "x", "options": "x,y"}', 'has options = "x,y": give a list'),
    (b'{"prompt": "p", "answer": "x", "opts": []}', "has an unknown key 'opts': the keys of a task item are prompt"),
    (b'{"prompt": "p", "answer": "X", "options": ["x", "y"], "case_sensitive": true}', 'has options = ["x", "y"]'),
    (b'{"prompt": "caf\xe9", "answer": "x"}', "is not UTF-8 text (byte 0xe9 at offset 15, line 1)"),
]


@pytest.mark.parametrize("line, message", TASK_LINES, ids=[m[:30] for _, m in TASK_LINES])
def test_splice_task_files_use_the_same_strict_schema(tmp_path, line, message):
    from eventkv.studies.splice.tasks import load_jsonl

    p = tmp_path / "task.jsonl"
    p.write_bytes(line + b"\n")
    with pytest.raises(EventKVError) as exc:
        load_jsonl(p)
    assert message in str(exc.value)


def test_a_good_task_line_keeps_its_values(tmp_path):
    from eventkv.studies.splice.tasks import load_jsonl

    p = tmp_path / "task.jsonl"
    p.write_text('{"prompt": "Which is red?", "answer": "Cherry", "options": ["cherry", "lime"]}\n')
    assert load_jsonl(p) == [
        {
            "index": 0,
            "prompt": "Which is red?",
            "answer": "Cherry",
            "options": ["cherry", "lime"],
            "case_sensitive": False,
        }
    ]
