"""Device support on a machine without a GPU: the ``device`` option and its errors
everywhere a model loads, ``auto`` resolving to the CPU here, the device in the run manifest, tensors
that follow the rows' device (checked on torch's ``meta`` device, which has no data but keeps the
device of every tensor made from it), and a static rule that every tensor the data path creates names
its device. What a GPU itself computes is ``tests/test_cuda.py``'s (skipped here)."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from cli_fixtures import run_cli

import eventkv.models
import eventkv.models.devices
from eventkv.errors import OptionError
from eventkv.kv.log import Event, EventLog, tokenize
from eventkv.kv.prefill import prefill
from eventkv.kv.rows import EventKV
from eventkv.kv.serve import serve
from eventkv.models import load, resolve_device, resolve_dtype
from eventkv.options import check_device
from eventkv.probes.run_options import RunOptions
from eventkv.testing import tiny_lm

META = torch.device("meta")
EVENTS = [Event("a", "Dana lives in Lyon.", budget=24), Event("b", "The table is at 19:30."), Event("c", "Ok.")]


@pytest.fixture()
def fake_gpu(monkeypatch):
    """One CUDA GPU as torch would report it (``name``, bf16 native or not), without a GPU."""

    def install(name="Fake GPU", bf16=True, count=1):
        monkeypatch.setattr(eventkv.models.devices, "cuda_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)

    return install


# --------------------------------------------------------------------------- the option and its errors


@pytest.mark.parametrize("bad", ["gpu", "CUDA", "cuda:", "cuda:01", "cuda:-1", "mps", "", None, 0])
def test_a_bad_device_is_refused_with_what_is_allowed(bad):
    with pytest.raises(OptionError, match=r"^device .*: use auto \(the CUDA GPU when torch sees one, else the CPU\)"):
        check_device(bad)
    with pytest.raises(OptionError) as exc:
        resolve_device(bad)
    assert exc.value.for_cli().startswith("--device ")


def test_auto_is_the_cpu_without_a_gpu():
    assert resolve_device("auto") == ("cpu", "auto: no CUDA device (torch.cuda.is_available() is False)")
    assert resolve_device("cpu") == ("cpu", "requested")
    assert resolve_dtype("float32", resolve_device("auto")[0]) == ("float32", "requested")


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_a_gpu_is_refused_with_the_fix(device):
    with pytest.raises(OptionError) as exc:
        resolve_device(device)
    assert str(exc.value) == (
        f"device {device!r}: torch sees no CUDA GPU here (torch.cuda.is_available() is False: no GPU, no driver, "
        "or a CPU-only torch build); use cpu, or auto (which picks the CPU here)."
    )


def test_auto_picks_the_gpu_and_bf16_where_it_is_native(fake_gpu):
    fake_gpu("NVIDIA H200", bf16=True)
    assert resolve_device("auto") == ("cuda", "auto: CUDA device NVIDIA H200")
    assert resolve_device("cuda:0") == ("cuda:0", "requested: CUDA device NVIDIA H200")
    assert resolve_dtype("auto", "cuda") == ("bfloat16", "auto: CUDA device NVIDIA H200 has native bf16")
    assert resolve_dtype("float32", "cuda") == ("float32", "requested")  # the gates' dtype is kept on request
    assert RunOptions("m", 1, dtype="auto").resolved_dtype() == "bfloat16"  # the default folder names it
    with pytest.raises(OptionError, match=r"^device 'cuda:1': this machine has 1 CUDA GPU\(s\) \(cuda:0\)"):
        resolve_device("cuda:1")


def test_a_gpu_without_native_bf16_runs_float32(fake_gpu):
    fake_gpu("Tesla V100", bf16=False)
    assert resolve_dtype("auto", resolve_device("auto")[0]) == (
        "float32",
        "auto: CUDA device Tesla V100 has no native bf16 (pre-Ampere)",
    )


def test_load_records_the_device_and_refuses_a_missing_gpu_before_reading(tiny_dir, monkeypatch):
    lm = load(str(tiny_dir), dtype="float32")  # device "auto"
    assert lm.profile.device == "cpu" and str(lm.model.device) == "cpu"
    assert lm.profile.device_reason == "auto: no CUDA device (torch.cuda.is_available() is False)"
    assert load(str(tiny_dir), dtype="float32", device="cpu").profile.device_reason == "requested"
    monkeypatch.setattr(eventkv.models.loading, "load_hf", lambda *a, **k: pytest.fail("read before the check"))
    with pytest.raises(OptionError, match=r"^device 'cuda': torch sees no CUDA GPU here"):
        load(str(tiny_dir), device="cuda")
    with pytest.raises(OptionError, match=r"^device 'gpu': use auto"):
        load(str(tiny_dir), device="gpu")


def test_run_options_check_the_device_first_and_name_the_field():
    with pytest.raises(OptionError, match=r"^device 'gpu'"):
        RunOptions("m", 1, device="gpu").validate()
    with pytest.raises(OptionError, match=r"^device 'cuda': torch sees no CUDA GPU"):
        RunOptions("m", 1, device="cuda").validate()
    RunOptions("m", 1, dtype="float32").validate()  # auto: the CPU here


# --------------------------------------------------------------------------------------------- CLI


def _app_commands():
    """``(path, click command)`` of every eventkv command, subcommands included."""
    import typer

    from eventkv.cli import app

    out = []

    def walk(cmd, path):
        if hasattr(cmd, "commands"):  # a group (typer's own click)
            for name, sub in cmd.commands.items():
                walk(sub, (*path, name))
        else:
            out.append((" ".join(path), cmd))

    walk(typer.main.get_command(app), ())
    return out


def test_every_command_that_loads_a_model_takes_device():
    """A command with ``--dtype`` loads a model: it must take ``--device`` too, default ``auto``."""
    loaders = [(path, cmd) for path, cmd in _app_commands() if any(p.name == "dtype" for p in cmd.params)]
    assert len(loaders) >= 12, [p for p, _ in loaders]
    for path, cmd in loaders:
        device = [p for p in cmd.params if p.name == "device"]
        assert device and device[0].opts == ["--device"] and device[0].default == "auto", path


def _argv(command: str, tmp_path: Path, jsonl: Path) -> list[str]:
    from eventkv.studies.materialization.memory_eval import DEMO_DATA

    extra = {
        "query": ["--log", str(jsonl), "--serve", "a", "-q", "which?"],
        "memory eval": ["--data", "demo"],
        "harvest": ["--data", DEMO_DATA],
        "serve": ["--model", "m", "--store", str(tmp_path / "store"), "--port", "0"],
    }
    return [*command.split(), *extra.get(command, [])]


LOADERS = [
    "query",
    "run donor-pair",
    "run trigger-bank",
    "run landing",
    "run access",
    "run carriers",
    "run patch",
    "contract",
    "splice",
    "memory eval",
    "audit",
    "harvest",
    "serve",
]


@pytest.mark.parametrize("command", LOADERS)
@pytest.mark.parametrize(
    "device, message",
    [
        ("gpu", "--device 'gpu': use auto (the CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N"),
        ("cuda", "--device 'cuda': torch sees no CUDA GPU here"),
    ],
)
def test_cli_bad_or_missing_device_exits_2_before_the_model_loads(
    monkeypatch, capsys, tmp_path, jsonl, command, device, message
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EVENTKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(eventkv.models, "load", lambda *a, **k: pytest.fail("the model loaded"))
    code, out, err = run_cli(monkeypatch, capsys, *_argv(command, tmp_path, jsonl), "--device", device)
    assert code == 2, (out, err)
    assert message in " ".join(err.split()) and "Traceback" not in err + out
    assert not (tmp_path / "runs").exists() and not (tmp_path / "store").exists()  # nothing written


def test_the_run_manifest_records_the_device_and_a_run_resumes_on_another(tiny_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from eventkv.cli import app

    monkeypatch.chdir(tmp_path)
    args = ["run", "donor-pair", "--model", str(tiny_dir), "--dtype", "float32", "--readout", "logits"]
    args += ["--no-progress", "--n-events", "16", "--root-slot", "13", "--out", "run"]
    res = CliRunner().invoke(app, [*args, "--items", "1"])  # --device auto: the CPU here
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["profile"]["device"] == "cpu"
    assert manifest["profile"]["device_reason"] == "auto: no CUDA device (torch.cuda.is_available() is False)"
    assert manifest["invocations"][-1]["device"] == "cpu"
    assert "device" not in manifest["identity"] and manifest["identity"]["dtype"] == "float32"
    # as if the first invocation had run on a GPU: the same dtype resumes (the device is provenance)
    manifest["invocations"][-1]["device"] = manifest["profile"]["device"] = "cuda:0"
    (tmp_path / "run" / "manifest.json").write_text(json.dumps(manifest))
    res = CliRunner().invoke(app, [*args, "--items", "2", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert [i["device"] for i in manifest["invocations"]] == ["cuda:0", "cpu"]
    assert [i["items_computed"] for i in manifest["invocations"]] == [1, 1]
    assert manifest["profile"]["device_reason"] == "requested"


def test_the_contract_provenance_lists_every_device(tmp_path):
    from eventkv.studies.materialization.contract.battery import provenance

    for probe, devices in (("donor_pair", ["cpu"]), ("landing", ["cuda:0", "cpu"])):
        (tmp_path / probe).mkdir()
        invocations = [{"seconds": 1.0, "torch_threads": 2, "device": d} for d in devices]
        manifest = {"identity": {"dtype": "float32", "seed": 0, "weights_digest": "w"}, "invocations": invocations}
        (tmp_path / probe / "manifest.json").write_text(json.dumps(manifest))
    assert provenance(tmp_path, ["donor_pair", "landing"])["devices"] == ["cpu", "cuda:0"]


# ------------------------------------------------- tensors follow the rows' device (meta: shapes only)


@pytest.fixture(scope="module")
def lm_log():
    lm = tiny_lm("llama")
    return lm, tokenize(EventLog(EVENTS), lm.tokenizer, lm.profile)


def _on_meta(ekv: EventKV) -> EventKV:
    return dataclasses.replace(ekv, keys=[k.to(META) for k in ekv.keys], values=[v.to(META) for v in ekv.values])


def test_serving_and_stacking_follow_the_rows_device(lm_log):
    from eventkv.kv.stacked import stack

    lm, tlog = lm_log
    ekv = _on_meta(prefill(lm.model, tlog))
    for mode in ("compact", "native"):
        s = serve(ekv, ["a", "c"], mode)
        assert {k.device for k in s.keys + s.values} == {META}
        assert s.positions.device.type == "cpu"  # bookkeeping stays on the CPU
        assert s.visible is None or s.visible.device == META
        batch = stack([s, serve(ekv, ["b"], "compact")], extra=4)
        assert batch.mask.device == META and batch.next_position.device == META
        assert {layer.keys.device for layer in batch.cache.layers} == {META}
        sub = batch.select([1, 1], capacity=batch.mask.shape[1] + 2)
        assert sub.next_position.device == META and sub.mask.device == META


def test_a_stored_eventkv_is_read_to_the_models_device(lm_log, tmp_path):
    from eventkv.kv.query import prefill_or_load

    lm, tlog = lm_log
    prefill(lm.model, tlog, weights_digest="w").save(tmp_path / "kv")
    back = EventKV.load(tmp_path / "kv", device="meta")
    assert {k.device for k in back.keys + back.values} == {META} and back.positions.device.type == "cpu"
    assert EventKV.load(tmp_path / "kv").keys[0].device.type == "cpu"  # the default
    # eventkv query's reuse path: the rows go where the model is (a model on meta: nothing is computed)
    moved = tiny_lm("llama")
    ekv, reused, _ = prefill_or_load(moved, EventLog(EVENTS), tmp_path / "q")
    assert not reused
    moved.model.to(META)
    ekv, reused, _ = prefill_or_load(moved, EventLog(EVENTS), tmp_path / "q")
    assert reused and {k.device for k in ekv.keys + ekv.values} == {META}


def test_a_memory_opens_its_rows_on_the_models_device(tmp_path):
    from eventkv.memory import EventMemory

    lm = tiny_lm("llama")
    with EventMemory.create(tmp_path / "mem", lm, namespace="n") as mem:
        mem.add(["Dana lives in Lyon.", "Ravi drinks tea."], prefill=True)
    lm.model.to(META)
    with EventMemory.open(tmp_path / "mem", lm) as mem:
        assert {k.device for k in mem._ekv.keys + mem._ekv.values} == {META}


def test_splice_plans_are_made_on_the_rows_device():
    from eventkv.studies.splice.engine import Splice, SplicePrompt, _spliced_rows, clean_run

    lm = tiny_lm("llama")
    prompt = SplicePrompt(tuple(range(10, 14)), tuple(range(20, 28)), tuple(range(40, 48)))
    run = clean_run(lm.model, prompt, max_new_tokens=0)
    run = dataclasses.replace(run, keys=[k.to(META) for k in run.keys], values=[v.to(META) for v in run.values])
    splices = [Splice("mask", layers=(0, 1), heads=(1,)), Splice("zero-kv", layers=(1,)), Splice("mask", layers=(1,))]
    keys, values, plan, head_plan = _spliced_rows(lm.model, run, splices, 19, {})
    assert {t.device for t in keys + values} == {META}
    assert {m.device for m in (*plan.values(), *head_plan.values())} == {META}
    assert sorted(plan) == [0, 1] and plan[1].shape == (3,) and head_plan[0].shape == (3, 4)  # [B], [B, q heads]


# ------------------------------------------- static rule: every tensor the data path creates names its device

#: tensor factories whose device defaults to the CPU when not named
FACTORIES = {
    "arange",
    "as_tensor",
    "empty",
    "eye",
    "full",
    "Generator",
    "linspace",
    "logspace",
    "ones",
    "rand",
    "randint",
    "randn",
    "randperm",
    "tensor",
    "zeros",
}
SRC = Path(__file__).resolve().parents[1] / "src" / "eventkv"
DATA_PATH = [
    SRC / f"{m}.py" for m in ("log", "prefill", "serve", "readout", "query", "batched", "rope", "blend", "windowed")
] + sorted(p for d in ("splice", "contract", "probes", "memory", "eviction") for p in (SRC / d).rglob("*.py"))
#: modules another change is editing; their fixes are listed in docs/devices.md ("Pending")
PENDING: set[str] = set()


def _undevised(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        f = node.func if isinstance(node, ast.Call) else None
        if (
            isinstance(f, ast.Attribute)
            and f.attr in FACTORIES
            and isinstance(f.value, ast.Name)
            and f.value.id == "torch"
            and not any(k.arg == "device" for k in node.keywords)
        ):
            out.append(f"{path.relative_to(SRC)}:{node.lineno}: torch.{f.attr}(...) without device=")
    return out


def test_every_tensor_the_data_path_creates_names_its_device():
    """``torch.zeros(...)`` and the like land on the CPU unless told otherwise; on a GPU that is a
    device mismatch or a copy per step. So every factory call in the data path and the studies on it
    says where its tensor goes: the model's or the rows' device, or ``device="cpu"`` on purpose
    (bookkeeping such as positions; seeded random draws). ``*_like``, ``new_*`` and slicing inherit
    their source's device and need nothing."""
    found = [
        line for p in DATA_PATH if p.is_file() and str(p.relative_to(SRC)) not in PENDING for line in _undevised(p)
    ]
    assert not found, "\n".join(found)
