"""Sweeps: the plan (expansion, folder names, every error before anything loads), and
the three backends on tiny random models — serial, process (2 spawned workers) and a local Ray cluster
started here with 2 CPUs write the same records per run folder; a sweep resumes per folder and refuses a
folder made with other settings; a sweep folder is an ordinary run folder."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from cli_fixtures import run_cli

from eventkv.errors import EventKVError, OptionError
from eventkv.probes.runner import RECORDS, RUN_MANIFEST, load_records
from eventkv.sweep import SweepOptions, load_plan, parse_plan, run_sweep
from eventkv.sweep.plan import DEFAULT_OUT, run_keys

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sweep.yaml"
THREADS = 1  # every backend's workers use one torch thread: float scores change with the thread count
ACCESS = {"max_new_tokens": 3, "n_events": 8, "source_slots": [2, 3], "root_slot": 5}


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory):
    """Two tiny model directories: the session's tiny Llama (byte-level tokenizer) and a tiny Qwen2 with the
    probes' word-level tokenizer — two models, so workers switch between them."""
    from probe_fixtures import tiny_tokenizer

    from eventkv.testing import tiny_model

    d = tmp_path_factory.mktemp("models") / "tinyqwen"
    tiny_model("qwen2", seed=1).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return [str(tiny_dir), str(d)]


def plan_data(models, root, **changes) -> dict:
    """2 models x 2 probe entries x 2 seeds = 8 runs of 3 items under ``root``."""
    data = {
        "out": f"{root}/{{label}}/{{model}}-seed{{seed}}",
        "models": models,
        "seeds": [0, 1],
        "items": 3,
        "dtype": "float32",
        "threads": THREADS,
        "probes": [{"probe": "donor-pair", "options": {"max_new_tokens": 4}}, {"probe": "access", "options": ACCESS}],
    }
    return {**data, **changes}


def sweep(models, root, backend="serial", **opts):
    plan = parse_plan(plan_data(models, root, **opts.pop("plan", {})))
    return run_sweep(plan, SweepOptions(backend=backend, **opts), figure=False)


def records(root: Path) -> dict[str, dict[int, str]]:
    """Every run folder under ``root`` -> its records keyed by index (order in the file ignored)."""
    return {
        d.parent.relative_to(root).as_posix(): {r["index"]: json.dumps(r) for r in load_records(d.parent)}
        for d in sorted(root.rglob(RUN_MANIFEST))
    }


def manifest(folder: Path) -> dict:
    return json.loads((folder / RUN_MANIFEST).read_text())


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory):
    """The serial sweep every other backend and every resume is compared with."""
    root = tmp_path_factory.mktemp("serial")
    results = sweep(models, root)
    assert [r.computed for r in results] == [3] * 8
    return root


# ------------------------------------------------------------------------------------------------ the plan


def test_plan_expands_models_probes_grids_and_seeds():
    plan = parse_plan(
        {
            "out": "sw/{label}/{model}-{dtype}-i{items}-s{seed}",
            "models": ["/m/tinyA", "hub/tinyB"],
            "seeds": [3, 4],
            "items": 2,
            "dtype": "float32",
            "grid": {"items": [2, 5]},
            "probes": [
                "donor-pair",
                {"probe": "access", "label": "access-root{root_slot}", "grid": {"root_slot": [13, 14]}},
            ],
        }
    )
    # models x (entry 1 + entry 2's two grid values) x the top grid's two values x seeds, models outermost
    assert len(plan.runs) == 2 * 3 * 2 * 2
    assert [r.out.as_posix() for r in plan.runs[:8]] == [
        "sw/donor-pair/tinyA-float32-i2-s3",
        "sw/donor-pair/tinyA-float32-i2-s4",
        "sw/donor-pair/tinyA-float32-i5-s3",
        "sw/donor-pair/tinyA-float32-i5-s4",
        "sw/access-root13/tinyA-float32-i2-s3",
        "sw/access-root13/tinyA-float32-i2-s4",
        "sw/access-root14/tinyA-float32-i2-s3",
        "sw/access-root14/tinyA-float32-i2-s4",
    ]
    assert plan.runs[12].out.as_posix() == "sw/donor-pair/tinyB-float32-i2-s3"
    assert [r.run.items for r in plan.runs[:4]] == [2, 2, 5, 5]
    run = plan.runs[6]
    assert run.label == "access-root14" and run.probe == "access" and run.options == {"root_slot": 14}
    assert run.make_probe().root_slot == 14 and run.run.seed == 3
    assert run.run.model == "/m/tinyA" and run.run.dtype == "float32" and run.run.threads is None


