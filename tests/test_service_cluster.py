"""``eventkv serve --backend ray`` under faults, on a local Ray cluster of 2 CPUs the test starts on
127.0.0.1 (tests/service_fixtures.RayCluster), 2 replicas of the sharpened tiny model (float32, one
thread each): a replica killed during a stream of adds (``ray.kill`` on its actor, and SIGKILL of its
process) loses no acknowledged add, the memory answers from the replica that reopened it, as the single
process answers on the same store; each memory is open on one replica at a time (the replicas' logs
of opens and closes), memories moving between replicas as each replica keeps few open; two memories
answered on two replicas at once. The behaviour tests of tests/test_service.py run against this
backend too."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("ray.serve")

from service_fixtures import RayCluster, Server, save_sharp_model  # noqa: E402

from eventkv.client import Client  # noqa: E402
from eventkv.service.cluster.replica import REPLICA_HEADER  # noqa: E402

QUESTION = "What is the value of event number 3?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_sharp_model(tmp_path_factory.mktemp("sharp"))


@pytest.fixture(scope="module")
def cluster():
    c = RayCluster()
    try:
        yield c
    finally:
        c.shutdown()


def post(srv, path, body, timeout=120):
    return httpx.post(srv.url + path, json=body, timeout=timeout)


def query(srv, mid, **kw):
    body = {"question": QUESTION, "select": "all", "max_new_tokens": 6, "candidates": ["21", "35"], **kw}
    r = post(srv, f"/v1/memories/{mid}/query", body)
    assert r.status_code == 200, r.text
    return r.json(), r.headers.get(REPLICA_HEADER)  # None from the single process


class AddStream:
    """Adds to memory ``mid``, one event a request (every third eager, so segment files are written
    while a replica dies), from a thread until stopped: ``acked`` holds each acknowledged event's id and
    the replica that acknowledged it; a refused add (503 ``unavailable`` while a replica is replaced, a
    connection error) is not acknowledged and the stream goes on."""

    def __init__(self, srv, mid: str) -> None:
        self.srv, self.mid = srv, mid
        self.acked: list[tuple[str, str]] = []
        self.refused: list[int | str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            body = {"events": [{"text": f"Event number {i}: the value is {i * 7}."}], "prefill": i % 3 == 0}
            try:
                r = post(self.srv, f"/v1/memories/{self.mid}/events", body, timeout=60)
            except httpx.TransportError as exc:
                self.refused.append(type(exc).__name__)
                time.sleep(0.1)
                continue
            if r.status_code == 201:
                assert REPLICA_HEADER in r.headers, (r.status_code, r.headers, r.text)
                self.acked.append((r.json()["added"][0]["id"], r.headers[REPLICA_HEADER]))
                i += 1
            else:
                assert r.status_code == 503 and r.json()["code"] == "unavailable", (r.status_code, r.text)
                self.refused.append(r.status_code)
                time.sleep(0.1)

    def wait(self, condition, seconds: float = 240) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            assert self.thread.is_alive() and time.monotonic() < deadline, (len(self.acked), self.refused[-5:])
            time.sleep(0.05)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(120)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_a_killed_replica_loses_no_acknowledged_add(model_dir, tmp_path, cluster, how):
    store = tmp_path / "store"
    srv = Server(model_dir, store, cluster=cluster)
    try:
        Client.create(srv.url, "stream", instruction="Answer from the events.").close()
        stream = AddStream(srv, "stream")
        stream.wait(lambda: len(stream.acked) >= 10)
        holder = stream.acked[-1][1]
        actor, pid = cluster.replicas()[holder]
        if how == "ray.kill":
            cluster.ray.kill(actor, no_restart=True)
        else:
            os.kill(pid, signal.SIGKILL)
        killed_at = len(stream.acked)
        stream.wait(lambda: sum(r != holder for _, r in stream.acked[killed_at:]) >= 10)
        stream.finish()
        assert stream.acked[killed_at - 1][1] == holder
        # until its death every add was acknowledged by the holder; after it, by the replica that reopened it
        after = {r for _, r in stream.acked[killed_at:]} - {holder}
        assert len(after) == 1 and all(r == holder for _, r in stream.acked[:killed_at]), stream.acked
        reopened = after.pop()
        with Client.open(srv.url, "stream") as mem:
            listed = {r.id for r in mem.list()}
        acked = {eid for eid, _ in stream.acked}
        assert acked <= listed, sorted(acked - listed)
        assert len(listed) - len(acked) <= 1  # at most the add that was under way when the replica died
        over_ray, replica = query(srv, "stream")
        assert replica == reopened and reopened in cluster.replicas()
        assert srv.stop() == 0  # the gateway's SIGTERM deletes the application: every store closed
    finally:
        srv.kill()
    single = Server(model_dir, store)  # the single process on the same store
    try:
        alone, _ = query(single, "stream")
    finally:
        single.kill()
    assert over_ray["tokens"] == alone["tokens"] and over_ray["text"] == alone["text"]
    assert over_ray["served_ids"] == alone["served_ids"] and len(over_ray["served_ids"]) == len(listed)
    for a, b in zip(over_ray["candidates"], alone["candidates"]):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)


OPENS = re.compile(r"memory (\S+) (opened|closing) at ([0-9.]+)")


def open_intervals(session_logs: Path) -> dict[str, list[tuple[float, float, str]]]:
    """Memory -> its ``(opened, closing, replica)`` intervals, from every replica's Serve log (a memory
    still open at the end closes at +inf)."""
    found: dict[str, list[tuple[float, float, str]]] = {}
    for log in sorted(session_logs.glob("replica_eventkv_MemoryReplica_*.log")):
        replica = log.stem.split("_")[-1]
        opened: dict[str, float] = {}
        for name, what, t in OPENS.findall(log.read_text(errors="replace")):
            if what == "opened":
                opened[name] = float(t)
            else:
                found.setdefault(name, []).append((opened.pop(name), float(t), replica))
        for name, t in opened.items():
            found.setdefault(name, []).append((t, float("inf"), replica))
    return found


@pytest.mark.slow
def test_each_memory_is_open_on_one_replica_at_a_time(model_dir, tmp_path, cluster):
    """6 memories, 2 replicas that keep 2 open each: 8 clients add to and query them at random, so
    memories close on one replica and open on the other. Every request is answered (a lock refusal is
    retried by the gateway, never seen by a client), every acknowledged add is there, and by the
    replicas' logs no memory was ever open on two replicas at once."""
    import random

    srv = Server(model_dir, tmp_path / "store", "--memories-per-replica", "2", cluster=cluster)
    mids = [f"m{i}" for i in range(6)]
    try:
        for m in mids:
            with Client.create(srv.url, m) as mem:
                mem.add(f"Memory {m} begins.")

        def client(seed: int) -> list[tuple[str, int, str | None]]:
            rng, done = random.Random(seed), []
            for n in range(12):
                m = rng.choice(mids)
                if rng.random() < 0.6:
                    body = {"events": [{"text": f"Client {seed} says {n}.", "id": f"c{seed}-{n}"}]}
                    r = post(srv, f"/v1/memories/{m}/events", body)
                else:
                    r = post(srv, f"/v1/memories/{m}/query", {"question": "Who says what?", "max_new_tokens": 2})
                done.append((m, r.status_code, r.headers.get(REPLICA_HEADER) if r.status_code < 400 else r.text))
                if r.status_code == 201:
                    done.append((m, 0, f"c{seed}-{n}"))
            return done

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = [x for got in pool.map(client, range(8)) for x in got]
        codes = {code for _, code, _ in results}
        assert codes <= {0, 200, 201}, [x for x in results if x[1] not in (0, 200, 201)]
        for m in mids:
            with Client.open(srv.url, m) as mem:
                listed = {r.id for r in mem.list()}
            assert {eid for mm, code, eid in results if mm == m and code == 0} <= listed
        assert srv.stop() == 0
    finally:
        srv.kill()
    found = open_intervals(cluster.serve_logs())  # the cluster's other tests' memories too: only this test's here
    intervals = {name: spans for name, spans in found.items() if name in {f"default/{m}" for m in mids}}
    assert len(intervals) == len(mids)
    moved = 0
    for name, spans in intervals.items():
        spans.sort()
        moved += len({r for _, _, r in spans}) > 1
        for (_, c1, r1), (o2, _, r2) in zip(spans, spans[1:]):
            assert c1 <= o2, f"{name} open on {r1} until {c1} and on {r2} from {o2}"
    assert moved > 0, intervals  # the test moved memories between replicas, or it proved nothing


