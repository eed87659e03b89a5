"""Abandoned requests and slow connections: a queued job whose client disconnected before it ran is
cancelled (it never runs: queries and writes alike), while the worker is held by a job the test
controls with events; a connection whose headers or body do not arrive in time is closed. A real
uvicorn server in this process (tests/service_fixtures.LiveApp) on 127.0.0.1 and a free port."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from service_fixtures import LiveApp  # noqa: E402

from eventkv.service.app import Settings, create_app  # noqa: E402
from eventkv.testing import tiny_lm  # noqa: E402


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds (a bounded deadline, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.01)


def send_and_vanish(port: int, path: str, body: dict) -> None:
    """A whole request on a raw socket, then the client goes away without reading the answer."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head.encode() + data)


@pytest.fixture()
def held(lm, tmp_path):
    """A live server with one memory (two events), and its worker held by a job that waits on
    ``release`` (set it to let the worker go on)."""
    app = create_app(Settings(lm, tmp_path / "store"))
    with LiveApp(app) as live:
        base = f"{live.url}/v1/memories"
        assert httpx.post(base, json={"id": "m"}).status_code == 201
        events = [{"text": "Dana lives in Lisbon."}, {"text": "Ravi drinks tea."}]
        assert httpx.post(f"{base}/m/events", json={"events": events, "prefill": True}).status_code == 201
        worker = app.state.worker
        running, release = threading.Event(), threading.Event()
        blocker = worker.submit(lambda: (running.set(), release.wait(60)))
        assert running.wait(30)
        live.worker, live.release = worker, release
        try:
            yield live
        finally:
            release.set()
            blocker.result(60)


def test_queued_queries_of_vanished_clients_never_run(held):
    worker, started = held.worker, held.worker.started  # the blocker counts as started
    for _ in range(6):
        send_and_vanish(held.port, "/v1/memories/m/query", {"question": "Where?", "max_new_tokens": 50})
    wait_until(lambda: worker.cancelled == 6, "six abandoned queries cancelled")
    assert worker.depth == 0  # they left the queue at once: it is not draining them
    held.release.set()
    r = httpx.post(f"{held.url}/v1/memories/m/query", json={"question": "Where?", "max_new_tokens": 2}, timeout=60)
    assert r.status_code == 200
    assert worker.started == started + 1  # the one query whose client waited; none of the six
    metrics = httpx.get(f"{held.url}/metrics").text
    assert 'eventkv_jobs_total{outcome="cancelled"} 6.0' in metrics


def test_queued_writes_of_vanished_clients_are_not_applied(held):
    for i in range(3):
        send_and_vanish(held.port, "/v1/memories/m/events", {"events": [{"text": f"never acknowledged {i}"}]})
    wait_until(lambda: held.worker.cancelled == 3, "three abandoned adds cancelled")
    held.release.set()
    texts = [e["text"] for e in httpx.get(f"{held.url}/v1/memories/m/events").json()]
    assert texts == ["Dana lives in Lisbon.", "Ravi drinks tea."]
    assert httpx.get(f"{held.url}/v1/memories/m").json()["version"] == 1


def test_a_client_that_waits_is_served_while_others_vanish(held):
    with httpx.Client(base_url=held.url, timeout=60) as c:
        result = {}
        waiting = threading.Thread(
            target=lambda: result.update(r=c.post("/v1/memories/m/select", json={"question": "tea", "k": 1}))
        )
        waiting.start()
        wait_until(lambda: held.worker.depth == 1, "the waiting client's job queued")
        for _ in range(2):
            send_and_vanish(held.port, "/v1/memories/m/select", {"question": "tea"})
        wait_until(lambda: held.worker.cancelled == 2, "two abandoned selects cancelled")
        held.release.set()
        waiting.join(60)
    assert result["r"].status_code == 200 and result["r"].json() == ["e2"]


def closed_by_server(s: socket.socket, timeout: float = 30.0) -> bytes:
    """Everything the server sent until it closed the connection (raises when it stays open)."""
    s.settimeout(timeout)
    got = b""
    while chunk := s.recv(4096):
        got += chunk
    return got


def read_answer(s: socket.socket) -> bytes:
    """One whole answer (headers and a Content-Length body) off a keep-alive connection."""
    s.settimeout(30)
    got = b""
    while b"\r\n\r\n" not in got:
        got += s.recv(4096)
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
    while len(body) < length:
        body += s.recv(4096)
    return head + b"\r\n\r\n" + body


@pytest.fixture()
def strict(lm, tmp_path):
    from eventkv.service.server import Connections

    app = create_app(Settings(lm, tmp_path / "store", body_timeout=0.5))
    with LiveApp(app, **Connections(header_timeout=0.5, keep_alive=0.5).uvicorn_options()) as live:
        yield live


def test_slow_headers_are_cut_off(strict):
    with socket.create_connection(("127.0.0.1", strict.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        assert closed_by_server(s) == b""
    with socket.create_connection(("127.0.0.1", strict.port)) as s:  # a connection that sends nothing
        assert closed_by_server(s) == b""


def test_slow_headers_after_a_first_request_are_cut_off(strict):
    with socket.create_connection(("127.0.0.1", strict.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_answer(s).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\n")  # keep-alive, then a second request that trickles
        assert closed_by_server(s) == b""


def test_a_slow_body_gets_408_and_the_connection_closes(strict):
    with socket.create_connection(("127.0.0.1", strict.port)) as s:
        s.sendall(b"POST /v1/memories HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        s.sendall(b"Content-Length: 100\r\n\r\n{")  # 1 of 100 bytes, then nothing
        answer = closed_by_server(s)
    assert answer.startswith(b"HTTP/1.1 408") and b'"code":"timeout"' in answer


def test_timeouts_are_options_of_serve(monkeypatch, capsys, tmp_path):
    from cli_fixtures import run_cli

    for flag in ("--header-timeout", "--body-timeout", "--keep-alive"):
        code, out, err = run_cli(
            monkeypatch, capsys, "serve", "--model", "/no/model", "--store", str(tmp_path / "s"), flag, "0"
        )
        assert code == 2 and f"{flag} 0.0: give a number of seconds > 0." in err and "Traceback" not in out + err
    code, _, err = run_cli(
        monkeypatch, capsys, "serve", "--model", "x", "--store", str(tmp_path), "--limit-concurrency", "0"
    )
    assert code == 2 and "--limit-concurrency 0: allow at least 1 connection." in err
