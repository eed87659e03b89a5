"""Search: ``EventMemory.search`` (the served set of ``select``, ranked, with texts and scores),
``POST /v1/memories/{mid}/search`` on a live app (a real uvicorn server on 127.0.0.1 and a free port,
in this process) and ``Client.search``, which answer as the library does on the same events; and
mem0's scopes as a namespace and a memory id (:func:`eventkv.wire.scope`, ``Client.scoped``)."""

from __future__ import annotations

import dataclasses

import pytest

from eventkv.errors import OptionError
from eventkv.memory import EventMemory, Hit, MemoryEvent
from eventkv.testing import tiny_lm
from eventkv.wire import scope

EVENTS = [
    MemoryEvent("Dana lives in Lisbon and works on the grant proposal.", role="user", id="dana"),
    MemoryEvent("Ravi will handle the quarterly report from Oslo.", role="user", id="ravi"),
    MemoryEvent("The team offsite is on Tuesday at 10:30.", role="assistant", tags=("calendar",)),
    "Mei moved the server migration to Friday.",
    "Tomas asked for the demo slides about Lisbon and Dana's grant.",
    "Lisbon is sunny in May, Dana says.",
]
QUERY = "Where does Dana live in Lisbon?"


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


@pytest.fixture()
def mem(lm, tmp_path):
    with EventMemory.create(tmp_path / "lib", lm, namespace="default") as m:
        m.add(EVENTS)
        yield m


def as_dicts(hits: list[Hit]) -> list[dict]:
    return [{**dataclasses.asdict(h), "tags": list(h.tags)} for h in hits]


# ====================================================================== the library verb
def test_search_ranks_the_served_set_of_select(mem):
    ranking = mem.selector.rank(QUERY, [cur for _, cur in mem._table.units()])  # the whole view, best first
    for k in (1, 2, 3, 6, 10):
        hits = mem.search(QUERY, k=k)
        assert len(hits) == min(k, len(EVENTS))
        assert sorted(h.id for h in hits) == sorted(mem.select(QUERY, k=k))  # select's set, in rank order
        assert [h.id for h in hits] == [r.id for r in ranking][:k]
        assert [h.score for h in hits] == [r.score for r in ranking][:k]
        assert [h.rank for h in hits] == list(range(1, len(hits) + 1))
        assert all(a.score >= b.score for a, b in zip(hits, hits[1:]))
    top = mem.search(QUERY, k=1)[0]
    assert top.id in {"dana", "e6"} and top.score > 0  # events naming both Dana and Lisbon
    dana = next(h for h in mem.search(QUERY, k=6) if h.id == "dana")
    assert (dana.text, dana.role, dana.tags, dana.pinned) == (EVENTS[0].text, "user", (), False)
    assert mem.search("quarterly report", k=1)[0].id == "ravi"


def test_search_follows_the_shaping_of_select(mem):
    mem.pin("e3")
    patch = mem.update("ravi", "Ravi moved the quarterly report to Bergen.")
    for shaping in ({}, {"k": 2}, {"k": 1, "neighbours": 1}, {"k": None, "budget_rows": 150}, {"k": 3, "budget": 0.5}):
        hits = mem.search(QUERY, **shaping)
        assert sorted(h.id for h in hits) == sorted(mem.select(QUERY, **shaping)), shaping
        assert [h.rank for h in hits] == sorted(h.rank for h in hits)
        assert all(a.score >= b.score for a, b in zip(hits, hits[1:]))
    hits = {h.id: h for h in mem.search("Bergen report", k=1)}
    assert hits[patch.id].text == "Ravi moved the quarterly report to Bergen." and hits[patch.id].rank == 1
    assert hits["e3"].pinned and hits["e3"].tags == ("calendar",)  # served as a pin, at its own rank
    assert set(hits) == {patch.id, "e3"}


def test_search_refuses_what_select_refuses(mem, lm, tmp_path):
    for bad in ({"k": 0}, {"budget": 2.0}, {"budget": 0.5, "budget_rows": 10}, {"selector": "nope"}):
        with pytest.raises(OptionError):
            mem.search(QUERY, **bad)
    with pytest.raises(OptionError, match="question"):
        mem.search("   ")
    with EventMemory.create(tmp_path / "empty", lm, namespace="default") as empty:
        assert empty.search(QUERY) == []


# ====================================================================== over HTTP
@pytest.fixture(scope="module")
def live(lm, tmp_path_factory):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from service_fixtures import LiveApp

    from eventkv.service.app import Settings, create_app

    with LiveApp(create_app(Settings(lm, tmp_path_factory.mktemp("store")))) as app:
        yield app