@pytest.mark.slow
def test_two_memories_on_two_replicas_at_once(model_dir, tmp_path, cluster):
    """Two memories held by the two replicas: queries on both, sent together, are answered by both
    replicas, each as the single process answers it.

    Ray Serve's router sends a memory no replica holds to one holding fewer memories, but it learns
    which replica holds what asynchronously (the replicas report to the controller, which tells the
    router): a memory made right after the first can still land on the first's replica. So new memories
    are made until one lands on the other replica (at most 8, half a second apart)."""
    store = tmp_path / "store"
    srv = Server(model_dir, store, cluster=cluster)

    def make(m: str) -> str:
        r = post(srv, "/v1/memories", {"id": m})
        assert r.status_code == 201
        r = post(srv, f"/v1/memories/{m}/events", {"events": [{"text": f"Event number 3: {m} is 21."}]})
        assert r.status_code == 201, r.text
        return r.headers[REPLICA_HEADER]

    try:
        holders = {"left": make("left")}
        for i in range(8):
            time.sleep(0.5)
            held = make(f"right{i}")
            if held != holders["left"]:
                holders[f"right{i}"] = held
                break
        assert len(set(holders.values())) == 2, holders
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = dict(zip(holders, pool.map(lambda m: query(srv, m, max_new_tokens=24), holders)))
        assert {m: rep for m, (_, rep) in answers.items()} == holders
        assert srv.stop() == 0
    finally:
        srv.kill()
    single = Server(model_dir, store)
    try:
        for m, (got, _) in answers.items():
            alone, _ = query(single, m, max_new_tokens=24)
            assert got["tokens"] == alone["tokens"]
    finally:
        single.kill()


