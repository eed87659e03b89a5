"""``eventkv harvest``: the carrier rules on a hand-built conversation, the hard
negative, the summary's statistics on hand-made records (cluster bootstrap, TOST on conversation
means against scipy), and a run on a synthetic LoCoMo file (tiny model; resume) and on the
synthetic REALTALK folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
from cli_fixtures import run_cli

from eventkv.studies.materialization.dialogue import QA, Conversation, Turn
from eventkv.studies.materialization.harvest import carriers, hard_negative, summarize_harvest

TURNS = [
    Turn("D1:1", 1, "", "Ada", "I planted twelve tomato seedlings along the fence."),
    Turn("D1:2", 1, "", "Bram", "Nice, how is the garden otherwise?"),
    Turn("D2:1", 2, "", "Ada", "The tomato seedlings by the fence are growing fast."),  # 2 words, strong: "seedlings"
    Turn("D2:2", 2, "", "Bram", "Glad to hear it."),
    Turn("D3:1", 3, "", "Bram", "Twelve coats of paint, ha."),  # holds the answer: its neighbours are out too
    Turn("D3:2", 3, "", "Ada", "My tomato fence needs paint."),  # shares tomato + fence, next to D3:1
    Turn("D4:1", 4, "", "Ada", "Planted basil near the garden fence, tomato plants love it."),
    Turn("D4:2", 4, "", "Bram", "Basil is great."),
]
QUESTIONS = [
    QA("How many tomato seedlings did Ada plant by the fence?", "twelve", ("D1:1",), 3),
    QA("What did Ada plant near the fence?", "basil", ("D4:1",), 1),
    QA("What did Bram say about basil?", "great", ("D4:2",), 2),
]
CONV = Conversation("c", ("Ada", "Bram"), TURNS, QUESTIONS)


def test_carrier_rules_by_hand():
    cands, ev = carriers(CONV, QUESTIONS[0])
    assert ev == 1
    # D2:1 shares tomato, seedlings, fence; D4:1 shares tomato, fence (and planted != plant: no stemming)
    # D3:2 shares tomato, fence but its neighbour D3:1 holds "twelve"; D1:* are in the evidence session
    assert [c["id"] for c in cands] == ["D2:1", "D4:1"]
    assert cands[0]["shared"] == ["fence", "seedlings", "tomato"] and cands[0]["strong"]
    assert cands[1]["shared"] == ["fence", "tomato"] and not cands[1]["strong"]  # both words in 3+ sessions
    assert carriers(CONV, QUESTIONS[1])[0] == []  # no session after the evidence's


def test_hard_negative_is_the_nearest_other_answer():
    assert hard_negative(CONV, 0) == "basil"
    assert hard_negative(CONV, 1) == "twelve"  # nearest: index 0 before index 2 on a tie
    same = Conversation("s", ("A", "B"), TURNS, [QA("q1", "x", ("D1:1",), 1), QA("q2", "X.", ("D1:1",), 1)])
    assert hard_negative(same, 0) is None  # the only other answer normalizes the same


def _q(strong, correct):
    return {"strong": strong, "arms": {a: {"correct": c, "f1": float(c)} for a, c in correct.items()}}


def test_summary_statistics_on_hand_made_records():
    arms = ("none", "text", "isolated", "harvested", "gold")

    def rec(conv, qs):
        return {"conversation": conv, "skipped": {"category": 0}, "questions": qs}

    recs = [
        rec("c1", [_q(True, dict(zip(arms, (0, 1, 0, 1, 1)))), _q(True, dict(zip(arms, (0, 1, 1, 1, 1))))]),
        rec("c2", [_q(True, dict(zip(arms, (0, 0, 1, 0, 1)))), _q(False, dict(zip(arms, (1, 1, 1, 1, 1))))]),
        rec("c3", [_q(True, dict(zip(arms, (0, 1, 0, 0, 1))))]),
    ]
    s = summarize_harvest(recs, margin=0.05).data
    assert s["n_questions"] == 5
    p = s["contrasts"]["harvested-isolated@strong"]
    assert p["primary"] and p["estimate"] == pytest.approx((1 + 0 - 1 + 0) / 4)
    conv_means = [np.mean([1, 0]), -1.0, 0.0]  # per conversation, strong questions only
    lo = scipy.stats.ttest_1samp(conv_means, -0.05, alternative="greater").pvalue
    hi = scipy.stats.ttest_1samp(conv_means, 0.05, alternative="less").pvalue
    assert p["tost_p"] == pytest.approx(max(lo, hi)) and p["tost_n"] == 3
    assert s["accuracy"]["all"]["gold"]["estimate"] == 1.0
    assert s["accuracy"]["strong"]["none"]["estimate"] == 0.0


def _locomo_file(path: Path) -> Path:
    conv = {"speaker_a": "Ada", "speaker_b": "Bram"}
    for s in (1, 2, 3, 4):
        conv[f"session_{s}_date_time"] = f"9:00 am on {s} May, 2023"
        conv[f"session_{s}"] = [{"speaker": t.speaker, "dia_id": t.id, "text": t.text} for t in TURNS if t.session == s]
    qa = [
        {"question": q.question, "answer": q.answer, "evidence": list(q.evidence), "category": q.category}
        for q in QUESTIONS
    ]
    path.write_text(json.dumps([{"sample_id": "syn-1", "conversation": conv, "qa": qa}]))
    return path


def test_harvest_runs_and_resumes(tiny_dir, tmp_path, monkeypatch, capsys):
    data = _locomo_file(tmp_path / "syn.json")
    out = tmp_path / "run"
    args = ["harvest", "--data", str(data), "--model", str(tiny_dir), "--max-tokens", "600"]
    args += ["--max-new-tokens", "3", "--dtype", "float32", "--out", str(out), "--no-progress"]
    code, text, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, text + err
    [rec] = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    [q] = rec["questions"]  # questions 2 and 3: no session after their evidence, so no carriers
    assert q["carriers"] == ["D2:1", "D4:1"] and q["strong"] and q["negative"] == "basil"
    assert set(q["arms"]) == {"none", "text", "isolated", "harvested", "gold"}
    assert all(a["correct"] == (a["margin"] > 0) for a in q["arms"].values())
    assert run_cli(monkeypatch, capsys, *args)[0] == 0


def test_harvest_realtalk_folder_and_errors(tiny_dir, tmp_path, monkeypatch, capsys):
    realtalk = Path(__file__).parent / "data" / "realtalk"
    args = ["harvest", "--data", str(realtalk), "--format", "realtalk", "--model", str(tiny_dir)]
    args += ["--max-tokens", "600", "--max-new-tokens", "2", "--dtype", "float32", "--no-progress"]
    code, text, err = run_cli(monkeypatch, capsys, *args, "--out", str(tmp_path / "rt"))
    assert code == 0, text + err
    assert len((tmp_path / "rt" / "records.jsonl").read_text().splitlines()) == 3
    for extra, message in (
        (["--format", "csv"], "--format 'csv'"),
        (["--tost-margin", "0"], "--tost-margin 0"),
        (["--max-tokens", "3900"], "--max-tokens 3900"),
    ):
        code, out, err = run_cli(monkeypatch, capsys, *args, *extra, "--out", str(tmp_path / "bad"))
        assert code == 2 and message in err and "Traceback" not in out + err
