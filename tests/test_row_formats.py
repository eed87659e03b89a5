"""Row formats of a memory's store (eventkv.kv.quant; docs/memory.md, "Row formats"): quantized rows within the
stated bound of the rows they came from, int4 packing exact, every tiny architecture's memory served from its own
format (the open memory equal, bit for bit, to the same store reopened), a query's logits within a stated tolerance
of native rows, the upkeep verbs in every format, checksums over what is stored, and bad formats refused."""

from __future__ import annotations

import json
import shutil
import sqlite3

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eventkv.errors import EventKVError, OptionError, StoreDamaged
from eventkv.files import sha256_file
from eventkv.kv.quant import (
    ROW_FORMATS,
    decode_rows,
    encode_rows,
    error_bound,
    pack_int4,
    param_dtype,
    split_rows,
    unpack_int4,
)
from eventkv.memory import EventMemory, MemoryEvent
from eventkv.memory.store import MANIFEST, SEGMENTS
from eventkv.testing import TINY_FAMILIES, tiny_lm

QUANTIZED = ("int8", "int4")
EVENTS = [
    MemoryEvent("Dana lives in Lisbon and works on the grant proposal.", role="user", id="dana"),
    MemoryEvent("Ravi will handle the quarterly report from Oslo.", role="user", id="ravi"),
    MemoryEvent("The team offsite is on Tuesday at 10:30.", role="assistant", id="offsite"),
    MemoryEvent("Mei moved the server migration to Friday.", id="mei"),
]
QUESTION = "Where does Dana live?"
#: max |logit - native logit| of a query's next token on the tiny random models (logit std ~0.16); measured at
#: most 3.7e-4 (int8) and 9.1e-3 (int4) over the four architectures
LOGIT_TOL = {"int8": 2e-3, "int4": 3e-2}


