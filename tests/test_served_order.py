"""EventMemory.query(..., order="relevance"): under contiguous positions the served events' rows are laid
out in increasing selector score, the most relevant event last before the question (Liu et al. 2023, "Lost
in the Middle", arXiv 2307.03172, sections 2-3); each shaping unit stays one block in history order; the
option is refused at the original positions; the default (``order=None``) serves a selector's choice at
contiguous positions in relevance order and every other plan in history order (``"log"``)."""

from __future__ import annotations

import pytest
import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.log import tokenize, tokenize_query
from eventkv.kv.readout import answer_served
from eventkv.kv.rope import rerotate
from eventkv.kv.rows import EventKV
from eventkv.kv.serve import serve
from eventkv.memory import EventMemory, MemoryEvent, MemoryQuery, QueryOptions
from eventkv.memory.select import relevance_order, shape, shape_units
from eventkv.testing import tiny_lm

#: BM25 ranks these b (Dana twice, Lisbon twice), then a (Dana), then c and d (no shared word): not log order
EVENTS = [
    MemoryEvent("Dana met Ravi on Tuesday.", id="a"),
    MemoryEvent("Dana lives in Lisbon; Dana loves Lisbon.", id="b"),
    MemoryEvent("Ravi will handle the report from Oslo.", id="c"),
    MemoryEvent("Mei moved the migration to Friday.", id="d"),
]
QUESTION = "Where does Dana live in Lisbon?"
#: keys re-rotated by the memory against the same stored keys re-rotated here (float32)
KEY_TOL = 1e-5
#: logits of two readouts of the same served rows and question (float32)
LOGIT_TOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def lm(request):
    return tiny_lm(request.param)


@pytest.fixture(scope="module")
def llama():
    return tiny_lm("llama")


def stored_rows(mem: EventMemory):
    """The memory's stored rows at their original positions: every event served compact (header first,
    then each stored event's rows in history order), and each event's ``(first row, rows)``."""
    p = mem.prepare_query(MemoryQuery(QUESTION, select="all", max_new_tokens=1))
    rows = {r.id: (r.row_start, r.n_rows) for r in mem.list()}
    return p.served[0], rows


def stored_tensors(stored):
    """``(keys, values, positions)`` of a served cache, as an EventKV takes them."""
    return stored.keys, stored.values, stored.positions


def test_relevance_serves_each_events_rows_in_increasing_score(lm, tmp_path):
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add(EVENTS, prefill=True)
        hits = mem.search(QUESTION, k=3)
        options = QueryOptions(k=3, positions="contiguous", order="relevance")
        p = mem.prepare_query(MemoryQuery(QUESTION, options=options, max_new_tokens=1))
        stored, rows = stored_rows(mem)
        h = len(mem.header_ids)
    assert [x.id for x in hits] == ["b", "a", "c"] and hits[0].score > hits[1].score > hits[2].score
    sc = p.served[0]
    assert sc.served == ("c", "a", "b")  # increasing score, the best last; log order would be a, b, c
    n = sc.n_rows
    # the positions are still 0 .. n-1: the header's, then the served rows' right after it
    assert sc.positions.tolist() == list(range(n)) and sc.next_position == n
    assert n == h + sum(rows[e][1] for e in sc.served)
    for k, v in zip(sc.keys, stored.keys):
        assert torch.equal(k[:, :, :h], v[:, :, :h])  # the header is not moved
    row = h
    for e in sc.served:
        start, width = rows[e]
        block, at = slice(row, row + width), slice(start, start + width)
        to = torch.arange(row, row + width)
        fresh = rerotate(lm.model, [k[:, :, at] for k in stored.keys], stored.positions[at], to)
        for got, want in zip(sc.keys, fresh):
            assert (got[:, :, block].float() - want.float()).abs().max().item() <= KEY_TOL, e
        for got, want in zip(sc.values, stored.values):
            assert torch.equal(got[:, :, block], want[:, :, at]), e  # values carry no rotation
        assert p.positions[0][sc.served.index(e)] == (e, row, width)
        row += width
    assert row == n


