"""Concurrent queries batched on the model worker (:class:`eventkv.service.worker.ModelWorker`): which
queued queries a batch takes (the oldest first; a write is a barrier for its memory; a job on no
memory a barrier for all; a cancelled query never runs), that one client's stream does not hold
another's query back beyond one batch, that a failing query fails alone, and that answers equal
one-at-a-time (greedy tokens equal, logits within 1e-4, float32). The worker runs on a tiny random
Llama (output layer sharpened) over real stores; each test holds the worker with a job it controls
while it queues, so what is queued together is known; then over HTTP against a live server on
127.0.0.1 and a free port."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import Future

import pytest
import torch

from eventkv.errors import EventKVError
from eventkv.memory import EventMemory, MemoryQuery
from eventkv.service.worker import ModelWorker, QueryJob
from eventkv.testing import assert_same_greedy, tiny_lm

TOL = 1e-4
HISTORIES = {
    "a": ["Dana lives in Lisbon and works on the grant proposal.", "Ravi will handle the quarterly report."],
    "b": ["Mei moved the server migration to Friday.", "Tomas asked for the demo slides."],
    "c": ["The team offsite is on Tuesday at 10:30 in Porto."],
}


@pytest.fixture(scope="module")
def lm():
    lm = tiny_lm("llama", max_context=512)
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(30.0)  # clear top-two margins at every greedy step
    return lm


@pytest.fixture()
def dirs(lm, tmp_path):
    out = {}
    for name, texts in HISTORIES.items():
        with EventMemory.create(tmp_path / name, lm, namespace="t") as mem:
            mem.add(texts, prefill=True)
        out[name] = tmp_path / name
    return out


#: a queued query's log and name (by the query's id), for the phases the worker runs on the memory
LOGS: dict[int, tuple[list, str]] = {}


@pytest.fixture(autouse=True)
def phases(monkeypatch):
    """Log each queued query's two phases, ``EventMemory.prepare_query`` and ``finish_query`` (what the worker
    calls), in its :class:`Held`'s log."""
    prepare, finish = EventMemory.prepare_query, EventMemory.finish_query

    def logged(phase, call):
        def run(mem, query, *rest):
            log, name = LOGS.get(id(query), ([], ""))
            log.append((phase, name))
            return call(mem, query, *rest)

        return run

    monkeypatch.setattr(EventMemory, "prepare_query", logged("prepare", prepare))
    monkeypatch.setattr(EventMemory, "finish_query", logged("finish", finish))


