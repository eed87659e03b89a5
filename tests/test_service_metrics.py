"""``/metrics`` of ``eventkv serve``: a token restricted to some namespaces sees only their
per-memory series; every label has a small fixed set of values whatever the requests (made-up
methods, raw paths, odd statuses); a damaged memory is left out (and counted), never failing the
answer for every other memory. In-process app (tiny random model) through Starlette's TestClient."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from eventkv.errors import StoreDamaged  # noqa: E402
from eventkv.service import metrics as service_metrics  # noqa: E402
from eventkv.service.app import Settings, create_app  # noqa: E402
from eventkv.testing import tiny_lm  # noqa: E402

ADMIN, ONLY_A, ONLY_B = "admin-token-0123456789", "token-of-a-0123456789", "token-of-b-0123456789"
TOKENS = {ADMIN: None, ONLY_A: frozenset({"nsa"}), ONLY_B: frozenset({"nsb"})}


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


@pytest.fixture()
def client(lm, tmp_path):
    with TestClient(create_app(Settings(lm, tmp_path / "store", TOKENS))) as c:
        for ns, mid in (("nsa", "notes"), ("nsb", "payroll-2027")):
            h = {"Authorization": f"Bearer {ADMIN}", "X-EventKV-Namespace": ns}
            assert c.post("/v1/memories", json={"id": mid}, headers=h).status_code == 201
            assert c.post(
                f"/v1/memories/{mid}/events", json={"events": [{"text": f"{mid} row."}]}, headers=h
            ).is_success
        yield c


def metrics(client, token=ADMIN) -> str:
    r = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return r.text


def series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]


def test_a_restricted_token_sees_only_its_namespaces(client):
    a = metrics(client, ONLY_A)
    assert 'eventkv_memory_rows{memory="notes",namespace="nsa"}' in a
    assert "payroll-2027" not in a and 'namespace="nsb"' not in a
    b = metrics(client, ONLY_B)
    assert 'eventkv_memory_bytes{memory="payroll-2027",namespace="nsb"}' in b and "nsa" not in b
    admin = metrics(client)  # an unrestricted token sees every namespace
    assert 'memory="notes"' in admin and 'memory="payroll-2027"' in admin
    assert client.get("/metrics").status_code == 401


def test_every_label_has_a_bounded_set_of_values(client):
    before = len(series(metrics(client), "eventkv_requests_total"))
    for i in range(40):
        client.request(f"MADEUP{i}", "/v1/memories", headers={"Authorization": f"Bearer {ADMIN}"})
        client.get(f"/no/such/path/{i}", headers={"Authorization": f"Bearer {ADMIN}"})
        client.get(f"/v1/memories/nope-{i}", headers={"Authorization": f"Bearer {ADMIN}"})  # a raw id: 404
    text = metrics(client)
    lines = series(text, "eventkv_requests_total")
    assert len(lines) - before <= 4, lines  # 120 requests with fresh methods and paths: a few new series
    assert 'method="other",route="/v1/memories",status="405"' in text
    assert 'method="GET",route="unmatched",status="404"' in text
    assert 'route="/v1/memories/{mid}",status="404"' in text
    assert "MADEUP" not in text and "/no/such" not in text and "nope-" not in text
    methods = set(re.findall(r'method="([^"]*)"', text))
    assert methods <= {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"}


def test_memory_labels_name_only_existing_memories(client, tmp_path):
    store = tmp_path / "store"
    (store / "nsa" / "half-made").mkdir()  # no manifest: not a memory
    (store / "nsa" / ".trash-x").mkdir()
    (store / "bad.ns" / "m").mkdir(parents=True)  # a name no request could use
    (store / "bad.ns" / "m" / "manifest.json").write_text("{}")
    text = metrics(client)
    assert set(re.findall(r'memory="([^"]*)"', text)) == {"notes", "payroll-2027"}
    assert set(re.findall(r'namespace="([^"]*)"', text)) == {"nsa", "nsb"}


def test_a_damaged_memory_is_left_out_not_the_whole_answer(client, monkeypatch):
    real = service_metrics.read_memory

    def read(d):
        if d.name == "payroll-2027":
            raise StoreDamaged(f"memory {d.name!r}: its database does not open: restore it from a backup.")
        return real(d)

    monkeypatch.setattr(service_metrics, "read_memory", read)
    text = metrics(client)
    assert 'eventkv_memory_rows{memory="notes",namespace="nsa"}' in text and "payroll-2027" not in text
    assert 'eventkv_memories_damaged{namespace="nsb"} 1.0' in text
    assert "nsb" not in metrics(client, ONLY_A)  # the damaged count is a namespace's series too


def test_a_memory_with_a_corrupt_manifest_does_not_fail_metrics(client, tmp_path):
    (tmp_path / "store" / "nsb" / "payroll-2027" / "manifest.json").write_bytes(b"\x00{not json")
    text = metrics(client)
    assert 'eventkv_memory_rows{memory="notes",namespace="nsa"}' in text and "payroll-2027" not in text
    assert 'eventkv_memories_damaged{namespace="nsb"} 1.0' in text