def test_plan_default_folder_is_eventkv_runs():
    from eventkv.probes.run_options import RunOptions

    plan = parse_plan({"models": ["/m/tinyA"], "seeds": [7], "items": 1, "dtype": "float32", "probes": ["patch"]})
    (run,) = plan.runs
    assert DEFAULT_OUT == "runs/{label}/{model}-{dtype}-seed{seed}"
    assert run.out == RunOptions("/m/tinyA", 1, seed=7, dtype="float32").default_out("patch")


def test_plan_run_options_per_entry_and_device():
    data = plan_data(["/m/a"], "r", seeds=[0])
    data["probes"][1]["options"] = {**ACCESS, "items": 5}
    if "device" in run_keys():  # RunOptions' device field: a plan sets it like dtype
        data["device"] = "cpu"
    plan = parse_plan(data)
    assert [r.run.items for r in plan.runs] == [3, 5]
    assert plan.threads == THREADS
    if "device" in run_keys():
        assert {r.run.device for r in plan.runs} == {"cpu"}


def test_plan_device_checked_here_unless_the_workers_are_elsewhere():
    """A device this machine lacks is refused when the plan is read, unless the runs go to a Ray cluster
    (``check_devices=False``: its workers' model load checks it)."""
    import torch

    if "device" not in run_keys() or torch.cuda.is_available():
        return  # a GPU machine has the device: nothing to refuse
    data = {**plan_data(["/m/a"], "r", seeds=[0]), "device": "cuda"}
    with pytest.raises(EventKVError, match=r"^plan: probes\[0\] \(donor-pair\): device 'cuda'"):
        parse_plan(data)
    assert {r.run.device for r in parse_plan(data, check_devices=False).runs} == {"cuda"}


def test_example_plan_is_valid_and_loads_nothing(monkeypatch):
    import eventkv.models

    monkeypatch.setattr(eventkv.models, "load", lambda *a, **k: pytest.fail("a plan check loaded a model"))
    plan = load_plan(EXAMPLE)
    assert len(plan.runs) == 16 and len({r.out for r in plan.runs}) == 16
    assert {r.label for r in plan.runs} == {
        "donor-pair",
        "donor-pair-decoy-none",
        "donor-pair-decoy-opposite",
        "access",
    }
    assert Path("runs/sweep-example/donor-pair-decoy-none/smollm2-135m-float32-seed1") in {r.out for r in plan.runs}


def _bad(**changes):
    return changes


