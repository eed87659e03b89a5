"""Served-set shaping (``EventMemory.select``'s budget, neighbours and group headers, and the per-call
selector): properties of :func:`eventkv.memory.select.shape` over random widths, pins, budgets,
neighbours and headers; the same properties on a memory (budgets in rows and as fractions); hand-made
cases with their exact ids; the keywords through query, query_batch, the HTTP routes and the client."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eventkv.errors import EventKVError, OptionError
from eventkv.memory import EventMemory, MemoryEvent
from eventkv.memory.query import DEFAULT_BUDGET_ROWS, QueryOptions, default_budget_rows
from eventkv.memory.select import (
    HEADER_TAG,
    Ranked,
    fraction_of,
    group_headers,
    relevance_order,
    shape,
    shape_units,
)
from eventkv.testing import tiny_lm

# ====================================================================== the fill, alone


def unit_of(i: int, n: int, neighbours: int, headers, ranked=None) -> set[int]:
    """Event ``i`` with its neighbours and (given ``headers``) every member's group header; given ``ranked``
    (``i`` a ranked event), a group header's unit is that of its group's best-ranked event (else its first)."""
    if ranked is not None and headers is not None and headers[i] == i:
        group = [j for j in range(i + 1, n) if headers[j] == i]
        ranked_group = [j for j in ranked if j in group]
        i = ranked_group[0] if ranked_group else (group[0] if group else i)
    members = set(range(max(0, i - neighbours), min(n, i + neighbours + 1)))
    if headers is not None:
        members |= {headers[j] for j in members if headers[j] is not None}
    return members


def check_served(served, ranked, rows, k, budget, pinned, neighbours, headers) -> None:
    """The guarantees of a served set: within the budget, every pin, maximal (no ranked or pinned
    unit's rest fits the rows left while fewer than ``k`` ranked units are whole), and nothing
    served that no candidate unit holds."""
    n, served = len(rows), set(served)
    used = sum(rows[i] for i in served)
    left = math.inf if budget is None else budget - used
    assert left >= 0
    assert set(pinned) <= served
    units = [unit_of(i, n, neighbours, headers, ranked) for i in ranked]
    pin_units = [unit_of(i, n, neighbours, headers) for i in pinned]
    assert served <= set().union(set(pinned), *units, *pin_units)
    for u in pin_units:
        assert u <= served or sum(rows[j] for j in u - served) > left
    whole = sum(u <= served for u in units)
    if k is None or whole < k:
        for u in units:
            assert u <= served or sum(rows[j] for j in u - served) > left
    if budget is None and k is not None:  # nothing to skip: the top k units and the pins' units, exactly
        assert served == set().union(set(pinned), *units[:k], *pin_units)


@st.composite
def views(draw):
    n = draw(st.integers(1, 12))
    rows = draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    ranked = draw(st.permutations(range(n)))[: draw(st.integers(0, n))]
    pinned = sorted(draw(st.sets(st.integers(0, n - 1), max_size=3)))
    k = draw(st.none() | st.integers(1, n + 1))
    budget = draw(st.none() | st.integers(1, sum(rows) + 3))
    neighbours = draw(st.integers(0, 3))
    is_header = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    headers = draw(st.sampled_from([None, group_headers(is_header)]))
    return ranked, rows, k, budget, pinned, neighbours, headers


@settings(max_examples=400, deadline=None)
@given(views())
def test_shape_never_exceeds_the_budget_serves_every_pin_and_is_maximal(view):
    ranked, rows, k, budget, pinned, neighbours, headers = view
    if budget is not None and sum(rows[i] for i in pinned) > budget:
        with pytest.raises(EventKVError, match="pinned events need"):
            shape(ranked, rows, k=k, budget=budget, pinned=pinned, neighbours=neighbours, headers=headers)
        return
    served = shape(ranked, rows, k=k, budget=budget, pinned=pinned, neighbours=neighbours, headers=headers)
    assert served == sorted(set(served))
    check_served(served, ranked, rows, k, budget, pinned, neighbours, headers)


@settings(max_examples=400, deadline=None)
@given(views())
def test_relevance_order_keeps_each_group_one_block_in_history_order(view):
    """Relevance order with the groups given: every served index once; each group's served indices one stretch,
    ascending (its header, when served, first); groups by the best rank of the anchors whose units hold their
    indices, worst first; with the groups not given the order is the units' (the same served indices)."""
    ranked, rows, k, budget, pinned, neighbours, headers = view
    if headers is None or (budget is not None and sum(rows[i] for i in pinned) > budget):
        return
    units = shape_units(ranked, rows, k=k, budget=budget, pinned=pinned, neighbours=neighbours, headers=headers)
    rank = {j: r for r, j in enumerate(ranked)}
    out = relevance_order(units, rank, headers)
    served = {j for _, members in units for j in members}
    assert sorted(out) == sorted(served) and sorted(relevance_order(units, rank)) == sorted(served)
    groups = [headers[j] for j in out]
    for g in {x for x in groups if x is not None}:
        at = [n for n, x in enumerate(groups) if x == g]
        assert at == list(range(at[0], at[-1] + 1)) and [out[n] for n in at] == sorted(out[n] for n in at)

    def place(anchor):  # lower: farther from the question
        return (0, anchor) if anchor not in rank else (1, -rank[anchor])

    best = {g: max(place(a) for a, ms in units for j in ms if headers[j] == g) for g in set(groups) - {None}}
    firsts = [g for n, g in enumerate(groups) if g is not None and (n == 0 or groups[n - 1] != g)]
    assert [best[g] for g in firsts] == sorted(best[g] for g in firsts)


def test_shape_by_hand():
    rows = [3, 5, 2, 4, 1]
    # best first 1, 3, 0: 1 (5 rows) fits 6; 3 (4 rows) and 0 (3 rows) do not
    assert shape([1, 3, 0], rows, budget=6) == [1]
    # 3 does not fit 8 after 1, 0 does: a unit that does not fit is skipped, the next one tried
    assert shape([1, 3, 0, 2, 4], rows, budget=8) == [0, 1]
    assert shape([1, 3, 0, 2, 4], rows, budget=7) == [1, 2]  # 1, then 2 (0 needs 3 of the 2 left)
    assert shape([1, 3, 0, 2, 4], rows, k=1, budget=7) == [1]  # k units, then stop
    assert shape([1, 3, 0, 2, 4], rows, k=2) == [1, 3]  # no budget: the top k
    # neighbours: the pin 0 (3 rows) with its unit {0, 1} (8 rows); 3's unit {2, 3, 4} (7 rows)
    assert shape([3], rows, budget=7, pinned=[0], neighbours=1) == [0]  # neither unit fits
    assert shape([3], rows, budget=9, pinned=[0], neighbours=1) == [0, 1]
    assert shape([3], rows, budget=15, pinned=[0], neighbours=1) == [0, 1, 2, 3, 4]
    # shared rows count once: 2's unit {1, 2, 3} (11) after 3's unit {2, 3, 4} (7) costs 5 more
    assert shape([3, 2], rows, budget=12, neighbours=1) == [1, 2, 3, 4]
    # a pinned event ranked among the best counts against k when its unit's rest fits
    assert shape([0, 1], rows, k=1, pinned=[0]) == [0]
    # headers: 0 and 3 head groups; 4's header is 3
    headers = group_headers([True, False, False, True, False])
    assert headers == [0, 0, 0, 3, 3]
    assert shape([4], rows, k=1, headers=headers) == [3, 4]
    assert shape([4], rows, budget=4, headers=headers) == []  # 4 and its header take 5 rows
    # 2's unit {0, 2} (5 rows) fits 9; 1's rest {1} (5 rows) does not
    assert shape([2, 1], rows, budget=9, headers=headers) == [0, 2]
    # a ranked header stands for its group: 3 is served with 4 (its group's only event), 0 with 2 (its
    # group's best-ranked) or 1 (its group's first, when none of its events is ranked)
    assert shape([3, 0, 1], rows, k=1, headers=headers) == [3, 4]
    assert shape([0, 2, 1], rows, k=1, headers=headers) == [0, 2]
    assert shape([0], rows, k=1, headers=headers) == [0, 1]
    assert shape([0], rows, k=1, neighbours=1, headers=headers) == [0, 1, 2]  # the stand-in's neighbours
    assert shape([3, 0], rows, budget=5, headers=headers) == [3, 4]  # {3, 4}: 5 rows; {0, 1} does not fit
    assert shape([3], rows, k=1) == [3]  # without headers served a header is an event like any
    assert shape([2], [1, 1, 1], k=1, headers=group_headers([False, False, True])) == [2]  # a group of none
    assert shape([4], rows, k=1, pinned=[3], headers=headers) == [3, 4]  # a pinned header is served
    with pytest.raises(EventKVError, match="pinned events need 8 rows, over the budget of 7 rows"):
        shape([], rows, budget=7, pinned=[1, 0])


@given(st.floats(min_value=1e-6, max_value=1.0), st.integers(1, 10**6))
def test_a_fraction_of_the_rows_is_its_floor_at_least_one(fraction, rows):
    got = fraction_of(fraction, rows)
    exact = Fraction(repr(fraction)) * rows
    assert got == max(1, math.floor(exact)) and 1 <= got <= rows
    assert got <= exact or got == 1


def test_fractions_as_written():
    assert fraction_of(0.29, 100) == 29  # float 0.29 * 100 is 28.999...
    assert fraction_of(0.1, 30) == 3 and fraction_of(1.0, 17) == 17 and fraction_of(0.01, 10) == 1


# ====================================================================== on a memory

SESSION1 = "[session 1, 1:56 pm on 8 May, 2023]"
SESSION2 = "[session 2, 10:37 am on 27 June, 2023]"
DIALOGUE = [
    MemoryEvent(SESSION1, id="h1", tags=(HEADER_TAG,)),
    MemoryEvent("Caroline: I went hiking in the mountains with my friends last weekend.", id="a"),
    MemoryEvent("Melanie: I painted a sunrise over the lake for my kids and my husband.", id="b"),
    MemoryEvent(SESSION2, id="h2", tags=(HEADER_TAG,)),
    MemoryEvent("Caroline: I adopted a puppy named Biscuit from the shelter.", id="c"),
    MemoryEvent("Melanie: Bread.", id="d"),
]
QUESTION = "What is the name of Caroline's puppy?"


@pytest.fixture(scope="module")
def llama():
    return tiny_lm("llama")


@pytest.fixture()
def dialogue(llama, tmp_path):
    with EventMemory.create(tmp_path / "m", llama, namespace="t") as mem:
        mem.add(DIALOGUE)
        yield mem


def test_neighbours_and_headers_by_hand(dialogue):
    mem = dialogue
    assert mem.select(QUESTION, k=1, with_headers=False) == ["c"]
    assert mem.select(QUESTION, k=1, with_headers=True) == ["h2", "c"]  # the session date comes with it
    assert mem.select(QUESTION, k=1) == ["h2", "c"]  # the default serves group headers
    assert mem.select(QUESTION, k=1, neighbours=1) == ["h2", "c", "d"]
    # c +-2 reaches b, whose group header is h1
    assert mem.select(QUESTION, k=1, neighbours=2, with_headers=False) == ["b", "h2", "c", "d"]
    assert mem.select(QUESTION, k=1, neighbours=2, with_headers=True) == ["h1", "b", "h2", "c", "d"]
    # a header ranked for itself stands for its session: served with the session's best-ranked turn
    assert mem.select("session June", k=1, with_headers=False) == ["h2"]
    assert mem.select("session June", k=1, with_headers=True) == ["h2", "c"]
    q = mem.query(QUESTION, k=1, with_headers=True, max_new_tokens=1)
    assert q.served_ids == ["h2", "c"]
    batch = mem.query_batch(QUESTION, [(None, "compact"), (None, "text"), ("view", "compact")], k=1, neighbours=1)
    assert [a.served_ids for a in batch] == [["h2", "c", "d"], ["h2", "c", "d"], [e.id for e in DIALOGUE]]


def test_budgets_by_hand(dialogue):
    mem = dialogue  # the hand cases serve no group header unless asked (with_headers=True)
    rows = {r.id: r.n_rows for r in mem.list()}
    total = sum(rows.values())
    # ranked: c, a (both say Caroline), then h1, b, h2, d (no shared word: history order)
    assert [r.id for r in mem.selector.rank(QUESTION, mem.list())][:2] == ["c", "a"]
    assert rows["d"] < min(rows["a"], rows["h1"], rows["b"], rows["h2"])  # the hand case needs it
    budget = rows["c"] + rows["d"]
    # c fits; a, h1, b, h2 do not fit what is left; d does: the fill goes on past a unit that does not fit
    assert mem.select(QUESTION, k=None, budget_rows=budget, with_headers=False) == ["c", "d"]
    assert mem.select(QUESTION, k=1, budget_rows=budget, with_headers=False) == ["c"]  # k and the budget both hold
    assert mem.select(QUESTION, k=None, budget_rows=total, with_headers=False) == [e.id for e in DIALOGUE]
    assert mem.select(QUESTION, k=None, budget=1.0, with_headers=False) == [e.id for e in DIALOGUE]
    # a fraction is floor(fraction * the view's rows)
    for fraction in (0.05, 0.2, 0.5, 0.75):
        n = max(1, math.floor(Fraction(repr(fraction)) * total))
        assert mem.select(QUESTION, k=None, budget=fraction, with_headers=False) == mem.select(
            QUESTION, k=None, budget_rows=n, with_headers=False
        )
    # with headers, the units in rank order are {h2, c}, {h1, a}, {h1, a} (h1 stands for its session, whose
    # best-ranked turn is a), {h1, b}, {h2, c} (h2's), {h2, d}: only {h2, d} fits rows(c) + rows(d)
    assert rows["h2"] + rows["c"] > budget and rows["h1"] + min(rows["a"], rows["b"]) > budget
    assert rows["h2"] + rows["d"] <= budget
    assert mem.select(QUESTION, k=None, budget_rows=budget, with_headers=True) == ["h2", "d"]
    smallest = min(rows.values())
    assert mem.select(QUESTION, k=None, budget_rows=smallest - 1, with_headers=False) == []
    with pytest.raises(EventKVError, match="no event fits the budget"):
        mem.query(QUESTION, k=None, budget_rows=smallest - 1, max_new_tokens=1, with_headers=False)
    assert mem.select(QUESTION, k=None, budget_rows=rows["h2"] + rows["c"], with_headers=True) == ["h2", "c"]
    # a pin is always served and counts against the budget
    mem.pin("b")
    assert mem.select(QUESTION, k=None, budget_rows=rows["b"] + rows["c"], with_headers=False) == ["b", "c"]
    with pytest.raises(EventKVError, match=f"pinned events need {rows['b']} rows, over the budget of 1 rows"):
        mem.select(QUESTION, budget_rows=1, with_headers=False)
    with pytest.raises(EventKVError, match="pinned events need"):
        mem.query(QUESTION, budget=1 / total, max_new_tokens=1, with_headers=False)


def test_the_default_budget_is_fixed_in_rows_and_bounded_by_the_context():
    assert DEFAULT_BUDGET_ROWS == 1600
    assert default_budget_rows(None) == 1600
    assert default_budget_rows(32768) == 1600
    assert default_budget_rows(3200) == 1600
    assert default_budget_rows(2000) == 1000
    assert default_budget_rows(3) == 1
    assert default_budget_rows(1) == 1
    assert QueryOptions().with_default_budget(2000).budget_rows == 1000
    for some in (dict(k=3), dict(budget=0.5), dict(budget_rows=7)):  # anything given: the options as they are
        assert QueryOptions(**some).with_default_budget(2000) == QueryOptions(**some)


def test_the_default_plan_serves_the_best_events_within_the_default_budget(tmp_path):
    # a context of 256 tokens: a default budget of 128 rows, well under the 12 turns' rows
    lm = tiny_lm("llama", max_context=256)
    turns = [
        MemoryEvent(f"Speaker {i % 2}: turn {i} says the word {w} twice, {w}.") for i, w in enumerate("abcdefghijkl")
    ]
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add(turns, prefill=True)
        rows = {r.id: r.n_rows for r in mem.list()}
        assert sum(rows.values()) > 2 * 128
        question = "Which turn says the word e?"
        served = mem.select(question)
        assert served == mem.select(question, k=None, budget_rows=128)
        assert 0 < sum(rows[i] for i in served) <= 128
        assert [h.id for h in mem.search(question)] == [h.id for h in mem.search(question, k=None, budget_rows=128)]
        answer = mem.query(question, max_new_tokens=1)
        assert sorted(answer.served_ids) == sorted(served) and answer.plan["order"] == "relevance"
        assert answer.plan["k"] is None and answer.plan["budget_rows"] == 128 and answer.plan["budget"] is None
        assert answer.plan["positions"] == "contiguous"
        # k alone: the best k events, with no row budget
        alone = mem.query(question, k=2, max_new_tokens=1)
        assert len(alone.served_ids) == 2 and alone.plan["budget_rows"] is None
        many = mem.select(question, k=len(turns))
        assert many == mem.view_ids() and sum(rows.values()) > 128
    # a memory smaller than the default budget serves every event: the rows of its full history
    with EventMemory.create(tmp_path / "small", tiny_lm("llama"), namespace="t") as mem:
        mem.add(DIALOGUE)
        assert mem.select(QUESTION) == [e.id for e in DIALOGUE] == mem.view_ids()
        assert mem.query(QUESTION, max_new_tokens=1).plan["budget_rows"] == DEFAULT_BUDGET_ROWS


def test_bad_shaping_options_name_the_value_and_the_fix(dialogue):
    mem = dialogue
    bad = [
        (dict(k=0), "k 0"),
        (dict(budget_rows=0), "budget_rows 0"),
        (dict(budget=0.0), "budget 0.0: give a fraction of the view's rows in"),
        (dict(budget=1.5), "budget 1.5"),
        (dict(budget=True), "budget True"),
        (dict(budget="0.1"), "budget '0.1'"),
        (dict(budget=0.1, budget_rows=10), r"give budget_rows \(10\) or budget"),
        (dict(neighbours=-1), "neighbours -1: give a whole number of events >= 0"),
        (dict(neighbours=1.0), "neighbours 1.0"),
        (dict(with_headers="yes"), "with_headers 'yes'"),
        (dict(selector="nope"), "selector 'nope'"),
        (dict(selector=object()), "selector"),
    ]
    for options, message in bad:
        with pytest.raises(OptionError, match=message):
            mem.select(QUESTION, **options)
    with pytest.raises(OptionError, match="neighbours -1"):
        mem.query(QUESTION, neighbours=-1)


class Reverse:
    """Ranks the events in reverse history order."""

    name = "reverse"

    def rank(self, question, events, k=None, budget=None, *, context=None):
        ranked = [Ranked(e.id, float(i)) for i, e in reversed(list(enumerate(events)))]
        return ranked[:k] if k is not None else ranked


def test_a_selector_per_call_equals_a_memory_made_with_it(llama, tmp_path, dialogue):
    with EventMemory.create(tmp_path / "rev", llama, namespace="t", selector=Reverse()) as rev:
        rev.add(DIALOGUE)
        cases = [dict(k=1), dict(k=2, neighbours=1), dict(k=None, budget=0.4, with_headers=True)]
        for options in cases:
            assert dialogue.select(QUESTION, selector=Reverse(), **options) == rev.select(QUESTION, **options)
            assert rev.select(QUESTION, selector="bm25", **options) == dialogue.select(QUESTION, **options)
        assert dialogue.select(QUESTION, k=1, selector=Reverse(), with_headers=False) == ["d"]
        assert dialogue.selector.name == "bm25"  # a per-call selector is not kept
        a = dialogue.query(QUESTION, k=2, selector=Reverse(), order="log", max_new_tokens=1)
        assert a.served_ids == rev.query(QUESTION, k=2, order="log", max_new_tokens=1).served_ids == ["h2", "c", "d"]


# the memory's view under random pins, questions, budgets (rows and fractions), neighbours, headers
WORDS = ["Caroline", "puppy", "Melanie", "session", "lake", "bread", "June", "hiking", "kids", "shelter"]


@pytest.fixture(scope="module")
def long_dialogue(llama, tmp_path_factory):
    events = []
    for s in range(3):
        events.append(MemoryEvent(f"[session {s + 1}, {s + 1}:00 pm on {s + 8} May, 2023]", tags=(HEADER_TAG,)))
        for t in range(4):
            who = ["Caroline", "Melanie"][t % 2]
            said = " ".join(WORDS[(s * 4 + t + j) % len(WORDS)] for j in range(1 + (s * 7 + t * 3) % 9))
            events.append(MemoryEvent(f"{who}: {said}."))
    with EventMemory.create(tmp_path_factory.mktemp("long") / "m", llama, namespace="t") as mem:
        mem.add(events)
        yield mem


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pins=st.sets(st.integers(0, 14), max_size=3),
    words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=3),
    k=st.none() | st.integers(1, 6),
    budget=st.none() | st.integers(1, 200) | st.floats(0.01, 1.0),
    neighbours=st.integers(0, 2),
    with_headers=st.booleans(),
)
def test_a_memory_serves_within_the_budget_every_pin_maximally(
    long_dialogue, pins, words, k, budget, neighbours, with_headers
):
    mem = long_dialogue
    view = mem.list()
    for i, r in enumerate(view):
        if r.pinned != (i in pins):
            mem.pin(r.id, i in pins)
    if k is None and budget is None:
        k = 3
    question = " ".join(words)
    rows = [r.n_rows for r in view]
    budget_rows = budget if isinstance(budget, int) or budget is None else fraction_of(budget, sum(rows))
    pinned = sorted(pins)
    options = dict(k=k, neighbours=neighbours, with_headers=with_headers)
    options.update(budget=budget) if isinstance(budget, float) else options.update(budget_rows=budget)
    if budget_rows is not None and sum(rows[i] for i in pinned) > budget_rows:
        with pytest.raises(EventKVError, match="pinned events need"):
            mem.select(question, **options)
        return
    served = mem.select(question, **options)
    index = {r.id: i for i, r in enumerate(view)}
    ranked = [index[r.id] for r in mem.selector.rank(question, view, k=k if budget is None else None)]
    headers = group_headers([HEADER_TAG in r.tags for r in view]) if with_headers else None
    got = [index[i] for i in served]
    assert got == sorted(got)
    check_served(got, ranked, rows, k, budget_rows, pinned, neighbours, headers)


