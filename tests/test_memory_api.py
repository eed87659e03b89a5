"""One protocol, two front ends: :class:`eventkv.memory.EventMemory` and the HTTP client of
``eventkv serve`` (:class:`eventkv.client.Client`) both implement :class:`eventkv.memory.api.MemoryAPI`
with the same parameter names, defaults and return annotations (extra parameters only keyword-only
with defaults), and one scenario (add, update, history, delete, pin, select, search, query, forget, ...) run
against each on the same tiny model gives the same records, selections and answers. Also the
selector seam: ``EventMemory.create(..., selector=)``."""

from __future__ import annotations

import collections
import dataclasses
import inspect

import pytest

from eventkv.errors import OptionError
from eventkv.memory import EventMemory, MemoryEvent
from eventkv.memory.api import MemoryAPI
from eventkv.memory.select import BM25Selector, Ranked, Selector, rank
from eventkv.testing import tiny_lm

EVENTS = [
    MemoryEvent("Dana lives in Lisbon and works on the grant proposal.", role="user", id="dana"),
    MemoryEvent("Ravi will handle the quarterly report from Oslo.", role="user", id="ravi", budget=60),
    MemoryEvent("The team offsite is on Tuesday at 10:30.", role="assistant", tags=("calendar",)),
    "Mei moved the server migration to Friday.",
    "Tomas asked for the demo slides about Lisbon.",
]
QUESTION = "Where does Dana live?"
#: the parameters one side adds to a protocol verb, on purpose (see eventkv.memory.api)
EXTRAS = {"expected_version", "purge_wait_s", "keep_logits", "messages", "decoding"}


def _members() -> list[str]:
    return sorted(
        n for n, v in vars(MemoryAPI).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))
    )


def test_the_protocol_lists_the_shared_verbs():
    assert _members() == [
        "add",
        "carrier",
        "close",
        "delete",
        "forget",
        "get",
        "history",
        "list",
        "pin",
        "prefill",
        "query",
        "rebase",
        "rows_format",
        "search",
        "select",
        "stats",
        "update",
        "version",
        "view_ids",
    ]


@pytest.mark.parametrize("cls_name", ["EventMemory", "Client"])
def test_both_front_ends_have_every_member_with_matching_parameters(cls_name):
    if cls_name == "Client":
        pytest.importorskip("httpx")
        from eventkv.client import Client as cls
    else:
        cls = EventMemory
    for name in _members():
        proto = getattr(MemoryAPI, name)
        impl = getattr(cls, name, None)
        assert impl is not None, f"{cls_name} lacks {name}"
        if isinstance(proto, property):
            assert isinstance(impl, property), f"{cls_name}.{name} is not a property"
            assert inspect.signature(impl.fget).return_annotation == inspect.signature(proto.fget).return_annotation
            continue
        want, got = inspect.signature(proto), inspect.signature(impl)
        shared = [p for p in got.parameters.values() if p.name in want.parameters]
        assert [p.name for p in shared] == list(want.parameters), (cls_name, name, got)
        for p in shared:
            q = want.parameters[p.name]
            assert (p.kind, p.default, p.annotation) == (q.kind, q.default, q.annotation), (cls_name, name, p)
        extra = [p for p in got.parameters.values() if p.name not in want.parameters]
        for p in extra:  # a deliberate addition: keyword-only, with a default, documented in eventkv.memory.api
            assert p.name in EXTRAS and p.kind is p.KEYWORD_ONLY and p.default is not p.empty, (cls_name, name, p)
        assert got.return_annotation == want.return_annotation, (cls_name, name)


