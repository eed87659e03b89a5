"""A router of the service runs alone: mounted on a bare FastAPI app, with its dependencies (the
app's state, the model worker) overridden through ``app.dependency_overrides``, no model loaded
and no lifespan. Here the operations router (prefill and rebase, one implementation) and the health
router, over a fake worker that runs each job at once on a fake memory."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from eventkv.service.errors import Handlers  # noqa: E402
from eventkv.service.routes import health, operations  # noqa: E402
from eventkv.service.state import ServiceState, Settings, get_state, get_worker  # noqa: E402


class FakeMemory:
    """What the prefill and rebase routes call: ``version``, ``prefill()`` and ``rebase()`` (rows)."""

    def __init__(self) -> None:
        self.version, self.calls = 3, []

    def prefill(self) -> int:
        self.calls.append("prefill")
        return 7

    def rebase(self) -> int:
        self.calls.append("rebase")
        return 12


class FakeWorker:
    """Runs each job at once; every directory opens the one fake memory."""

    depth = 2

    def __init__(self) -> None:
        self.mem, self.opened, self.directories = FakeMemory(), [], []

    def submit(self, job, directory=None) -> Future:
        self.directories.append(directory)
        fut: Future = Future()
        fut.set_result(job())
        return fut

    def memory(self, directory):
        self.opened.append(directory)
        return self.mem


@pytest.fixture()
def alone(tmp_path):
    """A bare app with the operations and health routers, state and worker overridden."""
    (tmp_path / "default" / "m1").mkdir(parents=True)
    (tmp_path / "default" / "m1" / "manifest.json").write_text("{}")
    state = ServiceState(Settings(SimpleNamespace(profile=SimpleNamespace(name="fake-lm")), tmp_path), tmp_path)
    worker = FakeWorker()
    app = FastAPI()
    app.include_router(operations.router)
    app.include_router(health.router)
    Handlers(tmp_path, [operations.router, health.router]).install(app)
    app.dependency_overrides[get_state] = lambda: state
    app.dependency_overrides[get_worker] = lambda: worker
    with TestClient(app) as client:
        yield client, worker


def test_prefill_and_rebase_run_their_verb_on_the_worker(alone, tmp_path):
    client, worker = alone
    r = client.post("/v1/memories/m1/prefill")
    assert r.status_code == 200 and r.json() == {"version": 3, "added": [], "rows": 7}
    r = client.post("/v1/memories/m1/rebase", json={"expected_version": 3})
    assert r.status_code == 200 and r.json() == {"version": 3, "added": [], "rows": 12}
    assert worker.mem.calls == ["prefill", "rebase"]
    assert worker.opened == [tmp_path / "default" / "m1"] * 2
    assert worker.directories == [tmp_path / "default" / "m1"] * 2  # queued as jobs on that memory


def test_refusals_of_a_router_alone_are_the_service_errors(alone):
    client, worker = alone
    r = client.post("/v1/memories/m1/rebase", json={"expected_version": 2})
    assert r.status_code == 409 and r.json()["code"] == "conflict" and "version 3" in r.json()["message"]
    r = client.post("/v1/memories/nope/prefill")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    assert worker.mem.calls == []  # neither reached the memory's verb


def test_health_reads_the_overridden_state_and_worker(alone):
    client, _ = alone
    assert client.get("/health").json() == {"status": "ok", "model": "fake-lm", "queue_depth": 2}