class Queued:
    """A queued query's future (cancel, done, ...), whose result is the query's one answer."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def result(self, timeout: float | None = None):
        return self.future.result(timeout).answers[0]

    def __getattr__(self, name: str):
        return getattr(self.future, name)


class Held:
    """A worker (``max_batch`` 4) held by a job until :meth:`release`; ``log`` records each query's
    phases and each write, in the order the worker ran them."""

    def __init__(self, lm, max_batch: int = 4) -> None:
        self.worker = ModelWorker(lm, max_queue=64, max_batch=max_batch)
        self.log: list[tuple[str, str]] = []
        running, self._release = threading.Event(), threading.Event()
        self._blocker = self.worker.submit(lambda: (running.set(), self._release.wait(60)))
        assert running.wait(30)

    def release(self) -> None:
        self._release.set()
        self._blocker.result(60)

    def query(self, d, name: str, question: str = "Where does Dana live?", n: int = 2, **kw) -> Queued:
        """Queue a query on the memory of ``d`` (served set: the view), logged as ``name``."""
        select = kw.pop("select", "view")
        query = MemoryQuery.build(question, plans=[(select, "compact")], max_new_tokens=n, **kw)
        LOGS[id(query)] = (self.log, name)
        return Queued(self.worker.submit_query(QueryJob(d, query)))

    def write(self, d, name: str, text: str):
        def job():
            self.log.append(("write", name))
            return self.worker.memory(d).add([text])

        return self.worker.submit(job, d)

    def batches(self) -> list[list[str]]:
        """The runs of consecutive prepares (one batch each) and the writes, in order."""
        out: list[list[str]] = []
        last = None
        for phase, name in self.log:
            if phase == "prepare" and last == "prepare":
                out[-1].append(name)
            elif phase != "finish":
                out.append([name])
            last = phase
        return out

    def stop(self) -> None:
        self._release.set()
        self.worker.stop(60)


@pytest.fixture()
def held(lm):
    h = Held(lm)
    yield h
    h.stop()


def test_queued_queries_are_answered_in_batches_of_the_oldest_as_alone(held, dirs, lm):
    questions = ["Where does Dana live?", "Who moved the migration?", "When?", "What will Ravi handle?", "Where?"]
    futs = [held.query(dirs["abcab"[i]], f"q{i}", q, n=3 + i % 3, keep_logits=True) for i, q in enumerate(questions)]
    held.release()
    got = [f.result(60) for f in futs]
    assert held.batches() == [["q0", "q1", "q2", "q3"], ["q4"]]
    assert held.worker.batches == Counter({4: 1, 1: 1})
    for i, (q, a) in enumerate(zip(questions, got)):
        d = dirs["abcab"[i]]
        alone = held.worker.submit(
            lambda d=d, q=q, n=3 + i % 3: held.worker.memory(d).query(
                q, select="view", max_new_tokens=n, keep_logits=True
            )
        ).result(60)
        assert a.served_ids == alone.served_ids
        assert_same_greedy(
            a.generation.tokens, a.generation.logits, alone.generation.tokens, alone.generation.logits, TOL
        )


def test_a_write_is_a_barrier_for_its_memory_only(held, dirs):
    first = held.query(dirs["a"], "a1")
    wrote = held.write(dirs["a"], "write a", "Priya joined the team in Perth.")
    after = held.query(dirs["a"], "a2")  # queued after the write to its memory: waits for it, sees it
    other = held.query(dirs["b"], "b1")  # another memory: goes in the first batch
    held.release()
    before, added, seen = first.result(60), wrote.result(60), after.result(60)
    other.result(60)
    assert held.batches() == [["a1", "b1"], ["write a"], ["a2"]]
    assert added[0].id not in before.served_ids and added[0].id in seen.served_ids


def test_a_job_on_no_memory_stops_the_batch(held, dirs):
    futs = [held.query(dirs["a"], "a1")]
    futs.append(held.worker.submit(lambda: held.log.append(("write", "create"))))  # e.g. a memory's creation
    futs.append(held.query(dirs["b"], "b1"))
    held.release()
    for f in futs:
        f.result(60)
    assert held.batches() == [["a1"], ["create"], ["b1"]]


def test_a_cancelled_query_never_runs_and_leaves_its_batch(held, dirs):
    futs = [held.query(dirs["abc"[i]], f"q{i}") for i in range(3)]
    assert futs[1].cancel()
    held.release()
    futs[0].result(60), futs[2].result(60)
    assert held.batches() == [["q0", "q2"]]
    assert held.worker.cancelled == 1 and held.worker.batches == Counter({2: 1})


def test_the_oldest_queries_go_first_whatever_the_client(held, dirs):
    """Client A queues 10 queries, then B one, then A 10 more (batches of 4): B's is in the batch of
    the oldest 12, and no query of A's queued after it is answered before it."""
    futs = [held.query(dirs["a"], f"A{i}") for i in range(10)]
    futs.append(held.query(dirs["b"], "B"))
    futs += [held.query(dirs["a"], f"A{i}") for i in range(10, 20)]
    held.release()
    for f in futs:
        f.result(120)
    batches = held.batches()
    assert batches[:3] == [["A0", "A1", "A2", "A3"], ["A4", "A5", "A6", "A7"], ["A8", "A9", "B", "A10"]]
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4, 1]


