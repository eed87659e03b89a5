"""Property test of EventMemory (hypothesis): after any sequence of add (lazy or eager), update,
delete, pin, prefill, forget and reopen, the stored history is consistent — positions contiguous
per width, rows contiguous per token count, every segment's rows line up with its events — and
``query(select="all")``'s first-step logits equal a fresh prefill of the same header + events within
1e-4 (tiny Llama, float32)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eventkv.kv.log import tokenize, tokenize_query
from eventkv.kv.prefill import prefill
from eventkv.kv.readout import query_logits
from eventkv.kv.serve import serve
from eventkv.memory import EventMemory, MemoryEvent
from eventkv.testing import tiny_lm

LM = tiny_lm("llama")
WORDS = ("Dana", "Lisbon", "tea", "report", "Kyoto", "Friday", "moved", "owns", "the", "server")
QUESTION = "Who owns the report?"

text = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)
op = st.one_of(
    st.tuples(st.just("add"), text, st.booleans(), st.sampled_from([None, 64])),
    st.tuples(st.just("update"), st.integers(0, 50), text, st.booleans()),
    st.tuples(st.just("delete"), st.integers(0, 50)),
    st.tuples(st.just("pin"), st.integers(0, 50)),
    st.tuples(st.just("forget"), st.integers(0, 50)),
    st.tuples(st.just("prefill")),
    st.tuples(st.just("reopen")),
)


def _pick(mem: EventMemory, i: int, live: bool = True) -> str | None:
    recs = [r for r in mem.list(include_superseded=True, include_deleted=not live)]
    return recs[i % len(recs)].id if recs else None


def _consistent(mem: EventMemory) -> None:
    pos = row = len(mem.header_ids)
    for r in mem._stored():
        assert (r.position, r.row_start) == (pos, row), r
        pos, row = pos + r.width, row + r.n_rows
    pre = [r for r in mem._stored() if r.prefilled]
    assert pre == mem._stored()[: len(pre)]  # prefilled events are a prefix of the history
    n = mem._ekv.n_rows if mem._ekv is not None else 0
    assert n == (pre[-1].row_start + pre[-1].n_rows if pre else 0)
    assert sum(s["n_rows"] for s in mem.store.segment_rows()) == n


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=12))
def test_any_sequence_of_verbs_keeps_the_gate(ops):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "m"
        mem = EventMemory.create(d, LM, namespace="p")
        try:
            for o in ops:
                kind = o[0]
                if kind == "add":
                    mem.add(MemoryEvent(o[1], budget=o[3]), prefill=o[2])
                elif kind == "prefill":
                    mem.prefill()
                elif kind == "reopen":
                    mem.close()
                    mem = EventMemory.open(d, LM)
                else:
                    eid = _pick(mem, o[1])
                    if eid is None:
                        continue
                    if kind == "update":
                        mem.update(eid, o[2], prefill=o[3])
                    elif kind == "delete":
                        mem.delete(eid)
                    elif kind == "pin":
                        mem.pin(eid)
                    elif kind == "forget":
                        mem.forget(eid)
                _consistent(mem)
            if not mem._stored():
                return
            got = mem.query(
                QUESTION, select="all", max_new_tokens=1, keep_logits=True, positions="original"
            ).generation.logits[0]
            _consistent(mem)
            tlog = tokenize(mem.event_log("all"), LM.tokenizer, LM.profile)
            assert mem._ekv.log.input_ids == tlog.input_ids and mem._ekv.log.position_ids == tlog.position_ids
            q = tokenize_query(LM.tokenizer, LM.profile, QUESTION)
            ref = query_logits(LM.model, serve(prefill(LM.model, tlog), "all"), q)
            assert float((got - ref).abs().max()) <= 1e-4
            assert torch.isfinite(got).all()
        finally:
            mem.close()
