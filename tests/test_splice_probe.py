"""Splice probe: tasks, JSONL loader, statistics, records and the CLI on tiny random models
(``pytest -k splice``; seconds each)."""

import json
import math

import pytest
import typer
from probe_fixtures import tiny_runtime
from scipy import stats as st
from typer.testing import CliRunner

from eventkv.cli.splice import build_probe, splice
from eventkv.errors import EventKVError
from eventkv.stats import mcnemar_exact
from eventkv.studies.splice.probe import (
    SpliceProbe,
    cell_table,
    parse_cutoffs,
    summarize_splice,
)
from eventkv.studies.splice.tasks import (
    TASKS,
    builtin_items,
    load_jsonl,
    outcome_decided,
    score,
)


# ---------------------------------------------------------------- tasks
@pytest.mark.parametrize("task", sorted(TASKS))
def test_splice_tasks_are_seeded_and_well_formed(task):
    items = builtin_items(task, 3, range(30))
    assert items == builtin_items(task, 3, range(30))
    assert items[7] == builtin_items(task, 3, [7])[0]
    assert items != builtin_items(task, 4, range(30))
    for it in items:
        assert it["prompt"] and it["answer"]
        if it["options"]:
            assert it["answer"] in it["options"]
        assert score(it["answer"], it)[0]
    assert len({it["prompt"] for it in items}) > 20


def test_splice_task_values():
    it = builtin_items("arithmetic", 0, [0])[0]
    a, b = [int(x) for x in it["prompt"].split("What is ")[1].split("?")[0].split(" + ")]
    assert it["answer"] == str(a + b)
    lk = builtin_items("lookup", 0, [5])[0]
    code = lk["prompt"].split("value of ")[1].split("?")[0]
    assert f"{code}: {lk['answer']}\n" in lk["prompt"]


def test_splice_scoring_is_exact_match_on_the_first_line():
    item = {"answer": "green", "case_sensitive": False}
    assert score("Green.", item, "exact") == (True, "Green")
    assert score("\n  green\nmore", item, "exact")[0]
    assert not score("The value is green.", item, "exact")[0]
    assert not score("greenish", item, "exact")[0]
    assert not score("ZEBRA", {"answer": "zebra", "case_sensitive": True}, "exact")[0]
    with pytest.raises(EventKVError, match="matcher"):
        score("green", item, "fuzzy")


WORD_CASES = [
    # (answer, options, case_sensitive, text, correct)
    ("violin", [], False, "The value of K3 is violin.", True),
    ("violin", [], False, "**Violin**", True),
    ("violin", [], False, "violins", False),
    ("violin", [], False, "The value is\nviolin", False),  # only the first non-empty line counts
    ("violin", [], False, "\n\n  violin\n", True),
    ("42", [], False, "The answer is 42.", True),
    ("42", [], False, "42", True),
    ("42", [], False, "12 + 30 = 42", False),  # another number in the line
    ("42", [], False, "42 or 43", False),
    ("42", [], False, "42.5", False),
    ("42", [], False, "142", False),
    ("42", [], False, "-42", False),
    ("positive", ["positive", "negative"], False, "The review is Positive.", True),
    ("positive", ["positive", "negative"], False, "positive or negative", False),  # lists another option
    ("positive", ["positive", "negative"], False, "1", False),
    ("positive", ["positive", "negative"], False, "nonpositive", False),
    ("tiger", ["apple", "tiger", "saw"], False, "A tiger is an animal.", True),
    ("tiger", ["apple", "tiger", "saw"], False, "I saw a tiger.", False),  # 'saw' is an option: strict
    ("VIOLIN", [], True, "VIOLIN", True),
    ("VIOLIN", [], True, "violin", False),
    ("violin", [], True, "The word: violin!", True),
]


@pytest.mark.parametrize("answer,options,cs,text,correct", WORD_CASES)
def test_splice_word_matcher(answer, options, cs, text, correct):
    item = {"answer": answer, "options": options, "case_sensitive": cs}
    assert score(text, item, "word")[0] is correct
    assert score(text, item)[0] is correct  # word is the default


