"""EventKV.save / load: layers that share memory or are non-contiguous round-trip bit-exact, and a
save that fails at any step leaves the store directory exactly as it was."""

import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

import eventkv.kv.rows as rows_module
from eventkv.errors import EventKVError
from eventkv.kv.log import TokenizedLog
from eventkv.kv.rows import EVENTKV_MANIFEST, EVENTKV_TENSORS, EventKV

HEADS, DIM = 2, 4


def _log() -> TokenizedLog:
    return TokenizedLog.from_ids([1, 2], [("a", [5, 6, 7], None), ("b", [8, 9], None)])


def _ekv(keys, values, seed_meta: int = 0) -> EventKV:
    log = _log()
    return EventKV(log, keys, values, torch.tensor(log.position_ids), "digest-test", {"seed": seed_meta})


def _rows(n_layers: int = 3, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rows = len(_log().input_ids)
    return [torch.randn(1, HEADS, rows, DIM, generator=g).to(dtype) for _ in range(n_layers)]


def _assert_same(a: EventKV, b: EventKV):
    assert b.n_layers == a.n_layers
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
        assert y.dtype == x.dtype and y.shape == x.shape
        assert torch.equal(y.contiguous().view(torch.uint8), x.contiguous().view(torch.uint8))  # bit-exact
    assert torch.equal(b.positions, a.positions)
    assert b.log.input_ids == a.log.input_ids and b.meta == a.meta and b.weights_digest == a.weights_digest


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _layouts():
    """(name, keys, values): layers sharing one tensor, keys/values views of one storage,
    non-contiguous views, and views at an offset into a larger storage."""
    rows = len(_log().input_ids)
    k = _rows(1, seed=1)[0]
    yield "same tensor in every layer", [k, k, k], [k, k, k]
    kv = torch.randn(2, 3, 1, HEADS, rows, DIM, generator=torch.Generator().manual_seed(2))
    yield "keys and values views of one storage", list(kv[0]), list(kv[1])
    t = torch.randn(3, 1, rows, HEADS, DIM, generator=torch.Generator().manual_seed(3))
    yield "non-contiguous (transposed) views", [x.transpose(1, 2) for x in t], [x.transpose(1, 2) for x in t.flip(0)]
    big = torch.randn(1, HEADS, rows + 5, DIM, generator=torch.Generator().manual_seed(4))
    yield "overlapping row slices of one tensor", [big[:, :, i : i + rows] for i in range(3)], [big[:, :, :rows]] * 3
    bf = _rows(2, seed=5, dtype=torch.bfloat16)
    yield "bfloat16, keys aliasing values", bf, [bf[1], bf[0]]


@pytest.mark.parametrize("name,keys,values", list(_layouts()), ids=[x[0] for x in _layouts()])
def test_save_load_round_trip_with_shared_and_non_contiguous_layers(tmp_path, name, keys, values):
    ekv = _ekv(keys, values)
    before = [t.clone() for t in (*keys, *values)]
    d = ekv.save(tmp_path / "kv")
    assert sorted(p.name for p in d.iterdir()) == sorted([EVENTKV_MANIFEST, EVENTKV_TENSORS])  # no temporary file left
    _assert_same(ekv, EventKV.load(d))
    for x, y in zip(before, (*keys, *values)):  # saving never writes into the caller's tensors
        assert torch.equal(x, y)


def test_save_overwrites_a_previous_eventkv(tmp_path):
    d = tmp_path / "kv"
    _ekv(_rows(seed=1), _rows(seed=2)).save(d)
    new = _ekv(_rows(seed=3), _rows(seed=4), seed_meta=1)
    new.save(d)
    assert sorted(p.name for p in d.iterdir()) == sorted([EVENTKV_MANIFEST, EVENTKV_TENSORS])
    _assert_same(new, EventKV.load(d))


def test_save_fsyncs_files_and_directory_before_returning(tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else str(fd))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    d = _ekv(_rows(), _rows(seed=1)).save(tmp_path / "kv")
    assert len(synced) == 3  # tensor file, manifest, directory
    if os.path.exists("/proc/self/fd"):
        assert Path(synced[0]).name.startswith(".kv-") and Path(synced[1]).name.startswith(".manifest-")
        assert Path(synced[2]) == d.resolve()


def _raiser(exc: BaseException):
    def f(*args, **kwargs):
        raise exc

    return f


def _fail_nth(n: int, real):
    calls = {"n": 0}

    def f(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise OSError(28, "No space left on device (simulated)")
        return real(*args, **kwargs)

    return f


# Every step of a save that can fail: writing the tensors, syncing either file, writing the manifest,
# taking the backup link, and each of the two renames (the second one after the tensors are in place).
FAILURES = {
    "save_file": lambda m: m.setattr(rows_module, "save_file", _fail_nth(1, safetensors.torch.save_file)),
    "fsync tensors": lambda m: m.setattr(os, "fsync", _fail_nth(1, os.fsync)),
    "fsync manifest": lambda m: m.setattr(os, "fsync", _fail_nth(2, os.fsync)),
    "json.dump": lambda m: m.setattr(rows_module.json, "dump", _fail_nth(1, rows_module.json.dump)),
    "interrupt in sha256": lambda m: m.setattr(rows_module, "sha256_file", _raiser(KeyboardInterrupt())),
    "rename tensors": lambda m: m.setattr(os, "replace", _fail_nth(1, os.replace)),
    "rename manifest": lambda m: m.setattr(os, "replace", _fail_nth(2, os.replace)),
}


@pytest.mark.parametrize("existing", [True, False], ids=["over an EventKV", "into an empty dir"])
@pytest.mark.parametrize("step", list(FAILURES))
def test_a_failed_save_leaves_the_directory_exactly_as_before(tmp_path, monkeypatch, step, existing):
    d = tmp_path / "kv"
    d.mkdir()
    old = _ekv(_rows(seed=1), _rows(seed=2))
    if existing:
        old.save(d)
    before = _snapshot(d)
    k = _rows(seed=3)[0]
    new = _ekv([k, k, k], [k, k, k], seed_meta=1)  # shared layers: the save itself would succeed
    with monkeypatch.context() as m:
        FAILURES[step](m)
        with pytest.raises((OSError, KeyboardInterrupt)):
            new.save(d)
    assert _snapshot(d) == before
    if existing:
        _assert_same(old, EventKV.load(d))
    else:
        with pytest.raises(EventKVError, match="holds no complete EventKV"):
            EventKV.load(d)


def test_failed_rename_without_hard_links_leaves_no_mixed_eventkv(tmp_path, monkeypatch):
    """Where the file system has no hard links there is no backup of the old tensor file; a failure
    of the manifest rename then leaves a directory that loads as nothing, never new tensors under
    the old manifest."""
    d = tmp_path / "kv"
    _ekv(_rows(seed=1), _rows(seed=2)).save(d)
    monkeypatch.setattr(os, "link", _raiser(OSError(1, "Operation not permitted (no hard links)")))
    monkeypatch.setattr(os, "replace", _fail_nth(2, os.replace))
    with pytest.raises(OSError):
        _ekv(_rows(seed=3), _rows(seed=4)).save(d)
    assert sorted(p.name for p in d.iterdir()) == [EVENTKV_MANIFEST]
    with pytest.raises(EventKVError, match="holds no complete EventKV"):
        EventKV.load(d)
