"""``eventkv serve``: a real uvicorn server on 127.0.0.1 and a free port (tests/service_fixtures),
tiny random model (sharpened, float32). Every endpoint through :class:`eventkv.client.Client`
and raw httpx; answers through HTTP equal the library's on the same store; namespaces; auth; the
409 / 413 / 422 / 503 paths; SIGTERM leaves the store consistent; SIGKILL mid-stream loses no
acknowledged event (and the gate passes on the reopened store); smollm2-135m once (integration)."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from service_fixtures import Server, save_sharp_model  # noqa: E402

from eventkv.client import Client, ServiceError  # noqa: E402
from eventkv.memory import EventMemory, MemoryEvent  # noqa: E402
from eventkv.models import load  # noqa: E402
from eventkv.testing import assert_same_greedy  # noqa: E402

TOKEN = "t0k3n-for-the-tests-0123456789"
EVENTS = [
    MemoryEvent("Dana lives in Lisbon and works on the grant proposal.", role="user", id="dana"),
    MemoryEvent("Ravi will handle the quarterly report from Oslo.", role="user", id="ravi", budget=60),
    MemoryEvent("The team offsite is on Tuesday at 10:30.", role="assistant", tags=("calendar",)),
    "Mei moved the server migration to Friday.",
]
QUESTION = "Where does Dana live?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_sharp_model(tmp_path_factory.mktemp("sharp"))


@pytest.fixture(scope="module")
def shared(tmp_path_factory, cluster):
    """The module's shared server (started by :func:`server`) and its store."""
    held = {"store": tmp_path_factory.mktemp("store"), "server": None}
    yield held
    if held["server"] is not None:
        held["server"].kill()


@pytest.fixture
def server(model_dir, shared, cluster):
    """The module's shared server, started again on its store when a test's own server has taken
    its place on the Ray cluster (one Serve application per cluster)."""
    srv = shared["server"]
    if srv is None or srv.proc.poll() is not None or (cluster is not None and cluster.deployed is not srv):
        if srv is not None:
            srv.kill()
        srv = shared["server"] = Server(model_dir, shared["store"], cluster=cluster)
    return srv


def raw(server, method, path, namespace="default", **kw):
    headers = {"X-EventKV-Namespace": namespace, **kw.pop("headers", {})}
    return httpx.request(method, server.url + path, headers=headers, timeout=60, **kw)


def test_every_endpoint_through_the_client(server):
    with Client.create(server.url, "verbs", instruction="Answer from the events.") as mem:
        added = mem.add(EVENTS)
        assert [a.id for a in added] == ["dana", "ravi", "e3", "e4"] and added[1].width == 60
        assert mem.stats().rows_prefilled == 0  # lazy
        assert mem.prefill() > 0 and mem.stats().rows_prefilled == mem.stats().rows
        patch = mem.update("dana", "Dana moved to Porto.")
        assert [r.id for r in mem.history("dana")] == ["dana", patch.id]
        assert mem.get(patch.id).supersedes == "dana"
        assert patch.id in mem.view_ids() and "dana" not in mem.view_ids()
        assert [r.id for r in mem.list(include_superseded=True)][:2] == ["dana", "ravi"]
        mem.delete("e4")
        assert "e4" not in [r.id for r in mem.list()] and mem.get("e4").deleted
        mem.pin("ravi")
        assert mem.get("ravi").pinned and "ravi" in mem.select("offsite Tuesday", k=1)
        mem.pin("ravi", False)
        carrier = mem.carrier(["e3"], "the offsite time", kind="passive")
        assert carrier.kind == "passive" and carrier.added is not None
        auto = mem.carrier(["e3"], "the offsite time")  # no contract: the sources are pinned instead
        assert auto.kind is None and auto.pinned == ("e3",)
        ans = mem.query(QUESTION, select=[patch.id], candidates=["Porto", "Lisbon"], max_new_tokens=3)
        assert ans.served_ids == [patch.id] and len(ans.candidates) == 2 and len(ans.generation.tokens) <= 3
        assert mem.forget("ravi") >= 0 and mem.get("ravi").forgotten and mem.get("ravi").text is None
        assert mem.rebase() > 0
        v = mem.version
        assert v == mem.stats().version and v > 0
        assert mem.query(QUESTION, select="view", mode="text", max_new_tokens=2).text is not None
        mem.destroy()
    with pytest.raises(ServiceError) as e:
        Client.open(server.url, "verbs")
    assert e.value.status == 404 and e.value.code == "not_found"
    assert raw(server, "GET", "/health").json()["status"] == "ok"
    metrics = raw(server, "GET", "/metrics", headers={"X-EventKV-Memory": "verbs"}).text  # of the memory's replica
    assert 'eventkv_requests_total{method="POST",route="/v1/memories/{mid}/query",status="200"}' in metrics
    assert "eventkv_queue_depth" in metrics and "eventkv_request_seconds_bucket" in metrics
    assert raw(server, "GET", "/docs").status_code == 200
    assert raw(server, "GET", "/openapi.json").json()["info"]["title"] == "eventkv memory service"


