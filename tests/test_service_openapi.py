"""The service's OpenAPI document describes what the service does: every error status a route can
answer is declared with the ``{"code", "message"}`` body (OpenAI's error body on the OpenAI-compatible
routes), ``/metrics`` as text, the bearer scheme
(with a token file); state-dependent refusals are 404 / 409 / 410, not 422; a 405's ``Allow`` names
every method of the path; the client raises the exception each code stands for. And schemathesis,
with all its checks, over the live spec of a live server (bounded: a few examples per operation)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from eventkv import wire  # noqa: E402
from eventkv.errors import EventKVError, OutOfSpace, StoreDamaged  # noqa: E402
from eventkv.service.app import Settings, create_app  # noqa: E402
from eventkv.testing import tiny_lm  # noqa: E402

TOKEN = "t0k3n-for-the-openapi-tests-0123"


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


@pytest.fixture()
def client(lm, tmp_path):
    with TestClient(create_app(Settings(lm, tmp_path / "store"))) as c:
        yield c


def test_every_error_is_declared_with_the_error_body(lm, tmp_path):
    doc = create_app(Settings(lm, tmp_path / "s", {TOKEN: None})).openapi()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}}
    openai_error = {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIErrorOut"}}}
    for path, ops in doc["paths"].items():
        openai = path.startswith(("/v1/chat/", "/v1/models"))
        for method, op in ops.items():
            declared = {int(s) for s in op["responses"] if s[0] in "45"}
            assert {408, 413} <= declared, (method, path)
            for status in declared:
                assert op["responses"][str(status)]["content"] == (openai_error if openai else error), (
                    method,
                    path,
                    status,
                )
            if path != "/health":
                assert op["security"] == [{"bearer": []}] and 401 in declared, (method, path)
            else:
                assert "security" not in op and 401 not in declared  # the one open route
            if path == "/v1/chat/completions":
                assert {400, 403, 404, 409, 503, 507} <= declared and 422 not in declared  # OpenAI's 400
            elif path.startswith("/v1/") and not openai:
                assert {403, 422} <= declared, (method, path)
            if method == "post" and "{mid}" in path:
                assert {404, 409, 503, 507} <= declared, (method, path)
                assert "Retry-After" in op["responses"]["503"]["headers"]
    events = doc["paths"]["/v1/memories/{mid}/events/{eid}/delete"]["post"]["responses"]
    assert "410" in events
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    create = schemas["CreateMemory"]["properties"]["model"]
    assert {"const": "tiny-llama"} in create["anyOf"]
    no_tokens = create_app(Settings(lm, tmp_path / "t")).openapi()
    assert "securitySchemes" not in no_tokens["components"]
    assert "401" not in no_tokens["paths"]["/v1/memories"]["get"]["responses"]


#: every operation's id, written out in its route as FastAPI generated it, and its router's tag
OPERATIONS = {
    "health_health_get": "health",
    "metrics_metrics_get": "metrics",
    "create_memory_v1_memories_post": "memories",
    "list_memories_v1_memories_get": "memories",
    "get_memory_v1_memories__mid__get": "memories",
    "delete_memory_v1_memories__mid__delete": "memories",
    "add_events_v1_memories__mid__events_post": "events",
    "list_events_v1_memories__mid__events_get": "events",
    "view_ids_v1_memories__mid__view_get": "events",
    "get_event_v1_memories__mid__events__eid__get": "events",
    "event_history_v1_memories__mid__events__eid__history_get": "events",
    "update_event_v1_memories__mid__events__eid__update_post": "events",
    "delete_event_v1_memories__mid__events__eid__delete_post": "events",
    "forget_event_v1_memories__mid__events__eid__forget_post": "events",
    "pin_event_v1_memories__mid__events__eid__pin_post": "events",
    "prefill_v1_memories__mid__prefill_post": "operations",
    "rebase_v1_memories__mid__rebase_post": "operations",
    "carrier_v1_memories__mid__carriers_post": "operations",
    "select_v1_memories__mid__select_post": "queries",
    "search_v1_memories__mid__search_post": "queries",
    "query_v1_memories__mid__query_post": "queries",
    "list_models_v1_models_get": "openai",
    "get_model_v1_models__model__get": "openai",
    "chat_completions_v1_chat_completions_post": "openai",
}


def test_every_operation_keeps_its_id_and_has_its_routers_tag(lm, tmp_path):
    """A client generated from the document names its methods by the operation ids: each is written
    out in its route, so renaming a handler changes none; each operation carries its router's tag."""
    doc = create_app(Settings(lm, tmp_path / "s")).openapi()
    got = {op["operationId"]: op["tags"] for ops in doc["paths"].values() for op in ops.values()}
    assert got == {op: [tag] for op, tag in OPERATIONS.items()}


