"""The contract battery end to end on a tiny model: one run writes contract.md, contract.json and
the figures, assembled from each probe's own contract section; a second run resumes (computes
nothing) and refuses other settings."""

import json

import pytest
from probe_fixtures import tiny_runtime

from eventkv.errors import EventKVError
from eventkv.probes.base import Summary, get_probe
from eventkv.probes.runner import load_records, render
from eventkv.studies.materialization.contract.battery import CONTRACT_PROBES, plan, provenance, run_contract
from eventkv.studies.materialization.contract.report import contract_sections, probe_section, write_contract
from eventkv.studies.materialization.contract_rows import ContractRow, ContractSection


def test_plan_sizes():
    full = {s.probe: s.items for s in plan(24)}
    assert full == {"donor-pair": 24, "trigger-bank": 96, "landing": 24, "access": 48, "carriers": 24, "patch": 24}
    quick = plan(8, quick=True)
    assert [s.probe for s in quick] == list(CONTRACT_PROBES)
    assert all(s.options.get("readout") == "logits" for s in quick)
    with pytest.raises(EventKVError, match="items 1: the contract needs at least 2 items"):
        plan(1)


@pytest.mark.slow
def test_contract_battery_on_a_tiny_model(tmp_path, monkeypatch):
    import eventkv.studies.materialization.contract.battery as c
    from eventkv.studies.materialization.contract.battery import Step

    def tiny_plan(items, quick=False):  # the quick preset, shrunk to a few items and short histories
        small = {"readout": "logits"}
        return [
            Step("donor-pair", {**small, "n_events": 6, "source_slots": (1, 2), "root_slot": 4}, items),
            Step("trigger-bank", {**small, "n_events": 8, "source_slots": (2, 3), "carrier_slot": 5}, 3),
            Step(
                "landing",
                {**small, "n_events": 10, "source_slots": (2, 3), "root_slot": 5, "edge_slot": 7, "mention_slot": 9},
                items,
            ),
            Step("access", {**small, "n_events": 8, "source_slots": (2, 3), "root_slot": 5}, 4),
            Step(
                "carriers", {**small, "n_events": 10, "source_slots": (2, 3), "carrier_slot": 5, "row_slot": 8}, items
            ),
            Step("patch", {**small, "lengths": (5, 8), "timing_repeats": 1}, 4),
        ]

    monkeypatch.setattr(c, "plan", tiny_plan)
    rt = tiny_runtime("llama")
    js = run_contract(rt, model="tiny", out=tmp_path, items=2, quick=True, progress=False)
    md = (tmp_path / "contract.md").read_text()
    for clause in ("materialization", "trigger", "landing", "access", "programming", "updates"):
        assert f"| {clause}" in md
    assert "77 ms vs 1033 ms" in md and ".934 (chance .5)" in md
    for graded in (
        "graded donor shift d (kv",
        "graded write-through",
        "graded donor shift d: root",
        "graded: donor shift d",
    ):
        assert graded in md
    for f in ("trigger.png", "access.png", "patch.png"):
        assert (tmp_path / "figures" / f).stat().st_size > 1000
    saved = json.loads((tmp_path / "contract.json").read_text())
    assert set(saved["trigger"]["constructions"]) == {"mirrors", "tracks", "copies"}
    assert set(saved["capacity"]["payloads"]) >= {"binary", "compass", "phonetic", "number"}
    assert saved["pairs"] == {"donor-pair": 2, "trigger-bank": 3, "landing": 2, "access": 4, "carriers": 2, "patch": 4}
    assert js["updates"]["timing"]
    assert saved["donor_pair"]["d"]["n"] == 2 and saved["trigger"]["d_pooled"]["n"] == 3
    assert set(saved["landing"]["d"]) >= {"root", "edge"} and saved["capacity"]["payloads"]["binary"]["d"]["n"] == 1
    # the table and the JSON sections are the probes' own sections, in battery order
    summaries = {p: render(tmp_path / p, figure=False) for p in CONTRACT_PROBES}
    sections = contract_sections(summaries)
    keys = ["donor_pair", "trigger", "landing", "capacity", "programming", "updates"]
    assert [s.key for s in sections] == keys and list(saved)[4:] == keys
    assert js["markdown_table"].splitlines()[4:] == ["| " + " | ".join(r) + " |" for s in sections for r in s.rows]
    assert [json.dumps(js[k]) for k in keys] == [json.dumps(s.data) for s in sections]
    assert [s.figure[0] for s in sections if s.figure] == ["trigger.png", "access.png", "patch.png"]
    # the report only assembles: a probe's new section is what the contract shows
    fake = ContractSection("updates-v2", {"x": float("nan")}, [ContractRow("updates", "m", "1/2", "t", "s")])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(get_probe("patch"), "contract_section", classmethod(lambda cls, summary: fake))
        js2 = write_contract(tmp_path, "tiny", summaries, provenance(tmp_path, summaries), quick=True)
    saved2 = json.loads((tmp_path / "contract.json").read_text())
    assert "updates" not in saved2 and saved2["updates-v2"] == {"x": None} and js2["updates-v2"] is fake.data
    assert js2["markdown_table"].splitlines()[-1] == "| updates | m | 1/2 | t | s |"
    assert "patch.png" not in (tmp_path / "contract.md").read_text()
    # resume: nothing recomputed, records unchanged
    before = {p: load_records(tmp_path / p) for p in CONTRACT_PROBES}
    run_contract(rt, model="tiny", out=tmp_path, items=2, quick=True, progress=False)
    assert {p: load_records(tmp_path / p) for p in CONTRACT_PROBES} == before
    # another model into the same directory is refused
    with pytest.raises(EventKVError, match="different settings"):
        run_contract(rt, model="other", out=tmp_path, items=2, quick=True, progress=False)