BAD_PLANS = [
    (_bad(modelz=["m"]), "plan: unknown key 'modelz': the top level of a plan takes out, models, seeds"),
    (_bad(models=[]), "plan: models '': give a list of distinct model names"),
    (_bad(models=["m", "m"]), "plan: models m,m: give a list of distinct model names"),
    (_bad(seeds=[0, "1"]), "plan: seeds 0,1: give a list of distinct whole-number seeds >= 0."),
    (_bad(seeds=None), "plan: seeds '': give a list"),
    (_bad(threads=0), "plan: threads 0: give the torch threads of each worker (>= 1)."),
    (_bad(items=0), "plan: probes[0] (donor-pair): items 0: run at least one item."),
    (_bad(items=None), "plan: probes[0] (donor-pair): items is not given: set items (items per run) at the plan's"),
    (_bad(dtype="fp8"), "plan: probes[0] (donor-pair): dtype 'fp8': not supported; use one of auto, float32"),
    (_bad(probes=[]), "plan: probes '': give a list of entries"),
    (_bad(probes=["donor-pairs"]), "plan: probes[0] (donor-pairs): unknown probe 'donor-pairs': use one of"),
    (_bad(probes=[{"probe": "access", "options": {"rootslot": 5}}]), "unknown option 'rootslot': access's options"),
    (
        _bad(probes=[{"probe": "donor-pair", "options": {"decoy": "sometimes"}}]),
        "plan: probes[0] (donor-pair): decoy 'sometimes': use one of independent, opposite, none",
    ),
    (
        _bad(probes=[{"probe": "access", "options": {"root_slot": 99}}]),
        "plan: probes[0] (access): root_slot 99:",
    ),
    (_bad(probes=[{"probe": "access", "options": {"threads": 2}}]), "unknown option 'threads' (the sweep sets it"),
    (_bad(probes=[{"probe": "access", "extra": 1}]), "unknown key 'extra': an entry of probes takes probe, label"),
    (_bad(probes=[{"probe": "access", "grid": {"root_slot": 13}}]), "grid root_slot 13: give a non-empty list"),
    (_bad(grid={"decoy": ["none"]}), "unknown grid key 'decoy': the top-level grid (run options only) takes items"),
    (_bad(out=""), "plan: out '': give a folder template"),
    (_bad(out="r/{model}/{nope}"), "out template field {nope} is not defined: use {probe}, {model}, {seed}"),
    (_bad(out="r/{model:>8}"), "field {model:>8} is not allowed"),
    (
        _bad(out="r/run-{seed}"),
        "plan: two runs would write the same folder 'r/run-0' (donor-pair: /m/a, seed 0, max_new_tokens=4 and access: "
        "/m/a, seed 0, max_new_tokens=3, n_events=8, source_slots=2,3, root_slot=5)",
    ),
    (
        _bad(probes=[{"probe": "access", "grid": {"root_slot": [13, 14]}}]),
        "two runs would write the same folder 'r/access/a-seed0' (access: /m/a, seed 0, root_slot=13 and access: "
        "/m/a, seed 0, root_slot=14): put what tells them apart into the out template",
    ),
    (_bad(probes=[{"probe": "access", "label": "a/b"}]), "label 'a/b': give a non-empty name without '/'."),
    (_bad(batch_pairs=2), "unknown key 'batch_pairs' (a sweep's workers compute one item per request"),
]


@pytest.mark.parametrize("changes, message", BAD_PLANS, ids=[m[:40] for _, m in BAD_PLANS])
def test_plan_errors_name_the_entry_value_and_fix(changes, message):
    data = {**plan_data(["/m/a"], "r"), **changes}
    for key in [k for k, v in changes.items() if v is None]:
        del data[key]  # None: the key left out
    with pytest.raises(EventKVError) as exc:
        parse_plan(data)
    assert message in str(exc.value), str(exc.value)


def test_plan_file_errors(tmp_path):
    bad = tmp_path / "plan.yaml"
    bad.write_text("models: [a, b\nseeds: [0]\n")
    with pytest.raises(EventKVError, match=r"plan.yaml: not valid YAML at line 2, column 6"):
        load_plan(bad)
    bad.write_text("- donor-pair\n")
    with pytest.raises(EventKVError, match=r"a plan is a YAML mapping with models, seeds and probes"):
        load_plan(bad)
    with pytest.raises(EventKVError, match=r"plan '.*missing.yaml': cannot be read"):
        load_plan(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    "options, message",
    [
        (SweepOptions(backend="gpu"), "--backend 'gpu': use one of serial, process, ray."),
        (SweepOptions(workers=2), "--workers 2: the serial backend runs one worker in this process"),
        (SweepOptions(backend="process", workers=0), "--workers 0: give a whole number of workers"),
        (SweepOptions(backend="process", threads=10_000), "--threads 10000: give 1 to"),
        (SweepOptions(backend="ray", threads=0), "--threads 0: give the torch threads (and CPUs) of each Ray worker"),
        (SweepOptions(ray_address="auto"), "--ray-address 'auto': only the ray backend uses a cluster"),
        (SweepOptions(backend="process", gpus_per_worker=1), "--gpus-per-worker 1: only Ray workers reserve GPUs"),
    ],
)
def test_sweep_options_name_the_flag(options, message):
    with pytest.raises(OptionError) as exc:
        options.validate()
    assert exc.value.for_cli().startswith(message), exc.value.for_cli()


