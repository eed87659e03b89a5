"""Splice probe: tasks, JSONL loader, statistics, records and the CLI on tiny random models
(``pytest -k splice``; seconds each)."""

import json
import math

import pytest
import typer
from probe_fixtures import tiny_runtime
from scipy import stats as st
from typer.testing import CliRunner

from eventkv.errors import EventKVError
from eventkv.splice_cli import build_probe, splice
from eventkv.splice_probe import SpliceProbe, cell_table, mcnemar_exact, parse_cutoffs, summarize_splice
from eventkv.splice_tasks import TASKS, builtin_items, load_jsonl, outcome_decided, score


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


EARLY_ITEMS = [{"answer": "Green", "case_sensitive": False, "options": []},
               {"answer": "positive", "case_sensitive": False, "options": ["positive", "negative"]},
               {"answer": "42", "case_sensitive": False, "options": []},
               {"answer": "GREEN", "case_sensitive": True, "options": []}]
EARLY_TEXTS = ["green", "Green.\nmore", " **green** and", "The value", "greenish", "\n\ngreen!\n", "gre", "* green *x",
               "\u00e9", "green \" ok", "It is positive", "positive or negative\n", "4", "42", "42\n43", "12 + 30 = 42",
               "\n*\nGREEN", "The answer is 42 or"]
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
                        assert (score(text[:cut] + tail, item, match)[0] == score(text[:cut], item, match)[0]), \
                            (match, item["answer"], text[:cut], tail)
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
    recs = [{"index": i, "n_layers": 2, "clean": {"correct": c0},
             "cells": [{"arm": "scaffold", "cutoff": 1, "step": 0, "correct": a}]}
            for i, (c0, a) in enumerate([(True, True), (True, False), (True, False), (False, True), (False, False)])]
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
    rt = tiny_runtime("gemma3")
    probe = SpliceProbe(cutoffs="all", steps=(0, 2), arm_names=("scaffold", "zero-kv", "mask"), max_new_tokens=4,
                        match=match)
    item = probe.items(0, [0])[0]
    rec = json.loads(json.dumps(probe.run_item(rt, item)))
    n = rec["n_layers"]
    assert len(rec["cells"]) == 3 * (n + 1) * 2
    # cutoff n_layers splices nothing: every arm gives the clean answer
    for c in rec["cells"]:
        if c["cutoff"] == n:
            assert c["pred"] == rec["clean"]["pred"]
    assert probe.summarize([rec]).tables
    # ending decodes early once the outcome is fixed changes no score
    full = SpliceProbe(cutoffs="all", steps=(0, 2), arm_names=("scaffold", "zero-kv", "mask"), max_new_tokens=4,
                       early_exit=False, match=match).run_item(rt, item)
    assert [c["correct"] for c in full["cells"]] == [c["correct"] for c in rec["cells"]]
    assert full["clean"]["correct"] == rec["clean"]["correct"]


STATES = ["ONLINE", "OFFLINE", "STANDBY"]


def _vocab_items():
    """Items over the tiny tokenizer's own words (other words are <unk>), with trained answers:
    options items, a numeric item and a word item; some answers list several candidates."""
    items, targets = [], []
    for i, (name, st_) in enumerate([("ALPHA", "ONLINE"), ("BETA", "OFFLINE"), ("GAMMA", "STANDBY")]):
        items.append({"index": i, "prompt": f"register {name} is set to {st_}. What is the state of register {name}?",
                      "answer": st_, "options": STATES, "case_sensitive": False})
    targets += ["the state is ONLINE.\nok", "OFFLINE or ONLINE\nok", "STANDBY\nok"]
    items.append({"index": 3, "prompt": "What is 40 + 2?", "answer": "42", "options": [], "case_sensitive": False})
    targets.append("it is 42.\nok")
    items.append({"index": 4, "prompt": "What is the final word? DELTA", "answer": "DELTA", "options": [],
                  "case_sensitive": True})
    targets.append("the final word is DELTA\nok")
    return items, targets


def _trained_runtime(family: str, items, targets):
    import torch

    from eventkv.splice import SplicePrompt

    torch.manual_seed(0)
    rt = tiny_runtime(family)
    tok = rt.tokenizer
    opt = torch.optim.Adam(rt.model.parameters(), lr=1e-2)
    seqs = []
    for it, tgt in zip(items, targets):
        prompt = SplicePrompt.from_text(tok, rt.profile, it["prompt"])
        ans = tok(tgt, add_special_tokens=False)["input_ids"]
        seqs.append((torch.tensor([prompt.ids + ans]), torch.tensor([[-100] * prompt.n_rows + ans])))
    for _ in range(60):
        for ids, labels in seqs:
            loss = rt.model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    rt.model.eval()
    return rt


@pytest.mark.parametrize("match", ["exact", "word"])
def test_splice_probe_early_exit_never_changes_a_score_on_trained_answers(match):
    """Early exit on generations that do contain the answers (a tiny model trained for a few steps
    on them), so the scored lines are neither all empty nor all wrong."""
    items, targets = _vocab_items()
    rt = _trained_runtime("llama", items, targets)
    probe = SpliceProbe(task="sentiment", cutoffs="0,1,2", steps=(0, 1, 3), arm_names=("scaffold", "zero-kv", "mask"),
                        max_new_tokens=10, match=match)
    nofast = SpliceProbe(**{**probe.options(), "early_exit": False, "steps": (0, 1, 3)})
    recs = [probe.run_item(rt, it) for it in items]
    full = [nofast.run_item(rt, it) for it in items]
    n_correct = n_all = n_cut = 0
    for r, f in zip(recs, full):
        assert r["clean"]["correct"] == f["clean"]["correct"]
        assert [c["correct"] for c in r["cells"]] == [c["correct"] for c in f["cells"]]
        n_correct += r["clean"]["correct"] + sum(c["correct"] for c in r["cells"])
        n_all += 1 + len(r["cells"])
        n_cut += len(r["clean"]["text"]) < len(f["clean"]["text"])
    assert 0 < n_correct < n_all  # mixed outcomes, so the comparison can fail
    assert n_cut > 0  # and early exit did end some generations


def test_splice_probe_choice_readout_on_a_tiny_model():
    items, targets = _vocab_items()
    rt = _trained_runtime("qwen2", items, targets)
    probe = SpliceProbe(task="sentiment", cutoffs="all", arm_names=("scaffold", "zero-kv", "mask"), readout="choice")
    probe.validate()
    item = items[2]
    rec = json.loads(json.dumps(probe.run_item(rt, item)))
    n = rec["n_layers"]
    assert len(rec["cells"]) == 3 * (n + 1)
    assert set(rec["clean"]["logprobs"]) == set(STATES)
    assert rec["clean"]["correct"] and rec["clean"]["pred"] == "STANDBY"  # trained: the gold option wins
    for c in rec["cells"]:
        assert c["step"] == 0 and set(c["logprobs"]) == set(STATES)
        if c["cutoff"] == n:  # nothing spliced: the clean scores
            assert c["pred"] == rec["clean"]["pred"]
            for o in STATES:
                assert c["logprobs"][o] == pytest.approx(rec["clean"]["logprobs"][o], abs=1e-4)
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
    args = ["splice", "--model", str(mdir), "--task", "sentiment", "--cutoffs", "0,2", "--steps", "0,1",
            "--arms", "scaffold,zero-kv", "--items", "2", "--out", str(out), "--max-new-tokens", "3", "--no-progress"]
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
