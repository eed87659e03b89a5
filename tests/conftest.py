"""Fixtures shared by several test files."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(autouse=True)
def _auto_device_is_the_cpu(request, monkeypatch):
    """``device="auto"`` resolves to the CPU in every test not marked ``cuda``, on every machine: the CPU
    tests' expected values (exact counts, stated tolerances) are measured on the CPU, and a GPU machine
    must not move them to another device. ``tests/test_cuda.py`` (marked ``cuda``) sees the GPU."""
    if request.node.get_closest_marker("cuda") is None:
        import eventkv.models.devices

        monkeypatch.setattr(eventkv.models.devices, "cuda_available", lambda: False)


@pytest.fixture()
def jsonl(tmp_path):
    """An event log of three events ``a``, ``b``, ``c`` (texts ``event a`` ...)."""
    p = tmp_path / "events.jsonl"
    p.write_text("\n".join(json.dumps({"id": i, "text": f"event {i}"}) for i in ("a", "b", "c")) + "\n")
    return p


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama and its tokenizer saved as a local model directory (the CLI's --model)."""
    from eventkv.testing import tiny_model, tiny_tokenizer

    d = tmp_path_factory.mktemp("tiny")
    tiny_model("llama").save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d