# --------------------------------------------------------------------------------- backends, same records


def test_serial_sweep_writes_run_folders(reference, models):
    recs = records(reference)
    names = [Path(m).name for m in models]
    assert sorted(recs) == sorted(f"{p}/{m}-seed{s}" for p in ("donor-pair", "access") for m in names for s in (0, 1))
    assert all(sorted(r) == [0, 1, 2] for r in recs.values())
    folder = reference / "access" / "tinyqwen-seed1"
    m = manifest(folder)
    assert m["identity"]["probe"] == "access" and m["identity"]["seed"] == 1 and m["identity"]["dtype"] == "float32"
    assert m["identity"]["options"]["root_slot"] == 5 and m["identity"]["model"] == models[1]
    (inv,) = m["invocations"]
    assert inv["items_computed"] == 3 and inv["torch_threads"] == THREADS
    assert inv["backend"] == "serial" and inv["workers"] == 1
    assert (folder / "summary.md").read_text().startswith("# access")
    # seeds and models give different records
    assert recs["access/tinyqwen-seed1"] != recs["access/tinyqwen-seed0"]
    assert recs["access/tinyqwen-seed0"] != recs[f"access/{names[0]}-seed0"]


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster of 2 CPUs, started for this module's Ray tests and shut down after them.

    Ray waits a fixed 30 s for its raylet to register at start-up, which a loaded CI machine can miss
    ("The current node timed out during startup"): a failed start is shut down and tried again, up to
    three times."""
    import ray

    for attempt in range(3):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            break
        except Exception as exc:  # Ray raises a bare Exception for this time-out
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["process", "ray"])
def test_every_backend_writes_the_serial_records(backend, reference, models, tmp_path, request):
    opts = {"workers": 2}
    if backend == "ray":
        request.getfixturevalue("local_ray")
    results = sweep(models, tmp_path, backend, **opts)
    assert [r.computed for r in results] == [3] * 8
    assert records(tmp_path) == records(reference)
    for folder in (tmp_path / "donor-pair").iterdir():
        m, ref = manifest(folder), manifest(reference / "donor-pair" / folder.name)
        assert m["identity"] == ref["identity"]
        (inv,) = m["invocations"]
        assert inv["backend"] == backend and inv["workers"] == 2 and inv["torch_threads"] == THREADS


@pytest.mark.slow
def test_ray_refuses_workers_the_cluster_cannot_place(local_ray, models, tmp_path):
    with pytest.raises(EventKVError, match=r"--threads 4: each Ray worker reserves that many CPUs .* has 2"):
        sweep(models, tmp_path, "ray", threads=4)
    with pytest.raises(EventKVError, match=r"--workers 3: 3 Ray workers of 1 CPU\(s\) each do not fit"):
        sweep(models, tmp_path, "ray", workers=3)
    assert not tmp_path.joinpath("donor-pair").exists()


@pytest.fixture()
def ray_worker_dies(local_ray, monkeypatch):
    """``kill(backend)``, called by the sweep after its second record is written, kills one of the sweep's
    Ray workers while the others still have items to compute (set ``kill`` before the sweep starts)."""
    import eventkv.sweep.run
    from eventkv.sweep.backends import RayBackend

    state = {"backend": None, "written": 0, "kill": None}
    enter, append = RayBackend.__enter__, eventkv.sweep.run.append_record

    def remember(self):
        state["backend"] = self
        return enter(self)

    def append_then_kill(out, record):
        append(out, record)
        state["written"] += 1
        if state["written"] == 2:
            state["kill"](state["backend"])

    monkeypatch.setattr(RayBackend, "__enter__", remember)
    monkeypatch.setattr(eventkv.sweep.run, "append_record", append_then_kill)
    return state


def _ray_kill(backend) -> None:
    backend._ray.kill(backend._actors[0])


def _sigkill_process(backend) -> None:  # what the kernel's OOM killer does to a worker's process
    import signal

    ray, actor = backend._ray, backend._actors[0]
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("kill", [_ray_kill, _sigkill_process], ids=["ray.kill", "SIGKILL"])
def test_a_dead_ray_worker_ends_the_sweep_with_one_line_and_it_resumes(
    ray_worker_dies, kill, reference, models, tmp_path, monkeypatch, capsys
):
    """A Ray worker that dies mid-sweep (its actor killed, or its process killed as by the OOM killer) ends
    the CLI's sweep with one line and exit 2, as a dead worker process of the process backend does; every
    record written stays, and the same command resumes the sweep to the serial records."""
    ray_worker_dies["kill"] = kill
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(plan_data(models, tmp_path / "runs")))
    args = ["sweep", str(plan), "--backend", "ray", "--workers", "2", "--no-progress"]
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2 and "Traceback" not in out + err, err
    assert err.strip().count("\n") == 0, err
    assert err.startswith("error: a sweep's Ray worker died (") and "run the same command again" in err, err
    kept = records(tmp_path / "runs")
    assert 2 <= sum(len(r) for r in kept.values()) < 24
    ray_worker_dies["kill"] = lambda backend: None
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    assert records(tmp_path / "runs") == records(reference)
    assert all(kept[k].items() <= records(reference)[k].items() for k in kept)


@pytest.mark.slow
def test_an_exception_in_a_ray_worker_is_not_a_dead_worker(local_ray, models, tmp_path, monkeypatch):
    """A bug in a worker's code (an exception other than EventKVError) is raised as the worker's own
    exception, with its traceback, as the process backend does — not reported as a dead worker."""
    import eventkv.sweep.backends

    class Broken:  # local: Ray ships it to the workers by value
        def __init__(self, runs, threads):
            pass

        def execute(self, task):
            raise ZeroDivisionError("a probe bug")

    monkeypatch.setattr(eventkv.sweep.backends, "Worker", Broken)
    with pytest.raises(ZeroDivisionError, match="a probe bug"):
        sweep(models, tmp_path, "ray", workers=2)


def test_ray_missing_is_one_clear_error(monkeypatch, models, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(EventKVError, match=r"Ray is not installed: pip install 'eventkv\[ray\]'"):
        sweep(models, tmp_path, "ray")


# ------------------------------------------------------------------------------------- resume and refusal


@pytest.mark.slow
def test_a_sweep_resumes_per_folder(reference, models, tmp_path):
    """Three folders left as a kill leaves them (a line cut short, one record, nothing at all) are completed; the
    others compute nothing; every folder then holds the reference records."""
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    folders = sorted(p.parent for p in tmp_path.rglob(RUN_MANIFEST))
    cut, short, gone, whole = folders[:4]
    lines = (cut / RECORDS).read_bytes().split(b"\n")
    (cut / RECORDS).write_bytes(lines[0] + b"\n" + lines[1] + b"\n" + lines[2][:20])  # a kill mid-write
    (short / RECORDS).write_bytes((short / RECORDS).read_bytes().split(b"\n")[0] + b"\n")
    shutil.rmtree(gone)
    results = sweep(models, tmp_path)
    computed = {r.out: r.computed for r in results}
    assert (computed[cut], computed[short], computed[gone], computed[whole]) == (1, 2, 3, 0)
    assert sum(computed.values()) == 6
    assert records(tmp_path) == records(reference)
    assert manifest(cut)["invocations"][-1]["items_computed"] == 1
    assert [inv["items_computed"] for inv in manifest(whole)["invocations"]] == [3, 0]


@pytest.mark.slow
def test_an_interrupted_sweep_keeps_its_records_and_resumes(reference, models, tmp_path, monkeypatch):
    from eventkv.sweep.worker import Item, Worker

    real, calls = Worker.execute, []

    def stop_after_five(self, task):
        if isinstance(task, Item):
            calls.append(task)
            if len(calls) > 5:
                raise KeyboardInterrupt
        return real(self, task)

    monkeypatch.setattr(Worker, "execute", stop_after_five)
    with pytest.raises(KeyboardInterrupt):
        sweep(models, tmp_path)
    name = Path(models[0]).name
    assert {k: sorted(v) for k, v in records(tmp_path).items() if v} == {
        f"donor-pair/{name}-seed0": [0, 1, 2],
        f"donor-pair/{name}-seed1": [0, 1],
    }
    (inv,) = manifest(tmp_path / "donor-pair" / f"{name}-seed1")["invocations"]
    assert inv["interrupted"] and inv["items_computed"] == 2
    monkeypatch.setattr(Worker, "execute", real)
    assert sum(r.computed for r in sweep(models, tmp_path)) == 24 - 5
    assert records(tmp_path) == records(reference)


def test_a_folder_made_with_other_settings_is_refused(reference, models, tmp_path):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    before = {p: p.read_bytes() for p in tmp_path.rglob(RECORDS)}
    changed = plan_data(models, tmp_path)
    changed["probes"][0]["options"]["max_new_tokens"] = 5
    with pytest.raises(EventKVError) as exc:
        run_sweep(parse_plan(changed), SweepOptions(), figure=False)
    message = str(exc.value)
    assert message.startswith("4 of 8 run folders refused, nothing computed:")
    assert "max_new_tokens: 4 -> 5" in message and "donor-pair" in message and "access/" not in message
    assert {p: p.read_bytes() for p in tmp_path.rglob(RECORDS)} == before  # not one record added anywhere


def test_what_needs_the_model_is_checked_before_any_folder_is_written(models, tmp_path):
    """A model that cannot be loaded, and an option the loaded model cannot run (the probe's check_model), stop
    the sweep in its first step, naming the model or the run folder; no folder is made."""
    with pytest.raises(EventKVError, match=r"^model '/nonexistent/tiny': "):
        sweep(["/nonexistent/tiny"], tmp_path)
    splice = {"probe": "splice", "options": {"cutoffs": "0,2", "max_new_tokens": 3, "heads": [5]}}
    with pytest.raises(EventKVError) as exc:
        sweep(models[:1], tmp_path, plan={"seeds": [0], "probes": [splice]})
    assert str(exc.value) == (
        f"{tmp_path}/splice/{Path(models[0]).name}-seed0: heads 5: this model has 2 KV heads per layer: "
        "give heads 0..1."
    )
    with pytest.raises(
        EventKVError, match=r"plan: threads 1000: give 1 to \d+ torch CPU threads .* \(or give --threads\)"
    ):
        sweep(models[:1], tmp_path, plan={"threads": 1000})
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_folder_is_a_run_folder(reference, models, tmp_path):
    """`eventkv run`'s runner resumes a sweep's folder (same identity: nothing to compute) and writes the same
    records into a new one at the same thread count."""
    import torch

    from eventkv.models import load
    from eventkv.probes import get_probe
    from eventkv.probes.base import Runtime
    from eventkv.probes.runner import run_probe

    lm = load(models[0], dtype="float32")
    rt = Runtime(lm.model, lm.tokenizer, lm.profile)
    folder = reference / "access" / f"{Path(models[0]).name}-seed1"
    shutil.copytree(folder, tmp_path / "copy")
    saved = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        for out in ("copy", "new"):
            probe = get_probe("access")(**ACCESS)
            run_probe(probe, rt, model=models[0], items=3, seed=1, out=tmp_path / out, progress=False, figure=False)
    finally:
        torch.set_num_threads(saved)
    assert manifest(tmp_path / "copy")["invocations"][-1]["items_computed"] == 0
    assert records(tmp_path)["new"] == records(reference)[f"access/{folder.name}"]


# ------------------------------------------------------------------------------------------------- the CLI


def test_cli_sweep_dry_run_run_and_errors(models, tmp_path, monkeypatch, capsys):
    plan = tmp_path / "plan.yaml"
    data = plan_data(models[1:], tmp_path / "runs", seeds=[2], probes=[{"probe": "access", "options": ACCESS}])
    plan.write_text(yaml.safe_dump(data))
    code, out, err = run_cli(monkeypatch, capsys, "sweep", str(plan), "--dry-run")
    assert code == 0, err
    assert f"| {tmp_path}/runs/access/tinyqwen-seed2 | access | {models[1]} | 2 | 3 |" in out and "1 runs" in out
    assert not (tmp_path / "runs").exists()
    code, out, err = run_cli(monkeypatch, capsys, "sweep", str(plan), "--no-progress", "--threads", "1")
    assert code == 0, err
    assert "backend serial: 1 worker(s) x 1 torch thread(s)" in out
    assert f"| {tmp_path}/runs/access/tinyqwen-seed2 | access | {models[1]} | 2 | 3 | 3 |" in out
    assert (tmp_path / "runs" / "access" / "tinyqwen-seed2" / "figure.png").is_file()
    code, out, err = run_cli(monkeypatch, capsys, "sweep", str(plan), "--no-progress", "--threads", "1")
    assert code == 0 and "| 2 | 3 | 0 |" in out  # resumed: nothing left to compute
    for args, message in [
        (["--backend", "gpu"], "error: --backend 'gpu': use one of serial, process, ray."),
        (["--workers", "2"], "error: --workers 2: the serial backend runs one worker"),
        (["--ray-address", "auto"], "error: --ray-address 'auto': only the ray backend uses a cluster"),
    ]:
        code, out, err = run_cli(monkeypatch, capsys, "sweep", str(plan), *args)
        assert code == 2 and message in err and "Traceback" not in err, err
    plan.write_text(yaml.safe_dump({**data, "probes": [{"probe": "access", "options": {"root_slot": "five"}}]}))
    code, out, err = run_cli(monkeypatch, capsys, "sweep", str(plan))
    assert code == 2 and f"error: {plan}: probes[0] (access): root_slot 'five':" in err and "Traceback" not in err


def _orphan_parent(pid_file: str) -> None:  # a spawned "sweep process" whose worker writes its pid, then waits
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=_orphan_worker, args=(pid_file,))
    child.start()
    child.join()


def _orphan_worker(pid_file: str) -> None:
    import time

    from eventkv.sweep.backends import exit_with_parent

    exit_with_parent()
    tmp = Path(pid_file + ".tmp")  # written aside and renamed: the test never reads a half-written pid
    tmp.write_text(str(os.getpid()))
    tmp.replace(pid_file)
    time.sleep(600)  # until its parent's death ends it (the test kills it after 120 s otherwise)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (an exited orphan whose new parent, the machine's
    init, has not reaped it yet still answers ``kill(pid, 0)``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: kill(pid, 0) is all there is
    return state != "Z"


@pytest.mark.slow
def test_a_worker_ends_when_the_sweep_process_is_killed(tmp_path):
    """kill -9 of the sweep process: its spawned workers end too (they hold a model each)."""
    import multiprocessing
    import signal
    import time

    pid_file = tmp_path / "worker.pid"
    parent = multiprocessing.get_context("spawn").Process(target=_orphan_parent, args=(str(pid_file),))
    parent.start()
    # generous bounds: two spawned interpreters start on a loaded machine (the worker leaves at once when
    # its parent dies; the bound only ends a failing test)
    deadline = time.monotonic() + 300
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.1)
    worker = int(pid_file.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    parent.join()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not _running(worker):
            return
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    pytest.fail("the worker outlived its killed parent by 120 s")


def test_cli_sweep_interrupted_says_how_to_resume(tmp_path, monkeypatch, capsys):
    import eventkv.sweep

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    plan = tmp_path / "plan.yaml"
    plan.write_text(
        yaml.safe_dump(plan_data(["/m/a"], tmp_path / "runs", probes=[{"probe": "access", "options": ACCESS}]))
    )
    monkeypatch.setattr(eventkv.sweep, "run_sweep", interrupted)
    code, out, err = run_cli(monkeypatch, capsys, "sweep", str(plan), "--no-progress")
    assert code == 130
    assert "interrupted: every finished record is kept; run the same command again to resume." in err
    assert "Traceback" not in out + err
