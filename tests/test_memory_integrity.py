"""A memory store's integrity: every event's text, token ids and fields carry a checksum written with
them, the manifest's checksum is in the database, and every read (EventMemory on open and on each
verb, the model-free reader behind the service's GET routes) refuses damaged state with
StoreDamaged naming the memory, the event and the damaged part — for that memory alone (HTTP 409
``damaged``; a healthy memory of the same namespace keeps working, ``GET /v1/memories`` lists the
damaged one as such). Schema-1 stores are upgraded on open. Event ids take their NFC form and refuse
invisible and look-alike characters and ids that look like nothing (a lone combining mark, the braille
blank), in the library, over HTTP and in the client (tests/test_event_ids.py: the rule over all of
Unicode)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import sqlite3
from pathlib import Path
from urllib.parse import quote

import pytest

from eventkv.errors import EventKVError, OptionError, StoreDamaged
from eventkv.memory import EventMemory, MemoryEvent
from eventkv.memory.reader import read_memory
from eventkv.memory.store import DATABASE, MANIFEST, SEGMENTS
from eventkv.testing import tiny_lm

EVENTS = [
    "Dana lives in Lisbon.",
    MemoryEvent("Ravi drinks green tea.", role="user", id="ravi", tags=("drinks",)),
    MemoryEvent("Mei moved the migration to Friday.", budget=60),
]


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


def build(d: Path, lm, namespace: str = "t") -> Path:
    """A store of three prefilled events and one pending patch, closed (its WAL folded in)."""
    with EventMemory.create(d, lm, namespace=namespace) as mem:
        mem.add(EVENTS, prefill=True)
        mem.update("ravi", "Ravi drinks coffee now.")
    assert not (d / f"{DATABASE}-wal").exists()
    return d


def sql(d: Path, statement: str, params=()) -> None:
    conn = sqlite3.connect(d / DATABASE)
    conn.execute(statement, params)
    conn.commit()
    conn.close()


def random_page(d: Path, table: str, seed: int = 20) -> None:
    """4 KiB of seeded random bytes over the first page of ``table`` (a data page of the file)."""
    conn = sqlite3.connect(d / DATABASE)
    page = conn.execute("PRAGMA page_size").fetchone()[0]
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
    conn.close()
    with open(d / DATABASE, "r+b") as f:
        f.seek((root - 1) * page)
        f.write(random.Random(seed).randbytes(4096))


def shift_token(d: Path) -> None:
    conn = sqlite3.connect(d / DATABASE)
    toks = json.loads(conn.execute("SELECT token_ids FROM events WHERE id = 'e1'").fetchone()[0])
    toks[0] += 1
    conn.execute("UPDATE events SET token_ids = ? WHERE id = 'e1'", (json.dumps(toks),))
    conn.commit()
    conn.close()


def truncate_segment(d: Path) -> None:
    seg = sorted((d / SEGMENTS).iterdir())[0]
    seg.write_bytes(seg.read_bytes()[: seg.stat().st_size // 2])


def edit_manifest(d: Path) -> None:
    m = json.loads((d / MANIFEST).read_text())
    m["header_ids"][-1] += 1  # valid JSON, another header: the rows were computed with the old one
    (d / MANIFEST).write_text(json.dumps(m))


#: name -> (damage done to a built store, what the error names)
DAMAGES = {
    "text": (
        lambda d: sql(d, "UPDATE events SET text = replace(text, 'Lisbon', 'Madrid') WHERE id = 'e1'"),
        r"event 'e1' \(seq 1\): its text does not match the checksum",
    ),
    "token-ids": (shift_token, r"event 'e1' \(seq 1\): its token ids do not match"),
    "tags-json": (
        lambda d: sql(d, "UPDATE events SET tags = '[\"drinks\"' WHERE id = 'ravi'"),
        r"event 'ravi' \(seq 2\): its fields \(.*tags.*\) do not match",
    ),
    "role": (
        lambda d: sql(d, "UPDATE events SET role = 'admin' WHERE id = 'ravi'"),
        r"event 'ravi' \(seq 2\): its fields",
    ),
    "position": (
        lambda d: sql(d, "UPDATE events SET position = position + 1 WHERE id = 'ravi'"),
        r"event 'ravi' \(seq 2\) is stored at position \d+, row \d+, but the events before it end at position",
    ),
    "checksum-dropped": (
        lambda d: sql(d, "UPDATE events SET checksum = NULL WHERE id = 'e1'"),
        r"event 'e1' \(seq 1\): its checksum is missing",
    ),
    "text-blob": (
        lambda d: sql(d, "UPDATE events SET text = X'4c6973626f6e' WHERE id = 'e1'"),
        r"event 'e1' \(seq 1\): its text is stored as bytes, not text",
    ),
    "text-not-utf8": (
        lambda d: sql(d, "UPDATE events SET text = CAST(X'ff4c69' AS TEXT) WHERE id = 'e1'"),
        r"its database does not read \(Could not decode to UTF-8",
    ),
    "random-4k": (lambda d: random_page(d, "events"), r"its database does not read \(database disk image is malformed"),
    "version": (lambda d: sql(d, "UPDATE meta SET value = 'x' WHERE key = 'version'"), r"its version counter is 'x'"),
    "segment-truncated": (truncate_segment, r"segment 'segments/000001.safetensors' has \d+ bytes, not the \d+"),
    "manifest-header": (edit_manifest, r"its manifest does not match its checksum \(the header token ids"),
    "manifest-json": (lambda d: (d / MANIFEST).write_text('{"schema": 2,'), r"its manifest is not readable JSON"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damage_is_refused_by_every_reader(lm, tmp_path, damage):
    d = build(tmp_path / "m", lm)
    before = read_memory(d).table.list(include_superseded=True)
    assert [r.text for r in before][0] == "Dana lives in Lisbon."
    do, names = DAMAGES[damage]
    do(d)
    for read in (lambda: read_memory(d), lambda: EventMemory.open(d, lm).close()):
        with pytest.raises(StoreDamaged, match=names) as e:
            read()
        msg = str(e.value)
        assert msg.startswith(f"the memory in {str(d)!r} is damaged: ")
        assert msg.endswith("restore the store directory from a backup, or delete the memory and add its events again.")
    assert isinstance(e.value, EventKVError)


def test_a_damaged_index_page_is_refused_on_open_and_on_write(lm, tmp_path):
    """Random bytes over the ids' index: the event table itself still reads (the reader serves it),
    the writer's open runs SQLite's quick_check and refuses it."""
    d = build(tmp_path / "m", lm)
    random_page(d, "sqlite_autoindex_events_1")
    assert [r.id for r in read_memory(d).table.list()] == ["e1", "e3", "ravi~1"]
    with pytest.raises(StoreDamaged, match=r"SQLite's check of its database fails"):
        EventMemory.open(d, lm)


def test_a_change_behind_an_open_memory_is_caught_before_it_is_used(lm, tmp_path):
    """A commit by another connection (an sqlite3 shell) while the memory is open: the next verb
    reads the events again and refuses the text its rows were not computed from."""
    d = tmp_path / "m"
    with EventMemory.create(d, lm, namespace="t") as mem:
        mem.add(EVENTS, prefill=True)
        assert mem.get("e1").text == "Dana lives in Lisbon."
        sql(d, "UPDATE events SET text = 'Dana lives in Madrid.' WHERE id = 'e1'")
        with pytest.raises(StoreDamaged, match=r"event 'e1' \(seq 1\): its text does not match"):
            mem.get("e1")
        with pytest.raises(StoreDamaged, match="event 'e1'"):
            mem.query("Where does Dana live?", select="all", max_new_tokens=1)
        sql(d, "UPDATE events SET text = 'Dana lives in Lisbon.' WHERE id = 'e1'")  # put back: readable again
        assert mem.get("e1").text == "Dana lives in Lisbon."
        mem.add("Later event.")  # a healthy memory keeps writing
        sql(d, "UPDATE events SET pinned = 1 WHERE id = 'e3'")  # a flag: not covered, but read again
        assert mem.get("e3").pinned


def test_every_write_path_seals_what_it_writes(lm, tmp_path):
    """add, update, delete, pin, carrier, prefill, forget and rebase leave a store every reader
    accepts; forgotten markers keep no checksum (a hash of a short text could be guessed back)."""
    d = tmp_path / "m"
    with EventMemory.create(d, lm, namespace="t") as mem:
        mem.add(EVENTS)
        mem.update("ravi", "Ravi drinks coffee now.", prefill=True)
        mem.delete("e3")
        mem.pin("ravi")
        mem.carrier(["ravi"], "Ravi's drink", kind="passive")
        mem.add(["Zoe joined on Monday.", "Ada left on Friday."], prefill=True)
        mem.forget("e1")
        stats = dataclasses.replace(mem.stats(), bytes_on_disk=0)  # the WAL is there while it is open
    assert dataclasses.replace(read_memory(d).stats, bytes_on_disk=0) == stats
    with EventMemory.open(d, lm) as mem:
        assert dataclasses.replace(mem.stats(), bytes_on_disk=0) == stats
        mem.rebase()
        mem.add("After the rebase.", prefill=True)
        stats = dataclasses.replace(mem.stats(), bytes_on_disk=0)
    assert dataclasses.replace(read_memory(d).stats, bytes_on_disk=0) == stats
    conn = sqlite3.connect(d / DATABASE)
    rows = conn.execute("SELECT id, forgotten, checksum FROM events").fetchall()
    conn.close()
    assert [(i, c) for i, f, c in rows if f] == [("e1", None)]
    assert all(c is not None for _, f, c in rows if not f)


def schema_1(d: Path) -> None:
    """Turn a store into one as eventkv wrote it before checksums (schema 1)."""
    sql(d, "DROP TABLE embeddings")
    sql(d, "ALTER TABLE events DROP COLUMN checksum")
    sql(d, "DELETE FROM meta WHERE key = 'manifest_checksum'")
    m = json.loads((d / MANIFEST).read_text())
    (d / MANIFEST).write_text(json.dumps({**m, "schema": 1}))


def test_a_schema_1_store_is_upgraded_by_the_writer_and_checked_from_then_on(lm, tmp_path):
    d = build(tmp_path / "m", lm)
    want = read_memory(d).table.list(include_superseded=True)
    schema_1(d)
    assert read_memory(d).table.list(include_superseded=True) == want  # readable before the upgrade
    with EventMemory.open(d, lm) as mem:
        assert mem.list(include_superseded=True) == want
    assert json.loads((d / MANIFEST).read_text())["schema"] == 3
    assert read_memory(d).table.list(include_superseded=True) == want
    sql(d, "UPDATE events SET text = replace(text, 'Lisbon', 'Madrid') WHERE id = 'e1'")
    with pytest.raises(StoreDamaged, match="event 'e1'"):
        read_memory(d)
    # a kill between the upgrade's commit and the manifest's rewrite: the next open finishes it
    d2 = build(tmp_path / "m2", lm)
    schema_1(d2)
    with EventMemory.open(d2, lm):
        pass
    m = json.loads((d2 / MANIFEST).read_text())
    (d2 / MANIFEST).write_text(json.dumps({**m, "schema": 1}))
    with EventMemory.open(d2, lm) as mem:
        assert [r.id for r in mem.list()] == ["e1", "e3", "ravi~1"]
    assert json.loads((d2 / MANIFEST).read_text())["schema"] == 3


def test_a_newer_schema_is_refused_as_such_not_as_damage(lm, tmp_path):
    d = build(tmp_path / "m", lm)
    m = json.loads((d / MANIFEST).read_text())
    (d / MANIFEST).write_text(json.dumps({**m, "schema": 4}))
    for read in (lambda: read_memory(d), lambda: EventMemory.open(d, lm)):
        with pytest.raises(EventKVError, match="schema version 4, this eventkv reads 1, 2, 3") as e:
            read()
        assert not isinstance(e.value, StoreDamaged)


# ---------------------------------------------------------------------- event ids
#: id -> what the refusal names (plain text): look-alikes of another id, and ids that look like nothing
LOOK_ALIKES = {
    "fullwidth": ("ｄａｎａ", "U+FF44 FULLWIDTH LATIN SMALL LETTER D, a look-alike of 'd': write 'dana' instead"),
    "zero-width-space": ("dana\u200b", "U+200B ZERO WIDTH SPACE (an invisible format character"),
    "rtl-override": ("da\u202ena", "U+202E RIGHT-TO-LEFT OVERRIDE (an invisible format character"),
    "hangul-filler": ("\u3164dana", "U+3164 HANGUL FILLER (a default-ignorable character"),
    "variation-selector": ("dana\ufe0f", "U+FE0F VARIATION SELECTOR-16 (a default-ignorable character"),
    "no-break-space": ("dana\u00a0b", "U+00A0 NO-BREAK SPACE, a look-alike of ' ': write 'dana b' instead"),
    "control": ("dana\x07", "U+0007 (a control character"),
    "lone-combining-mark": ("\u0301", "U+0301 COMBINING ACUTE ACCENT (a combining mark, which has no character"),
    "braille-blank": ("\u2800", "U+2800 BRAILLE PATTERN BLANK is a braille cell with no dot raised"),
    "spaces-and-marks": ("  \u0301", "U+0020 SPACE, is a space"),
}


def test_nfc_and_nfd_spellings_are_one_event_id(lm, tmp_path):
    nfd, nfc = "jose\u0301", "jos\u00e9"
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        (added,) = mem.add(MemoryEvent("José lives in Porto.", id=nfd))
        assert added.id == nfc
        assert mem.get(nfd).id == nfc and mem.get(nfc).text == "José lives in Porto."
        with pytest.raises(EventKVError, match="duplicate event id 'josé'"):
            mem.add({"text": "Another José.", "id": nfc})
        ans = mem.query("Where does José live?", select=[nfd], max_new_tokens=1)
        assert ans.served_ids == [nfc]
        assert mem.update(nfd, "José moved to Braga.").id == f"{nfc}~1"
    assert read_memory(tmp_path / "m").table.lookup(nfd).id == nfc


@pytest.mark.parametrize("case", list(LOOK_ALIKES))
def test_look_alike_event_ids_are_refused(lm, tmp_path, case):
    eid, names = LOOK_ALIKES[case]
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add(MemoryEvent("Dana lives in Lisbon.", id="dana"))
        with pytest.raises(OptionError, match=re.escape(names)):
            MemoryEvent("Dana again.", id=eid)
        with pytest.raises(OptionError, match=f"^event id {re.escape(repr(eid))}: it .*{re.escape(names)}") as e:
            mem.add([{"text": "Dana again.", "id": eid}])
        assert "event ids are compared in Unicode NFC" in str(e.value)
        with pytest.raises(OptionError, match=re.escape(names)):
            mem.get(eid)  # no event can have it: the lookup names the character too
        assert mem.stats().events == 1 and mem.view_ids() == ["dana"]


#: ids people write -> their stored (NFC) form: marks after their letter, scripts, emoji, digits
WRITTEN_IDS = {
    "jose\u0301": "jos\u00e9",
    "क्ष": "क्ष",
    "東京": "東京",
    "مرحبا": "مرحبا",
    "👍🏽": "👍🏽",
    "1\u20e3": "1\u20e3",
    "42": "42",
    "dana b": "dana b",
}


def test_ids_people_write_are_kept_and_found(lm, tmp_path):
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        added = mem.add([MemoryEvent(f"Event {i}.", id=eid) for i, eid in enumerate(WRITTEN_IDS)])
        assert [a.id for a in added] == list(WRITTEN_IDS.values())
        assert [mem.get(eid).id for eid in WRITTEN_IDS] == list(WRITTEN_IDS.values())


@pytest.mark.parametrize("namespace", [" ", "\u2800", "\u0301", " \u3000"])
def test_a_namespace_that_looks_like_nothing_is_refused(lm, tmp_path, namespace):
    with pytest.raises(OptionError, match="give the memory a namespace with a letter, number, punctuation mark"):
        EventMemory.create(tmp_path / "m", lm, namespace=namespace)
    assert not (tmp_path / "m").exists()
    with EventMemory.create(tmp_path / "ok", lm, namespace=f"a{namespace}") as mem:
        assert mem.namespace == f"a{namespace}"


# ---------------------------------------------------------------------- over HTTP
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from service_fixtures import Server, save_sharp_model  # noqa: E402

from eventkv.client import Client, ServiceError  # noqa: E402

NS = "dmg"
#: damage -> what the 409's message names
HTTP_DAMAGES = {
    "text": "event 'e1' (seq 1): its text does not match",
    "token-ids": "event 'e1' (seq 1): its token ids do not match",
    "tags-json": "event 'ravi' (seq 2): its fields",
    "random-4k": "its database does not read (database disk image is malformed)",
    "segment-truncated": "segment 'segments/000001.safetensors' has",
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server over a store root that holds, in namespace ``dmg``, a healthy memory, one memory per
    damage in :data:`HTTP_DAMAGES` and one with a damaged index page, all built by the library with
    the server's model before it starts (so none is open in its worker)."""
    from eventkv.models import load

    model_dir = save_sharp_model(tmp_path_factory.mktemp("sharp"))
    root = tmp_path_factory.mktemp("store")
    lm = load(str(model_dir), dtype="float32")
    healthy = build(root / NS / "healthy", lm, NS)
    for name in HTTP_DAMAGES:
        shutil.copytree(healthy, root / NS / name)
        DAMAGES[name][0](root / NS / name)
    shutil.copytree(healthy, root / NS / "index")
    random_page(root / NS / "index", "sqlite_autoindex_events_1")
    srv = Server(model_dir, root)
    yield srv, root
    srv.kill()


