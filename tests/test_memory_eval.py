"""`eventkv memory eval`: the run folder on the shipped demo file with a tiny
model, resume, option errors, and the summary's statistics on hand-made records."""

import json

import numpy as np
import pytest
import scipy.stats
from cli_fixtures import run_cli

from eventkv.stats import cluster_bootstrap, wilson
from eventkv.studies.materialization.memory_eval import DEMO_DATA, MemoryEval, first_line, summarize_memory_eval


def test_eval_runs_resumes_and_reports(tiny_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = ["memory", "eval", "--data", DEMO_DATA, "--model", str(tiny_dir), "--conversations", "2"]
    args += ["--questions-per-conversation", "2", "--max-tokens", "600", "--k", "2", "--max-new-tokens", "3"]
    args += ["--dtype", "float32", "--out", str(out), "--no-progress"]
    code, out_text, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, out_text + err
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [x["index"] for x in records] == [0, 1, 2, 3]
    done = [x for x in records if "arms" in x]
    assert done and all(set(x["arms"]) == {"rows", "text", "isolated", "full", "gold"} for x in done)
    for x in done:
        assert 1 <= len(x["selected"]) <= 2
        assert x["arms"]["full"]["n_rows"] >= x["arms"]["rows"]["n_rows"]
        assert set(x["timing"]) == {"serve", "readout"} and set(x["timing"]["serve"]) == set(x["arms"])
        assert len(set(x["timing"]["readout"].values())) == 1  # one batched readout
        assert all(1 <= a["n_tokens"] <= 3 for a in x["arms"].values())
    assert (out / "summary.md").read_text().startswith("# memory-eval")
    assert run_cli(monkeypatch, capsys, *args)[0] == 0  # resume: nothing recomputed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["invocations"][-1]["items_computed"] == 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data", "/no/such.json"], "--data '/no/such.json': no such file"),
        (["--data", "demo", "--conversations", "3"], "--conversations 3: "),
        (["--data", DEMO_DATA, "--conversations", "9"], "--conversations 9:"),
        (["--data", DEMO_DATA, "--k", "0"], "--k 0:"),
        (["--data", DEMO_DATA, "--arms", "text,gold"], "--arms"),
    ],
)
def test_eval_option_errors(extra, message, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "memory", "eval", *extra, "--out", str(tmp_path / "o"))
    assert code == 2 and message in err and "Traceback" not in out + err
    assert not (tmp_path / "o").exists()


def test_first_line():
    assert first_line("\n  Pepper \nthe cat") == "Pepper"
    assert first_line("   \n") == ""


def _rec(conv, cat, f1s, i, abstains=None):
    arms = {a: {"f1": f, "em": f == 1.0, "n_rows": 10, "answer": "x", "n_tokens": i + 1} for a, f in f1s.items()}
    for a, choice in (abstains or {}).items():
        arms[a]["abstains"] = choice
    return {
        "index": i,
        "conversation": conv,
        "category": cat,
        "arms": arms,
        "timing": {"serve": {a: 10.0 * (i + 1) for a in f1s}, "readout": {a: 100.0 for a in f1s}},
    }


def test_summary_statistics_on_hand_made_records():
    recs = [
        _rec("c1", 4, {"rows": 1.0, "text": 0.5, "isolated": 0.0}, 0),
        _rec("c1", 1, {"rows": 0.5, "text": 0.5, "isolated": 0.5}, 1),
        _rec("c2", 2, {"rows": 0.0, "text": 1.0, "isolated": 0.0}, 2),
        _rec(
            "c2", 5, {"rows": 1.0, "text": 1.0, "isolated": 1.0}, 3, {"rows": True, "text": False, "isolated": True}
        ),  # adversarial: apart
        {"index": 4, "conversation": "c3", "skipped": "0 eligible questions"},
    ]
    s = summarize_memory_eval(recs).data
    assert (s["n_questions"], s["n_adversarial"], s["n_skipped"], s["n_conversations"]) == (3, 1, 1, 2)
    assert s["f1"]["rows"]["estimate"] == pytest.approx(0.5)
    assert s["f1"]["text"]["estimate"] == pytest.approx(2 / 3)
    ref = cluster_bootstrap([0.5, 0.0, -1.0], ["c1", "c1", "c2"])
    assert s["paired"]["rows-text"]["estimate"] == pytest.approx(-0.5 / 3)
    assert (s["paired"]["rows-text"]["low"], s["paired"]["rows-text"]["high"]) == (ref.low, ref.high)
    assert s["latency_ms"]["rows"]["serve_p50"] == pytest.approx(float(np.percentile([10, 20, 30, 40], 50)))
    assert s["latency_ms"]["rows"]["readout_p95"] == pytest.approx(100.0) and s["batched_readout"]
    assert s["n_tokens"]["rows"] == pytest.approx(2.5)
    assert s["em"]["rows"] == pytest.approx(1 / 3)
    # question-level Wilcoxon on rows - text: differences +0.5, 0, -1 -> scipy on the non-zero ones
    w = scipy.stats.wilcoxon([0.5, -1.0], zero_method="wilcox")
    assert s["paired"]["rows-text"]["wilcoxon_p"] == pytest.approx(w.pvalue)
    assert (s["paired"]["rows-text"]["better"], s["paired"]["rows-text"]["worse"]) == (1, 1)
    # category 5 forced choice: Wilson interval of 1/1 and 0/1
    assert s["abstention"]["rows"]["k"] == 1 and s["abstention"]["text"]["k"] == 0
    assert s["abstention"]["rows"]["low"] == pytest.approx(wilson(1, 1).low)


def test_probe_options_are_checked_before_the_model():
    with pytest.raises(Exception, match="questions_per_conversation 0"):
        MemoryEval(data=DEMO_DATA, questions_per_conversation=0)


@pytest.mark.parametrize("batch_arms", [True, False])
def test_adversarial_question_gets_the_forced_choice(batch_arms):
    """A category-5 question: every arm scores 'Not mentioned in the conversation' against the
    adversarial answer; abstains is the sign of the log-prob margin. Batched or not, the same
    structure; unbatched, each arm has its own readout time."""
    from probe_fixtures import tiny_runtime

    from eventkv.studies.materialization.memory_eval import NOT_MENTIONED, question_prompt

    probe = MemoryEval(
        data=DEMO_DATA,
        conversations=1,
        questions_per_conversation=8,
        max_tokens=600,
        k=2,
        max_new_tokens=2,
        batch_arms=batch_arms,
    )
    rt = tiny_runtime("llama")
    _, _, questions = probe._memory(rt, 0, 0)
    slot = next(i for i, q in enumerate(questions) if q.category == 5)
    rec = probe.run_item(rt, probe.items(0, [slot])[0])
    assert rec["category"] == 5 and rec["choice"] == [NOT_MENTIONED, "A blue ceramic tile"]
    for arm in rec["arms"].values():
        assert arm["abstains"] == (arm["abstain_margin"] > 0) and np.isfinite(arm["abstain_margin"])
    assert (len(set(rec["timing"]["readout"].values())) == 1) == batch_arms
    assert question_prompt("When?", 2).startswith("Question: When? Use DATE of CONVERSATION")
    assert "DATE" not in question_prompt("When?", 4)