@pytest.mark.slow
def test_chat_and_mcp_through_the_ray_backend(model_dir, tmp_path, cluster):
    """The OpenAI client's chat (a memory attached by the body and by the header, streamed and not,
    ``remember``), the inspector's pages and the MCP server's ``--server`` backend, against the Ray backend:
    the memory's chats and fragments all answered by its replica, streamed = not streamed, the remembered turns
    stored."""
    import anyio
    import openai
    from mcp import ClientSession
    from mcp.client.stdio import stdio_client
    from test_mcp import calls, params

    srv = Server(model_dir, tmp_path / "store", cluster=cluster)
    try:
        with Client.create(srv.url, "chat") as mem:
            mem.add(["Event number 3: the value is 21.", "Event number 4: the value is 28."], prefill=True)
        seen: list[str] = []
        http = httpx.Client(event_hooks={"response": [lambda r: seen.append(r.headers.get(REPLICA_HEADER))]})
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120, http_client=http)
        ask = [{"role": "user", "content": QUESTION}]
        plain = client.chat.completions.create(
            model=str(model_dir), messages=ask, max_tokens=8, extra_body={"memory": {"id": "chat"}}
        )
        by_header = client.chat.completions.create(
            model=str(model_dir), messages=ask, max_tokens=8, extra_headers={"X-EventKV-Memory": "chat"}
        )
        chunks = list(
            client.chat.completions.create(
                model=str(model_dir), messages=ask, max_tokens=8, stream=True, extra_body={"memory": {"id": "chat"}}
            )
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert plain.choices[0].message.content == by_header.choices[0].message.content == streamed
        assert plain.usage.prompt_tokens == by_header.usage.prompt_tokens > 0
        sse = {"model": str(model_dir), "messages": ask, "max_tokens": 8, "stream": True, "memory": {"id": "chat"}}
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=sse, timeout=120) as r:
            raw_stream = b"".join(r.iter_bytes())  # a stream cut short raises here (httpx.RemoteProtocolError)
        assert raw_stream.rstrip().endswith(b"data: [DONE]")
        remembered = client.chat.completions.create(
            model=str(model_dir), messages=ask, max_tokens=8, extra_body={"memory": {"id": "chat", "remember": True}}
        )
        assert len(set(seen)) == 1 and None not in seen, seen  # every chat on the memory's replica
        with Client.open(srv.url, "chat") as mem:
            texts, version = [r.text for r in mem.list()], mem.version
        assert texts[-2] == QUESTION and len(texts) == 4 and remembered.choices[0].message.content is not None
        # the inspector through the gateway: its shell from any replica, the memory's fragments from its replica
        with httpx.Client(base_url=srv.url, timeout=300) as ui:
            assert ui.get("/ui/memory/chat").status_code == 200
            timeline = ui.get("/ui/part/memory/chat/timeline")
            assert timeline.status_code == 200 and "Event number 3: the value is 21." in timeline.text
            asked = ui.post("/ui/part/memory/chat/query", data={"question": QUESTION, "k": "1", "max_new_tokens": "3"})
            assert asked.status_code == 200 and 'id="served-table"' in asked.text
            assert timeline.headers.get(REPLICA_HEADER) == asked.headers.get(REPLICA_HEADER) == seen[0]
        got: dict = {}

        async def session():
            with (tmp_path / "mcp-stderr.txt").open("w") as err, anyio.fail_after(600):
                async with stdio_client(params("--server", srv.url, "--memory", "chat"), errlog=err) as (read, write):
                    async with ClientSession(read, write) as s:
                        await s.initialize()
                        steps = [
                            ("add", "add_memory", {"text": "Event number 5: the value is 35.", "id": "five"}),
                            ("query", "query_memory", {"question": QUESTION, "k": 1, "max_new_tokens": 3}),
                        ]
                        got.update(await calls(s, steps))

        anyio.run(session)
        assert not got["add"].is_error and not got["query"].is_error
        assert (
            got["add"].structured_content["version"] == version + 1
            and len(got["query"].structured_content["served_ids"]) == 1
        )
    finally:
        srv.kill()


