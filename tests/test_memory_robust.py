"""EventMemory follow-ups from a user trial: one writer per store, damaged stores give
EventKVError (never a raw JSON/sqlite error), ids and tags are checked, a contract of another
model is refused, the database is owner-only like the segments."""

import json
import stat

import pytest

from eventkv.errors import EventKVError, StoreDamaged
from eventkv.memory import EventMemory
from eventkv.memory.store import DATABASE, MANIFEST
from eventkv.testing import tiny_lm


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


def test_one_writer_per_store(lm, tmp_path):
    with EventMemory.create(tmp_path / "m", lm, namespace="a") as mem:
        mem.add("first event")
        with pytest.raises(EventKVError, match="open in another EventMemory"):
            EventMemory.open(tmp_path / "m", lm)
    with EventMemory.open(tmp_path / "m", lm) as again:  # released on close
        assert [r.text for r in again.list()] == ["first event"]


@pytest.mark.parametrize("damage", ["manifest-json", "manifest-key", "database"])
def test_a_damaged_store_is_refused_as_damaged(lm, tmp_path, damage):
    EventMemory.create(tmp_path / "m", lm, namespace="a").close()
    if damage == "manifest-json":
        (tmp_path / "m" / MANIFEST).write_text("{not json")
        match = "damaged: its manifest is not readable JSON"
    elif damage == "manifest-key":
        m = json.loads((tmp_path / "m" / MANIFEST).read_text())
        del m["header_ids"]
        (tmp_path / "m" / MANIFEST).write_text(json.dumps(m))
        match = "lacks header_ids"
    else:
        (tmp_path / "m" / DATABASE).write_bytes(b"this is not a database" * 100)
        match = "damaged: its database does not open"
    with pytest.raises(StoreDamaged, match=match):
        EventMemory.open(tmp_path / "m", lm)


def test_ids_and_tags_are_checked(lm, tmp_path):
    with EventMemory.create(tmp_path / "m", lm, namespace="a") as mem:
        with pytest.raises(EventKVError, match="tags 'abc': give a list of non-empty strings, not one string"):
            mem.add({"text": "x", "tags": "abc"})
        with pytest.raises(EventKVError, match="'~' is reserved for patch ids"):
            mem.add({"text": "x", "id": "dana~1"})
        with pytest.raises(EventKVError, match="'twice': it is given twice in this call"):
            mem.add([{"text": "x", "id": "twice"}, {"text": "y", "id": "twice"}])
        assert mem.list() == []  # nothing of a refused call was written
        assert stat.S_IMODE((tmp_path / "m" / DATABASE).stat().st_mode) == 0o600


def test_a_contract_of_another_model_is_refused_at_create(lm, tmp_path):
    c = tmp_path / "contract.json"
    c.write_text(json.dumps({"model": "qwen2.5-coder-1.5b", "programming": {"d": {}}}))  # no weights digest
    with pytest.raises(EventKVError, match="measured on 'qwen2.5-coder-1.5b'"):
        EventMemory.create(tmp_path / "m", lm, namespace="a", contract=c)
    with pytest.raises(EventKVError, match="does not exist"):
        EventMemory.create(tmp_path / "m2", lm, namespace="a", contract=tmp_path / "missing.json")
