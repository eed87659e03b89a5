"""The decode loop started from rows already in a batch (:func:`eventkv.kv.readout.generate_from`), on
stacked served caches of a tiny Llama whose output layer is scaled by 30 (clear top-two margins):
it answers as :func:`eventkv.kv.readout.read_out` does, and dropping finished sequences from the batch
(``drop_finished``, :meth:`eventkv.kv.stacked.Batch.keep` on GrowingLayers) changes no other sequence's
tokens. Seconds on a CPU."""

from __future__ import annotations

import pytest
import torch
from served_fixtures import sharp_served

from eventkv.errors import EventKVError
from eventkv.kv.readout import generate_from, read_out
from eventkv.kv.rows import cache_kv
from eventkv.kv.stacked import stack
from eventkv.testing import assert_same_greedy

TOL = 1e-4


@pytest.fixture(scope="module")
def setting():
    lm, _, caches, query = sharp_served("llama", [("all", "compact"), (["a"], "compact"), (["b", "c"], "native")])
    return lm, caches, query


def test_generate_from_answers_as_read_out(setting):
    lm, caches, query = setting
    opts = dict(max_new_tokens=5, keep_logits=True, tokenizer=lm.tokenizer)
    ref = read_out(lm.model, caches, query, generate=[True] * 3, score=[False] * 3, **opts)
    batch = stack(caches, extra=len(query) + 5)
    ids = torch.tensor([query] * 3)
    gens = generate_from(lm.model, batch, ids, **opts)
    for g, r in zip(gens, ref):
        assert r.generation is not None
        assert_same_greedy(g.tokens, g.logits, r.generation.tokens, r.generation.logits, TOL)
        assert g.text == r.generation.text and g.text


def test_generate_from_drops_finished_sequences_without_changing_the_others(setting):
    lm, caches, query = setting
    budgets = [1, 6, 3]
    ids = torch.tensor([query] * 3)
    fed = generate_from(lm.model, stack(caches), ids, max_new_tokens=budgets, keep_logits=True)
    batch, dropped = stack(caches), []
    rows = batch.mask.shape[1]
    gens = generate_from(
        lm.model,
        batch,
        ids,
        max_new_tokens=budgets,
        keep_logits=True,
        drop_finished=True,
        on_drop=lambda idx: dropped.append(idx.tolist()),
    )
    # after step 1 the first sequence leaves (rows 1, 2 stay), after step 3 the third (row 0 stays)
    assert dropped == [[1, 2], [0]]
    for g, f, n in zip(gens, fed, budgets):
        assert len(g.tokens) == n and not g.stopped
        assert_same_greedy(g.tokens, g.logits, f.tokens, f.logits, TOL)
    # the one sequence left holds its rows, the query's and the 5 tokens fed after it (the 6th is never fed)
    keys, _ = cache_kv(batch.cache)
    assert batch.size == 1 and keys[0].shape[0] == 1 and keys[0].shape[2] == rows + len(query) + 5
    assert batch.next_position.tolist() == [caches[1].next_position]


def test_generate_from_user_errors(setting):
    lm, caches, query = setting
    with pytest.raises(EventKVError, match="batch of 3 sequences but 2 max_new_tokens"):
        generate_from(lm.model, stack(caches), torch.tensor([query] * 3), max_new_tokens=[1, 2])