def test_relevance_equals_the_same_order_listed_by_hand(llama, tmp_path):
    # the log already in increasing score: relevance order is the log order, listed by hand
    ordered = [
        MemoryEvent("Mei moved the migration to Friday.", id="d"),
        MemoryEvent("Dana met Ravi on Tuesday.", id="a"),
        MemoryEvent("Dana lives in Lisbon; Dana loves Lisbon.", id="b"),
    ]
    kw = dict(positions="contiguous", max_new_tokens=4, keep_logits=True)
    with EventMemory.create(tmp_path / "m", llama, namespace="t") as mem:
        mem.add(ordered, prefill=True)
        assert [x.id for x in mem.search(QUESTION, k=3)] == ["b", "a", "d"]
        rel = mem.query(QUESTION, k=3, order="relevance", **kw)
        log = mem.query(QUESTION, select=["d", "a", "b"], order="log", **kw)
    assert rel.served_ids == log.served_ids == ["d", "a", "b"] and rel.positions == log.positions
    assert rel.generation.tokens == log.generation.tokens
    diff = (torch.stack(rel.generation.logits) - torch.stack(log.generation.logits)).abs().max().item()
    assert diff <= LOGIT_TOL


def test_relevance_answers_as_the_data_path_given_that_order(llama, tmp_path):
    # the log not in increasing score: the data path served the same rows in the order listed by hand
    with EventMemory.create(tmp_path / "m", llama, namespace="t") as mem:
        mem.add(EVENTS, prefill=True)
        rel = mem.query(QUESTION, k=3, positions="contiguous", order="relevance", max_new_tokens=4, keep_logits=True)
        stored, _ = stored_rows(mem)
        log = tokenize(mem.event_log("all"), llama.tokenizer, llama.profile)
    assert rel.served_ids == ["c", "a", "b"]
    ekv = EventKV(log, *stored_tensors(stored))
    sc = serve(ekv, ["a", "b", "c"], "compact", llama.model, positions="contiguous", sequence=["c", "a", "b"])
    assert sc.served == ("c", "a", "b") and sc.next_position == rel.n_rows_served
    [(gen, _)] = answer_served(
        llama.model,
        llama.tokenizer,
        [sc],
        tokenize_query(llama.tokenizer, llama.profile, QUESTION),
        max_new_tokens=4,
        stop_token_ids=llama.profile.stop_token_ids,
        max_context=llama.profile.max_context,
        keep_logits=True,
    )
    assert gen.tokens == rel.generation.tokens
    assert (torch.stack(gen.logits) - torch.stack(rel.generation.logits)).abs().max().item() <= LOGIT_TOL


def test_relevance_at_original_positions_is_refused(llama, tmp_path):
    fix = (
        "order 'relevance': positions='original' keeps every served row at the position it was computed at, so "
        "the order of the rows changes nothing the model computes: use positions='contiguous' with "
        "order='relevance', or order='log'."
    )
    with EventMemory.create(tmp_path / "m", llama, namespace="t") as mem:
        mem.add(EVENTS, prefill=True)
        for call in (
            lambda: mem.query(QUESTION, positions="original", order="relevance"),
            # text is contiguous, but ask for it
            lambda: mem.query(QUESTION, mode="text", positions="original", order="relevance"),
            lambda: mem.query_batch(
                QUESTION, [(None, "compact"), ("view", "text")], positions="original", order="relevance"
            ),
            # no positions given with a native plan: the original positions, so relevance is refused too
            lambda: mem.query_batch(QUESTION, [(None, "compact"), ("view", "native")], order="relevance"),
        ):
            with pytest.raises(OptionError) as e:
                call()
            assert str(e.value) == fix
        with pytest.raises(OptionError, match=r"order 'random': use one of log, relevance\."):
            mem.query(QUESTION, positions="contiguous", order="random")
        # no positions given: contiguous by default, where relevance order is served
        by_default = mem.query(QUESTION, order="relevance", max_new_tokens=1)
        assert by_default.plan["positions"] == "contiguous" and by_default.plan["order"] == "relevance"
        stored, _ = stored_rows(mem)
        log = tokenize(mem.event_log("all"), llama.tokenizer, llama.profile)
    ekv = EventKV(log, *stored_tensors(stored))
    with pytest.raises(OptionError) as e:
        serve(ekv, ["a", "b"], "compact", llama.model, sequence=["b", "a"])
    assert str(e.value) == fix
    with pytest.raises(EventKVError, match="does not list the served events"):
        serve(ekv, ["a", "b"], "compact", llama.model, positions="contiguous", sequence=["b"])