def call(srv, method, path, namespace=NS, **kw):
    return httpx.request(method, srv.url + path, headers={"X-EventKV-Namespace": namespace}, timeout=60, **kw)


@pytest.mark.parametrize("name", list(HTTP_DAMAGES))
def test_a_damaged_memory_answers_409_on_every_route(served, name):
    srv, root = served
    base = f"/v1/memories/{name}"
    for method, path, body in [
        ("GET", base, None),
        ("GET", f"{base}/events", None),
        ("GET", f"{base}/view", None),
        ("GET", f"{base}/events/ravi", None),
        ("POST", f"{base}/query", {"question": "Where does Dana live?", "max_new_tokens": 1}),
        ("POST", f"{base}/events", {"events": [{"text": "One more."}]}),
        ("POST", f"{base}/events/ravi/pin", {}),
    ]:
        r = call(srv, method, path, json=body)
        assert r.status_code == 409, (method, path, r.text)
        out = r.json()
        assert out["code"] == "damaged" and set(out) == {"code", "message"}
        assert out["message"].startswith(f"the memory in '{NS}/{name}' is damaged: ")  # by id, no server path
        assert str(root) not in r.text and HTTP_DAMAGES[name] in out["message"]
    # the healthy memory of the same namespace keeps working
    assert call(srv, "GET", "/v1/memories/healthy/events").status_code == 200
    r = call(srv, "POST", "/v1/memories/healthy/query", json={"question": "Where does Dana live?", "max_new_tokens": 1})
    assert r.status_code == 200, r.text