def kv(heads=2, rows=70, head_dim=64, dtype=torch.float32, seed=0):
    """Keys with outlier channels (KIVI's observation: a few channels of large magnitude) and plain values."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(heads, rows, head_dim, generator=g) + 20 * torch.randn(1, 1, head_dim, generator=g)
    values = torch.randn(heads, rows, head_dim, generator=g)
    return keys.to(dtype), values.to(dtype)


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])
def test_rows_read_back_within_the_bound(fmt, dtype, head_dim):
    keys, values = kv(head_dim=head_dim, dtype=dtype)
    tensors = encode_rows([keys], [values], fmt, native_head=5)
    (k,), (v,) = decode_rows(tensors, fmt, 1)
    assert k.dtype == dtype and k.shape == keys.shape and v.shape == values.shape
    for got, want, kind in ((k, keys, "keys"), (v, values, "values")):
        bound = error_bound(want, fmt, native_head=5, kind=kind)
        err = (got.float() - want.float()).abs()
        assert bool((err <= bound).all()), float((err - bound).max())
        # the header's rows are native, bit for bit, and so are the keys past the last whole group of 32 rows;
        # values are grouped within each row, so every value row after the header is quantized
        end = 69 if kind == "keys" else 70
        assert torch.equal(got[:, :5], want[:, :5]) and torch.equal(got[:, end:], want[:, end:])
        assert bool((bound[:, 5:end] > 0).all())


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 100),
    head=st.integers(0, 40),
    fmt=st.sampled_from(QUANTIZED),
    scale=st.floats(1e-3, 1e4),
    seed=st.integers(0, 2**16),
)
def test_any_write_reads_back_within_the_bound(rows, head, fmt, scale, seed):
    keys, values = kv(rows=rows, head_dim=32, seed=seed)
    keys, values = keys * scale, values * scale
    (k,), (v,) = decode_rows(encode_rows([keys], [values], fmt, native_head=head), fmt, 1)
    assert ((k - keys).abs() <= error_bound(keys, fmt, native_head=head, kind="keys")).all()
    assert ((v - values).abs() <= error_bound(values, fmt, native_head=head, kind="values")).all()


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_values_past_float16s_range_keep_float32_params(fmt):
    """A group minimum past +-65504 is an infinity in float16 and would read back as NaN: such a write keeps its
    scales and minima in float32; every other write in float16."""
    keys, values = kv(rows=70, head_dim=32, seed=31)
    big = keys * 1e3  # this seed's outlier channel reaches -65,973
    assert float(big.abs().amax()) > 65504 and param_dtype(big) == torch.float32 and param_dtype(keys) == torch.float16
    tensors = encode_rows([big, keys], [values, values * 1e5], fmt, native_head=3)
    assert tensors["keys.0.minimum"].dtype == torch.float32 and tensors["values.0.minimum"].dtype == torch.float16
    assert tensors["keys.1.scale"].dtype == torch.float16 and tensors["values.1.scale"].dtype == torch.float32
    k, v = decode_rows(tensors, fmt, 2)
    for got, want, kind in (
        (k[0], big, "keys"),
        (k[1], keys, "keys"),
        (v[0], values, "values"),
        (v[1], values * 1e5, "values"),
    ):
        assert bool(got.isfinite().all())
        assert bool(((got - want).abs() <= error_bound(want, fmt, native_head=3, kind=kind)).all())


def test_constant_groups_and_the_split():
    keys = torch.full((1, 64, 32), 3.25)
    (k,), (v,) = decode_rows(encode_rows([keys], [keys], "int4"), "int4", 1)
    assert torch.equal(k, keys) and torch.equal(v, keys)
    assert split_rows(100, 5) == (5, 64) and split_rows(10, 20) == (10, 0) and split_rows(31, 0) == (0, 0)
    assert split_rows(100, 5, kind="values") == (5, 95) and split_rows(31, 0, kind="values") == (0, 31)


def test_int4_packing_is_exact():
    codes = torch.randint(0, 16, (3, 7, 10), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (3, 7, 5) and torch.equal(unpack_int4(packed), codes)
    with pytest.raises(OptionError, match="head_dim 15 is odd"):
        encode_rows(*[[t] for t in kv(head_dim=15)], "int4")


def test_quantized_rows_take_the_stated_bytes():
    keys, values = kv(rows=64, head_dim=128, dtype=torch.bfloat16)
    native = 2 * keys.numel() * keys.element_size()
    for fmt, bits in (("int8", 8), ("int4", 4)):
        t = encode_rows([keys], [values], fmt)
        stored = sum(x.numel() * x.element_size() for x in t.values())
        # bits per value plus a float16 scale and minimum per group of 32
        assert stored == 2 * keys.numel() * (bits + 32 / 32) / 8
        assert native / stored == pytest.approx(16 / (bits + 1))


# ====================================================================== memories in every format
@pytest.fixture(scope="module", params=TINY_FAMILIES)
def lm(request):
    return tiny_lm(request.param)


def _answer(mem):
    ans = mem.query(QUESTION, select="all", mode="compact", max_new_tokens=4, keep_logits=True, positions="original")
    return torch.stack(ans.generation.logits)


def _rows(mem):
    return [k.clone() for k in mem._ekv.keys], [v.clone() for v in mem._ekv.values]


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_a_memory_serves_its_own_format(lm, fmt, tmp_path):
    native = EventMemory.create(tmp_path / "native", lm, namespace="t", instruction="Answer from the log.")
    mem = EventMemory.create(tmp_path / fmt, lm, namespace="t", instruction="Answer from the log.", rows=fmt)
    for m in (native, mem):
        m.add(EVENTS, prefill=True)
    header = len(mem.header_ids)
    # the first write's rows are the native rows within the bound (later writes attend to the stored rows)
    for got, want, kind in ((mem._ekv.keys, native._ekv.keys, "keys"), (mem._ekv.values, native._ekv.values, "values")):
        for g, w in zip(got, want):
            bound = error_bound(w[0], fmt, native_head=header, kind=kind)
            assert bool(((g[0].float() - w[0].float()).abs() <= bound).all())
            assert torch.equal(g[0, :, :header], w[0, :, :header])
    for m in (native, mem):
        m.add("Lena joins the call at 9:15.", prefill=True)
    # the query's next-token logits (later steps follow each side's own greedy tokens, which may differ)
    diff = float((_answer(mem)[0] - _answer(native)[0]).abs().max())
    assert diff <= LOGIT_TOL[fmt], diff
    before, logits = _rows(mem), _answer(mem)
    mem.close()
    mem = EventMemory.open(tmp_path / fmt, lm)
    after = _rows(mem)
    assert all(torch.equal(a, b) for a, b in zip(before[0] + before[1], after[0] + after[1]))
    assert torch.equal(_answer(mem), logits)
    assert json.loads((tmp_path / fmt / MANIFEST).read_text())["rows"] == fmt
    assert mem.query(QUESTION, max_new_tokens=1).plan["rows"] == fmt  # every answer records its memory's format
    assert mem.stats().bytes_on_disk < native.stats().bytes_on_disk
    mem.close()
    native.close()


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_the_query_that_prefills_answers_from_the_stored_rows(fmt, tmp_path):
    """A lazy add's rows are computed and committed by the next query, which answers from the rows as stored
    (read back from the format), as every later query and a reopened memory do."""
    lm = tiny_lm("llama")
    mem = EventMemory.create(tmp_path / fmt, lm, namespace="t", instruction="Answer from the log.", rows=fmt)
    mem.add(EVENTS)  # pending: prefilled by the next read
    first, second = _answer(mem), _answer(mem)
    assert torch.equal(first, second)
    mem.add("Lena joins the call at 9:15.")
    third = _answer(mem)
    mem.close()
    with EventMemory.open(tmp_path / fmt, lm) as reopened:
        assert torch.equal(_answer(reopened), third)


@pytest.mark.parametrize("fmt", ROW_FORMATS)
def test_upkeep_in_every_format(fmt, tmp_path):
    lm = tiny_lm("llama")
    mem = EventMemory.create(tmp_path / "m", lm, namespace="t", rows=fmt)
    mem.add(EVENTS, prefill=True)
    mem.add([MemoryEvent(f"Note {i}: the courier comes at {i}:00.", id=f"n{i}") for i in range(6)], prefill=True)
    mem.update("dana", "Dana moved to Porto last month.", prefill=True)  # a patch
    mem.carrier(["ravi"], "the report's city", kind="binding", prefill=True)
    mem.forget("offsite")  # the rows from it on are recomputed and written again
    mem.rebase()
    mem.delete("mei")
    mem.prefill()
    rows, logits = _rows(mem), _answer(mem)
    ids = [r.id for r in mem.list()]
    mem.close()
    mem = EventMemory.open(tmp_path / "m", lm)
    assert [r.id for r in mem.list()] == ids and "offsite" not in ids
    again = _rows(mem)
    assert all(torch.equal(a, b) for a, b in zip(rows[0] + rows[1], again[0] + again[1]))
    assert torch.equal(_answer(mem), logits)
    mem.close()


def test_a_damaged_quantized_segment_is_refused(tmp_path):
    lm = tiny_lm("llama")
    with EventMemory.create(tmp_path / "m", lm, namespace="t", rows="int4") as mem:
        mem.add(EVENTS + [MemoryEvent("x " * 40, id="long")], prefill=True)
    seg = sorted((tmp_path / "m" / SEGMENTS).iterdir())[-1]
    data = bytearray(seg.read_bytes())
    data[-5] ^= 0x01  # a code in the last tensor
    seg.write_bytes(bytes(data))
    with pytest.raises(StoreDamaged, match="does not match its sha256"):
        EventMemory.open(tmp_path / "m", lm)


def test_bad_formats_are_refused(tmp_path):
    lm = tiny_lm("llama")
    with pytest.raises(OptionError, match="rows 'int3': give native"):
        EventMemory.create(tmp_path / "a", lm, namespace="t", rows="int3")
    assert not (tmp_path / "a").exists()
    EventMemory.create(tmp_path / "b", lm, namespace="t").close()
    manifest = json.loads((tmp_path / "b" / MANIFEST).read_text())
    (tmp_path / "b" / MANIFEST).write_text(json.dumps({**manifest, "rows": "int2"}))
    with pytest.raises(EventKVError, match="stores its rows as 'int2', this eventkv reads native, int8, int4"):
        EventMemory.open(tmp_path / "b", lm)


def test_a_store_is_read_in_its_own_format_only(tmp_path):
    """Opening with another ``rows`` is refused naming the store's format; a segment whose file holds another format
    than the manifest's (copied in from another store, its database row made to match) is refused as damage."""
    lm = tiny_lm("llama")
    for fmt in ("native", "int4"):
        with EventMemory.create(tmp_path / fmt, lm, namespace="t", rows=fmt) as mem:
            mem.add(EVENTS, prefill=True)
    with pytest.raises(OptionError, match=r"rows 'int8': the memory in .* stores its rows as int4 .* rows='int4'"):
        EventMemory.open(tmp_path / "int4", lm, rows="int8")
    with pytest.raises(OptionError, match="rows 'int3': give native"):
        EventMemory.open(tmp_path / "int4", lm, rows="int3")
    with EventMemory.open(tmp_path / "int4", lm, rows="int4") as mem, EventMemory.open(tmp_path / "native", lm) as nat:
        assert mem.rows_format == "int4" and nat.rows_format == "native"
    foreign = sorted((tmp_path / "int4" / SEGMENTS).glob("*.safetensors"))[-1]
    target = sorted((tmp_path / "native" / SEGMENTS).glob("*.safetensors"))[-1]
    shutil.copyfile(foreign, target)
    with sqlite3.connect(tmp_path / "native" / "memory.sqlite") as db:
        db.execute(
            "UPDATE segments SET sha256 = ?, bytes = ? WHERE file LIKE ?",
            (sha256_file(target), target.stat().st_size, f"%{target.name}"),
        )
    with pytest.raises(StoreDamaged, match="holds rows in format 'int4' but the store's manifest says 'native'"):
        EventMemory.open(tmp_path / "native", lm)