def test_allow_names_every_method_of_the_path(client):
    for path, allowed in [
        ("/v1/memories", "GET, POST"),
        ("/v1/memories/m", "DELETE, GET"),
        ("/v1/memories/m/events", "GET, POST"),
        ("/v1/memories/m/events/e1/delete", "POST"),
    ]:
        r = client.options(path)
        assert r.status_code == 405 and r.headers["allow"] == allowed, (path, r.headers.get("allow"))
        assert r.json()["code"] == "method_not_allowed" and allowed in r.json()["message"]


def test_state_dependent_refusals_are_404_409_410(client):
    def call(method, path, body=None, status=None, code=None):
        r = client.request(method, path, json=body)
        assert r.status_code == status and r.json()["code"] == code, (method, path, r.status_code, r.text)
        return r

    m = "/v1/memories/st"
    assert client.post("/v1/memories", json={"id": "st"}).status_code == 201
    call("POST", f"{m}/query", {"question": "Where?"}, 409, "conflict")  # an empty memory: nothing to serve
    events = [{"text": "Dana lives in Lisbon.", "id": "dana"}, {"text": "Ravi drinks tea.", "id": "ravi"}]
    assert client.post(f"{m}/events", json={"events": events}).status_code == 201
    call("POST", f"{m}/events", {"events": [{"text": "again", "id": "dana"}]}, 409, "conflict")  # a taken id
    call("POST", f"{m}/events/nope/delete", None, 404, "not_found")
    call("POST", f"{m}/query", {"question": "Where?", "select": ["nope"]}, 404, "not_found")
    call("POST", f"{m}/carriers", {"sources": ["nope"], "subject": "x", "kind": "passive"}, 404, "not_found")
    assert client.post(f"{m}/events/dana/delete").status_code == 200
    call("POST", f"{m}/events/dana/delete", None, 410, "gone")  # already deleted
    call("POST", f"{m}/events/dana/update", {"text": "Dana moved."}, 410, "gone")
    call("POST", f"{m}/events/dana/pin", None, 410, "gone")
    call("POST", f"{m}/carriers", {"sources": ["dana"], "subject": "x", "kind": "passive"}, 410, "gone")
    assert client.post(f"{m}/events/ravi/forget").status_code == 200
    call("POST", f"{m}/events/ravi/forget", None, 410, "gone")  # already forgotten
    call("POST", f"{m}/query", {"question": "Where?", "select": ["ravi"]}, 410, "gone")
    call("POST", f"{m}/events", {"events": [{"text": "reuse", "id": "ravi"}]}, 409, "conflict")  # ids stay taken
    assert client.post(f"{m}/events/dana/pin", json={"pinned": False}).status_code == 200  # unpinning is fine
    r = client.post(
        f"{m}/events", content=b'{"events": [{"text": "\xff"}]}', headers={"content-type": "application/json"}
    )
    assert r.status_code == 422 and r.json()["code"] == "invalid_request"  # not UTF-8: not JSON
    r = client.post("/v1/memories", json={"id": "x", "namespace": "other"})
    assert r.status_code == 403 and r.json()["code"] == "forbidden"  # the body names another namespace
    r = client.post(f"{m}/events", json={"events": [{"text": "x", "budget": 2.0}], "expected_version": 3.0})
    assert r.status_code == 409 and r.json()["code"] == "conflict"  # 2.0 and 3.0 are whole numbers; v3 is stale