def test_units_stay_whole_and_shared_members_go_with_the_best_ranked_unit():
    # event 4 (best) is a neighbour of pin 5, whose unit is taken first: 4, 5 and 3 go with 4, last
    units = shape_units([4, 1], [1] * 6, neighbours=1, pinned=[5])
    assert units == [(5, [4, 5]), (4, [3, 4, 5]), (1, [0, 1, 2])]
    assert shape([4, 1], [1] * 6, neighbours=1, pinned=[5]) == [0, 1, 2, 3, 4, 5]
    assert relevance_order(units, {4: 0, 1: 1, 5: 2, 0: 3, 2: 4, 3: 5}) == [0, 1, 2, 3, 4, 5]
    assert relevance_order(shape_units([1, 4], [1] * 6, neighbours=1), {1: 0, 4: 1}) == [3, 4, 5, 0, 1, 2]
    # a pin sits at its own rank; an unranked anchor goes first; ties are the ranking's order
    assert relevance_order([(0, [0]), (2, [2]), (3, [3]), (5, [5])], {2: 0, 5: 1, 0: 2}) == [3, 0, 5, 2]
    # a group header shared by two units goes with the better-ranked one, before its event
    units = shape_units([4, 2], [1] * 6, headers=[0, 0, 0, 3, 3, 3])
    assert units == [(4, [3, 4]), (2, [0, 2])]
    assert relevance_order(units, {2: 0, 4: 1}) == [3, 4, 0, 2]


def test_a_group_is_one_block_at_its_best_units_rank():
    """Groups 0 (events 1-3) and 4 (5-6); ranked 5, 2, 3. By units alone turn 3 (ranked last) leads, apart from
    its header 0, which went with turn 2; with the groups given, 0 2 3 are one block at turn 2's rank, before
    group 4's block (turn 5 the best)."""
    headers = [0, 0, 0, 0, 4, 4, 4]
    units = shape_units([5, 2, 3], [1] * 7, headers=headers)
    assert units == [(5, [4, 5]), (2, [0, 2]), (3, [0, 3])]
    rank = {5: 0, 2: 1, 3: 2}
    assert relevance_order(units, rank) == [3, 0, 2, 4, 5]
    assert relevance_order(units, rank, headers) == [0, 2, 3, 4, 5]
    # a neighbour across a session's end goes to its own group's block; indices before the first header keep
    # their unit's block, ahead of a group block at the same rank
    headers = [None, None, 2, 2, 4, 4]
    units = shape_units([3, 1], [1] * 6, neighbours=1, headers=headers)
    assert units == [(3, [2, 3, 4]), (1, [0, 1, 2])]
    assert relevance_order(units, {3: 0, 1: 1}) == [0, 1, 2, 3, 4]
    assert relevance_order(units, {3: 0, 1: 1}, headers) == [0, 1, 2, 3, 4]
    assert relevance_order(units, {1: 0, 3: 1}, headers) == [4, 0, 1, 2, 3]


