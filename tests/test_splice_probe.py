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
    assert score("Green.", item) == (True, "Green")
    assert score("\n  green\nmore", item)[0]
    assert not score("The value is green.", item)[0]
    assert not score("greenish", item)[0]
    assert not score("ZEBRA", {"answer": "zebra", "case_sensitive": True})[0]


def test_splice_early_exit_never_changes_a_score():
    item = {"answer": "Green", "case_sensitive": False}
    texts = ["green", "Green.\nmore", " **green** and", "The value", "greenish", "\n\ngreen!\n", "gre", "* green *x",
             "\u00e9", "green \" ok"]
    for text in texts:
        for cut in range(1, len(text) + 1):
            if outcome_decided(text[:cut], item):
                # every continuation of a decided prefix scores the same
                for tail in ("", "x", "\n", ".", " green"):
                    assert score(text[:cut] + tail, item)[0] == score(text[:cut], item)[0], (text[:cut], tail)
    assert not outcome_decided("gre", item) and outcome_decided("grx", item) and outcome_decided("green\n", item)
    assert not outcome_decided("green.", item) and not outcome_decided("", item)


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
def test_splice_probe_records_on_a_tiny_model():
    rt = tiny_runtime("gemma3")
    probe = SpliceProbe(cutoffs="all", steps=(0, 2), arm_names=("scaffold", "zero-kv", "mask"), max_new_tokens=4)
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
                       early_exit=False).run_item(rt, item)
    assert [c["correct"] for c in full["cells"]] == [c["correct"] for c in rec["cells"]]


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
    first = (out / "records.jsonl").read_text().splitlines()
    assert len(first) == 2
    r = CliRunner().invoke(app, args[:-6] + ["3"] + args[-5:])  # --items 3 extends the run
    assert r.exit_code == 0, r.output
    lines = (out / "records.jsonl").read_text().splitlines()
    assert lines[:2] == first and len(lines) == 3
    r = CliRunner().invoke(app, [a if a != "0,1" else "0" for a in args])
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