EARLY_ITEMS = [
    {"answer": "Green", "case_sensitive": False, "options": []},
    {"answer": "positive", "case_sensitive": False, "options": ["positive", "negative"]},
    {"answer": "42", "case_sensitive": False, "options": []},
    {"answer": "GREEN", "case_sensitive": True, "options": []},
]
EARLY_TEXTS = [
    "green",
    "Green.\nmore",
    " **green** and",
    "The value",
    "greenish",
    "\n\ngreen!\n",
    "gre",
    "* green *x",
    "\u00e9",
    'green " ok',
    "It is positive",
    "positive or negative\n",
    "4",
    "42",
    "42\n43",
    "12 + 30 = 42",
    "\n*\nGREEN",
    "The answer is 42 or",
]
EARLY_TAILS = ("", "x", "\n", ".", " green", " negative", " 43", "2", "\nGreen", " positive\n", "-")


@pytest.mark.parametrize("match", ["exact", "word"])
def test_splice_early_exit_never_changes_a_score(match):
    n_decided = 0
    for item in EARLY_ITEMS:
        for text in EARLY_TEXTS + [item["answer"], item["answer"] + "\n"]:
            for cut in range(1, len(text) + 1):
                if outcome_decided(text[:cut], item, match):
                    n_decided += 1
                    # every continuation of a decided prefix scores the same
                    for tail in EARLY_TAILS:
                        assert score(text[:cut] + tail, item, match)[0] == score(text[:cut], item, match)[0], (
                            match,
                            item["answer"],
                            text[:cut],
                            tail,
                        )
    assert n_decided > 20
    item = EARLY_ITEMS[0]
    assert not outcome_decided("gre", item, match) and outcome_decided("green\n", item, match)
    assert not outcome_decided("green.", item, match) and not outcome_decided("", item, match)
    # exact can stop as soon as the line diverges; word must wait for the end of the line
    assert outcome_decided("grx", item, "exact") and not outcome_decided("grx", item, "word")


def test_splice_jsonl_loader(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "2+2?", "answer": "4"}\n\n{"prompt": "pick", "answer": "b", "options": ["a", "b"]}\n')
    items = load_jsonl(p)
    assert [i["index"] for i in items] == [0, 1] and items[1]["options"] == ["a", "b"]
    p.write_text('{"prompt": "x"}\n')
    with pytest.raises(EventKVError, match="answer"):
        load_jsonl(p)
    p.write_text("{not json\n")
    with pytest.raises(EventKVError, match="not valid JSON"):
        load_jsonl(p)
    with pytest.raises(EventKVError, match="does not exist"):
        load_jsonl(tmp_path / "none.jsonl")


# ---------------------------------------------------------------- statistics
@pytest.mark.parametrize("b,c", [(7, 1), (3, 3), (0, 5), (12, 2)])
def test_splice_mcnemar_exact_equals_scipy(b, c):
    r = mcnemar_exact(b, c)
    assert r.p_value == pytest.approx(st.binomtest(b, b + c, 0.5).pvalue, abs=1e-12)
    assert r.counts["discordant"] == b + c
    assert math.isnan(mcnemar_exact(0, 0).p_value)


def test_splice_parse_cutoffs():
    assert parse_cutoffs("all", 4) == [0, 1, 2, 3, 4]
    assert parse_cutoffs("0,2-3,-1", 4) == [0, 2, 3]
    for bad in ("9", "x", ","):
        with pytest.raises(EventKVError, match="cutoff"):
            parse_cutoffs(bad, 4)


def test_splice_summary_counts():
    recs = [
        {
            "index": i,
            "n_layers": 2,
            "clean": {"correct": c0},
            "cells": [{"arm": "scaffold", "cutoff": 1, "step": 0, "correct": a}],
        }
        for i, (c0, a) in enumerate([(True, True), (True, False), (True, False), (False, True), (False, False)])
    ]
    t = cell_table(recs)
    assert t[("clean",)] == {"k": 3, "n": 5}
    assert t[("scaffold", 1, 0)] == {"k": 2, "n": 5, "clean_only": 2, "arm_only": 1}
    s = summarize_splice(recs)
    cell = s.data["cells"]["scaffold|1|0"]
    assert cell["p"] == pytest.approx(st.binomtest(2, 3, 0.5).pvalue)
    assert "0.400" in s.to_markdown()