def test_namespaces_do_not_see_each_other(server):
    a = Client.create(server.url, "shared-id", namespace="alpha")
    b = Client.create(server.url, "shared-id", namespace="beta")  # the same id in another namespace
    a.add("Alpha's secret is 41.")
    b.add("Beta's note.")
    assert [r.text for r in a.list()] == ["Alpha's secret is 41."]
    assert [r.text for r in b.list()] == ["Beta's note."]
    only_a = Client.create(server.url, "only-alpha", namespace="alpha")
    r = raw(server, "GET", "/v1/memories/only-alpha/events", namespace="beta")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    assert [m["id"] for m in raw(server, "GET", "/v1/memories", namespace="beta").json()] == ["shared-id"]
    for c in (a, b, only_a):
        c.close()


def test_expected_version_conflicts_and_taken_ids(server):
    with Client.create(server.url, "versions") as mem:
        v0 = mem.version
        mem.add("first", expected_version=v0)
        with pytest.raises(ServiceError) as e:
            mem.add("second", expected_version=v0)  # the memory moved on
        assert e.value.status == 409 and "version" in e.value.message
        assert [r.text for r in mem.list()] == ["first"]  # nothing written
        with pytest.raises(ServiceError) as e:
            Client.create(server.url, "versions")
        assert e.value.status == 409


@pytest.mark.parametrize(
    "path",
    [
        "/v1/memories/..%2Fx",
        "/v1/memories/%2E%2E",  # ".." (a client would normalise a literal one away)
        "/v1/memories/%00",
        "/v1/memories/" + "a" * 65,
        "/v1/memories//etc/passwd",
        "/v1/memories/a.b",
        "/v1/memories/%2Fetc%2Fpasswd/events",
    ],
)
def test_bad_memory_ids_are_422(server, path):
    for method in ("GET", "POST"):
        r = raw(server, method, path, json={})
        assert r.status_code == 422, (path, r.status_code, r.text)
        assert r.json()["code"] == "invalid_option" and "memory id" in r.json()["message"]


