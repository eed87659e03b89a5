"""Run directories: manifest, records, resume after a kill, identity checks, report."""

import json

import pytest
from probe_fixtures import tiny_runtime

from eventkv.errors import EventKVError
from eventkv.probes.runner import FIGURE, RECORDS, RUN_MANIFEST, SUMMARY, load_records, render, run_probe
from eventkv.studies.materialization.donor_pair import DonorPair


@pytest.fixture(scope="module")
def rt():
    return tiny_runtime("llama")


def _run(rt, out, items=3, seed=0, **opts):
    probe = DonorPair(max_new_tokens=4, **opts)
    return run_probe(probe, rt, model="tiny", items=items, seed=seed, out=out, progress=False, figure=False)


@pytest.fixture(scope="module")
def reference(rt, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    _run(rt, out)
    return out


def test_run_writes_manifest_records_summary(reference):
    m = json.loads((reference / RUN_MANIFEST).read_text())
    assert m["identity"]["probe"] == "donor-pair" and m["identity"]["seed"] == 0
    assert m["identity"]["options"]["source_slots"] == [8, 11]
    assert m["identity"]["weights_digest"] == "tiny-random" and m["identity"]["dtype"] == "float32"
    assert m["items"] == 3 and "torch" in m["environment"]["packages"]
    assert m["environment"]["eventkv"]
    recs = load_records(reference)
    assert [r["index"] for r in recs] == [0, 1, 2]
    assert (reference / SUMMARY).read_text().startswith("# donor-pair: 3 pairs")


def test_same_seed_gives_identical_records(rt, reference, tmp_path):
    _run(rt, tmp_path)
    assert (tmp_path / RECORDS).read_bytes() == (reference / RECORDS).read_bytes()


def test_resume_after_a_kill_mid_write(rt, reference, tmp_path):
    lines = (reference / RECORDS).read_bytes().split(b"\n")
    (tmp_path / RUN_MANIFEST).write_bytes((reference / RUN_MANIFEST).read_bytes())
    # one complete record and half of the next: what a kill during the second write leaves
    (tmp_path / RECORDS).write_bytes(lines[0] + b"\n" + lines[1][: len(lines[1]) // 2])
    _run(rt, tmp_path)
    assert (tmp_path / RECORDS).read_bytes() == (reference / RECORDS).read_bytes()
    m = json.loads((tmp_path / RUN_MANIFEST).read_text())
    assert m["invocations"][-1]["items_computed"] == 2


def test_resume_after_a_crash_recomputes_nothing_finished(rt, reference, tmp_path, monkeypatch):
    calls = []
    real = DonorPair.run_item

    def crashing(self, rt_, item):
        calls.append(item["index"])
        if item["index"] == 2:
            raise KeyboardInterrupt
        return real(self, rt_, item)

    monkeypatch.setattr(DonorPair, "run_item", crashing)
    with pytest.raises(KeyboardInterrupt):
        _run(rt, tmp_path)
    assert [r["index"] for r in load_records(tmp_path)] == [0, 1]
    monkeypatch.setattr(
        DonorPair, "run_item", lambda self, rt_, item: calls.append(item["index"]) or real(self, rt_, item)
    )
    _run(rt, tmp_path)
    assert calls == [0, 1, 2, 2]  # item 2 only is recomputed
    assert (tmp_path / RECORDS).read_bytes() == (reference / RECORDS).read_bytes()


def test_more_items_extend_a_run(rt, reference, tmp_path):
    _run(rt, tmp_path, items=2)
    _run(rt, tmp_path, items=3)
    assert (tmp_path / RECORDS).read_bytes() == (reference / RECORDS).read_bytes()


def test_different_options_into_the_same_directory_are_refused(rt, reference, tmp_path):
    (tmp_path / RUN_MANIFEST).write_bytes((reference / RUN_MANIFEST).read_bytes())
    first = (reference / RECORDS).read_bytes().split(b"\n")[0] + b"\n"
    (tmp_path / RECORDS).write_bytes(first)
    with pytest.raises(EventKVError, match=r"root_slot: 13 -> 14"):
        _run(rt, tmp_path, root_slot=14)
    with pytest.raises(EventKVError, match=r"seed: 0 -> 1"):
        _run(rt, tmp_path, seed=1)
    assert (tmp_path / RECORDS).read_bytes() == first


def test_a_run_that_failed_before_its_first_record_is_taken_over(rt, reference, tmp_path):
    (tmp_path / RUN_MANIFEST).write_bytes((reference / RUN_MANIFEST).read_bytes())  # manifest, no records
    _run(rt, tmp_path, items=1, root_slot=14)
    manifest = json.loads((tmp_path / RUN_MANIFEST).read_text())
    assert manifest["identity"]["options"]["root_slot"] == 14
    assert len((tmp_path / RECORDS).read_text().splitlines()) == 1


def test_duplicate_records_are_reported(reference, tmp_path):
    line = (reference / RECORDS).read_bytes().split(b"\n")[0]
    (tmp_path / RECORDS).write_bytes(line + b"\n" + line + b"\n")
    with pytest.raises(EventKVError, match="item 0 twice"):
        load_records(tmp_path)


def test_report_rerenders_from_records_alone(reference, tmp_path):
    for name in (RUN_MANIFEST, RECORDS):
        (tmp_path / name).write_bytes((reference / name).read_bytes())
    s = render(tmp_path)
    assert (tmp_path / SUMMARY).read_text() == (reference / SUMMARY).read_text()
    assert (tmp_path / FIGURE).stat().st_size > 10_000
    assert s.data["pairs"] == 3
    with pytest.raises(EventKVError, match="not a run directory"):
        render(tmp_path / "nothing")


def test_cli_report_and_errors(reference, tmp_path):
    import typer
    from typer.testing import CliRunner

    from eventkv.cli.run import report, run_app

    app = typer.Typer()
    app.add_typer(run_app, name="run")
    app.command("report")(report)
    runner = CliRunner()
    r = runner.invoke(app, ["report", str(reference)])
    assert r.exit_code == 0, r.output
    assert "donor-pair: 3 pairs" in r.output
    r = runner.invoke(app, ["report", str(tmp_path)])
    assert r.exit_code == 2 and "not a run directory" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["run", "donor-pair", "--decoy", "sometimes", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "--decoy 'sometimes': use one of" in r.output
    r = runner.invoke(app, ["run", "donor-pair", "--source-slots", "8..11"])
    assert r.exit_code == 2 and "--source-slots '8..11'" in r.output


def test_cli_run_donor_pair_end_to_end(tmp_path, monkeypatch):
    """`eventkv run donor-pair` with the model loader swapped for a tiny random model."""
    import types

    import typer
    from typer.testing import CliRunner

    import eventkv.models
    from eventkv.cli.run import report, run_app

    tiny = tiny_runtime("qwen3")
    monkeypatch.setattr(
        eventkv.models,
        "load",
        lambda name, dtype="float32", device="cpu": types.SimpleNamespace(
            model=tiny.model, tokenizer=tiny.tokenizer, profile=tiny.profile
        ),
    )
    app = typer.Typer()
    app.add_typer(run_app, name="run")
    app.command("report")(report)
    args = [
        "run",
        "donor-pair",
        "--model",
        "tiny",
        "--items",
        "2",
        "--seed",
        "5",
        "--out",
        str(tmp_path),
        "--max-new-tokens",
        "3",
        "--source-slots",
        "7-9",
        "--decoy",
        "none",
        "--no-progress",
    ]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "donor-pair: 2 pairs" in r.output and "| kv | generate | 2 |" in r.output
    m = json.loads((tmp_path / RUN_MANIFEST).read_text())
    assert m["identity"]["options"]["source_slots"] == [7, 9] and m["identity"]["options"]["decoy"] == "none"
    recs = load_records(tmp_path)
    assert [r["index"] for r in recs] == [0, 1] and all(7 <= r["source_slot"] <= 9 for r in recs)
    assert (tmp_path / FIGURE).is_file()
    # rerun: nothing recomputed; other options refused with exit code 2
    r = CliRunner().invoke(app, args)
    assert (
        r.exit_code == 0 and json.loads((tmp_path / RUN_MANIFEST).read_text())["invocations"][-1]["items_computed"] == 0
    )
    r = CliRunner().invoke(app, args[:-1] + ["--decoy", "independent", "--no-progress"])
    assert r.exit_code == 2 and "decoy: 'none' -> 'independent'" in r.output


# ------------------------------------------------------------------------------- run options


def test_run_options_name_the_field_and_check_in_order(tmp_path):
    """RunOptions.validate names the field (the CLI prints the flag), and checks the probe's options, then
    items, threads, dtype and out, in that order."""
    from eventkv.errors import OptionError
    from eventkv.probes.run_options import RunOptions
    from eventkv.studies.splice.probe import SpliceProbe

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        (RunOptions("m", 0, threads=0, dtype="fp8", out=a_file), None, "items 0: run at least one item."),
        (RunOptions("m", 0, threads=0), SpliceProbe(batch_size=0), "batch_size 0:"),
        (RunOptions("m", True), None, "items True:"),
        (RunOptions("m", 1, threads=0, dtype="fp8", out=a_file), None, "threads 0: give 1 to"),
        (RunOptions("m", 1, dtype="fp8", out=a_file), None, "dtype 'fp8': not supported; use one of auto, float32"),
        (RunOptions("m", 1, out=a_file), None, f"out '{a_file}': that path is a file, not a directory"),
    ]
    for opts, probe, message in cases:
        with pytest.raises(OptionError) as exc:
            opts.validate(probe)
        assert str(exc.value).startswith(message), str(exc.value)
        assert exc.value.for_cli() == "--" + str(exc.value).replace("batch_size", "batch-size")
    RunOptions("m", 2, threads=1, dtype="float32", out=tmp_path / "new").validate(DonorPair())
    with pytest.raises(OptionError, match=r"^out None: give a run directory"):
        RunOptions("m", 1).run(DonorPair(), rt=None)


def test_run_options_default_out():
    from eventkv.probes.run_options import RUNS, RunOptions

    opts = RunOptions("/models/tinyB/", 4, seed=7, dtype="bfloat16")
    assert opts.default_out("donor-pair") == RUNS / "donor-pair" / "tinyB-bfloat16-seed7"
    assert opts.default_out("splice", "{model}-{task}-{dtype}-seed{seed}", task="copy") == (
        RUNS / "splice" / "tinyB-copy-bfloat16-seed7"
    )
    filled = opts.with_default_out("landing")
    assert filled.out == RUNS / "landing" / "tinyB-bfloat16-seed7" and filled.items == 4 and opts.out is None
    given = RunOptions("m", 1, out="elsewhere")
    assert given.with_default_out("landing") is given


@pytest.mark.parametrize(
    "args, folder",
    [
        (["run", "donor-pair", "--seed", "3"], "runs/donor-pair/tinyB-float32-seed3"),
        (["run", "patch"], "runs/patch/tinyB-float32-seed0"),
        (["contract"], "runs/contract/tinyB-float32"),
        (["contract", "--quick"], "runs/contract/tinyB-float32-quick"),
        (["splice", "--task", "copy", "--seed", "2"], "runs/splice/tinyB-copy-float32-seed2"),
        (["splice", "--task", "TASKFILE"], "runs/splice/tinyB-items-float32-seed0"),
    ],
)
def test_cli_default_out_folders(monkeypatch, capsys, tmp_path, args, folder):
    """The default --out of every run command, filled in before the model loads."""
    from pathlib import Path

    from cli_fixtures import run_cli

    from eventkv.probes.run_options import RunOptions

    monkeypatch.chdir(tmp_path)
    (tmp_path / "items.jsonl").write_text('{"prompt": "say yes", "answer": "yes"}\n')
    seen = []

    def stop(self, console=None):
        seen.append(self.out)
        raise EventKVError("stopped before the model loads")

    monkeypatch.setattr(RunOptions, "load_runtime", stop)
    args = [str(tmp_path / "items.jsonl") if a == "TASKFILE" else a for a in args]
    items = ["--items", "1"] if args[0] == "splice" else []
    code, out, err = run_cli(monkeypatch, capsys, *args, *items, "--model", "/x/tinyB", "--dtype", "float32")
    assert code == 2 and "stopped before the model loads" in err, err
    assert seen == [Path(folder)]