def test_the_search_route_answers_as_the_library(live, mem):
    import httpx

    from eventkv.client import Client

    with Client.create(live.url, "search") as client:
        client.add(EVENTS)
        for k in (1, 3, 6):
            r = httpx.post(f"{live.url}/v1/memories/search/search", json={"query": QUERY, "k": k}, timeout=60)
            assert r.status_code == 200
            assert r.json() == as_dicts(mem.search(QUERY, k=k))
            assert [h["id"] for h in r.json()] == [h.id for h in client.search(QUERY, k=k)]
        assert client.search(QUERY, k=2, neighbours=1) == mem.search(QUERY, k=2, neighbours=1)
        assert client.search(QUERY, k=None, budget=0.5) == mem.search(QUERY, k=None, budget=0.5)
        body = httpx.post(f"{live.url}/v1/memories/search/search", json={"query": QUERY}, timeout=60).json()
        assert len(body) == 6 and [h["score"] for h in body] == sorted((h["score"] for h in body), reverse=True)
        assert set(body[0]) == {"id", "text", "score", "rank", "role", "tags", "pinned"}


@pytest.fixture(scope="module")
def few(live):
    """A memory ``bad-searches`` of two events on the live app."""
    from eventkv.client import Client

    with Client.create(live.url, "bad-searches") as client:
        client.add(EVENTS[:2])


@pytest.mark.parametrize(
    ("body", "status", "code", "says"),
    [
        ({"query": "  "}, 422, "invalid_request", "query '  ': string should match pattern '\\S'"),
        ({"query": QUERY, "k": 0}, 422, "invalid_request", "k 0: input should be greater than or equal to 1"),
        ({"query": QUERY, "k": "3"}, 422, "invalid_request", "k '3'"),
        ({"query": QUERY, "limit": 3}, 422, "invalid_request", "limit 3: extra inputs are not permitted"),
        ({"question": QUERY}, 422, "invalid_request", "query: field required"),
        ({"query": QUERY, "selector": "nope"}, 422, "invalid_request", "selector 'nope'"),
        ({"query": QUERY, "budget": 0.5, "budget_rows": 9}, 422, "invalid_option", "not both"),
    ],
)
def test_bad_searches_are_422_with_the_error_body(live, few, body, status, code, says):
    import httpx

    r = httpx.post(f"{live.url}/v1/memories/bad-searches/search", json=body, timeout=60)
    assert (r.status_code, r.json()["code"]) == (status, code), r.text
    assert says in r.json()["message"], r.json()["message"]


def test_searching_an_unknown_memory_is_404(live):
    import httpx

    r = httpx.post(f"{live.url}/v1/memories/nobody/search", json={"query": QUERY}, timeout=60)
    assert r.status_code == 404
    assert r.json() == {
        "code": "not_found",
        "message": "no memory 'nobody' in namespace 'default': create it with POST /v1/memories.",
    }
    r = httpx.post(f"{live.url}/v1/memories/..%2Fx/search", json={"query": QUERY}, timeout=60)
    assert r.status_code == 422 and r.json()["code"] == "invalid_option"


# ====================================================================== mem0's scopes
def test_scopes_map_to_a_namespace_and_a_memory_id():
    assert scope() == ("default", "default")
    assert scope("alice") == ("alice", "default")
    assert scope("alice", "travel") == ("alice", "travel")
    assert scope("alice", "travel", "r7") == ("alice", "travel--r7")
    assert scope(agent_id="travel", run_id="2024-05-01") == ("default", "travel--2024-05-01")
    assert scope(run_id="r1") == ("default", "default--r1")
    with pytest.raises(OptionError, match="user_id 'a/b'"):
        scope("a/b")
    with pytest.raises(OptionError, match="agent_id 'a--b': give an id without '--'"):
        scope("u", "a--b", "c")
    with pytest.raises(OptionError, match="run_id"):
        scope("u", "a" * 40, "r" * 30)


def test_a_scoped_client_creates_its_memory_once(live):
    from eventkv.client import Client

    with Client.scoped(live.url, user_id="alice", agent_id="travel", run_id="r7", instruction="Be brief.") as c:
        assert (c.namespace, c.memory_id) == ("alice", "travel--r7")
        c.add("Alice flies to Oslo on Monday.")
    with Client.scoped(live.url, user_id="alice", agent_id="travel", run_id="r7") as again:
        assert [r.text for r in again.list()] == ["Alice flies to Oslo on Monday."]
        assert again.search("Oslo flight", k=1)[0].text == "Alice flies to Oslo on Monday."
    with Client.scoped(live.url, user_id="bob", agent_id="travel", run_id="r7") as other:
        assert other.list() == []  # another user's namespace