@pytest.mark.parametrize("fmt", ROW_FORMATS)
def test_released_rows_are_rebuilt_from_the_packed_tensors(fmt, tmp_path):
    lm = tiny_lm("qwen3")
    mem = EventMemory.create(tmp_path / "m", lm, namespace="t", rows=fmt)
    mem.add(EVENTS + [MemoryEvent(f"Note {i}: the courier comes at {i}:00 with parcels.") for i in range(12)])
    mem.prefill()
    rows, logits, held = _rows(mem), _answer(mem), mem.rows_bytes
    n = mem._ekv.n_rows
    native = sum(t.numel() * t.element_size() for t in rows[0] + rows[1])
    freed = mem.release_rows()
    if fmt == "native":
        assert freed == 0 and mem.rows_bytes == held
    else:
        assert freed > 0 and mem.rows_bytes == held - freed and mem.rows_bytes < native
        assert mem._rows.n_rows == n and mem._rows._ekv is None  # n_rows without rebuilding
    assert torch.equal(_answer(mem), logits)  # rebuilt from RAM, bit for bit
    again = _rows(mem)
    assert all(torch.equal(a, b) for a, b in zip(rows[0] + rows[1], again[0] + again[1]))
    mem.release_rows()
    mem.add("Lena joins the call at 9:15.", prefill=True)  # a write after a release continues the rebuilt rows
    after = _rows(mem)
    mem.close()
    mem = EventMemory.open(tmp_path / "m", lm)
    reopened = _rows(mem)
    assert all(torch.equal(a, b) for a, b in zip(after[0] + after[1], reopened[0] + reopened[1]))
    mem.close()


