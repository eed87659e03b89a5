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
        (["--policy", "snapkv(win=8)"], "snapkv has no setting 'win': its settings are window, kernel, pooling"),
        (["--policy", "snapkv(kernel=five)"], "kernel must be a whole number, not 'five'"),
        (["--policy", "snapkv(window=8"], "write settings as name(key=value,...)"),
        (["--policy", "snapkv(pooling=mean)"], "--policy 'snapkv(pooling=mean)': pooling 'mean': use max or avg."),
        (["--policy", "streaming(sinks=-1)"], "--policy 'streaming(sinks=-1)': sinks -1"),  # not the --sinks flag
        (["--policy", "snapkv(window=0)"], "--policy 'snapkv(window=0)': window 0"),
        (["--policy", "expected(use_vnorm=yes)"], "use_vnorm must be true or false"),
        (["--policy", "snapkv(window=64)", "--window", "32"], "snapkv(window=64) reads the last 64 queries: give"),
        (["--policy", "adakv", "--window", "8"], "adakv reads the last 64 queries"),  # its SnapKV's default window
        (["--policy", "composed(policies=knorm/think)", "--window", "8"], "reads the last 32 queries"),
        (["--policy", "knorm,knorm"], "give distinct policies"),
        # a wrapper that keeps rows by its inner's scores, around ThinK (whose scores rank no rows)
        (["--policy", "adakv(inner=think(window=8))"], "adakv keeps rows by its inner's scores, and think ranks no"),
        (["--policy", "chunkkv(inner=think)"], "or apply think after one: composed(policies=snapkv/think)"),
        # a chunk too short for the window at a ratio: refused before any model work, named by its spec
        (
            ["--policy", "finch(window=8,chunk=16)", "--ratio", "0.5"],
            "--policy 'finch(window=8,chunk=16)': chunk 16: a chunk must hold more than window / (1 - ratio) = 16",
        ),
        (["--policy", "composed(policies=knorm/finch(chunk=10))"], "chunk 10: a chunk must hold more than"),
    ],
)
def test_audit_option_errors(extra, message, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "audit", *extra, "--out", str(tmp_path / "o"))
    assert code == 2 and message in err and "Traceback" not in out + err
    assert not (tmp_path / "o").exists()


def test_policy_specs_reach_every_setting_and_the_audit_runs_them(tiny_dir, tmp_path, monkeypatch, capsys):
    """A policy's settings from the command line: kvpress's SnapKV settings (window 8, kernel 5, avg pooling) next
    to eventkv's defaults; each spec is its own cell, and the spec's policy scores as the library's object does."""
    import torch

    from eventkv.eviction import LayerCapture, SnapKV, keep_mask, policy_from_spec, split_policy_specs

    specs = "knorm,snapkv(window=8,kernel=5,pooling=avg),snapkv,expected(horizon=64,use_covariance=false)"
    assert split_policy_specs(specs) == [
        "knorm",
        "snapkv(window=8,kernel=5,pooling=avg)",
        "snapkv",
        "expected(horizon=64,use_covariance=false)",
    ]
    assert policy_from_spec("snapkv(window=8,kernel=5,pooling=avg)", window=32) == SnapKV(8, 5, "avg")
    assert policy_from_spec("snapkv", window=8) == SnapKV(window=8)  # a caller's default, no setting over it
    g = torch.Generator().manual_seed(0)
    rows, window = 40, 8
    cap = LayerCapture(
        layer=0,
        keys=torch.randn(2, rows, 16, generator=g),
        values=torch.randn(2, rows, 16, generator=g),
        positions=torch.arange(rows),
        queries=torch.randn(4, window, 16, generator=g),
        query_positions=torch.arange(rows - window, rows),
        scaling=0.25,
    )
    spec_mask = keep_mask(policy_from_spec("snapkv(window=8,kernel=5,pooling=avg)"), cap, 0.5)
    assert torch.equal(spec_mask, keep_mask(SnapKV(window=8, kernel=5, pooling="avg"), cap, 0.5))

    out, specs = tmp_path / "run", "snapkv(window=8,kernel=5,pooling=avg),snapkv"  # two cells of one policy
    args = ["audit", "--model", str(tiny_dir), "--items", "1", "--policy", specs, "--ratio", "0.5", "--window", "8"]
    code, text, err = run_cli(monkeypatch, capsys, *args, "--dtype", "float32", "--out", str(out), "--no-progress")
    assert code == 0, text + err
    rec = json.loads((out / "records.jsonl").read_text().splitlines()[0])
    assert set(rec["cells"]) == {f"{spec}@0.5" for spec in split_policy_specs(specs)}


