"""A memory's query as typed values (eventkv.memory.query): QueryOptions as every surface's one options type,
MemoryQuery answered by EventMemory.ask with ``remember``, and the refusals the memory owns (NotFound,
Gone, Conflict), on a tiny random Llama."""

from __future__ import annotations

import pytest

from eventkv.errors import Conflict, EventKVError, Gone, NotFound, OptionError
from eventkv.memory import EventMemory, MemoryQuery, QueryOptions
from eventkv.memory.select import BM25Selector
from eventkv.service import schemas
from eventkv.testing import tiny_lm

EVENTS = ["Dana lives in Lisbon.", {"text": "Ravi likes tea.", "id": "ravi"}, "The offsite is in Porto."]


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


def test_ask_with_remember_stores_the_question_and_its_answer(lm, tmp_path):
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add(EVENTS, prefill=True)
        plain = mem.query("Where does Dana live?", max_new_tokens=3)
        version = mem.version
        [answer] = mem.ask(MemoryQuery("Where does Dana live?", max_new_tokens=3, remember=True))
        assert answer.generation.tokens == plain.generation.tokens  # remember changes nothing it answers
        stored = mem.list()[-2:] if answer.text.strip() else mem.list()[-1:]
        assert stored[0].text == "Where does Dana live?" and stored[0].role == "user"
        if answer.text.strip():
            assert stored[1].text == answer.text and stored[1].role == "assistant"
        assert mem.version == version + 1  # one add: both turns in one transaction
        assert mem.finish_query(MemoryQuery("Where?"), [answer]) == []  # no remember: nothing stored


def test_the_memory_refuses_what_it_cannot_serve(lm, tmp_path):
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        with pytest.raises(Conflict, match="no live events"):
            mem.query("Where?", max_new_tokens=1)
        with pytest.raises(Conflict):
            mem.query("Where?", select="all", max_new_tokens=1)
        mem.add(EVENTS)
        with pytest.raises(NotFound, match="'nope'"):
            mem.query("Where?", select=["nope"], max_new_tokens=1)
        mem.forget("ravi")
        with pytest.raises(Gone, match="forgotten"):
            mem.query("Where?", select=["ravi"], max_new_tokens=1)
        for e in mem.view_ids():
            mem.delete(e)
        with pytest.raises(Conflict):
            mem.query("Where?", max_new_tokens=1)
        assert mem.query("Where?", select="all", max_new_tokens=1).served_ids  # deleted events keep their rows


def test_options_are_one_type_for_every_surface():
    body = schemas.QueryIn(question="Where?", k=3, budget=0.2, neighbours=1, mode="text", positions="original")
    query = body.query()
    assert query.options == QueryOptions(k=3, budget=0.2, neighbours=1, mode="text", positions="original")
    assert query.plan_list() == [(None, "text")]
    assert set(QueryOptions().keywords()) == {
        "k",
        "budget_rows",
        "selector",
        "budget",
        "neighbours",
        "with_headers",
        "mode",
        "positions",
        "order",
        "recompute",
        "blend_schedule",
    }
    assert QueryOptions(selector="bm25").body("k", "selector") == {"k": None, "selector": "bm25"}
    with pytest.raises(OptionError, match="cannot travel"):
        QueryOptions(selector=BM25Selector()).body()
    with pytest.raises(TypeError, match="'nope'"):
        MemoryQuery.build("Where?", nope=1)
    with pytest.raises(OptionError, match="neighbours"):
        QueryOptions(neighbours=-1).check_shaping()
    with pytest.raises(OptionError, match="recompute"):
        QueryOptions(recompute=0.5, positions="original").check_serving(["compact"])


def test_query_batch_takes_the_keywords_of_query(lm, tmp_path):
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add(EVENTS, prefill=True)
        [a, b] = mem.query_batch("Where?", [(None, "compact"), ("view", "text")], k=2, max_new_tokens=2)
        assert a.plan["k"] == 2 and b.plan["select"] == "view" and b.plan["mode"] == "text"
        with pytest.raises(TypeError, match="'budgett'"):
            mem.query_batch("Where?", [(None, "compact")], budgett=0.1)
        with pytest.raises(EventKVError, match="no event fits the budget"):
            mem.query("Where?", budget_rows=1, max_new_tokens=1)