@pytest.mark.parametrize(
    "args,says",
    [
        (["--backend", "kubernetes"], "--backend 'kubernetes': use process or ray."),
        (["--replicas", "3"], "--replicas 3: only --backend ray takes it."),
        (["--ray-address", "auto"], "--ray-address 'auto': only --backend ray takes it."),
        (["--memories-per-replica", "4"], "--memories-per-replica 4: only --backend ray takes it."),
        (["--backend", "ray", "--max-open", "4"], "--max-open 4: --backend ray keeps --memories-per-replica open"),
        (["--backend", "ray", "--replicas", "0"], "--replicas 0: run at least 1 replica."),
    ],
)
def test_bad_cluster_options_exit_2_before_anything_starts(monkeypatch, capsys, tmp_path, args, says):
    from cli_fixtures import run_cli

    code, out, err = run_cli(monkeypatch, capsys, "serve", "--model", "/no/model", "--store", str(tmp_path), *args)
    assert code == 2 and says in err and "Traceback" not in out + err, err


@pytest.mark.slow
def test_a_cluster_too_small_for_the_replicas_is_refused(monkeypatch, capsys, tmp_path, cluster):
    """3 replicas of 1 CPU on the 2-CPU cluster: refused at once (Serve would wait for CPUs forever)."""
    from cli_fixtures import run_cli

    code, _, err = run_cli(
        monkeypatch, capsys, "serve", "--model", "/m", "--store", str(tmp_path / "store"), *cluster.args(replicas=3)
    )
    assert code == 2 and "the Ray cluster has 2 CPUs, the replicas need 3" in err, err
    assert not tmp_path.joinpath("store").exists()  # refused before anything was made


