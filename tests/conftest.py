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


@pytest.fixture(scope="module", params=["process", pytest.param("ray", marks=pytest.mark.slow)])
def cluster(request):
    """The backend of ``eventkv serve`` a test module's servers run on (tests/service_fixtures.Server's
    ``cluster``): None (one process), or a local Ray cluster of 2 CPUs on 127.0.0.1 that each server
    deploys 2 replicas on (``--backend ray``), started for the module and stopped after it. The Ray
    cases are ``slow``: starting the cluster and deploying on it take most of their time."""
    if request.param == "process":
        yield None
        return
    pytest.importorskip("ray.serve")
    from service_fixtures import RayCluster

    c = RayCluster()
    try:
        yield c
    finally:
        c.shutdown()
