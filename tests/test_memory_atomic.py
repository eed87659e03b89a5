"""Every write of a memory is all or nothing: acknowledged, or not there.

- A full filesystem at any write step (each segment file write, fsync, rename, each SQL statement
  of the commit) raises :class:`OutOfSpace`; the open memory and the store reopened from disk both
  equal the state before the call, and the same call succeeds once the fault is gone. A fault after
  the commit (removing old files, the purge) leaves the call acknowledged. The steps are injected
  one by one (deterministic, every machine) and met for real on a small tmpfs (where mounting is
  allowed); over HTTP a full disk is 507 ``insufficient_storage`` and the server keeps answering.
- A creation killed (SIGKILL) at any line of its code leaves no stuck id: the id is absent (GET
  404, POST 201) or complete, and DELETE works.
- ``forget`` never reports success while the forgotten text is still in the store's files: a
  reader holding a snapshot makes it raise :class:`PurgePending`, and calling it again (or closing,
  or opening) after the reader is gone leaves no trace.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from safetensors import SafetensorError

import eventkv.memory.store as store_mod
from eventkv.errors import EventKVError, OutOfSpace, PurgePending
from eventkv.files import is_out_of_space
from eventkv.memory import EventMemory
from eventkv.memory.store import DATABASE, SEGMENTS, STAGING, Store
from eventkv.testing import tiny_lm

SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"
#: statements that write (the fault may hit any of them); reads are never failed
WRITE_SQL = ("BEGIN", "INSERT", "UPDATE", "DELETE", "COMMIT", "CREATE", "PRAGMA WAL_CHECKPOINT")
SECRET = "Priya's passport number is XK-4471-SECRET."
NEEDLES = ("XK-4471", "passport")


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


# ====================================================================== injected faults
class DiskFull:
    """Counts the write steps of a call and raises, at step ``at`` (1-based; None: never), the error
    a full filesystem gives at that step."""

    def __init__(self, at: int | None = None) -> None:
        self.at, self.steps = at, []

    def step(self, name: str, error: BaseException) -> None:
        self.steps.append(name)
        if self.at is not None and len(self.steps) == self.at:
            raise error


class FaultyConn:
    """An sqlite3 connection whose write statements may fail as on a full disk."""

    def __init__(self, conn: sqlite3.Connection, disk: DiskFull) -> None:
        self._conn, self._disk = conn, disk

    def _check(self, sql: str) -> None:
        head = " ".join(sql.split()).upper()
        if head.startswith(WRITE_SQL):
            self._disk.step("sql " + head[:40], sqlite3.OperationalError("database or disk is full"))

    def execute(self, sql, *args):
        self._check(sql)
        return self._conn.execute(sql, *args)

    def executemany(self, sql, *args):
        self._check(sql)
        return self._conn.executemany(sql, *args)

    def executescript(self, sql):
        self._check(sql)
        return self._conn.executescript(sql)

    def __getattr__(self, name):
        return getattr(self._conn, name)


def inject(monkeypatch, disk: DiskFull, mem: EventMemory | None = None) -> None:
    """Route every write step of the store through ``disk``: segment files (safetensors' save,
    temp-file creation, fsyncs, renames), the manifest, and every SQL write statement (of ``mem``'s
    connection, and of connections a create opens)."""
    nospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def hook(name, real, error):
        def hooked(*args, **kwargs):
            disk.step(name, error)
            return real(*args, **kwargs)

        return hooked

    monkeypatch.setattr(
        store_mod, "save_file", hook("save_file", store_mod.save_file, SafetensorError(SAFETENSORS_FULL))
    )
    monkeypatch.setattr(store_mod, "fsync_path", hook("fsync", store_mod.fsync_path, nospc))
    monkeypatch.setattr(store_mod, "write_json_atomic", hook("manifest", store_mod.write_json_atomic, nospc))
    monkeypatch.setattr(tempfile, "mkstemp", hook("mkstemp", tempfile.mkstemp, nospc))
    monkeypatch.setattr(os, "replace", hook("replace", os.replace, nospc))
    monkeypatch.setattr(os, "rename", hook("rename", os.rename, nospc))
    connect = Store.connect
    monkeypatch.setattr(Store, "connect", staticmethod(lambda path: FaultyConn(connect(path), disk)))
    if mem is not None:
        mem.store.conn = FaultyConn(mem.store.conn, disk)


def state(mem: EventMemory) -> dict:
    """What a write may change, on disk and in the open memory: version, event rows, segment rows and
    files, the in-memory records and rows (timestamps left out)."""
    c = mem.store.conn
    cols = (
        "seq, id, kind, text, role, tags, budget, token_ids, position, width, row_start, n_rows, segment, "
        "supersedes, deleted, forgotten, pinned"
    )
    rows = None
    if mem._ekv is not None:
        h = hashlib.sha256()
        for t in [*mem._ekv.keys, *mem._ekv.values, mem._ekv.positions]:
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        rows = (mem._ekv.n_rows, h.hexdigest())
    return {
        "version": mem.version,
        "events": [tuple(r) for r in c.execute(f"SELECT {cols} FROM events ORDER BY seq")],
        # not the sha256: safetensors writes its metadata in no fixed order (the rows' hash is compared instead)
        "segments": [tuple(r) for r in c.execute("SELECT id, file, bytes, n_rows, row_start FROM segments")],
        "files": sorted(p.name for p in (mem.directory / SEGMENTS).iterdir()),
        "records": [dataclasses.replace(r, created="") for r in mem._recs],
        "rows": rows,
    }


def build_base(lm, d) -> None:
    with EventMemory.create(d, lm, namespace="t") as mem:
        mem.add([{"text": "Dana lives in Lisbon.", "id": "dana"}, {"text": "Ravi likes tea.", "id": "ravi"}])
        mem.add([{"text": SECRET, "id": "priya"}, "Mei moved the migration to Friday."], prefill=True)
        mem.add("Tomas asked for the demo slides.")  # pending


OPS = {
    "add": lambda m: m.add("Sofia takes the 8:00 train."),
    "add_prefill": lambda m: m.add(
        ["Sofia takes the 8:00 train.", {"text": "Perth closes early.", "id": "p"}], prefill=True
    ),
    "update": lambda m: m.update("ravi", "Ravi likes coffee now."),
    "update_prefill": lambda m: m.update("ravi", "Ravi likes coffee now.", prefill=True),
    "prefill": lambda m: m.prefill(),
    "delete": lambda m: m.delete("dana"),
    "pin": lambda m: m.pin("ravi"),
    "carrier_prefill": lambda m: m.carrier(["dana"], "Dana's city", kind="passive", prefill=True),
    "carrier_auto_pins": lambda m: m.carrier(["dana", "ravi"], "the team"),  # no contract: pins both sources
    "forget": lambda m: m.forget("priya", purge_wait_s=0.05),
    "rebase": lambda m: m.rebase(),
}


def _run(op, mem):
    try:
        return op(mem), None
    except EventKVError as exc:
        return None, exc


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPS))
def test_a_full_disk_at_any_write_step_keeps_nothing(name, lm, tmp_path, monkeypatch):
    op = OPS[name]
    base = tmp_path / "base"
    build_base(lm, base)
    # the call without a fault: its steps, and the state it leaves
    shutil.copytree(base, tmp_path / "dry")
    disk = DiskFull()
    with monkeypatch.context() as mp, EventMemory.open(tmp_path / "dry", lm) as mem:
        inject(mp, disk, mem)
        result, exc = _run(op, mem)
        assert exc is None, exc
        after = state(mem)
    steps = disk.steps
    commit = steps.index("sql COMMIT") + 1  # the main transaction's commit: the write's one atomic step
    assert commit >= 2 and any(s.startswith("sql") for s in steps[: commit - 1])
    # a fault at any step up to the commit: OutOfSpace, and the memory (open and on disk) as before; each
    # failed call leaves the state it started from, so the next step's fault starts from it too
    d = tmp_path / "pre"
    shutil.copytree(base, d)
    with EventMemory.open(d, lm) as mem:
        before = state(mem)
        for k in range(1, commit + 1):
            where = f"{name}: fault at step {k} ({steps[k - 1]})"
            with monkeypatch.context() as mp:
                inject(mp, DiskFull(at=k), mem)
                got, exc = _run(op, mem)
            mem.store.conn = mem.store.conn._conn
            assert isinstance(exc, OutOfSpace), f"{where}: {exc!r}"
            assert "full" in str(exc) and "retry" in str(exc)
            assert state(mem) == before, where  # the open memory did not move
            shutil.copytree(d, tmp_path / f"disk{k}")
            with EventMemory.open(tmp_path / f"disk{k}", lm) as again:
                assert state(again) == before, where  # nor did the disk
        got, exc = _run(op, mem)  # the same call, the fault gone
        assert exc is None and got == result, f"{name}: the retry raised {exc!r}"
        assert state(mem) == after
    with EventMemory.open(d, lm) as mem:
        assert state(mem) == after
    # a fault after the commit (removing replaced files, the purge): the write is acknowledged
    for k in range(commit + 1, len(steps) + 1):
        where = f"{name}: fault at step {k} ({steps[k - 1]})"
        d = tmp_path / f"post{k}"
        shutil.copytree(base, d)
        with EventMemory.open(d, lm) as mem:
            with monkeypatch.context() as mp:
                inject(mp, DiskFull(at=k), mem)
                got, exc = _run(op, mem)
            mem.store.conn = mem.store.conn._conn
            assert exc is None or (name == "forget" and isinstance(exc, PurgePending)), f"{where}: {exc!r}"
            assert exc is not None or got == result, where
            assert state(mem) == after, where
        with EventMemory.open(d, lm) as mem:
            assert state(mem) == after, where


def test_a_lazy_prefill_on_a_full_disk_answers_from_memory_and_keeps_nothing(lm, tmp_path, monkeypatch):
    base = tmp_path / "base"
    build_base(lm, base)
    ask = {"question": "Where does Dana live?", "select": "all", "max_new_tokens": 3, "candidates": ["Lisbon"]}
    shutil.copytree(base, tmp_path / "dry")
    with EventMemory.open(tmp_path / "dry", lm) as mem:
        before = state(mem)
        disk = DiskFull()
        with monkeypatch.context() as mp:
            inject(mp, disk, mem)
            ans = mem.query(**ask)
        mem.store.conn = mem.store.conn._conn
        after = state(mem)
    assert after != before and after["version"] == before["version"]  # rows computed and kept, version unmoved
    commit = disk.steps.index("sql COMMIT") + 1
    d = tmp_path / "pre"
    shutil.copytree(base, d)
    with EventMemory.open(d, lm) as mem:
        for k in range(1, commit + 1):
            with monkeypatch.context() as mp:
                inject(mp, DiskFull(at=k), mem)
                got = mem.query(**ask)
            mem.store.conn = mem.store.conn._conn
            assert got.generation.tokens == ans.generation.tokens and got.served_ids == ans.served_ids
            assert got.candidates[0].logprob == pytest.approx(ans.candidates[0].logprob, abs=1e-5)
            assert state(mem) == before, k  # answered, nothing kept: the events are still pending
        again = mem.query(**ask)  # space again: this query keeps its rows
        assert again.generation.tokens == ans.generation.tokens
        assert state(mem) == after
    with EventMemory.open(d, lm) as mem:
        assert state(mem) == after


@pytest.mark.slow
def test_create_on_a_full_disk_leaves_nothing(lm, tmp_path, monkeypatch):
    disk = DiskFull()
    with monkeypatch.context() as mp:
        inject(mp, disk)
        EventMemory.create(tmp_path / "dry", lm, namespace="t").close()
    steps = disk.steps
    assert "rename" in steps and "manifest" in steps
    for k in range(1, len(steps) + 1):
        parent = tmp_path / f"k{k}"
        parent.mkdir()
        with monkeypatch.context() as mp:
            inject(mp, DiskFull(at=k))
            with pytest.raises(OutOfSpace, match="cannot write the new memory 'm'"):
                EventMemory.create(parent / "m", lm, namespace="t")
        assert list(parent.iterdir()) == [], f"step {k} ({steps[k - 1]}) left {list(parent.iterdir())}"
        with EventMemory.create(parent / "m", lm, namespace="t") as mem:  # space again: the same call works
            assert mem.add("Dana lives in Lisbon.", prefill=True)[0].id == "e1"


@pytest.mark.parametrize(
    "exc, full",
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (sqlite3.OperationalError("database or disk is full"), True),
        (SafetensorError(SAFETENSORS_FULL), True),
        (SafetensorError("Error while serializing: I/O error: Disk quota exceeded (os error 122)"), True),
        (RuntimeError("wrapped"), False),
        (OSError(errno.EACCES, "Permission denied"), False),
        (sqlite3.OperationalError("database is locked"), False),
        (SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)"), False),
    ],
)
def test_out_of_space_is_recognised_from_every_layer(exc, full):
    if isinstance(exc, OSError) and exc.errno == errno.EDQUOT and errno.EDQUOT != 122:
        pytest.skip("EDQUOT is not 122 on this platform")
    assert is_out_of_space(exc) is full
    wrapped = RuntimeError("while writing")
    wrapped.__cause__ = exc
    assert is_out_of_space(wrapped) is full


# ====================================================================== a real full filesystem
@pytest.fixture()
def small_fs(tmp_path):
    """A 30 MiB tmpfs mounted at ``tmp_path/fs`` (skipped where mounting is not allowed)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8); the injected-fault tests cover the same steps")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the injected-fault tests cover the same steps")
    try:
        yield mnt
    finally:
        gc.collect()  # connections of failed calls, held by tracebacks
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(directory) -> None:
    """Fill the filesystem of ``directory`` to the last byte."""
    with open(directory / "filler", "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC


def test_a_real_full_filesystem_keeps_nothing_and_works_again_once_space_is_freed(small_fs, lm):
    d = small_fs / "m"
    build_base(lm, d)
    mem = EventMemory.open(d, lm)
    try:
        before = state(mem)
        fill(small_fs)
        for name in ("add", "add_prefill", "update_prefill", "prefill", "delete", "forget", "rebase"):
            with pytest.raises(OutOfSpace, match="filesystem is full"):
                OPS[name](mem)
            assert state(mem) == before, name
        ans = mem.query("Where does Dana live?", select="all", max_new_tokens=2)  # answered, not kept
        assert ans.served_ids and state(mem) == before
        with pytest.raises(OutOfSpace, match="cannot write the new memory 'm2'"):
            EventMemory.create(small_fs / "m2", lm, namespace="t")
        assert sorted(p.name for p in small_fs.iterdir()) == ["filler", "m"]
        (small_fs / "filler").unlink()
        added = OPS["add_prefill"](mem)
        assert [a.id for a in added] == ["e6", "p"] and mem.version == before["version"] + 1
        assert mem.get("p").prefilled
    finally:
        mem.close()
    with EventMemory.open(d, lm) as mem:
        assert mem.get("p").prefilled and mem.version == before["version"] + 1


# ====================================================================== HTTP: 507, and the server keeps answering
def _client(lm, root):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from eventkv.service.app import Settings, create_app

    return TestClient(create_app(Settings(lm=lm, store=root)))


def test_a_full_disk_over_http_is_507_and_the_server_keeps_answering(lm, tmp_path, monkeypatch):
    with _client(lm, tmp_path / "store") as http:
        assert http.post("/v1/memories", json={"id": "m"}).status_code == 201
        assert (
            http.post("/v1/memories/m/events", json={"events": [{"text": "Dana lives in Lisbon."}]}).status_code == 201
        )
        disk = DiskFull(at=1)  # the first write step of each call fails
        with monkeypatch.context() as mp:
            inject(mp, disk)
            mem = http.app.state.worker.memory(tmp_path / "store" / "default" / "m")
            real = mem.store.conn
            mem.store.conn = FaultyConn(real, disk)
            for path, body in [
                ("/v1/memories/m/events", {"events": [{"text": "Ravi likes tea."}], "prefill": True}),
                ("/v1/memories/m/events", {"events": [{"text": "Ravi likes tea."}]}),
                ("/v1/memories/m/prefill", {}),
                ("/v1/memories/m/events/e1/pin", {}),
                ("/v1/memories", {"id": "n"}),
            ]:
                disk.steps.clear()
                r = http.post(path, json=body)
                assert r.status_code == 507, (path, r.text)
                assert r.json()["code"] == "insufficient_storage" and "full" in r.json()["message"]
                assert str(tmp_path) not in r.text  # no server path in the answer
            disk.steps.clear()
            q = http.post("/v1/memories/m/query", json={"question": "Where does Dana live?", "max_new_tokens": 2})
            assert q.status_code == 200 and q.json()["served_ids"] == ["e1"]  # answered from memory, not kept
            assert http.get("/health").status_code == 200
            m = http.get("/v1/memories/m").json()
            assert m["version"] == 1 and m["stats"]["events"] == 1 and m["stats"]["rows_prefilled"] == 0
            assert http.get("/v1/memories/n").status_code == 404
            mem.store.conn = real
        # space again: the same calls work on the running server
        r = http.post("/v1/memories/m/events", json={"events": [{"text": "Ravi likes tea."}], "prefill": True})
        assert r.status_code == 201 and r.json()["version"] == 2
        assert (
            http.get("/v1/memories/m").json()["stats"]["rows_prefilled"]
            == http.get("/v1/memories/m").json()["stats"]["rows"]
        )
        assert http.post("/v1/memories", json={"id": "n"}).status_code == 201


@pytest.mark.slow
def test_a_real_full_disk_under_a_live_server_is_507(small_fs, tmp_path):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from service_fixtures import Server, save_sharp_model

    model = save_sharp_model(tmp_path / "model")
    srv = Server(model, small_fs / "store")
    try:
        url = srv.url + "/v1/memories"
        assert httpx.post(url, json={"id": "m"}, timeout=60).status_code == 201
        fill(small_fs)
        for body in ({"events": [{"text": "Dana lives in Lisbon."}], "prefill": True}, {"events": [{"text": "x"}]}):
            r = httpx.post(url + "/m/events", json=body, timeout=60)
            assert r.status_code == 507 and r.json()["code"] == "insufficient_storage", r.text
        assert httpx.post(url, json={"id": "n"}, timeout=60).status_code == 507
        assert httpx.get(srv.url + "/health", timeout=60).status_code == 200
        assert httpx.get(url + "/m", timeout=60).json()["version"] == 0
        (small_fs / "filler").unlink()
        r = httpx.post(
            url + "/m/events", json={"events": [{"text": "Dana lives in Lisbon."}], "prefill": True}, timeout=60
        )
        assert r.status_code == 201 and r.json()["version"] == 1
        assert httpx.post(url, json={"id": "n"}, timeout=60).status_code == 201
    finally:
        srv.kill()


# ====================================================================== a creation killed mid-way
@pytest.fixture()
def shm_path(tmp_path):
    """A directory in memory (``/dev/shm``) where there is one, else ``tmp_path``: a SIGKILL loses no
    page cache, so these kills need no disk, and 100+ creations with fsyncs run much faster there."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        d = tempfile.mkdtemp(dir="/dev/shm", prefix="eventkv-test-")
        yield Path(d)
        shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path


KILL_CHILD = r"""
import os, signal, sys
from eventkv.memory import EventMemory
from eventkv.testing import tiny_lm
import eventkv.files, eventkv.memory.sql, eventkv.memory.store

root = sys.argv[1]
lm = tiny_lm("llama")
CODE = {eventkv.memory.store.__file__, eventkv.memory.sql.__file__, eventkv.files.__file__}

def create(ns, kill_at):
    # SIGKILL at the kill_at-th line run in the store's and the file helpers' code (0: never); each
    # creation in a namespace of its own, so every one runs the same lines
    parent = os.path.join(root, ns)
    os.makedirs(parent)
    n = 0
    def line(frame, event, arg):
        nonlocal n
        if event == "line":
            n += 1
            if n == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return line
    sys.settrace(lambda frame, event, arg: line if frame.f_code.co_filename in CODE else None)
    try:
        EventMemory.create(os.path.join(parent, "m"), lm, namespace=ns).close()
    finally:
        sys.settrace(None)
    return n

total = create("whole", 0)
for k in range(1, total + 1):
    pid = os.fork()
    if pid == 0:
        create(f"k{k}", k)
        os._exit(3)  # not reached: the kill comes first
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (k, status)
print(total, flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill at each line forks a child per line")
def test_a_creation_killed_at_any_line_leaves_no_stuck_id(lm, tmp_path, shm_path):
    root = shm_path / "store"
    root.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", KILL_CHILD, str(root)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    assert out.returncode == 0, out.stderr
    total = int(out.stdout.split()[-1])
    assert total > 20
    # a kill leaves a staging directory beside the store, which start-up removes
    staged = [k for k in range(1, total + 1) if any(STAGING in p.name for p in (root / f"k{k}").iterdir())]
    complete = 0
    with _client(lm, root) as http:
        for k in range(1, total + 1):
            ns, where = {"X-EventKV-Namespace": f"k{k}"}, f"killed at line {k} of {total}"
            assert not [p.name for p in (root / f"k{k}").iterdir() if STAGING in p.name], where
            r = http.get("/v1/memories/m", headers=ns)
            assert r.status_code in (200, 404), (where, r.text)
            if r.status_code == 404:  # never created: the id is free
                assert http.post("/v1/memories", json={"id": "m"}, headers=ns).status_code == 201, where
            else:  # killed after the rename: a whole store, that opens
                complete += 1
                assert http.post("/v1/memories", json={"id": "m"}, headers=ns).status_code == 409, where
            add = http.post("/v1/memories/m/events", json={"events": [{"text": "Dana lives in Lisbon."}]}, headers=ns)
            assert add.status_code == 201, (where, add.text)
            assert http.delete("/v1/memories/m", headers=ns).status_code == 200, where
            assert http.get("/v1/memories/m", headers=ns).status_code == 404, where
            assert list((root / f"k{k}").iterdir()) == [], where
    assert 0 < complete < total and staged  # the kills landed on both sides of the rename


def test_what_an_interrupted_create_or_delete_left_is_removed(lm, tmp_path):
    """The partial states a kill leaves, laid out by hand: a store directory without a manifest (as a
    non-atomic create left), a staging directory, a half-removed trash directory, a contract whose
    memory is gone; also a stale staging directory the library's create meets."""
    root = tmp_path / "store"
    ns = root / "default"
    (ns / "stuck" / SEGMENTS).mkdir(parents=True)
    (ns / "stuck" / DATABASE).write_bytes(b"")
    (ns / "stuck" / ".lock").write_bytes(b"")
    (ns / f".half{STAGING}0123abcd" / SEGMENTS).mkdir(parents=True)
    (ns / ".trash-gone-0123abcd" / SEGMENTS).mkdir(parents=True)
    (ns / ".contracts").mkdir()
    (ns / ".contracts" / "gone.json").write_text("{}")
    (ns / "notes").mkdir()
    (ns / "notes" / "todo.txt").write_text("not a store")  # not eventkv's: kept
    with _client(lm, root) as http:
        assert sorted(p.name for p in ns.iterdir()) == [".contracts", "notes"]
        assert list((ns / ".contracts").iterdir()) == []
        assert http.get("/v1/memories/stuck").status_code == 404
        assert http.post("/v1/memories", json={"id": "stuck"}).status_code == 201
        assert http.delete("/v1/memories/stuck").status_code == 200
        assert http.post("/v1/memories", json={"id": "notes"}).status_code == 409  # foreign files: refused
        # left while the server runs (a create killed in another process): POST clears it, no restart
        (ns / "later" / SEGMENTS).mkdir(parents=True)
        (ns / "later" / DATABASE).write_bytes(b"")
        assert http.get("/v1/memories/later").status_code == 404
        assert http.post("/v1/memories", json={"id": "later"}).status_code == 201
    (tmp_path / "lib" / f".m{STAGING}feedbeef" / SEGMENTS).mkdir(parents=True)
    (tmp_path / "lib" / "m" / SEGMENTS).mkdir(parents=True)
    (tmp_path / "lib" / "m" / DATABASE).write_bytes(b"")
    with EventMemory.create(tmp_path / "lib" / "m", lm, namespace="t") as mem:
        assert mem.add("Dana lives in Lisbon.")[0].id == "e1"
    assert sorted(p.name for p in (tmp_path / "lib").iterdir()) == ["m"]


def test_a_live_creation_is_not_a_leftover(lm, tmp_path):
    stage = tmp_path / f".m{STAGING}0123abcd"
    stage.mkdir()
    lock = Store.lock(stage)  # a creator that is still running holds its staging directory's lock
    try:
        assert store_mod.remove_leftovers(tmp_path) == []
        assert stage.is_dir()
    finally:
        lock.close()
    assert store_mod.remove_leftovers(tmp_path) == [stage.name]


# ====================================================================== forget with a concurrent reader
def _findable(d) -> list[str]:
    """The store files in which a forgotten needle's bytes can still be found."""
    found = []
    for p in sorted(d.rglob("*")):
        if p.is_file():
            blob = p.read_bytes()
            found += [f"{p.name}:{n}" for n in NEEDLES if n.encode() in blob or n.encode("utf-16-le") in blob]
    return found


def _memory_with_secret(lm, d, checkpointed: bool) -> EventMemory:
    mem = EventMemory.create(d, lm, namespace="t")
    mem.add(["Dana lives in Lisbon.", {"text": SECRET, "id": "priya"}, "Mei moved the migration to Friday."])
    mem.add("Tomas asked for the demo slides.", prefill=True)
    if checkpointed:  # the text in memory.sqlite itself, as in a store that has been running a while
        mem.store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert _findable(d)
    return mem


def _reader(d) -> sqlite3.Connection:
    """Another connection holding a read snapshot (as a long read transaction or a backup does)."""
    r = sqlite3.connect(d / DATABASE, isolation_level=None)
    r.execute("BEGIN")
    assert r.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 4
    return r


@pytest.mark.parametrize("checkpointed", [False, True], ids=["text-in-wal", "text-in-database"])
def test_forget_does_not_report_success_while_a_reader_keeps_the_text_on_disk(lm, tmp_path, checkpointed):
    d = tmp_path / "m"
    mem = _memory_with_secret(lm, d, checkpointed)
    reader = _reader(d)
    with pytest.raises(PurgePending, match=r"forget on the same id again") as e:
        mem.forget("priya", purge_wait_s=0.05)
    assert "read snapshot" in str(e.value) and "memory.sqlite-wal" in str(e.value)
    assert _findable(d)  # the error is true: the bytes are still there
    assert mem.get("priya").forgotten and mem.get("priya").text is None  # logically forgotten already
    assert "priya" not in mem.view_ids()
    with pytest.raises(PurgePending):  # still blocked: a retry says so again
        mem.forget("priya", purge_wait_s=0.05)
    reader.execute("COMMIT")
    reader.close()
    assert mem.forget("priya", purge_wait_s=0.05) == 0  # completes the purge
    assert _findable(d) == []
    with pytest.raises(EventKVError, match="already forgotten"):
        mem.forget("priya")
    mem.close()
    assert _findable(d) == []


@pytest.mark.parametrize("completes", ["close", "open"])
def test_close_or_the_next_open_completes_a_pending_purge(lm, tmp_path, monkeypatch, completes):
    monkeypatch.setattr(store_mod, "CLOSE_PURGE_S", 0.05)
    d = tmp_path / "m"
    mem = _memory_with_secret(lm, d, checkpointed=True)
    reader = _reader(d)
    with pytest.raises(PurgePending):
        mem.forget("priya", purge_wait_s=0.05)
    if completes == "open":  # closed while the reader still holds it (or killed): the flag is on disk
        mem.close()
        assert _findable(d)
    reader.execute("COMMIT")
    reader.close()
    if completes == "close":
        mem.close()
    else:
        with EventMemory.open(d, lm) as mem:
            assert mem.get("priya").forgotten and not mem.store.purge_pending
    assert _findable(d) == []


def test_rebase_purges_the_text_it_drops(lm, tmp_path):
    d = tmp_path / "m"
    with _memory_with_secret(lm, d, checkpointed=True) as mem:
        mem.delete("priya")
        assert _findable(d)  # a tombstone keeps its text
        mem.rebase()  # drops tombstoned events, and purges their text
        assert "priya" not in {r.id for r in mem.list(include_deleted=True)}
        assert _findable(d) == []


def test_forget_over_http_behind_a_reader_is_503_purge_pending_until_forgotten_again(lm, tmp_path, monkeypatch):
    forget = EventMemory.forget
    monkeypatch.setattr(EventMemory, "forget", lambda self, eid: forget(self, eid, purge_wait_s=0.05))
    with _client(lm, tmp_path / "store") as http:
        assert http.post("/v1/memories", json={"id": "m"}).status_code == 201
        events = [{"text": "Dana lives in Lisbon."}, {"text": SECRET, "id": "priya"}, {"text": "Mei likes tea."}]
        assert http.post("/v1/memories/m/events", json={"events": events}).status_code == 201
        d = tmp_path / "store" / "default" / "m"
        reader = sqlite3.connect(d / DATABASE, isolation_level=None)
        reader.execute("BEGIN")
        assert reader.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 3
        r = http.post("/v1/memories/m/events/priya/forget", json={})
        assert r.status_code == 503 and r.json()["code"] == "purge_pending", r.text
        assert r.headers["retry-after"] == "1" and "forget on the same id again" in r.json()["message"]
        assert str(tmp_path) not in r.text  # no server path in the answer
        assert _findable(d)  # the answer is true: the bytes are still on disk
        assert http.get("/v1/memories/m/events/priya").json()["forgotten"]  # but forgotten already
        assert http.post("/v1/memories/m/events/priya/forget", json={}).status_code == 503  # still blocked
        reader.execute("COMMIT")
        reader.close()
        r = http.post("/v1/memories/m/events/priya/forget", json={})
        assert r.status_code == 200 and r.json()["rows"] == 0, r.text  # the purge completed
        assert _findable(d) == []
        r = http.post("/v1/memories/m/events/priya/forget", json={})
        assert r.status_code == 410 and r.json()["code"] == "gone"