# ====================================================================== over HTTP


@pytest.fixture()
def live(llama, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from service_fixtures import LiveApp

    from eventkv.service.app import create_app
    from eventkv.service.state import Settings

    with LiveApp(create_app(Settings(llama, tmp_path / "store"))) as app:
        yield app


def test_the_keywords_round_trip_through_the_client_and_the_routes(live, dialogue):
    import httpx

    from eventkv.client import Client, InvalidRequest, Refused

    cases = [
        dict(),  # the default plan
        dict(k=1, with_headers=True),
        dict(k=1, neighbours=2, with_headers=True),
        dict(k=None, budget=0.5, selector="bm25"),
        dict(k=2, budget_rows=120, neighbours=1),
    ]
    with Client.create(live.url, "shaped") as client:
        client.add(DIALOGUE)
        for options in cases:
            assert client.select(QUESTION, **options) == dialogue.select(QUESTION, **options), options
            a = client.query(QUESTION, max_new_tokens=1, **options)
            assert a.served_ids == dialogue.query(QUESTION, max_new_tokens=1, **options).served_ids
        with pytest.raises(OptionError, match="a Selector object cannot travel"):
            client.select(QUESTION, selector=Reverse())
        client.pin("b")
        with pytest.raises(Refused, match="pinned events need"):
            client.select(QUESTION, budget_rows=1)
        with pytest.raises(InvalidRequest):
            client.select(QUESTION, selector="nope")
        # a bad value is an OptionError from the server as from the library
        for options in (dict(selector="nope"), dict(k=0), dict(budget=1.5)):
            with pytest.raises(OptionError):
                dialogue.select(QUESTION, **options)
            with pytest.raises(OptionError):
                client.select(QUESTION, **options)
    url = f"{live.url}/v1/memories/shaped"
    for route in ("select", "query"):
        for body, code in [
            ({"budget": 1.5}, "invalid_request"),
            ({"budget": 0}, "invalid_request"),
            ({"neighbours": -1}, "invalid_request"),
            ({"with_headers": 1}, "invalid_request"),
            ({"selector": "nope"}, "invalid_request"),
            ({"budget": 0.5, "budget_rows": 10}, "invalid_option"),
            ({"k": 0}, "invalid_request"),
        ]:
            r = httpx.post(f"{url}/{route}", json={"question": QUESTION, **body}, timeout=60)
            assert r.status_code == 422, (route, body, r.text)
            assert r.json()["code"] == code and r.json()["message"], (route, body)
        # pydantic's rule in the library's wording: the field, the value given, what is allowed
        r = httpx.post(f"{url}/{route}", json={"question": QUESTION, "neighbours": -1}, timeout=60)
        assert r.json()["message"].startswith("neighbours -1: input should be greater than or equal to 0"), r.text