def test_bad_requests_are_4xx_with_a_json_body(server):
    with Client.create(server.url, "bad") as mem:
        mem.add("one")
        base = "/v1/memories/bad"
        cases = [
            ("POST", f"{base}/events", {"events": []}, 422),
            ("POST", f"{base}/events", {"events": [{"text": ""}]}, 422),
            ("POST", f"{base}/events", {"events": [{"text": "x", "colour": 1}]}, 422),
            ("POST", f"{base}/events", {"events": [{"text": "x", "budget": 0}]}, 422),
            ("POST", f"{base}/events", {"events": [{"text": "x", "id": "e1"}]}, 409),  # a taken id: the state
            ("POST", f"{base}/query", {"question": "q", "mode": "sideways"}, 422),
            ("POST", f"{base}/query", {"question": "q", "max_new_tokens": 0}, 422),
            ("POST", f"{base}/query", {"question": "q", "positions": "packed"}, 422),  # not in the Literal
            ("POST", f"{base}/query", {"question": "q", "mode": "native", "positions": "contiguous"}, 422),
            ("POST", f"{base}/query", {"question": "q", "select": ["nope"]}, 404),  # an unknown id
            ("POST", f"{base}/events/nope/update", {"text": "x"}, 404),
            ("GET", f"{base}/events/nope", None, 404),
            ("GET", "/v1/nothing", None, 404),
            ("POST", "/v1/memories", {"id": "x", "namespace": "other"}, 403),  # not the request's namespace
            ("POST", "/v1/memories", {"id": "x", "model": "some/other-model"}, 422),
            ("DELETE", "/health", None, 405),
        ]
        for method, path, body, status in cases:
            r = raw(server, method, path, json=body)
            assert r.status_code == status, (method, path, body, r.status_code, r.text)
            assert set(r.json()) == {"code", "message"} and r.json()["message"]
        r = raw(server, "POST", f"{base}/events", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422
        assert r.json()["message"].startswith("the body is not valid JSON at character 1: Expecting property name")


@pytest.mark.slow
def test_http_answers_equal_the_library_on_the_same_store(model_dir, tmp_path, cluster):
    srv = Server(model_dir, tmp_path / "store", cluster=cluster)
    try:
        with Client.create(srv.url, "same") as mem:
            mem.add(EVENTS, prefill=True)
            mem.update("ravi", "Ravi handles the report from Bergen.")
            over_http = {
                (mode, str(sel)): mem.query(
                    QUESTION, select=sel, mode=mode, candidates=["Lisbon", "Oslo"], max_new_tokens=6
                )
                for mode, sel in [("compact", "all"), ("compact", None), ("text", "view"), ("isolated", ["dana"])]
            }
        assert srv.stop() == 0  # graceful: the store is closed, the writer lock released
        assert "Application shutdown complete" in srv.log()
    finally:
        srv.kill()
    lm = load(str(model_dir), dtype="float32")
    with EventMemory.open(tmp_path / "store" / "default" / "same", lm) as lib:
        for (mode, sel), got in over_http.items():
            ref = lib.query(
                QUESTION,
                select=None if sel == "None" else eval(sel) if sel.startswith("[") else sel,
                mode=mode,
                candidates=["Lisbon", "Oslo"],
                max_new_tokens=6,
            )
            assert got.generation.tokens == ref.generation.tokens and got.text == ref.text
            assert got.served_ids == ref.served_ids and got.n_rows_served == ref.n_rows_served
            for c, r in zip(got.candidates, ref.candidates):
                assert c.logprob == pytest.approx(r.logprob, abs=1e-5)


@pytest.mark.slow
def test_auth_tokens_and_namespace_grants(model_dir, tmp_path, cluster):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# admin\n{TOKEN}\n{'b' * 32} beta\n")
    srv = Server(model_dir, tmp_path / "store", "--token-file", str(tokens), cluster=cluster)
    try:
        assert raw(srv, "GET", "/health").status_code == 200  # open, as the API description is (test_service_docs)
        for headers in ({}, {"Authorization": "Bearer wrong-token-0000000000"}, {"Authorization": TOKEN}):
            r = raw(srv, "GET", "/v1/memories", headers=headers)
            assert r.status_code == 401 and r.json()["code"] == "unauthorized"
            assert r.headers["www-authenticate"] == "Bearer"
        assert raw(srv, "GET", "/metrics").status_code == 401
        with Client.create(srv.url, "m", token=TOKEN, namespace="alpha") as mem:
            mem.add("x")
        beta = {"Authorization": "Bearer " + "b" * 32}
        assert raw(srv, "GET", "/v1/memories", namespace="alpha", headers=beta).status_code == 403
        assert raw(srv, "POST", "/v1/memories", namespace="beta", headers=beta, json={"id": "m"}).status_code == 201
    finally:
        srv.kill()


@pytest.mark.slow
def test_413_and_503(model_dir, tmp_path, cluster):
    srv = Server(model_dir, tmp_path / "store", "--max-body", "2048", "--max-queue", "1", cluster=cluster)
    try:
        with Client.create(srv.url, "busy") as mem:
            r = raw(srv, "POST", "/v1/memories/busy/events", json={"events": [{"text": "x" * 5000}]})
            assert r.status_code == 413 and r.json()["code"] == "body_too_large"
            chunks = iter([b'{"events": [{"text": "'] + [b"x" * 1000] * 4 + [b'"}]}'])  # no Content-Length
            r = raw(
                srv, "POST", "/v1/memories/busy/events", content=chunks, headers={"content-type": "application/json"}
            )
            assert r.status_code == 413 and r.json()["code"] == "body_too_large"
            mem.add(["Dana lives in Lisbon."] * 3, prefill=True)
            body = {"question": QUESTION, "select": "all", "max_new_tokens": 300}
            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                results = list(pool.map(lambda _: raw(srv, "POST", "/v1/memories/busy/query", json=body), range(12)))
            codes = sorted(r.status_code for r in results)
            assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
            busy = next(r for r in results if r.status_code == 503)
            assert busy.headers["retry-after"] == "1" and busy.json()["code"] == "busy"
            assert raw(srv, "GET", "/v1/memories/busy").status_code == 200  # reads do not queue
    finally:
        srv.kill()


def test_non_loopback_bind_without_a_token_is_refused(monkeypatch, capsys, tmp_path):
    from cli_fixtures import run_cli

    code, out, err = run_cli(
        monkeypatch, capsys, "serve", "--model", "/no/model/needed", "--store", str(tmp_path / "s"), "--host", "0.0.0.0"
    )
    assert code == 2 and "--host '0.0.0.0'" in err and "--token-file" in err and "Traceback" not in out + err
    short = tmp_path / "t"
    short.write_text("short\n")
    code, _, err = run_cli(
        monkeypatch, capsys, "serve", "--model", "x", "--store", str(tmp_path / "s"), "--token-file", str(short)
    )
    assert code == 2 and "16 characters" in err


@pytest.mark.slow
def test_sigkill_mid_stream_loses_no_acknowledged_event(model_dir, tmp_path, cluster):
    """A client streams adds (each acknowledged by a 2xx after the commit; every third eager, so
    segment files are being written); the server is SIGKILLed mid-stream; a new server on the same
    store lists every acknowledged event; the reopened store passes the gate."""
    from test_memory import check_gate

    store = tmp_path / "store"
    srv = Server(model_dir, store, cluster=cluster)
    acked: list[str] = []
    stop = threading.Event()

    def stream():
        with Client(srv.url, "crash") as mem:
            i = 0
            while not stop.is_set():
                try:
                    added = mem.add(f"Event number {i}: the value is {i * 7}.", prefill=i % 3 == 0)
                except Exception:
                    return
                acked.append(added[0].id)
                i += 1

    try:
        Client.create(srv.url, "crash").close()
        t = threading.Thread(target=stream)
        t.start()
        while len(acked) < 12:
            t.join(0.05)
            assert t.is_alive(), srv.log()[-2000:]
        srv.kill()
        stop.set()
        t.join(30)
    finally:
        srv.kill()
    srv2 = Server(model_dir, store, cluster=cluster)
    try:
        with Client.open(srv2.url, "crash") as mem:
            listed = {r.id for r in mem.list()}
            assert set(acked) <= listed, sorted(set(acked) - listed)
            assert mem.stats().events >= len(acked)
        assert srv2.stop() == 0
    finally:
        srv2.kill()
    lm = load(str(model_dir), dtype="float32")
    with EventMemory.open(store / "default" / "crash", lm) as mem:  # verifies every segment's checksum
        assert check_gate(lm, mem, "after SIGKILL") <= 1e-4


@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_through_http_equals_the_library(tmp_path):
    srv = Server("smollm2-135m", tmp_path / "store")
    try:
        with Client.create(srv.url, "real") as mem:
            mem.add(EVENTS, prefill=True)
            got = mem.query(QUESTION, select="all", candidates=["Lisbon", "Oslo"], max_new_tokens=8)
        assert srv.stop() == 0
    finally:
        srv.kill()
    lm = load("smollm2-135m", dtype="float32")
    with EventMemory.open(tmp_path / "store" / "default" / "real", lm) as lib:
        ref = lib.query(QUESTION, select="all", candidates=["Lisbon", "Oslo"], max_new_tokens=8, keep_logits=True)
    assert got.generation.tokens == ref.generation.tokens and got.text == ref.text
    for c, r in zip(got.candidates, ref.candidates):
        assert c.logprob == pytest.approx(r.logprob, abs=1e-4)
    assert_same_greedy(ref.generation.tokens, ref.generation.logits, ref.generation.tokens, ref.generation.logits, 1e-4)


@pytest.mark.slow
def test_sigterm_finishes_queued_work_and_leaves_the_store_consistent(model_dir, tmp_path, cluster):
    """SIGTERM while writes and queries are queued: uvicorn lets the open requests finish, the worker
    runs what was queued, every store is closed; each request got a 2xx (or, once stopping, a 503 or
    a refused connection), never a 500; every acknowledged add is in the reopened store."""
    import time

    srv = Server(model_dir, tmp_path / "store", cluster=cluster)
    try:
        with Client.create(srv.url, "term") as mem:
            mem.add(["Dana lives in Lisbon."] * 3, prefill=True)

        def work(i):
            try:
                if i % 2:
                    r = raw(srv, "POST", "/v1/memories/term/events", json={"events": [{"text": f"late {i}"}]})
                else:
                    body = {"question": QUESTION, "select": "all", "max_new_tokens": 200}
                    r = raw(srv, "POST", "/v1/memories/term/query", json=body)
                return r.status_code, (r.json().get("added") or [{}])[0].get("id") if r.status_code == 201 else None
            except httpx.TransportError:
                return "refused", None

        def jobs_started() -> int:
            for line in raw(srv, "GET", "/metrics", headers={"X-EventKV-Memory": "term"}).text.splitlines():
                if line.startswith('eventkv_jobs_total{outcome="started"}'):
                    return int(float(line.split()[-1]))
            return 0

        before = jobs_started()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(work, i) for i in range(8)]
            # SIGTERM once the worker has begun one of them (a bounded poll, not a fixed sleep: on a
            # loaded machine the requests may take seconds to reach the server)
            deadline = time.monotonic() + 120
            while jobs_started() == before and time.monotonic() < deadline:
                time.sleep(0.02)
            assert jobs_started() > before, "no request reached the worker within 120 s"
            assert srv.stop(timeout=300) == 0
            results = [f.result() for f in futures]
        assert "Application shutdown complete" in srv.log()
    finally:
        srv.kill()
    assert all(code in (200, 201, 503, "refused") for code, _ in results), results
    assert any(code in (200, 201) for code, _ in results), results
    acked = [eid for code, eid in results if code == 201]
    lm = load(str(model_dir), dtype="float32")
    with EventMemory.open(tmp_path / "store" / "default" / "term", lm) as mem:
        assert set(acked) <= {r.id for r in mem.list()}