def test_the_client_raises_the_exception_of_each_code():
    for code, (status, kind) in wire.ERRORS.items():
        exc = wire.error_for(status, code, "why")
        assert isinstance(exc, wire.ServiceError) and isinstance(exc, kind) and isinstance(exc, EventKVError)
        assert (exc.status, exc.code, exc.message) == (status, code, "why")
    assert isinstance(wire.error_for(409, "damaged", "m"), StoreDamaged)
    assert isinstance(wire.error_for(507, "insufficient_storage", "m"), OutOfSpace)
    assert isinstance(wire.error_for(410, "from-a-newer-server", "m"), wire.Gone)  # by its status
    assert type(wire.error_for(418, "teapot", "m")) is wire.ServiceError


def test_the_client_maps_live_answers(lm, tmp_path):
    from service_fixtures import LiveApp

    from eventkv.client import Client

    with LiveApp(create_app(Settings(lm, tmp_path / "store"))) as live:
        with Client.create(live.url, "c") as mem:
            mem.add({"text": "Dana lives in Lisbon.", "id": "dana"})
            mem.delete("dana")
            with pytest.raises(wire.Gone):
                mem.delete("dana")
            with pytest.raises(wire.NotFound):
                mem.get("nope")
            with pytest.raises(wire.Conflict):
                mem.add("x", expected_version=0)
            with pytest.raises(wire.InvalidRequest):
                mem.query("q", k=0)
            with pytest.raises(wire.Conflict):
                mem.destroy(expected_version=0)  # version 0 is a version too: sent, and stale
            mem.destroy(expected_version=mem.version)


SCHEMATHESIS_CONFIG = """
# A schema-valid request is answered 2xx, or a refusal of the memory's state: 404 (an unknown
# memory or event), 409 (a version conflict, a taken id, an empty memory), 410 (a deleted or
# forgotten event), 503 (the queue is full), 507 (a full disk).
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "401", "403", "404", "409", "410", "503", "507"]

# These also answer 422 to schema-valid requests whose content the model cannot take, which no
# JSON schema can say: an event longer than its position budget, a history past the model's
# context, a served set that fits no row budget or pins over it, both budgets or neither budget
# nor k given, a contract measured on other weights.
[[operations]]
include-name = ["POST /v1/memories", "POST /v1/memories/{mid}/events", "POST /v1/memories/{mid}/events/{eid}/update",
                "POST /v1/memories/{mid}/carriers", "POST /v1/memories/{mid}/select", "POST /v1/memories/{mid}/query"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "404", "409", "410", "422", "503", "507"]

# The chat endpoint answers those refusals with OpenAI's 400 instead of 422 (a conversation past the
# model's context, a last message that is not the user's, an empty or unservable memory selection).
[[operations]]
include-name = ["POST /v1/chat/completions"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "410", "503", "507"]
"""


@pytest.mark.slow
def test_schemathesis_all_checks_pass_against_the_live_server(lm, tmp_path):
    """Every check schemathesis has (status codes, content types, headers, response schemas,
    negative and positive data, Allow, auth, use after delete), its fuzzing and stateful phases,
    a few examples per operation and a fixed seed, so the run is bounded and repeatable."""
    pytest.importorskip("schemathesis")
    from service_fixtures import LiveApp

    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG)
    with LiveApp(create_app(Settings(lm, tmp_path / "store", {TOKEN: None}))) as live:
        cli = os.path.join(os.path.dirname(sys.executable), "schemathesis")
        cmd = [cli, "--config-file", str(config), "run", f"{live.url}/openapi.json", "--checks", "all"]
        cmd += ["--phases", "fuzzing,stateful", "--max-examples", "3", "--seed", "20", "--workers", "1"]
        cmd += ["--header", f"Authorization: Bearer {TOKEN}", "--no-shrink", "--request-timeout", "60"]
        cmd += ["--report-dir", str(tmp_path / "report")]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "passed" in run.stdout