@pytest.mark.slow
def test_more_replicas_than_this_machines_cores_are_refused_before_ray_starts(tmp_path):
    """Without --ray-address (in a process of its own: this one is a Ray driver already)."""
    import subprocess

    cores = len(os.sched_getaffinity(0))
    start = "from eventkv.cli import main; import sys; sys.argv[0] = 'eventkv'; main()"
    args = [
        "serve",
        "--model",
        "/m",
        "--store",
        str(tmp_path / "store"),
        "--backend",
        "ray",
        "--replicas",
        str(cores + 1),
    ]
    out = subprocess.run([sys.executable, "-c", start, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"this machine has {cores} CPUs, the replicas need {cores + 1}" in out.stderr
    assert "Traceback" not in out.stderr and "Started a local Ray instance" not in out.stderr
    assert not tmp_path.joinpath("store").exists()


@pytest.mark.parametrize(
    "method,path,headers,body,key",
    [
        ("GET", "/v1/memories/agent-7/events", {}, b"", "default/agent-7"),
        ("POST", "/v1/memories/agent-7/query", {"x-eventkv-namespace": "team"}, b"{}", "team/agent-7"),
        ("POST", "/v1/memories", {}, b'{"id": "new-one"}', "default/new-one"),
        ("POST", "/v1/memories", {}, b"{}", None),  # an id the server will generate: any replica
        ("POST", "/v1/memories", {}, b"{not json", None),
        ("POST", "/v1/chat/completions", {}, b'{"memory": {"id": "m"}}', "default/m"),
        ("POST", "/v1/chat/completions", {"x-eventkv-memory": "h"}, b'{"memory": {"id": "m"}}', "default/m"),
        ("POST", "/v1/chat/completions", {"x-eventkv-memory": "h"}, b"{}", "default/h"),
        ("POST", "/v1/chat/completions", {}, b'{"messages": []}', None),
        ("GET", "/metrics", {"x-eventkv-memory": "m"}, b"", "default/m"),
        ("GET", "/v1/memories", {}, b"", None),
        ("GET", "/health", {}, b"", None),
        ("GET", "/v1/memories/..%2Fx", {}, b"", None),  # not a name: the replica answers 422
        ("GET", "/v1/memories/m", {"x-eventkv-namespace": "../etc"}, b"", None),
        # the inspector's fragments of a memory go to its replica; its page shells and list to any
        ("POST", "/ui/part/memory/agent-7/query", {"x-eventkv-namespace": "team"}, b"question=x", "team/agent-7"),
        ("GET", "/ui/part/memory/agent-7/timeline", {}, b"", "default/agent-7"),
        ("GET", "/ui/part/memories", {}, b"", None),
        ("GET", "/ui/memory/agent-7", {}, b"", None),
    ],
)
def test_the_routing_key_is_the_memory_a_request_names(method, path, headers, body, key):
    from urllib.parse import unquote

    from eventkv.service.cluster.routing import memory_key

    assert memory_key(method, unquote(path), headers, body, raw_path=path) == key


def test_without_ray_the_ray_backend_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    from cli_fixtures import run_cli

    monkeypatch.setitem(sys.modules, "ray", None)  # as if the ray extra were not installed
    code, out, err = run_cli(
        monkeypatch, capsys, "serve", "--model", "/m", "--store", str(tmp_path), "--backend", "ray"
    )
    assert code == 2 and "pip install 'eventkv[ray]'" in err and "Traceback" not in out + err, err


@pytest.mark.slow
def test_a_store_held_elsewhere_is_retried_until_released(model_dir, tmp_path, cluster):
    """A library process holds the memory's store (its writer lock) when an add arrives: the replica's
    open is refused before anything is written, the gateway sends the add again until the library
    closes the store, and the add is then stored once. (The single process answers 503 ``locked`` at
    once: tests/test_service.py.)"""
    from eventkv.memory import EventMemory
    from eventkv.models import load

    store = tmp_path / "store"
    lm = load(str(model_dir), dtype="float32")
    held = EventMemory.create(store / "default" / "held", lm, namespace="default")
    held.add("Event number 1: the value is 7.")
    srv = Server(model_dir, store, cluster=cluster)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            body = {"events": [{"text": "Event number 2: the value is 14.", "id": "two"}]}
            sent = pool.submit(post, srv, "/v1/memories/held/events", body)
            time.sleep(3)
            assert not sent.done()  # refused by the lock and sent again, not answered
            held.close()
            r = sent.result(60)
        assert r.status_code == 201, r.text
        with Client.open(srv.url, "held") as mem:
            assert [e.id for e in mem.list()] == ["e1", "two"]
    finally:
        held.close()
        srv.kill()
