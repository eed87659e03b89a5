"""Queries of several memories read out in one batch (:func:`eventkv.memory.answer_prepared`) answer
as each read out alone: the same greedy tokens, every step's logits within 1e-4 (float32), the same
candidate log-probabilities within 1e-4 — with questions of different lengths, different decoding
budgets and different serving modes in one batch, on a full-attention model and on one with
sliding-window layers (tiny random models, their output layer sharpened)."""

from __future__ import annotations

import pytest
import torch
from tiers import slow_except

from eventkv.errors import EventKVError
from eventkv.kv.readout import read_out
from eventkv.kv.serve import serve
from eventkv.memory import EventMemory, MemoryQuery, answer_prepared
from eventkv.testing import assert_same_greedy, tiny_lm

TOL = 1e-4
FAMILIES = ("llama", "qwen2", "gemma3")

HISTORIES = {
    "a": ["Dana lives in Lisbon and works on the grant proposal.", "Ravi will handle the quarterly report."],
    "b": ["Mei moved the server migration to Friday.", "Tomas asked for the demo slides.", "Aiko is in Kyoto."],
    "c": ["The team offsite is on Tuesday at 10:30 in Porto."],
}

#: (memory, question, plan, max_new_tokens): questions of several lengths, budgets and modes
QUERIES = [
    ("a", "Where does Dana live?", ("view", "compact"), 5),
    ("b", "Who moved the server migration, and to which day?", ("view", "text"), 3),
    ("a", "What will Ravi handle?", ("all", "native"), 7),
    ("c", "When is it?", ("view", "isolated"), 4),
    ("b", "Where is Aiko?", (None, "compact"), 6),
]


def sharp_lm(family: str):
    """A tiny random model whose output layer is scaled by 30: greedy steps with clear top-two margins."""
    lm = tiny_lm(family)
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(30.0)
    return lm


@pytest.fixture(scope="module", params=slow_except(FAMILIES, "gemma3"))
def memories(request, tmp_path_factory):
    lm = sharp_lm(request.param)
    root = tmp_path_factory.mktemp(f"batch-{request.param}")
    mems = {name: EventMemory.create(root / name, lm, namespace="t") for name in HISTORIES}
    for name, texts in HISTORIES.items():
        mems[name].add(texts, prefill=name != "c")  # c's rows come from the lazy prefill of its first query
    yield lm, mems
    for mem in mems.values():
        mem.close()


def prepared(mems, queries, **kw):
    return [
        mems[m].prepare_query(MemoryQuery.build(question, plans=[plan], max_new_tokens=n, keep_logits=True, **kw))
        for m, question, plan, n in queries
    ]


def test_queries_of_several_memories_read_out_together_answer_as_alone(memories):
    lm, mems = memories
    batch = prepared(mems, QUERIES)
    assert len({len(p.query_ids) for p in batch}) == len(QUERIES)  # every question a length of its own
    together = answer_prepared(lm, batch)
    assert [len(a) for a in together] == [1] * len(QUERIES)
    assert len({a[0].timings_ms["decode"] for a in together}) == 1  # one readout
    full = set()  # the budgets that ended a generation (the others stopped on a stop token)
    for (m, question, (select, mode), n), [got] in zip(QUERIES, together):
        alone = mems[m].query(question, select=select, mode=mode, max_new_tokens=n, keep_logits=True)
        assert got.served_ids == alone.served_ids and got.positions == alone.positions
        assert got.n_rows_served == alone.n_rows_served
        assert len(alone.generation.tokens) == n or alone.generation.stopped
        full |= {n} if len(alone.generation.tokens) == n else set()
        assert_same_greedy(
            got.generation.tokens, got.generation.logits, alone.generation.tokens, alone.generation.logits, TOL
        )
        assert got.text == alone.text and got.generation.stopped == alone.generation.stopped
    assert len(full) >= 2  # budgets of several sizes decoded in one batch


def test_queries_with_other_candidates_are_read_out_in_their_own_batch(memories):
    lm, mems = memories
    cities = prepared(mems, QUERIES[:2], candidates=["Lisbon", "Porto"])
    plain = prepared(mems, QUERIES[2:4])
    together = answer_prepared(lm, [cities[0], plain[0], cities[1], plain[1]])
    decode = [a[0].timings_ms["decode"] for a in together]
    assert decode[0] == decode[2] and decode[1] == decode[3] and decode[0] != decode[1]  # two readouts
    for (m, question, (select, mode), n), [got] in zip([QUERIES[0], QUERIES[2], QUERIES[1], QUERIES[3]], together):
        cands = ["Lisbon", "Porto"] if question in (QUERIES[0][1], QUERIES[1][1]) else None
        alone = mems[m].query(question, select=select, mode=mode, max_new_tokens=n, keep_logits=True, candidates=cands)
        assert_same_greedy(
            got.generation.tokens, got.generation.logits, alone.generation.tokens, alone.generation.logits, TOL
        )
        assert [c.text for c in got.candidates] == [c.text for c in alone.candidates] == (cands or [])
        for c, r in zip(got.candidates, alone.candidates):
            assert c.tokens == r.tokens and abs(c.logprob - r.logprob) <= TOL


def test_read_out_decodes_queries_of_several_lengths_and_budgets_as_alone(memories):
    """The readout itself: per-cache queries of different lengths and per-cache budgets give each
    cache's readout alone (tokens equal, logits within TOL); candidates scored per length group."""
    lm, mems = memories
    ekv = mems["b"]._lazy_prefill()
    caches = [serve(ekv, "all", "compact"), serve(ekv, [mems["b"].view_ids()[0]], "compact")]
    caches.append(caches[0])
    queries = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    budgets = [4, 2, 6]
    cands = [[40, 41], [42]]
    opts = dict(candidates=cands, max_context=lm.profile.max_context, keep_logits=True)
    outs = read_out(lm.model, caches, queries, generate=[True] * 3, score=[True] * 3, max_new_tokens=budgets, **opts)
    for sc, q, n, got in zip(caches, queries, budgets, outs):
        [alone] = read_out(lm.model, [sc], q, generate=[True], score=[True], max_new_tokens=n, **opts)
        assert got.generation is not None and alone.generation is not None
        assert len(got.generation.tokens) == n or got.generation.stopped
        assert_same_greedy(
            got.generation.tokens, got.generation.logits, alone.generation.tokens, alone.generation.logits, TOL
        )
        for c, r in zip(got.candidates, alone.candidates):
            assert abs(c.logprob - r.logprob) <= TOL
    with pytest.raises(EventKVError, match="3 served caches but 2 max_new_tokens"):
        read_out(lm.model, caches, queries, generate=[True] * 3, score=[False] * 3, max_new_tokens=[1, 2])
