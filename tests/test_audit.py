"""``eventkv audit``: the run folder on a tiny model (resume), the records'
bookkeeping (eviction of the source counted per layer and head), the summary's statistics on
hand-made records against scipy, and option errors before the model loads."""

from __future__ import annotations

import json

import pytest
import scipy.stats
from cli_fixtures import run_cli

from eventkv.studies.materialization.audit import EvictionAudit, summarize_audit


@pytest.mark.slow
def test_audit_runs_and_resumes(tiny_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = ["audit", "--model", str(tiny_dir), "--items", "2", "--policy", "streaming,knorm", "--ratio", "0.25,0.9"]
    args += ["--window", "8", "--dtype", "float32", "--out", str(out), "--no-progress"]
    code, text, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, text + err
    recs = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert [r["index"] for r in recs] == [0, 1]
    for r in recs:
        assert set(r["cells"]) == {"streaming@0.25", "knorm@0.25", "streaming@0.9", "knorm@0.9"}
        for (lo, hi), n in zip(r["source_rows"], r["n_rows"]):  # each variant's own source rows
            assert 0 < lo < hi <= n
        for key, cell in r["cells"].items():
            assert cell["source_evicted"] == (max(cell["source_kept_cells"]) == 0)
            assert all(0 <= k <= n for k, n in zip(cell["source_kept_cells"], cell["source_cells"]))
            assert cell["false_negative"] <= cell["source_evicted"]
            ratio = float(key.split("@")[1])
            assert all(abs(f - (1 - ratio)) < 0.05 for f in cell["kept_fraction"])
        # streaming at 0.9 keeps the sinks and the last ~10% of positions: the source (slots 8-11 of 24) goes
        assert r["cells"]["streaming@0.9"]["source_evicted"]
    assert (out / "summary.md").read_text().startswith("# audit")
    assert run_cli(monkeypatch, capsys, *args)[0] == 0
    assert json.loads((out / "manifest.json").read_text())["invocations"][-1]["items_computed"] == 0


def _rec(follow_full, cell):
    return {"full": {"outcome": "follow" if follow_full else "constant"}, "cells": {"knorm@0.5": cell}}


def _cell(g, i, evicted, d):
    return {
        "outcomes": {"global": "follow" if g else "constant", "isolated": "follow" if i else "other"},
        "source_evicted": evicted,
        "source_kept_cells": [0, 0] if evicted else [3, 1],
        "source_cells": [4, 4],
        "false_negative": evicted and g and d > 0,
        "d": d,
    }


def test_summary_statistics_on_hand_made_records():
    recs = [
        _rec(True, _cell(True, False, True, 0.8)),
        _rec(True, _cell(True, False, True, 0.5)),
        _rec(True, _cell(True, True, False, 0.0)),
        _rec(False, _cell(False, True, True, -0.2)),
        _rec(True, _cell(True, False, True, 0.3)),
    ]
    s = summarize_audit(recs).data
    c = s["cells"][0]
    assert (c["policy"], c["ratio"]) == ("knorm", 0.5)
    assert c["accuracy"]["global"]["k"] == 4 and c["accuracy"]["isolated"]["k"] == 2
    assert c["source_evicted"]["k"] == 4 and c["false_negative"]["k"] == 3
    assert (c["global_only"], c["isolated_only"]) == (3, 1)
    assert c["mcnemar_p"] == pytest.approx(scipy.stats.binomtest(3, 4, 0.5).pvalue)
    assert c["d_evicted"]["n"] == 4
    assert c["d_evicted"]["wilcoxon_p"] == pytest.approx(scipy.stats.wilcoxon([0.8, 0.5, -0.2, 0.3]).pvalue)
    lo = scipy.stats.binomtest(3, 5).proportion_ci(method="wilson").low
    assert c["false_negative"]["low"] == pytest.approx(lo)
    assert s["full"]["k"] == 4
    assert c["source_cells_kept"] == pytest.approx((3 / 4 + 1 / 4) / 10)  # one pair of ten variant cells kept some


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ratio", "1"], "--ratio"),
        (["--ratio", "abc"], "--ratio 'abc'"),
        (["--ratio", "0.5,0.5"], "--ratio"),
        (["--policy", "h2o"], "--policy"),
        (["--window", "0"], "--window 0"),
    ],
)
def test_audit_option_errors(extra, message, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "audit", *extra, "--out", str(tmp_path / "o"))
    assert code == 2 and message in err and "Traceback" not in out + err
    assert not (tmp_path / "o").exists()


def test_audit_items_are_the_donor_pair_items():
    from eventkv.studies.materialization.donor_pair import DonorPair

    assert EvictionAudit().items(3, [0, 5]) == DonorPair().items(3, [0, 5])
