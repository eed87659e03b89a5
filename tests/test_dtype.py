"""dtype="auto": bfloat16 only where the hardware computes it natively, recorded with its reason."""

from __future__ import annotations

import json

import pytest
import torch

from eventkv.errors import EventKVError
from eventkv.models import load, native_bf16, resolve_dtype
from eventkv.testing import tiny_model, tiny_tokenizer

AVX2_ONLY = {"cpu_name": "AMD EPYC", "avx2": True, "avx512_f": False, "avx512_bf16": False, "amx_bf16": False}
AVX512_BF16 = {"cpu_name": "AMD EPYC", "avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_bf16": False}
AMX = {"cpu_name": "Intel Xeon", "avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_bf16": True}


def _cpu(monkeypatch, caps: dict, kernels: str) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: dict(caps))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: kernels)


@pytest.mark.parametrize(
    "caps, kernels, want",
    [
        (AVX2_ONLY, "AVX2", "float32"),  # an AVX2-only EPYC: bf16 would be ~6x slower
        (AVX512_BF16, "AVX512", "bfloat16"),
        (AMX, "AVX512", "bfloat16"),
        (AVX512_BF16, "AVX2", "bfloat16"),  # ATEN_CPU_CAPABILITY=avx2 on a bf16 CPU: oneDNN's bf16 matmuls stay native
        (AVX2_ONLY, "AVX512", "float32"),  # AVX-512 without the BF16 extension
        (AMX, "AVX2", "float32"),  # ATEN_CPU_CAPABILITY=avx2 on an AMX CPU: torch's bf16 attention refuses to run
        (AMX, "AVX512_VNNI", "bfloat16"),
    ],
)
def test_auto_dtype_follows_the_cpu(monkeypatch, caps, kernels, want):
    _cpu(monkeypatch, caps, kernels)
    dtype, reason = resolve_dtype("auto", "cpu")
    assert dtype == want
    assert reason.startswith("auto: CPU AMD EPYC" if caps["cpu_name"] == "AMD EPYC" else "auto: CPU Intel Xeon")
    assert kernels in reason


def test_explicit_dtype_is_kept_and_bad_dtype_refused():
    assert resolve_dtype("float32") == ("float32", "requested")
    assert resolve_dtype("bfloat16") == ("bfloat16", "requested")
    with pytest.raises(EventKVError, match=r"^dtype 'fp8': not supported; use one of auto, float32"):
        resolve_dtype("fp8")


def test_auto_on_a_cuda_device_without_cuda_is_float32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert native_bf16("cuda") == (False, "CUDA requested but not available")


def test_load_records_the_choice_and_the_reason(tmp_path, monkeypatch):
    d = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    _cpu(monkeypatch, AVX2_ONLY, "AVX2")
    lm = load(str(d))  # default dtype is "auto"
    assert lm.profile.dtype == "float32" and lm.model.dtype == torch.float32
    assert lm.profile.dtype_reason.startswith("auto: CPU AMD EPYC has no native bf16")
    _cpu(monkeypatch, AVX512_BF16, "AVX512")
    lm = load(str(d))
    assert lm.profile.dtype == "bfloat16" and lm.model.dtype == torch.bfloat16
    assert lm.profile.dtype_reason == "auto: CPU AMD EPYC has avx512_bf16 (torch kernels AVX512)"
    assert load(str(d), dtype="float32").profile.dtype_reason == "requested"


def test_run_manifest_records_the_dtype_reason(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from eventkv.cli import app

    d = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    _cpu(monkeypatch, AVX2_ONLY, "AVX2")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(
        app,
        [
            "run",
            "donor-pair",
            "--model",
            str(d),
            "--items",
            "1",
            "--readout",
            "logits",
            "--no-progress",
            "--n-events",
            "16",
            "--root-slot",
            "13",
        ],
    )
    assert res.exit_code == 0, res.output
    out = tmp_path / "runs" / "donor-pair" / "tiny-float32-seed0"  # the resolved dtype names the folder
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["identity"]["dtype"] == "float32"
    assert manifest["profile"]["dtype_reason"].startswith("auto: CPU AMD EPYC has no native bf16")
