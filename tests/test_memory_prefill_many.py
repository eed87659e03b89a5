"""Several memories' pending events prefilled in one batched forward (eventkv.memory.prefill_many): each memory's
rows equal its own prefill's within ROW_TOL (the matmuls run at another shape), the segments committed as its own
prefill commits them, a memory past its window prefilled alone, and bad input refused."""

from __future__ import annotations

import pytest
import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.windowed import PrefillWindow
from eventkv.memory import EventMemory, MemoryEvent, prefill_many
from eventkv.testing import TINY_FAMILIES, tiny_lm

#: rows of a batched prefill against the unbatched one (float32, tiny models), as tests/test_batch_pairs.py states
ROW_TOL = 1e-5

HISTORIES = [
    ["Dana lives in Lisbon.", "Ravi moved the report to Oslo.", "The offsite is on Tuesday."],
    ["Mei fixed the build.", "Tomas wants the demo slides by Friday at noon, with the budget table."],
    ["Aiko booked Kyoto."],
]


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def lm(request):
    return tiny_lm(request.param)


def _memories(lm, root, tag, rows="native", window=None):
    mems = []
    for i, texts in enumerate(HISTORIES):
        mem = EventMemory.create(root / f"{tag}{i}", lm, namespace="t", instruction="Answer.", rows=rows, window=window)
        if i == 0:  # one memory continues stored rows, the others start from nothing
            mem.add([MemoryEvent("Lena joins at 9:15.", id="first")], prefill=True)
        mem.add([MemoryEvent(t, id=f"e{k}") for k, t in enumerate(texts)])
        mems.append(mem)
    return mems


def test_batched_rows_equal_each_memory_own(lm, tmp_path):
    alone = _memories(lm, tmp_path, "a")
    together = _memories(lm, tmp_path, "b")
    assert all(m.pending for m in together)
    counts = prefill_many(together)
    assert counts == [m.prefill() for m in alone] and all(c > 0 for c in counts)
    for a, b in zip(alone, together):
        assert not b.pending and b.stats().segments == a.stats().segments
        for x, y in zip(a._ekv.keys + a._ekv.values, b._ekv.keys + b._ekv.values):
            torch.testing.assert_close(y, x, atol=ROW_TOL, rtol=0)
        assert b._ekv.positions.tolist() == a._ekv.positions.tolist()
    # reopened: the committed rows are the ones computed
    rows = [k.clone() for k in together[1]._ekv.keys]
    together[1].close()
    again = EventMemory.open(tmp_path / "b1", lm)
    assert all(torch.equal(x, y) for x, y in zip(rows, again._ekv.keys))
    assert prefill_many([again, together[0]]) == [0, 0]  # nothing pending
    for m in [*alone, again, together[0], together[2]]:
        m.close()


def test_quantized_and_windowed_memories_in_one_call(tmp_path):
    lm = tiny_lm("llama")
    window = PrefillWindow(64, 16)
    mems = _memories(lm, tmp_path, "q", rows="int4")
    long = EventMemory.create(tmp_path / "long", lm, namespace="t", window=window)
    long.add([MemoryEvent(f"Note {i}: the courier comes at {i}:00 with parcels.", id=f"n{i}") for i in range(8)])
    ref = EventMemory.create(tmp_path / "ref", lm, namespace="t", window=window)
    ref.add([MemoryEvent(f"Note {i}: the courier comes at {i}:00 with parcels.", id=f"n{i}") for i in range(8)])
    counts = prefill_many([*mems, long])
    assert counts[-1] == ref.prefill()  # past its window: prefilled alone, as its own prefill does
    assert all(torch.equal(x, y) for x, y in zip(long._ekv.keys, ref._ekv.keys))
    assert not any(m.pending for m in mems)
    for m in [*mems, long, ref]:
        m.close()


def test_bad_input(tmp_path):
    lm, other = tiny_lm("llama"), tiny_lm("qwen2")
    a = EventMemory.create(tmp_path / "a", lm, namespace="t")
    b = EventMemory.create(tmp_path / "b", other, namespace="t")
    with pytest.raises(OptionError, match="give each memory once"):
        prefill_many([a, a])
    with pytest.raises(OptionError, match="memories of one model"):
        prefill_many([a, b])
    b.close()
    c = EventMemory.create(tmp_path / "c", lm, namespace="t")
    c.close()
    with pytest.raises(EventKVError, match="closed"):
        prefill_many([a, c])
    assert prefill_many([]) == []
    a.close()


def test_the_memories_commit_side_by_side(tmp_path, monkeypatch):
    """Each memory's segment write waits at a barrier for the others': only commits that run side by side pass it
    (one at a time, the first would wait out the barrier's timeout and break it). A failing commit keeps the
    others' rows and is raised after them."""
    import threading

    from eventkv.errors import OutOfSpace
    from eventkv.memory.store import Store

    lm = tiny_lm("llama")
    mems = _memories(lm, tmp_path, "s")
    barrier = threading.Barrier(len(mems), timeout=60)
    write = Store.write_segment

    def meet_then_write(store, *args, **kwargs):
        barrier.wait()
        return write(store, *args, **kwargs)

    monkeypatch.setattr(Store, "write_segment", meet_then_write)
    assert all(c > 0 for c in prefill_many(mems)) and not any(m.pending for m in mems)
    monkeypatch.setattr(Store, "write_segment", write)
    # the second of three memories runs out of space: the first and third keep their rows, its events stay pending
    more = _memories(lm, tmp_path, "f")

    def full_for_f1(store, *args, **kwargs):
        if store.directory.name == "f1":
            raise OutOfSpace("no space left on the test's device")
        return write(store, *args, **kwargs)

    monkeypatch.setattr(Store, "write_segment", full_for_f1)
    with pytest.raises(OutOfSpace, match="no space left"):
        prefill_many(more)
    assert [bool(m.pending) for m in more] == [False, True, False]
    for m in [*mems, *more]:
        m.close()