def test_the_namespace_listing_reports_damaged_memories_and_lists_the_rest(served):
    srv, _ = served
    r = call(srv, "GET", "/v1/memories")
    assert r.status_code == 200, r.text
    by_id = {m["id"]: m for m in r.json()}
    assert sorted(by_id) == sorted(["healthy", "index", *HTTP_DAMAGES])
    assert by_id["healthy"]["stats"]["events"] == 4 and "damaged" not in by_id["healthy"]
    for name in HTTP_DAMAGES:
        assert set(by_id[name]) == {"id", "namespace", "damaged"} and by_id[name]["namespace"] == NS
        assert by_id[name]["damaged"].startswith(f"the memory in '{NS}/{name}' is damaged: ")
    assert "text does not match" in by_id["text"]["damaged"]
    assert call(srv, "GET", "/metrics").status_code == 200
    # the inspector's list marks the same memories damaged, with the same message, and lists the healthy one
    page = call(srv, "GET", "/ui/part/memories")
    assert page.status_code == 200, page.text
    rows = page.text.split("<tr")[2:]  # past the header row
    damaged = {name for name in HTTP_DAMAGES for row in rows if f">{name}</a>" in row and "damaged</span>" in row}
    assert damaged == set(HTTP_DAMAGES)
    assert any(">healthy</a>" in row and "damaged" not in row for row in rows)
    assert "text does not match" in next(row for row in rows if ">text</a>" in row)