def test_event_ids_travel_in_urls(server):
    """The client percent-encodes ids in paths: ids with '?', '#', '%' or spaces stay addressable; an id
    with '/' (no URL could name it) and a blank text are refused at add time; numbers are numbers."""
    with Client.create(server.url, "ids") as mem:
        odd = ["q?x", "h#1", "p%2Fq", "with space", ".", ".."]
        mem.add([{"text": f"event {i}.", "id": i} for i in odd])
        for i in odd:
            assert mem.get(i).id == i and mem.history(i)[0].id == i
        assert mem.update("h#1", "patched.").id.startswith("h#1")
        for body in ({"events": [{"text": "x", "id": "a/b"}]}, {"events": [{"text": "   "}]}):
            r = raw(server, "POST", "/v1/memories/ids/events", json=body)
            assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
        r = raw(server, "POST", "/v1/memories/ids/events", json={"events": [{"text": "x"}], "expected_version": "3"})
        assert r.status_code == 422  # strict: a string is not a version
    with pytest.raises(ServiceError) as e:
        _ = Client(server.url, "../x").version
    assert e.value.status == 422 and "memory id" in e.value.message


def test_a_query_does_not_move_the_version(server):
    with Client.create(server.url, "vq") as mem:
        mem.add(["Dana lives in Lisbon.", "Ravi drinks tea."])  # lazy: the query prefills them
        v = mem.version
        mem.query(QUESTION, select="all", max_new_tokens=1)
        assert mem.version == v
        mem.add("Mei moved to Oslo.", expected_version=v)  # read, query, write: no conflict