def scenario(mem) -> dict:
    """The same calls on either front end; what they return, comparable across the two (creation
    times and file sizes left out)."""

    def recs(rs):
        return [dataclasses.replace(r, created="") for r in rs]

    def answer(a):
        return (a.text, a.generation.tokens, a.served_ids, [tuple(p) for p in a.positions], a.n_rows_served)

    out = {"added": mem.add(EVENTS)}
    out["prefill"] = mem.prefill()
    out["patch"] = mem.update("ravi", "Ravi handles the report from Bergen.")
    out["history"] = recs(mem.history("ravi"))
    mem.delete("e4")
    mem.pin("e3")
    out["select"] = mem.select(QUESTION, k=2)
    out["select_budget"] = mem.select(QUESTION, k=8, budget_rows=80)  # over the pin's (e3) rows
    out["search"] = mem.search(QUESTION, k=2, neighbours=1)
    a = mem.query(QUESTION, candidates=["Lisbon", "Oslo"], max_new_tokens=6)
    out["query"] = answer(a)
    out["candidates"] = [(c.text, c.logprob) for c in a.candidates]
    out["query_view_text"] = answer(mem.query(QUESTION, select="view", mode="text", max_new_tokens=4))
    # served rows re-rotated right after the header: positions travel, the answer and positions match
    out["query_contiguous"] = answer(
        mem.query(QUESTION, select=["ravi", "e3"], positions="contiguous", max_new_tokens=4)
    )
    out["query_view_blend"] = answer(mem.query(QUESTION, select="view", mode="blend", max_new_tokens=4, recompute=0.5))
    out["forget"] = mem.forget("dana")
    out["after_forget"] = answer(mem.query(QUESTION, select="all", max_new_tokens=4))
    out["get"] = dataclasses.replace(mem.get("dana"), created="")
    out["list"] = recs(mem.list(include_superseded=True, include_deleted=True))
    out["view"] = mem.view_ids()
    out["stats"] = dataclasses.replace(mem.stats(), bytes_on_disk=0)
    out["version"] = mem.version
    out["rows_format"] = mem.rows_format
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from service_fixtures import save_sharp_model

    return save_sharp_model(tmp_path_factory.mktemp("sharp"))


def test_the_library_and_the_client_give_the_same_results(model_dir, tmp_path):
    pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from service_fixtures import Server

    from eventkv.client import Client
    from eventkv.models import load

    srv = Server(model_dir, tmp_path / "store")
    try:
        with Client.create(srv.url, "same") as client:
            assert isinstance(client, MemoryAPI)
            over_http = scenario(client)
    finally:
        srv.kill()
    lm = load(str(model_dir), dtype="float32")
    with EventMemory.create(tmp_path / "lib", lm, namespace="default") as mem:
        assert isinstance(mem, MemoryAPI)
        library = scenario(mem)
    assert over_http.keys() == library.keys()
    for key in library:
        if key == "candidates":  # scored in two processes: equal within float tolerance
            assert [c for c, _ in over_http[key]] == [c for c, _ in library[key]]
            assert [p for _, p in over_http[key]] == pytest.approx([p for _, p in library[key]], abs=1e-5)
        else:
            assert over_http[key] == library[key], key
    assert library["select"] and library["search"] and library["query"][1] and library["forget"] > 0
    header = library["added"][0].position  # the first event starts right after the header
    served = library["query_contiguous"][3]
    assert served[0][1] == header and served[1][1] == header + served[0][2]  # contiguous after the header
    assert served[0][0] == "ravi" and served[0][2] < 60  # ravi's budget of 60 positions closed up to its rows


# ====================================================================== the selector seam
#: what a selector reads of an event
Candidate = collections.namedtuple("Candidate", "id text n_rows")


class Reverse:
    """A selector that ranks the events in reverse history order (score: the position in the list)."""

    name = "reverse"

    def rank(self, question, events, k=None, budget=None, *, context=None):
        ranked = [Ranked(e.id, float(i)) for i, e in reversed(list(enumerate(events)))]
        return ranked[:k] if k is not None else ranked


def test_bm25_selector_ranks_as_rank_does():
    texts = ["Dana lives in Lisbon.", "Ravi likes tea.", "Lisbon is sunny; Dana agrees.", "no match here"]
    recs = [Candidate(f"x{i}", t, 5) for i, t in enumerate(texts)]
    sel = BM25Selector()
    assert isinstance(sel, Selector) and sel.name == "bm25"
    for k in (1, 2, 4, None):
        got = sel.rank("Where does Dana live in Lisbon?", recs, k=k)
        assert [r.id for r in got] == [f"x{i}" for i in rank(texts, "Where does Dana live in Lisbon?", k or 4)]
        assert [r.score for r in got] == sorted((r.score for r in got), reverse=True)
    assert [r.id for r in sel.rank("Dana Lisbon", recs, budget=11)] == ["x0", "x2"]  # 5 + 5 rows fit, not 15


def test_a_memory_ranks_with_the_selector_it_is_given(tmp_path):
    lm = tiny_lm("llama")
    with EventMemory.create(tmp_path / "m", lm, namespace="t", selector=Reverse()) as mem:
        mem.add(["Dana lives in Lisbon.", "Ravi likes tea.", "Mei moved the migration."])
        assert mem.select("Where does Dana live?", k=1) == ["e3"]
    with EventMemory.open(tmp_path / "m", lm) as mem:  # not stored: the default again
        assert mem.selector.name == "bm25" and mem.select("Where does Dana live?", k=1) == ["e1"]
    with pytest.raises(
        OptionError, match="selector 'nope': give one of attention, bm25, dense, hybrid, rerank, or a Selector"
    ):
        EventMemory.open(tmp_path / "m", lm, selector="nope")