def test_a_steady_stream_of_one_client_delays_another_by_one_batch_at_most(held, dirs):
    """Client A keeps 3 queries queued (each answered one is replaced at once, 20 times); B queues one
    while a batch of A's is being answered: B's is in the very next batch."""
    futs, replaced = [], [0]

    def stream(name: str):
        fut = held.query(dirs["a"], name)
        fut.add_done_callback(lambda f: replace())  # runs on the worker thread, as the batch finishes
        futs.append(fut)

    def replace():
        replaced[0] += 1
        if replaced[0] <= 20:
            stream(f"A{replaced[0] + 2}")
        if replaced[0] == 7:  # B's client sends its query now, in the middle of a batch
            held.log.append(("write", "B sent"))
            futs.append(held.query(dirs["b"], "B"))

    for i in range(3):
        stream(f"A{i}")
    held.release()
    deadline = time.monotonic() + 120
    while len(futs) < 24:  # 3 + 20 replacements + B's
        assert time.monotonic() < deadline, f"{len(futs)} queries sent"
        time.sleep(0.05)
    for f in list(futs):
        f.result(120)
    batches = [b for b in held.batches() if b != ["B sent"]]
    sent = held.batches().index(["B sent"])
    after = held.batches()[sent + 1 :]
    assert "B" in after[0], after  # the first batch to start after B's query was queued takes it
    assert sum(len(b) for b in batches) == 24 and all(len(b) <= 4 for b in batches)


def test_a_query_that_fails_fails_alone(held, dirs, lm):
    ok = held.query(dirs["a"], "ok")
    unknown = held.query(dirs["b"], "unknown", select=["no-such-event"])  # fails while it is prepared
    # a candidate past the model's context (512 positions) fails the readout: the batch is read out again, each alone
    too_long = held.query(dirs["c"], "too long", candidates=["x" * 500])
    also_ok = held.query(dirs["c"], "also ok", question="When is the offsite?")
    held.release()
    assert ok.result(60).served_ids and also_ok.result(60).served_ids
    with pytest.raises(EventKVError, match="no-such-event"):
        unknown.result(60)
    with pytest.raises(EventKVError, match="context"):
        too_long.result(60)
    assert held.worker.batches == Counter({4: 1})
    alone = held.worker.submit(
        lambda: held.worker.memory(dirs["a"]).query("Where does Dana live?", select="view", max_new_tokens=2)
    ).result(60)
    assert ok.result().generation.tokens == alone.generation.tokens


def test_max_batch_1_answers_one_query_at_a_time(lm, dirs):
    h = Held(lm, max_batch=1)
    try:
        futs = [h.query(dirs["abc"[i]], f"q{i}") for i in range(3)]
        h.release()
        for f in futs:
            f.result(60)
        assert h.batches() == [["q0"], ["q1"], ["q2"]]
        assert h.worker.batches == Counter({1: 3})
    finally:
        h.stop()


# ---------------------------------------------------------------------- over HTTP, a live server
def test_concurrent_http_queries_are_answered_in_one_batch_as_alone(lm, dirs, tmp_path):
    """Four clients' queries (three memories, questions of several lengths and budgets) queued while the
    worker is held are answered in one batched readout; each answer equals the same request sent
    alone afterwards (tokens, text, served ids); /metrics counts the batch."""
    import shutil

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from service_fixtures import LiveApp

    from eventkv.service.app import Settings, create_app

    store = tmp_path / "store"
    for name, d in dirs.items():
        shutil.copytree(d, store / "default" / name)
    app = create_app(Settings(lm, store, max_batch=4))
    bodies = [
        ("a", {"question": "Where does Dana live?", "max_new_tokens": 3}),
        ("b", {"question": "Who moved the server migration?", "max_new_tokens": 5}),
        ("c", {"question": "When?", "max_new_tokens": 4, "select": "view"}),
        ("a", {"question": "What will Ravi handle?", "max_new_tokens": 2, "k": 1}),
    ]
    with LiveApp(app) as live:
        worker = app.state.worker
        running, release = threading.Event(), threading.Event()
        blocker = worker.submit(lambda: (running.set(), release.wait(60)))
        assert running.wait(30)
        answers: dict[int, object] = {}

        def send(i: int) -> None:
            mid, body = bodies[i]
            answers[i] = httpx.post(f"{live.url}/v1/memories/{mid}/query", json=body, timeout=60)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
        for i, t in enumerate(threads):
            t.start()
            deadline = time.monotonic() + 30
            while worker.depth < i + 1:  # queued in this order
                assert time.monotonic() < deadline
                time.sleep(0.01)
        release.set()
        blocker.result(60)
        for t in threads:
            t.join(60)
        assert worker.batches == Counter({4: 1})
        for i, (mid, body) in enumerate(bodies):
            batched = answers[i]
            alone = httpx.post(f"{live.url}/v1/memories/{mid}/query", json=body, timeout=60)
            assert batched.status_code == alone.status_code == 200
            b, a = batched.json(), alone.json()
            assert (b["tokens"], b["text"], b["served_ids"], b["version"]) == (
                a["tokens"],
                a["text"],
                a["served_ids"],
                a["version"],
            )
            assert len(b["tokens"]) == body["max_new_tokens"] or b["stopped"]
        metrics = httpx.get(f"{live.url}/metrics").text
        assert "eventkv_query_batch_size_count 5.0" in metrics  # the batch of 4, then 4 batches of one
        assert "eventkv_query_batch_size_sum 8.0" in metrics
        assert 'eventkv_query_batch_size_bucket{le="1.0"} 4.0' in metrics


