"""EventMemory.query(..., positions="contiguous"): the served rows re-rotated to the positions right after the
header (eventkv.kv.serve), the question right after them; what the answer reports, and the context check that
counts the served rows rather than the history."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.log import tokenize, tokenize_query
from eventkv.kv.prefill import prefill
from eventkv.kv.readout import answer_served
from eventkv.kv.serve import serve
from eventkv.memory import EventMemory, MemoryEvent
from eventkv.models import LoadedModel
from eventkv.testing import tiny_lm

EVENTS = [
    MemoryEvent("Dana lives in Lisbon and works on the grant.", id="dana"),
    MemoryEvent("Ravi will handle the report from Oslo.", id="ravi", budget=60),
    MemoryEvent("The offsite is on Tuesday at 10:30.", id="offsite"),
    MemoryEvent("Mei moved the migration to Friday.", id="mei"),
]
QUESTION = "Where does Dana live?"


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def lm(request):
    return tiny_lm(request.param)


def test_contiguous_answers_as_the_data_path_and_reports_the_served_positions(lm, tmp_path):
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        added = mem.add(EVENTS, prefill=True)
        a = mem.query(QUESTION, select=["ravi", "mei"], positions="contiguous", max_new_tokens=5, keep_logits=True)
        o = mem.query(QUESTION, select=["ravi", "mei"], positions="original", max_new_tokens=5)
        d = mem.query(QUESTION, select=["ravi", "mei"], max_new_tokens=5, keep_logits=True)  # the default
        log = mem.event_log("all")
    h = added[0].position  # the header's length: the first event starts right after it
    n = {r.id: r.width for r in added}
    assert a.served_ids == ["ravi", "mei"] and n["ravi"] == 60  # ravi reserves 60 positions
    ravi, mei = a.positions
    assert ravi[:2] == ("ravi", h) and ravi[2] < 60  # its rows only: the budget's gap is closed up
    assert mei == ("mei", h + ravi[2], n["mei"])  # right after ravi's rows (mei has no budget: width = rows)
    assert a.n_rows_served == h + ravi[2] + mei[2]
    assert o.positions == [(r.id, r.position, r.width) for r in added if r.id in ("ravi", "mei")]
    # no positions given: contiguous (the model's RoPE re-rotates exactly), and the answer says so
    assert d.positions == a.positions and d.generation.tokens == a.generation.tokens
    assert all(torch.equal(x, y) for x, y in zip(d.generation.logits, a.generation.logits))
    assert d.plan == {
        "select": ["ravi", "mei"],
        "mode": "compact",
        "positions": "contiguous",
        "order": "log",
        "rows": "native",
    }
    assert o.plan["positions"] == "original" and a.plan["positions"] == "contiguous"
    # the same rows served by the data path, from a fresh prefill of the stored history
    ekv = prefill(lm.model, tokenize(log, lm.tokenizer, lm.profile))
    sc = serve(ekv, ["ravi", "mei"], "compact", lm.model, positions="contiguous")
    assert sc.next_position == a.n_rows_served
    q = tokenize_query(lm.tokenizer, lm.profile, QUESTION)
    [(gen, _)] = answer_served(
        lm.model,
        lm.tokenizer,
        [sc],
        q,
        max_new_tokens=5,
        stop_token_ids=lm.profile.stop_token_ids,
        max_context=lm.profile.max_context,
        keep_logits=True,
    )
    assert gen.tokens == a.generation.tokens
    assert (torch.stack(gen.logits) - torch.stack(a.generation.logits)).abs().max().item() <= 1e-4


def test_contiguous_with_no_gap_equals_original(tmp_path):
    lm = tiny_lm("qwen3")
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add([dataclasses.replace(e, budget=None) for e in EVENTS])
        kw = dict(select="all", max_new_tokens=4, keep_logits=True)
        a = mem.query(QUESTION, positions="contiguous", **kw)
        o = mem.query(QUESTION, positions="original", **kw)
    assert a.generation.tokens == o.generation.tokens and a.positions == o.positions
    assert all(torch.equal(x, y) for x, y in zip(a.generation.logits, o.generation.logits))


def test_query_batch_takes_positions_for_every_plan(tmp_path):
    lm = tiny_lm("llama")
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add(EVENTS)
        plans = [(["dana", "mei"], "compact"), (["dana", "mei"], "isolated"), (["dana", "mei"], "text")]
        got = mem.query_batch(QUESTION, plans, positions="contiguous", max_new_tokens=3)
        text = mem.query(QUESTION, select=["dana", "mei"], mode="text", max_new_tokens=3)
        with pytest.raises(OptionError, match="native"):
            mem.query_batch(QUESTION, [*plans, (["dana"], "native")], positions="contiguous")
        with pytest.raises(OptionError, match="positions 'packed'"):
            mem.query(QUESTION, positions="packed")  # type: ignore[arg-type]
    assert [a.positions for a in got[:2]] == [got[2].positions] * 2  # the three layouts agree on where rows sit
    assert got[2].generation.tokens == text.generation.tokens  # text is contiguous already


def test_the_question_fits_after_the_served_rows_not_after_the_history(tmp_path):
    """A history that fills the context but for 3 positions: a question after it does not fit; after the
    header and one served event it does."""
    base = tiny_lm("llama")
    with EventMemory.create(tmp_path / "probe", base, namespace="t") as mem:
        added = mem.add(EVENTS)
        header, history_end = added[0].position, added[-1].position + added[-1].width
    lm = LoadedModel(base.model, base.tokenizer, dataclasses.replace(base.profile, max_context=history_end + 3))
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add(EVENTS)
        with pytest.raises(EventKVError, match="positions=.contiguous."):
            mem.query(QUESTION, select=["mei"], positions="original", max_new_tokens=2)
        a = mem.query(QUESTION, select=["mei"], positions="contiguous", max_new_tokens=2)
        assert mem.query(QUESTION, select=["mei"], max_new_tokens=2).plan["positions"] == "contiguous"  # default
    assert a.served_ids == ["mei"] and a.positions[0][1] == header and len(a.generation.tokens) <= 2