# ---------------------------------------------------------------- probe on a tiny model
@pytest.mark.parametrize("match", ["exact", "word"])
def test_splice_probe_records_on_a_tiny_model(match):
    # the answering model (by construction), not a random one: the cells are compared across batch
    # shapes (early exit, batched vs clean decode), which a random model's near-ties could flip on some CPUs
    rt = _answering_runtime("llama")
    probe = SpliceProbe(
        cutoffs="all", steps=(0, 2), arm_names=("scaffold", "zero-kv", "mask"), max_new_tokens=4, match=match
    )
    item = _vocab_items()[0]
    rec = json.loads(json.dumps(probe.run_item(rt, item)))
    n = rec["n_layers"]
    assert len(rec["cells"]) == 3 * (n + 1) * 2
    # cutoff n_layers splices nothing: every arm gives the clean answer
    assert rec["clean"]["pred"] == "ONLINE" and rec["clean"]["correct"]
    for c in rec["cells"]:
        if c["cutoff"] == n:
            assert c["pred"] == rec["clean"]["pred"]
        if (c["cutoff"], c["step"]) == (0, 0):  # the trigger spliced away before the first token
            assert c["pred"] == "OFFLINE" and not c["correct"]
    assert probe.summarize([rec]).tables
    # ending decodes early once the outcome is fixed changes no score
    full = SpliceProbe(
        cutoffs="all",
        steps=(0, 2),
        arm_names=("scaffold", "zero-kv", "mask"),
        max_new_tokens=4,
        early_exit=False,
        match=match,
    ).run_item(rt, item)
    assert [c["correct"] for c in full["cells"]] == [c["correct"] for c in rec["cells"]]
    assert full["clean"]["correct"] == rec["clean"]["correct"]


STATES = ["ONLINE", "OFFLINE", "STANDBY"]


def _vocab_items():
    """Items over the tiny tokenizer's own words (other words are <unk>): options items, a numeric
    item and a word item. Each prompt holds one trigger word of :data:`LINES`."""
    items = []
    for i, (name, st_) in enumerate([("ALPHA", "ONLINE"), ("BETA", "OFFLINE"), ("GAMMA", "STANDBY")]):
        items.append(
            {
                "index": i,
                "prompt": f"register {name} is set to {st_}. What is the state of register {name}?",
                "answer": st_,
                "options": STATES,
                "case_sensitive": False,
            }
        )
    items.append({"index": 3, "prompt": "What is 40 + 2?", "answer": "42", "options": [], "case_sensitive": False})
    items.append(
        {
            "index": 4,
            "prompt": "What is the final word? DELTA",
            "answer": "DELTA",
            "options": [],
            "case_sensitive": True,
        }
    )
    return items


#: What the answering model writes: with a trigger word in sight, that trigger's line; with no trigger
#: in sight (None: the span was spliced away), "OFFLINE". Lines are right, wrong or right under one
#: matcher only (word vs exact) on the items of _vocab_items.
LINES = {
    "ALPHA": "ONLINE.",
    "BETA": "OFFLINE/ONLINE",
    "GAMMA": "STANDBY",
    "+": "is 42",
    "final": "word: DELTA",
    None: "OFFLINE",
}


def _answering_runtime(family: str):
    """The probe tokenizer and profile with a model that answers by construction, not by training
    (:func:`eventkv.testing.lookup_model`), so its answers are the same on every CPU: after the
    prompt's last token (the chat tail's newline) it writes the line of the trigger word its
    layer-0 attention finds in the prompt, a newline, and that line again (a cycle through the
    newline) until ``max_new_tokens``; with no trigger in sight (a splice at layer 0 hid, zeroed or
    replaced the span) it cycles through "OFFLINE"; from any other token it stops (``<|im_end|>``).
    The splice code path it runs is the real one; only its weights are set by hand."""
    from eventkv.models.encoding import encode
    from eventkv.probes.base import Runtime
    from eventkv.testing import lookup_model

    rt = tiny_runtime(family)
    tok = rt.tokenizer
    nl = tok.convert_tokens_to_ids("\n")
    assert encode(tok, rt.profile.chat_tail)[-1] == nl  # the first prediction is made from the newline
    table = {}
    for trigger, line in LINES.items():
        ids = [nl, *encode(tok, line)]
        assert len(set(ids)) == len(ids), line  # one next token per (trigger, current token)
        key = None if trigger is None else tok.convert_tokens_to_ids(trigger)
        table[key] = {ids[i]: ids[(i + 1) % len(ids)] for i in range(len(ids))}
    model = lookup_model(family, table, fallback=rt.stop_token_ids[0])
    return Runtime(model, tok, rt.profile)