def test_max_batch_is_an_option_of_serve(monkeypatch, capsys, tmp_path):
    from cli_fixtures import run_cli

    code, out, err = run_cli(
        monkeypatch, capsys, "serve", "--model", "/no/model", "--store", str(tmp_path / "s"), "--max-batch", "0"
    )
    assert code == 2 and "--max-batch 0: batch at least 1 query (1: one at a time)." in err
    assert "Traceback" not in out + err


def test_pending_events_of_a_batch_are_prefilled_in_one_forward(held, dirs, lm, monkeypatch):
    """Queries on memories whose events wait for rows: their pending events are prefilled together (one
    prefill_many over the memories with pending events), and the answers are those of one-at-a-time."""
    import eventkv.memory as memory_package

    calls: list[int] = []
    together = memory_package.prefill_many
    monkeypatch.setattr(memory_package, "prefill_many", lambda mems: calls.append(len(mems)) or together(mems))
    for name in "ab":  # added lazily: pending until the next query
        held.worker.submit(lambda name=name: held.worker.memory(dirs[name]).add([f"Priya met {name} in Perth."]))
    futs = [held.query(dirs[name], name, "Who met Priya?", n=3, keep_logits=True) for name in "abc"]
    held.release()
    got = [f.result(60) for f in futs]
    assert calls == [2]  # a and b had pending events; c had none
    for name, a in zip("abc", got):
        mem = held.worker.submit(lambda name=name: held.worker.memory(dirs[name])).result(60)
        assert not mem.pending
        alone = held.worker.submit(
            lambda mem=mem: mem.query("Who met Priya?", select="view", max_new_tokens=3, keep_logits=True)
        ).result(60)
        assert a.served_ids == alone.served_ids
        assert_same_greedy(
            a.generation.tokens, a.generation.logits, alone.generation.tokens, alone.generation.logits, TOL
        )


def test_a_batch_on_more_memories_than_max_open_opens_each_once(lm, dirs):
    """max_open 1, a batch of queries on three memories: each memory is opened once (none closed between its
    query's prepare and finish), and after the batch only one stays open."""
    worker = ModelWorker(lm, max_queue=64, max_open=1, max_batch=4)
    try:
        running, release = threading.Event(), threading.Event()
        blocker = worker.submit(lambda: (running.set(), release.wait(60)))
        assert running.wait(30)
        futs = [
            worker.submit_query(
                QueryJob(dirs[n], MemoryQuery.build("Where?", plans=[("view", "compact")], max_new_tokens=2))
            )
            for n in "abc"
        ]
        release.set()
        blocker.result(60)
        assert all(f.result(60).answers for f in futs)
        worker.submit(lambda: None).result(60)  # the batch has ended (its answers are set before it ends)
        assert worker.batches == Counter({3: 1})
        assert (worker.opened, worker.closed, worker.n_open) == (3, 2, 1)
        from eventkv.service.metrics import Metrics

        text = Metrics(dirs["a"].parent, lambda: worker).text(None).decode()
        assert 'eventkv_memory_events_total{event="opened"} 3.0' in text and "eventkv_memories_open 1.0" in text
        assert 'eventkv_memory_events_total{event="closed"} 2.0' in text
    finally:
        worker.stop(60)