def test_neighbours_headers_and_pins_in_a_memory(llama, tmp_path):
    turns = [
        MemoryEvent("Ravi walked to the harbour.", id="x1"),
        MemoryEvent("Dana lives in Lisbon; Dana loves Lisbon.", id="x2"),
        MemoryEvent("Mei moved the migration to Friday.", id="x3"),
        MemoryEvent("The offsite is on Tuesday.", id="x4"),
        MemoryEvent("Dana called Ravi.", id="x5"),
        MemoryEvent("Ravi will handle the report from Oslo.", id="x6"),
    ]
    headed = [
        MemoryEvent("Session one, May 1.", id="h1", tags=("header",)),
        MemoryEvent("Dana lives in Lisbon; Dana loves Lisbon.", id="a1"),
        MemoryEvent("Mei moved the migration to Friday.", id="a2"),
        MemoryEvent("Session two, June 2.", id="h2", tags=("header",)),
        MemoryEvent("Ravi will handle the report from Oslo.", id="b1"),
        MemoryEvent("Dana called Ravi.", id="b2"),
    ]
    kw = dict(positions="contiguous", order="relevance", max_new_tokens=1)
    with EventMemory.create(tmp_path / "n", llama, namespace="t") as mem:
        mem.add(turns)
        assert [x.id for x in mem.search(QUESTION, k=2)] == ["x2", "x5"]
        # each event with its neighbours on either side, the best-ranked unit last
        assert mem.query(QUESTION, k=2, neighbours=1, **kw).served_ids == ["x4", "x5", "x6", "x1", "x2", "x3"]
        log = mem.query(QUESTION, k=2, neighbours=1, order="log", max_new_tokens=1)
        assert log.served_ids == [t.id for t in turns] and log.plan["order"] == "log"
        mem.pin("x3")  # no shared word: ranked after x2 and x5, so its block comes first
        assert mem.query(QUESTION, k=2, **kw).served_ids == ["x3", "x5", "x2"]
        # units {x2, x3, x4} (the pin's, taken first) and {x1, x2, x3} (x2's) share x2 and x3: they go with
        # x2, the better ranked, and x4 stays in the pin's block, before it
        assert mem.query(QUESTION, k=1, neighbours=1, **kw).served_ids == ["x4", "x1", "x2", "x3"]
    with EventMemory.create(tmp_path / "h", llama, namespace="t") as mem:
        mem.add(headed)
        assert [x.id for x in mem.search(QUESTION, k=2, with_headers=False)] == ["a1", "b2"]
        # each event after its group header
        assert mem.query(QUESTION, k=2, with_headers=True, **kw).served_ids == ["h2", "b2", "h1", "a1"]
        # a worse-ranked event of a group joins its group's block, after the header
        q = "Where does Dana live in Lisbon, and did Dana call Mei?"
        assert [x.id for x in mem.search(q, k=3, with_headers=False)] == ["a1", "b2", "a2"]
        assert mem.query(q, k=3, with_headers=True, **kw).served_ids == ["h2", "b2", "h1", "a1", "a2"]


def test_the_default_order_is_relevance_for_a_selectors_choice_at_contiguous_positions(llama, tmp_path):
    q = tokenize_query(llama.tokenizer, llama.profile, QUESTION)
    with EventMemory.create(tmp_path / "m", llama, namespace="t") as mem:
        mem.add(EVENTS, prefill=True)
        stored, _ = stored_rows(mem)
        ekv = EventKV(tokenize(mem.event_log("all"), llama.tokenizer, llama.profile), *stored_tensors(stored))
        kw = dict(k=3, max_new_tokens=5, keep_logits=True)
        # contiguous positions (the default here): a selector's choice in relevance order, listed ids in log order
        default, rel = mem.query(QUESTION, **kw), mem.query(QUESTION, order="relevance", **kw)
        assert default.served_ids == rel.served_ids == ["c", "a", "b"] and default.plan["order"] == "relevance"
        assert default.plan["positions"] == "contiguous" and default.generation.tokens == rel.generation.tokens
        assert all(torch.equal(x, y) for x, y in zip(default.generation.logits, rel.generation.logits))
        listed = mem.query(QUESTION, select=["c", "a", "b"], **kw)
        assert listed.served_ids == ["a", "b", "c"] and listed.plan["order"] == "log"
        batch = mem.query_batch(QUESTION, [(None, "compact"), ("view", "compact")], k=3, max_new_tokens=1)
        assert [a.plan["order"] for a in batch] == ["relevance", "log"]
        assert batch[0].served_ids == ["c", "a", "b"] and batch[1].served_ids == [e.id for e in EVENTS]
        for positions in ("original", "contiguous"):
            kw = dict(k=3, positions=positions, max_new_tokens=5, keep_logits=True)
            log = mem.query(QUESTION, order="log", **kw)
            if positions == "original":  # the default at the original positions: history order
                default = mem.query(QUESTION, **kw)
                assert default.served_ids == log.served_ids and default.plan["order"] == "log"
                assert default.generation.tokens == log.generation.tokens and default.positions == log.positions
                assert all(torch.equal(x, y) for x, y in zip(default.generation.logits, log.generation.logits))
            assert log.served_ids == mem.select(QUESTION, 3) == ["a", "b", "c"]
            # the data path without an order: the rows in log order
            sc = serve(ekv, ["a", "b", "c"], "compact", llama.model, positions=positions)
            [(gen, _)] = answer_served(
                llama.model,
                llama.tokenizer,
                [sc],
                q,
                max_new_tokens=5,
                stop_token_ids=llama.profile.stop_token_ids,
                max_context=llama.profile.max_context,
                keep_logits=True,
            )
            assert gen.tokens == log.generation.tokens
            assert (torch.stack(gen.logits) - torch.stack(log.generation.logits)).abs().max().item() <= LOGIT_TOL


