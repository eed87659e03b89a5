"""Dialogue loaders (eventkv.studies.materialization.dialogue): LoCoMo and REALTALK read from small
synthetic files in each format (tests/data, invented text), evidence parsing, truncation by tokens,
and clear errors on bad files.
The real LoCoMo dev split is read from ../shared (never copied here); that test skips when it is absent."""

import json
from collections import Counter
from pathlib import Path

import pytest

from eventkv.errors import EventKVError, OptionError
from eventkv.studies.materialization.dialogue import (
    QA,
    Turn,
    load_locomo,
    load_realtalk,
    parse_evidence,
    truncate,
    turn_tokens,
)
from eventkv.testing import tiny_tokenizer

DATA = Path(__file__).parent / "data"
LOCOMO = DATA / "locomo" / "tiny-locomo.json"
REALTALK = DATA / "realtalk"
LOCOMO_DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "locomo" / "locomo10-dev.json"


def test_locomo_synthetic():
    convs = load_locomo(LOCOMO)
    assert [c.id for c in convs] == ["tiny-1", "tiny-2"]
    c = convs[0]
    assert c.speakers == ("Ada", "Bram")
    # session 3 has a date and no turn list: skipped; sessions in number order
    assert [t.id for t in c.turns] == ["D1:1", "D1:2", "D1:3", "D2:1", "D2:2", "D2:3", "D4:1"]
    assert [t.session for t in c.turns] == [1, 1, 1, 2, 2, 2, 4]
    assert c.turns[2] == Turn(
        "D1:3",
        1,
        "9:05 am on 3 March, 2022",
        "Ada",
        "Twelve, all along the south fence. [shares an image: a photo of a garden bed next to a wooden fence]",
    )
    assert (
        c.turns[3].event_text()
        == "[session 2, 6:40 pm on 10 March, 2022] Bram: I adopted a grey cat called Pepper yesterday."
    )
    q = c.questions
    assert len(q) == 8
    assert q[0] == QA("How many tomato seedlings did Ada plant?", "12", ("D1:3",), 4)  # a number becomes its str
    assert q[2].evidence == ("D1:1", "D2:1")  # "D1:1; D2:1"
    assert q[3].evidence == ("D2:3",)  # "D:2:3"
    assert (q[4].answer, q[4].adversarial_answer, q[4].category) == ("", "grey", 5)
    assert q[6].evidence == ()
    assert [qa.category for qa in q] == [4, 2, 1, 3, 5, 4, 4, 4]


def test_realtalk_synthetic():
    convs = load_realtalk(REALTALK)
    assert [c.id for c in convs] == ["Chat_1_Ada_Bram", "Chat_2_Bram_Cleo", "Chat_10_Cleo_Dev"]  # by chat number
    c = convs[0]
    assert c.speakers == ("Ada", "bram")
    assert [(t.id, t.session) for t in c.turns] == [("D1:1", 1), ("D1:2", 1), ("D1:3", 1), ("D1:4", 2), ("D2:1", 2)]
    assert c.turns[2].text == "look what I baked [shares an image: a loaf of bread on a cutting board]"
    assert c.turns[1].event_text() == "[session 1, 04.02.2024, 07:09:40] bram: barely lol, coffee first"
    assert c.turns[4].date_time == "05.02.2024, 21:30:00"  # no date of its own: the session's
    assert [qa.evidence for qa in c.questions] == [("D1:3", "D2:1"), ("D1:1", "D1:2"), ("D2:1",)]
    assert [qa.answer for qa in c.questions] == ["dark rye bread", "coffee", "caraway"]
    assert load_realtalk(REALTALK / "Chat_10_Cleo_Dev.json")[0].questions[0].answer == "1000"


def test_parse_evidence():
    assert parse_evidence(["D8:6; D9:17", "D:11:26", "D13:43-D13:46", "D5:3.", "", "D", "D8:6"]) == (
        "D8:6",
        "D9:17",
        "D11:26",
        "D13:43",
        "D13:44",
        "D13:45",
        "D13:46",
        "D5:3",
    )
    assert parse_evidence(["D1:5-D2:1"]) == ("D1:5", "D2:1")  # across sessions: the two ends


def test_event_text_without_date():
    assert Turn("D1:1", 3, "", "Ada", "hi").event_text() == "[session 3] Ada: hi"


def test_truncate_counts_each_turn_alone():
    tok = tiny_tokenizer()  # byte-level: one token per UTF-8 byte
    c = load_locomo(LOCOMO)[0]
    sizes = [len((t.event_text() + "\n").encode()) for t in c.turns]
    assert [turn_tokens(t, tok) for t in c.turns] == sizes
    t3 = truncate(c, tok, sum(sizes[:3]))
    assert [t.id for t in t3.turns] == ["D1:1", "D1:2", "D1:3"]
    assert [q.question for q in t3.questions] == ["How many tomato seedlings did Ada plant?"]
    t4 = truncate(c, tok, sum(sizes[:5]) - 1)  # one token short of five turns: four
    assert [t.id for t in t4.turns] == ["D1:1", "D1:2", "D1:3", "D2:1"]
    # evidence inside: q0, q1, q2 (D1:1 + D2:1), q4 (category 5, D2:1); not q3 (D2:3), q5 (D4:1);
    # q6 has no evidence, q7 names a turn that does not exist
    assert [q.category for q in t4.questions] == [4, 2, 1, 5]
    full = truncate(c, tok, 10**6)
    assert full.turns == c.turns and len(full.questions) == 6
    assert c.questions and len(c.turns) == 7  # the input is not changed