#: per matcher: the clean generation with early exit (ended once its score is fixed) and without (10 tokens)
CLEAN_TEXTS = {
    "exact": ["ONLINE.\n", "OFFLINE/", "STANDBY\n", "is", "word"],
    "word": ["ONLINE.\n", "OFFLINE/ONLINE\n", "STANDBY\n", "is 42\n", "word: DELTA\n"],
    None: [
        "ONLINE.\nONLINE.\nONLINE.\nONLINE",
        "OFFLINE/ONLINE\nOFFLINE/ONLINE\nOFFLINE/",
        "STANDBY\n" * 5,
        "is 42\nis 42\n",
        "word: DELTA\nword: DELTA\n",
    ],
}


@pytest.mark.parametrize("match", ["exact", "word"])
def test_splice_probe_early_exit_never_changes_a_score_on_right_answers(match):
    """Early exit on generations that do contain the answers (a model that answers by construction,
    see _answering_runtime), so the scored lines are neither all empty nor all wrong.

    Expected counts, per item (1 clean + 3 arms x 3 cutoffs x 3 steps = 28 scores): cutoffs 1 and
    2 leave layer 0 (where the trigger is read) alone, so those 18 cells score as clean; cutoff 0
    hides the trigger from the splice's step on: step 0 writes "OFFLINE" (right for item 1 only),
    step 1 keeps the clean first token then stops (right for ONLINE, STANDBY, and OFFLINE from
    "OFFLINE/"), step 3 keeps three clean tokens (right for items 0 and 2). exact: 25 + 6 + 25 + 0
    + 0 = 56; word (items 3 and 4 are right in the clean line): 25 + 6 + 25 + 19 + 19 = 94."""
    items = _vocab_items()
    rt = _answering_runtime("llama")
    probe = SpliceProbe(
        task="sentiment",
        cutoffs="0,1,2",
        steps=(0, 1, 3),
        arm_names=("scaffold", "zero-kv", "mask"),
        max_new_tokens=10,
        match=match,
    )
    nofast = SpliceProbe(**{**probe.options(), "early_exit": False, "steps": (0, 1, 3)})
    recs = [probe.run_item(rt, it) for it in items]
    full = [nofast.run_item(rt, it) for it in items]
    assert [r["clean"]["text"] for r in recs] == CLEAN_TEXTS[match]
    assert [f["clean"]["text"] for f in full] == CLEAN_TEXTS[None]
    n_correct = n_all = n_cut = n_moot = 0
    for r, f in zip(recs, full):
        assert r["clean"]["correct"] == f["clean"]["correct"]
        assert [c["correct"] for c in r["cells"]] == [c["correct"] for c in f["cells"]]
        n_correct += r["clean"]["correct"] + sum(c["correct"] for c in r["cells"])
        n_all += 1 + len(r["cells"])
        n_cut += len(r["clean"]["text"]) < len(f["clean"]["text"])
        # a splice from a step after the early-ended clean run never takes effect; without early exit it does
        n_moot += sum(not c["effect"] and fc["effect"] for c, fc in zip(r["cells"], f["cells"]))
    assert (n_correct, n_all) == ({"exact": 56, "word": 94}[match], 140)  # mixed outcomes: the comparison can fail
    assert n_cut == 5  # early exit ended every clean generation
    # 9 cells a step: exact ends the clean runs after 3, 2, 2, 1, 1 tokens (step 3 moot in all, step 1 in the
    # last two); word after 3, 4, 2, 5, 5 tokens (step 3 moot in items 0 and 2)
    assert n_moot == {"exact": 9 + 9 + 9 + 18 + 18, "word": 9 + 0 + 9 + 0 + 0}[match]


def test_splice_probe_choice_readout_on_a_tiny_model():
    items = _vocab_items()
    rt = _answering_runtime("qwen2")
    probe = SpliceProbe(task="sentiment", cutoffs="all", arm_names=("scaffold", "zero-kv", "mask"), readout="choice")
    probe.validate()
    item = items[2]
    rec = json.loads(json.dumps(probe.run_item(rt, item)))
    n = rec["n_layers"]
    assert len(rec["cells"]) == 3 * (n + 1)
    assert set(rec["clean"]["logprobs"]) == set(STATES)
    assert rec["clean"]["correct"] and rec["clean"]["pred"] == "STANDBY"  # by construction: the gold option wins
    assert rec["clean"]["logprobs"]["STANDBY"] > -1e-3 and rec["clean"]["logprobs"]["ONLINE"] < -30
    for c in rec["cells"]:
        assert c["step"] == 0 and set(c["logprobs"]) == set(STATES)
        if c["cutoff"] == n:  # nothing spliced: the clean scores
            assert c["pred"] == rec["clean"]["pred"]
            for o in STATES:
                assert c["logprobs"][o] == pytest.approx(rec["clean"]["logprobs"][o], abs=1e-4)
        # the trigger is read in layer 0: a cutoff above it changes nothing; cutoff 0 hides it and the
        # model falls back to its no-trigger answer, OFFLINE, by a margin of more than 10 nats
        want = "OFFLINE" if c["cutoff"] == 0 else "STANDBY"
        assert (c["pred"], c["correct"]) == (want, want == "STANDBY"), c
        assert c["logprobs"][want] > max(lp for o, lp in c["logprobs"].items() if o != want) + 10
    zero0 = next(c for c in rec["cells"] if c["arm"] == "zero-kv" and c["cutoff"] == 0)
    assert any(abs(zero0["logprobs"][o] - rec["clean"]["logprobs"][o]) > 1e-3 for o in STATES)
    s = probe.summarize([rec])
    assert any("forced choice" in x for x in s.notes)
    with pytest.raises(EventKVError, match="do not include its answer"):
        probe.run_item(rt, {**item, "options": ["ONLINE", "OFFLINE"]})