def test_order_over_http_and_in_the_client(llama, tmp_path):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from service_fixtures import LiveApp

    from eventkv.client import Client
    from eventkv.service.app import Settings, create_app

    with EventMemory.create(tmp_path / "lib", llama, namespace="t") as mem:
        mem.add(EVENTS, prefill=True)
        want = mem.query(QUESTION, k=3, positions="contiguous", order="relevance", max_new_tokens=3)
    with LiveApp(create_app(Settings(llama, tmp_path / "store"))) as live:
        with Client.create(live.url, "m") as client:
            client.add(EVENTS)
            got = client.query(QUESTION, k=3, positions="contiguous", order="relevance", max_new_tokens=3)
            assert got.served_ids == want.served_ids == ["c", "a", "b"] and got.positions == want.positions
            assert got.generation.tokens == want.generation.tokens
            with pytest.raises(OptionError, match="use positions='contiguous' with order='relevance'"):
                client.query(QUESTION, positions="original", order="relevance")
        url = f"{live.url}/v1/memories/m/query"
        r = httpx.post(url, json={"question": QUESTION, "positions": "contiguous", "order": "random"}, timeout=60)
        assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
        assert r.json()["message"].startswith("order 'random': input should be 'log' or 'relevance'"), r.text
        r = httpx.post(url, json={"question": QUESTION, "positions": "original", "order": "relevance"}, timeout=60)
        assert r.status_code == 422 and r.json()["code"] == "invalid_option", r.text
        assert "use positions='contiguous' with order='relevance', or order='log'" in r.json()["message"]
        body = {"question": QUESTION, "k": 3, "positions": "contiguous", "order": "relevance", "max_new_tokens": 3}
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200 and r.json()["served_ids"] == ["c", "a", "b"], r.text
        assert r.json()["plan"] == {
            "select": None,
            "mode": "compact",
            "positions": "contiguous",
            "order": "relevance",
            "selector": "bm25",
            "k": 3,
            "budget": None,
            "budget_rows": None,
            "neighbours": 0,
            "with_headers": True,
            "rows": "native",
        }
        # no positions given: the default (contiguous here), recorded in the answer's plan, the client's and the
        # chat's; original only when asked
        for positions, want, order in ((None, "contiguous", "relevance"), ("original", "original", "log")):
            r = httpx.post(url, json={"question": QUESTION, "positions": positions, "max_new_tokens": 1}, timeout=60)
            assert r.status_code == 200 and r.json()["plan"]["positions"] == want, r.text
            assert r.json()["plan"]["order"] == order, r.text
        with Client(live.url, "m") as client:
            plan = client.query(QUESTION, max_new_tokens=1).plan
            assert (plan["positions"], plan["order"]) == ("contiguous", "relevance")
        chat = {"model": "tiny-llama", "memory": {"id": "m"}, "messages": [{"role": "user", "content": QUESTION}]}
        r = httpx.post(f"{live.url}/v1/chat/completions", json={**chat, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200 and r.json()["eventkv"]["plan"]["positions"] == "contiguous", r.text
        assert r.json()["eventkv"]["plan"]["order"] == "relevance", r.text