def test_truncate_errors():
    tok = tiny_tokenizer()
    c = load_locomo(LOCOMO)[0]
    with pytest.raises(EventKVError, match="keeps no turn of conversation 'tiny-1'"):
        truncate(c, tok, 5)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(OptionError, match="^max_tokens"):
            truncate(c, tok, bad)


def _write(tmp_path, obj, name="bad.json"):
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return p


def _locomo(**qa_over):
    return [
        {
            "sample_id": "s-1",
            "conversation": {
                "speaker_a": "A",
                "speaker_b": "B",
                "session_1_date_time": "noon",
                "session_1": [{"speaker": "A", "dia_id": "D1:1", "text": "hi"}],
            },
            "qa": [{"question": "q?", "answer": "a", "evidence": ["D1:1"], "category": 4, **qa_over}],
        }
    ]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda d: d[0]["conversation"]["session_1"][0].pop("speaker"),
            r"sample 's-1' session_1\[0\] has no 'speaker'",
        ),
        (lambda d: d[0]["conversation"]["session_1"][0].update(text=5), r"sample 's-1' session_1\[0\] has text = 5"),
        (lambda d: d[0]["conversation"]["session_1"][0].update(img_url=7), r"session_1\[0\] has img_url = 7"),
        (lambda d: d[0]["conversation"].update(session_1="x"), r"sample 's-1' conversation has session_1 of type str"),
        (lambda d: d[0]["conversation"].pop("speaker_b"), r"sample 's-1' conversation has no 'speaker_b'"),
        (lambda d: d[0]["qa"][0].update(category=7), r"sample 's-1' qa\[0\] has category = 7"),
        (lambda d: d[0]["qa"][0].update(answer=[1]), r"sample 's-1' qa\[0\] has answer = \[1\]"),
        (lambda d: d[0]["qa"][0].pop("answer"), r"sample 's-1' qa\[0\] \(category 4\) has no 'answer'"),
        (lambda d: d[0]["qa"][0].update(evidence="D1:1"), r"qa\[0\] has evidence = \"D1:1\""),
        (lambda d: d[0].pop("sample_id"), r"sample \[0\] has no 'sample_id'"),
        (
            lambda d: d[0]["conversation"]["session_1"].append({"speaker": "B", "dia_id": "D1:1", "text": "yo"}),
            r"sample 's-1' gives the dia_id 'D1:1' to two turns",
        ),
    ],
)
def test_locomo_bad_records_name_file_sample_field(tmp_path, mutate, message):
    data = _locomo()
    mutate(data)
    p = _write(tmp_path, data)
    with pytest.raises(EventKVError, match=message) as e:
        load_locomo(p)
    assert str(e.value).startswith(str(p))


def test_locomo_bad_files(tmp_path):
    with pytest.raises(EventKVError, match="does not exist"):
        load_locomo(tmp_path / "nope.json")
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(EventKVError, match="broken.json' is not valid JSON"):
        load_locomo(tmp_path / "broken.json")
    with pytest.raises(EventKVError, match="holds a JSON dict: LoCoMo is a JSON list"):
        load_locomo(_write(tmp_path, {"sample_id": "x"}))
    # category 5 may leave the answer out
    assert load_locomo(_write(tmp_path, _locomo(category=5, answer=None)))[0].questions[0].answer == ""


def test_realtalk_bad_files(tmp_path):
    with pytest.raises(EventKVError, match="holds no Chat_\\*.json"):
        load_realtalk(tmp_path)
    good = json.loads((REALTALK / "Chat_2_Bram_Cleo.json").read_text())
    bad = {**good, "session_1": [{**good["session_1"][0], "clean_text": None}]}
    p = _write(tmp_path, bad, "Chat_3_X_Y.json")
    with pytest.raises(EventKVError, match=r"Chat_3_X_Y.json: conversation 'Chat_3_X_Y' session_1\[0\] has clean_text"):
        load_realtalk(tmp_path)
    _write(tmp_path, {**good, "name": {"speaker_1": "Bram"}}, "Chat_3_X_Y.json")
    with pytest.raises(EventKVError, match=r"conversation 'Chat_3_X_Y' name has no 'speaker_2'"):
        load_realtalk(p)
    _write(tmp_path, {**good, "qa": [{"question": "q?", "answer": None, "evidence": [], "category": 1}]}, p.name)
    with pytest.raises(EventKVError, match=r"qa\[0\] has answer = null"):
        load_realtalk(p)


@pytest.mark.skipif(not LOCOMO_DEV.is_file(), reason="the LoCoMo dev split is not in ../shared/data/locomo")
def test_locomo_dev_split_loads():
    convs = load_locomo(LOCOMO_DEV)
    assert [c.id for c in convs] == ["conv-26", "conv-30", "conv-41", "conv-42", "conv-43", "conv-44", "conv-47"]
    assert sum(len(c.turns) for c in convs) == 4124
    cats = Counter(q.category for c in convs for q in c.questions)
    assert cats == {1: 192, 2: 214, 3: 66, 4: 563, 5: 312}
    assert all(t.text and t.speaker in c.speakers for c in convs for t in c.turns)