def test_audit_items_are_the_donor_pair_items():
    from eventkv.studies.materialization.donor_pair import DonorPair

    assert EvictionAudit().items(3, [0, 5]) == DonorPair().items(3, [0, 5])


def test_the_audit_runs_budgeted_and_every_query_policies(tiny_dir, tmp_path, monkeypatch, capsys):
    """H2O reads every prefill query, AdaKV keeps uneven counts per head, PyramidKV per layer, KVzip a
    reconstruction pass, ThinK prunes key channels: one item each."""
    from eventkv.eviction import split_policy_specs

    out = tmp_path / "run"
    specs = "observed,adakv(inner=snapkv(window=8,kernel=5,pooling=avg)),pyramidkv(window=8),kvzip,think(window=8)"
    args = ["audit", "--model", str(tiny_dir), "--items", "1", "--policy", specs, "--ratio", "0.5", "--window", "8"]
    code, text, err = run_cli(monkeypatch, capsys, *args, "--dtype", "float32", "--out", str(out), "--no-progress")
    assert code == 0, text + err
    rec = json.loads((out / "records.jsonl").read_text().splitlines()[0])
    assert set(rec["cells"]) == {f"{spec}@0.5" for spec in split_policy_specs(specs)}
    for spec, cell in rec["cells"].items():
        if spec.startswith("think"):  # key channels pruned, every row kept
            assert cell["kept_fraction"] == [1.0, 1.0] and not cell["source_evicted"]
        else:
            assert all(0 < f < 1 for f in cell["kept_fraction"]), spec
    summary = (out / "summary.md").read_text()
    assert "rows kept (mean)" in summary
    assert "think(window=8): the ratio is the fraction of key channels pruned; every row is kept." in summary
    assert "pyramidkv(window=8): the ratio is the fraction of rows evicted over all layers together" in summary


def test_settings_the_model_or_the_history_cannot_meet(tiny_dir, tmp_path, monkeypatch, capsys):
    """Per-layer lists are checked against the model's layer count once it is loaded, before the run directory
    is made; a window longer than the history and a spec's setting the history cannot meet name the spec."""
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(tiny_dir).num_hidden_layers
    base = ["audit", "--model", str(tiny_dir), "--items", "1", "--ratio", "0.5", "--dtype", "float32", "--no-progress"]
    for spec, says in [
        (
            "per-layer(policies=knorm/knorm/knorm)",
            f"policies 3: per-layer takes one entry per layer and the model has {layers}",
        ),
        (
            "per-layer-ratio(inner=knorm,ratios=0.5)",
            f"ratios 1: per-layer-ratio takes one entry per layer and the model has {layers}",
        ),
    ]:
        out = tmp_path / "refused"
        code, text, err = run_cli(monkeypatch, capsys, *base, "--policy", spec, "--window", "8", "--out", str(out))
        assert code == 2 and f"--policy '{spec}'" in err and says in err and "Traceback" not in text + err, err
        assert not out.exists()
    code, text, err = run_cli(monkeypatch, capsys, *base, "--policy", "snapkv", "--window", "5000", "--out", str(out))
    assert code == 2 and "snapkv reads the last 5000 queries and pair 0's history has" in err, err
    assert "give a window of at most" in err and "Traceback" not in text + err
    spec = "expected(sinks=5000)"
    code, text, err = run_cli(
        monkeypatch, capsys, *base, "--policy", spec, "--window", "8", "--out", str(tmp_path / "s")
    )
    assert code == 2 and f"--policy '{spec}': sinks 5000" in err and "Traceback" not in text + err, err