@pytest.mark.slow
def test_refusals_do_not_leak_server_paths(model_dir, tmp_path, cluster):
    from eventkv.testing import tiny_lm

    other = tmp_path / "other-model"
    lm = tiny_lm("qwen2")
    lm.model.save_pretrained(other)
    lm.tokenizer.save_pretrained(other)
    store = tmp_path / "store"
    srv = Server(model_dir, store, cluster=cluster)
    try:
        with Client.create(srv.url, "mine") as mem:
            mem.add("Dana lives in Lisbon.", prefill=True)
        assert srv.stop() == 0
    finally:
        srv.kill()
    srv = Server(other, store, cluster=cluster)  # another model on the same store
    try:
        assert raw(srv, "GET", "/v1/memories/mine/events").status_code == 200  # reads need no model
        r = raw(srv, "POST", "/v1/memories/mine/query", json={"question": "Where?"})
        assert r.status_code == 422 and r.json()["code"] == "refused"
        assert str(store) not in r.text and "weights" in r.json()["message"]  # the store's paths stay private
    finally:
        srv.kill()


def test_a_taken_port_is_refused_before_the_model_loads(monkeypatch, capsys, tmp_path):
    import socket

    from cli_fixtures import run_cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, out, err = run_cli(
            monkeypatch, capsys, "serve", "--model", "/no/model", "--store", str(tmp_path / "s"), "--port", str(port)
        )
    assert code == 2 and f"--port {port}" in err and "Traceback" not in out + err


@pytest.mark.slow
def test_a_store_held_by_another_process_is_503_locked(model_dir, tmp_path):
    """The library holds a memory's store (its writer lock): the single process answers a write 503
    ``locked`` with Retry-After at once, nothing written (the Ray backend retries it until the store
    is released: tests/test_service_cluster.py)."""
    lm = load(str(model_dir), dtype="float32")
    store = tmp_path / "store"
    with EventMemory.create(store / "default" / "held", lm, namespace="default") as held:
        held.add("Dana lives in Lisbon.")
        srv = Server(model_dir, store)
        try:
            r = raw(srv, "POST", "/v1/memories/held/events", json={"events": [{"text": "Ravi drinks tea."}]})
            assert r.status_code == 503 and r.json()["code"] == "locked" and r.headers["retry-after"] == "1"
            assert str(store) not in r.text  # the server's paths stay private
        finally:
            srv.kill()
        assert [e.text for e in held.list()] == ["Dana lives in Lisbon."]