def test_splice_probe_choice_and_match_option_errors():
    with pytest.raises(EventKVError, match="options"):
        SpliceProbe(task="lookup", readout="choice").validate()
    with pytest.raises(EventKVError, match="--steps 0"):
        SpliceProbe(task="sentiment", readout="choice", steps=(0, 1)).validate()
    with pytest.raises(EventKVError, match="--match"):
        SpliceProbe(match="fuzzy").validate()
    with pytest.raises(EventKVError, match="--readout"):
        SpliceProbe(readout="vote").validate()


def test_splice_cli_runs_resumes_and_refuses_other_settings(tmp_path):
    from eventkv.testing import tiny_model, tiny_tokenizer

    mdir = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(mdir)
    tiny_tokenizer().save_pretrained(mdir)
    app = typer.Typer()
    app.command("splice")(splice)
    app.callback()(lambda: None)
    out = tmp_path / "run"
    args = [
        "splice",
        "--model",
        str(mdir),
        "--task",
        "sentiment",
        "--cutoffs",
        "0,2",
        "--steps",
        "0,1",
        "--arms",
        "scaffold,zero-kv",
        "--items",
        "2",
        "--out",
        str(out),
        "--max-new-tokens",
        "3",
        "--no-progress",
    ]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    for f in ("manifest.json", "records.jsonl", "summary.md", "figure.png", "heatmap.png"):
        assert (out / f).is_file(), f
    opts = json.loads((out / "manifest.json").read_text())["identity"]["options"]
    assert opts["match"] == "word" and opts["readout"] == "generate"
    assert "matcher 'word'" in (out / "summary.md").read_text()
    first = (out / "records.jsonl").read_text().splitlines()
    assert len(first) == 2
    r = CliRunner().invoke(app, args[:-6] + ["3"] + args[-5:])  # --items 3 extends the run
    assert r.exit_code == 0, r.output
    lines = (out / "records.jsonl").read_text().splitlines()
    assert lines[:2] == first and len(lines) == 3
    r = CliRunner().invoke(app, [a if a != "0,1" else "0" for a in args])
    assert r.exit_code == 2 and "different settings" in r.output
    r = CliRunner().invoke(app, args + ["--match", "exact"])  # another matcher is another run
    assert r.exit_code == 2 and "different settings" in r.output
    r = CliRunner().invoke(app, ["splice", "--task", "nope", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "nope" in r.output


def test_splice_cli_user_errors():
    with pytest.raises(EventKVError, match="zero"):
        build_probe("lookup", "all", "0", "zero", None, None, "from", "clean", 16, 16)
    with pytest.raises(EventKVError, match="--steps"):
        build_probe("lookup", "all", "x", "mask", None, None, "from", "clean", 16, 16)
    with pytest.raises(EventKVError, match="max-new-tokens"):
        build_probe("lookup", "all", "20", "mask", None, None, "from", "clean", 16, 16)
    with pytest.raises(EventKVError, match="layer-set"):
        build_probe("lookup", "all", "0", "mask", None, None, "below", "clean", 16, 16)
    with pytest.raises(EventKVError, match="--match"):
        build_probe("lookup", "all", "0", "mask", None, None, "from", "clean", 16, 16, match="fuzzy")
    with pytest.raises(EventKVError, match="options"):
        build_probe("arithmetic", "all", "0", "mask", None, None, "from", "clean", 16, 16, readout="choice")