def test_a_damaged_index_answers_409_on_writes_while_its_events_still_read(served):
    srv, _ = served
    assert [e["id"] for e in call(srv, "GET", "/v1/memories/index/events").json()] == ["e1", "e3", "ravi~1"]
    r = call(srv, "POST", "/v1/memories/index/events", json={"events": [{"text": "One more."}]})
    assert r.status_code == 409 and "check of its database fails" in r.json()["message"], r.text
    assert call(srv, "POST", "/v1/memories/healthy/events", json={"events": [{"text": "One more."}]}).status_code == 201


def test_text_changed_under_a_served_memory_is_refused_by_get_and_query(served):
    """The memory is open in the server's worker (rows in RAM) when its text is changed on disk."""
    srv, root = served
    with Client.create(srv.url, "live", namespace="live") as mem:
        mem.add(["Dana lives in Lisbon.", "Ravi drinks tea."], prefill=True)
        assert mem.query("Where does Dana live?", select="all", max_new_tokens=1).served_ids == ["e1", "e2"]
        sql(root / "live" / "live", "UPDATE events SET text = 'Dana lives in Madrid.' WHERE id = 'e1'")
        for call_ in (lambda: mem.get("e1"), lambda: mem.query("Where does Dana live?", max_new_tokens=1)):
            with pytest.raises(ServiceError) as e:
                call_()
            assert e.value.status == 409 and e.value.code == "damaged" and "event 'e1'" in e.value.message