def test_the_worker_keeps_only_the_hot_memories_rows(tmp_path):
    from eventkv.memory import MemoryQuery
    from eventkv.service.worker import ModelWorker, QueryJob

    lm = tiny_lm("llama")
    for name, fmt in (("a", "int4"), ("b", "int4"), ("native", "native")):
        with EventMemory.create(tmp_path / name, lm, namespace="t", rows=fmt) as mem:
            mem.add(EVENTS, prefill=True)
    worker = ModelWorker(lm, max_batch=1, max_hot=1)
    try:

        def ask(name):
            query = MemoryQuery.build(QUESTION, plans=[("view", "compact")], max_new_tokens=2, keep_logits=True)
            return worker.submit_query(QueryJob(tmp_path / name, query)).result(60).answers[0]

        first = ask("a")
        ask("b")  # a is now the memory used longest ago: its rows are released
        opened = worker.submit(lambda: dict(worker._open)).result(60)  # looked at without using them
        a, b = opened[tmp_path / "a"], opened[tmp_path / "b"]
        assert a._rows._ekv is None and b._rows._ekv is not None and a.rows_bytes < b.rows_bytes
        again = ask("a")  # rebuilt from the packed tensors
        assert again.generation.tokens == first.generation.tokens
        assert all(torch.equal(x, y) for x, y in zip(again.generation.logits, first.generation.logits))
        released = worker.released
        ask("native")  # a native memory holds no packed tensors: it does not count against max_hot
        opened = worker.submit(lambda: dict(worker._open)).result(60)
        assert worker.released == released and opened[tmp_path / "a"]._rows._ekv is not None
    finally:
        worker.stop(60)


def test_max_hot_is_an_option_of_serve(monkeypatch, capsys, tmp_path):
    from cli_fixtures import run_cli

    code, out, err = run_cli(
        monkeypatch, capsys, "serve", "--model", "/no/model", "--store", str(tmp_path / "s"), "--max-hot", "-1"
    )
    assert code == 2 and "--max-hot -1: give 0 or more memories, or leave --max-hot out." in err
    assert "Traceback" not in out + err


#: max |logit - native logit| of a query's next token on smollm2-135m in float32 (logit std ~3.3): measured 0.049
#: for int8 and 0.74 for int4 on a six-event history (qwen2.5-coder-0.5b: 0.028 and 0.59)
REAL_LOGIT_TOL = {"int8": 0.15}


@pytest.mark.slow
@pytest.mark.integration
def test_int8_rows_on_a_real_model(tmp_path):
    """smollm2-135m (float32): int8 rows answer as native rows (same greedy tokens) with the query's logits within
    REAL_LOGIT_TOL; int4 is measured in docs/memory.md, not held to a tolerance here."""
    from eventkv.models import load

    lm = load("smollm2-135m", dtype="float32")
    got = {}
    for fmt in ("native", "int8"):
        with EventMemory.create(tmp_path / fmt, lm, namespace="t", rows=fmt) as mem:
            mem.add(EVENTS, prefill=True)
            mem.add("Lena joins the call at 9:15.", prefill=True)
            got[fmt] = mem.query(QUESTION, select="all", max_new_tokens=8, keep_logits=True)
    native, int8 = got["native"].generation, got["int8"].generation
    assert int8.tokens == native.tokens
    assert float((int8.logits[0] - native.logits[0]).abs().max()) <= REAL_LOGIT_TOL["int8"]