def test_every_contract_probe_writes_its_own_section():
    for p in CONTRACT_PROBES:  # donor-pair: its section is a function in studies.materialization.contract_rows
        assert callable(getattr(get_probe(p), "contract_section", None)), p
    with pytest.raises(EventKVError, match="'splice' has no contract_section"):
        probe_section("splice", Summary("splice", []))


@pytest.mark.slow
def test_cli_run_contract_probes(tmp_path, monkeypatch):
    """`eventkv run patch|access ...` (mounted by eventkv.cli from contract_cli.RUN_COMMANDS) with a tiny model."""
    import types

    import typer
    from typer.testing import CliRunner

    import eventkv.cli  # noqa: F401  (mounts the run commands)
    import eventkv.models
    from eventkv.cli.run import run_app

    tiny = tiny_runtime("qwen2")
    monkeypatch.setattr(
        eventkv.models,
        "load",
        lambda name, dtype="float32", device="cpu": types.SimpleNamespace(
            model=tiny.model, tokenizer=tiny.tokenizer, profile=tiny.profile
        ),
    )
    app = typer.Typer()
    app.add_typer(run_app, name="run")
    r = CliRunner().invoke(
        app,
        [
            "run",
            "patch",
            "--model",
            "tiny",
            "--items",
            "2",
            "--lengths",
            "5,6",
            "--no-timing",
            "--readout",
            "logits",
            "--out",
            str(tmp_path / "p"),
            "--no-progress",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "patch: 2 pairs" in r.output and len(load_records(tmp_path / "p")) == 2
    r = CliRunner().invoke(
        app,
        [
            "run",
            "access",
            "--model",
            "tiny",
            "--items",
            "2",
            "--cardinalities",
            "binary,number",
            "--max-new-tokens",
            "2",
            "--out",
            str(tmp_path / "a"),
            "--no-progress",
        ],
    )
    assert r.exit_code == 0, r.output
    assert [x["cardinality"] for x in load_records(tmp_path / "a")] == ["binary", "number"]
    r = CliRunner().invoke(app, ["run", "patch", "--model", "tiny", "--lengths", "2", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "lengths" in r.output