def test_event_ids_over_http_and_in_the_client(served):
    srv, _ = served
    nfd, nfc = "jose\u0301", "jos\u00e9"
    with Client.create(srv.url, "ids", namespace="ids") as mem:
        assert mem.add([{"text": "José lives in Porto.", "id": nfd}])[0].id == nfc
        assert mem.get(nfd).id == nfc and mem.get(nfc).id == nfc
        with pytest.raises(OptionError, match=r"U\+200B ZERO WIDTH SPACE"):
            mem.add([{"text": "x", "id": "dana\u200b"}])  # refused in the client, before sending
        with pytest.raises(OptionError, match=r"U\+2800 BRAILLE PATTERN BLANK"):
            mem.add([{"text": "x", "id": "\u2800"}])
        with pytest.raises(ServiceError) as e:
            mem.get("ｄａｎａ")
        assert e.value.status == 404
    for eid, names in LOOK_ALIKES.values():
        r = call(srv, "POST", "/v1/memories/ids/events", namespace="ids", json={"events": [{"text": "x", "id": eid}]})
        assert r.status_code == 422 and r.json()["code"] == "invalid_option", r.text
        assert "event id" in r.json()["message"] and names.split(" ")[0] in r.json()["message"]
    for eid in ("\u0301", "\u2800"):  # no event can have them: looking them up answers 404
        assert call(srv, "GET", f"/v1/memories/ids/events/{quote(eid)}", namespace="ids").status_code == 404
    r = call(srv, "POST", "/v1/memories/ids/events", namespace="ids", json={"events": [{"text": "y", "id": nfc}]})
    assert r.status_code == 409 and "event id 'josé' is taken" in r.json()["message"], r.text
    ids = [e["id"] for e in call(srv, "GET", "/v1/memories/ids/events", namespace="ids").json()]
    assert ids == [nfc]


def test_a_damaged_memory_is_deleted_as_its_message_says_and_its_id_works_again(served):
    srv, root = served
    d = root / NS / "to-delete"
    shutil.copytree(root / NS / "healthy", d, ignore=shutil.ignore_patterns(".lock"))
    DAMAGES["text"][0](d)
    assert call(srv, "GET", "/v1/memories/to-delete").status_code == 409
    r = call(srv, "POST", "/v1/memories/to-delete/query", json={"question": "Where?", "max_new_tokens": 1})
    assert r.status_code == 409 and "delete the memory" in r.json()["message"]
    r = call(srv, "DELETE", "/v1/memories/to-delete")
    assert r.status_code == 200 and r.json()["version"] == 0, r.text  # no version to trust
    assert not d.exists() and call(srv, "GET", "/v1/memories/to-delete").status_code == 404
    assert call(srv, "POST", "/v1/memories", json={"id": "to-delete"}).status_code == 201
    assert call(srv, "DELETE", "/v1/memories/to-delete").json()["version"] == 0  # a new, empty memory
    assert not d.exists()
