"""Candidate scoring in the query's forward: the candidates' continuations ride along after the query as a
prefix tree of branches (:class:`eventkv.kv.stacked.CandidateTree`, :meth:`Batch.forward_tree`), each branch
seeing the served rows, the query and itself. Its scores must be those of scoring each candidate as the
plain continuation of the query (a float64 reference), on every tiny family — Gemma 3 with a window
shorter than the history, so that the sliding layers' window decides what a branch token sees — and the
generation that follows must be the one without scoring."""

from __future__ import annotations

import copy

import pytest
import torch
from tiers import slow_except

import eventkv.kv.readout as readout
from eventkv.kv.log import TokenizedLog
from eventkv.kv.prefill import prefill
from eventkv.kv.readout import CandidateTree, read_out
from eventkv.kv.rows import cache_from_rows
from eventkv.kv.serve import serve
from eventkv.testing import TINY_FAMILIES, tiny_model

VOCAB = 320
PREFIX = [7, 8]  # a two-token answer prefix, shared by every candidate's branch
CANDS = [[11], [12], [13, 14, 15], [13, 14, 16], [13, 17]]  # one-token and shared multi-token continuations


def _log(seed: int = 5) -> TokenizedLog:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(20, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    return TokenizedLog.from_ids(ids(6), [(f"e{i}", ids(9), None) for i in range(5)])


def _reference(model, tlog, served_ids, mode, query, cand) -> float:
    """Float64: prefill, serve, then the query + answer prefix + candidate as one plain forward."""
    m64 = copy.deepcopy(model).double()
    s64 = serve(prefill(m64, tlog), served_ids, mode=mode)
    seq = list(query) + PREFIX + list(cand[:-1])
    pos = torch.arange(s64.next_position, s64.next_position + len(seq)).unsqueeze(0)
    visible = torch.ones(s64.n_rows, dtype=torch.bool) if s64.visible is None else s64.visible
    mask = torch.cat([visible, torch.ones(len(seq), dtype=torch.bool)]).unsqueeze(0)
    with torch.inference_mode():
        out = m64(
            input_ids=torch.tensor([seq]),
            position_ids=pos,
            use_cache=True,
            attention_mask=mask,
            cache=cache_from_rows(s64.keys, s64.values),
        ).logits[0]
    lp = torch.log_softmax(out, dim=-1)
    at = torch.arange(len(query) + len(PREFIX) - 1, len(seq))
    return float(lp[at, torch.tensor(cand)].sum())


def test_the_tree_has_one_node_per_distinct_input_prefix():
    tree = CandidateTree.of([PREFIX + c for c in CANDS])
    # "7", "7 8", then "7 8 13" and "7 8 13 14" (shared by three candidates): 4 nodes, not 2 + 2 + 4 + 4 + 3
    assert tree.tokens == [7, 8, 13, 14]
    assert tree.depths == [0, 1, 2, 3]
    assert tree.ancestors[3] == [True, True, True, True] and tree.ancestors[0] == [True, False, False, False]
    siblings = CandidateTree.of([[1, 2, 3], [1, 4, 5]])
    assert siblings.tokens == [1, 2, 4] and siblings.ancestors[2] == [True, False, True]


@pytest.mark.parametrize("family", slow_except(TINY_FAMILIES, "gemma3"))
def test_scores_from_the_query_forward_match_a_float64_reference(family):
    model = tiny_model(family, sliding_window=12)  # shorter than every served history here
    tlog = _log()
    query = [30, 31, 32, 33]
    ekv = prefill(model, tlog)
    served = [
        (["e1", "e3"], "compact"),
        (["e0", "e2", "e4"], "native"),
        (["e4"], "compact"),  # fewer rows: left-padded in the batch
    ]
    caches = [serve(ekv, ids, mode) for ids, mode in served]
    got = read_out(
        model,
        caches,
        query,
        generate=[False] * 3,
        score=[True] * 3,
        candidates=CANDS,
        answer_prefix_ids=PREFIX,
    )
    for (ids, mode), r in zip(served, got):
        ref = [_reference(model, tlog, ids, mode, query, c) for c in CANDS]
        assert [c.logprob for c in r.candidates] == pytest.approx(ref, abs=1e-5)
        assert [len(c.token_logprobs) for c in r.candidates] == [len(c) for c in CANDS]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_one_forward_and_two_forwards_score_and_generate_alike(family, monkeypatch):
    """The branch rows are dropped before decoding: the tokens generated after scoring in the query's
    forward are those generated without scoring, and the scores equal the separate branch forward's
    (the path taken by attention implementations without 4D masks)."""
    model = tiny_model(family, sliding_window=12)
    ekv = prefill(model, _log(7))
    caches = [serve(ekv, ["e1", "e3"], "compact"), serve(ekv, ["e2"], "native")]
    opts = dict(candidates=CANDS, answer_prefix_ids=PREFIX, max_new_tokens=6, keep_logits=True)
    one = read_out(model, caches, [40, 41, 42], generate=[True, True], score=[True, True], **opts)
    plain = read_out(model, caches, [40, 41, 42], generate=[True, True], score=[False, False], **opts)
    forwards = []
    hook = model.get_decoder().register_forward_pre_hook(lambda *a: forwards.append(1))
    monkeypatch.setattr(readout, "takes_4d_masks", lambda m: False)
    two = read_out(model, caches, [40, 41, 42], generate=[False, False], score=[True, True], **opts)
    hook.remove()
    assert len(forwards) == 2  # the query's, then the branches'
    for a, b, c in zip(one, plain, two):
        assert a.generation.tokens == b.generation.tokens
        assert torch.allclose(torch.stack(a.generation.logits), torch.stack(b.generation.logits), atol=1e-5)
        assert [x.logprob for x in a.candidates] == pytest.approx([x.logprob for x in c.candidates], abs=1e-5)


def test_scoring_takes_one_forward_with_the_query(monkeypatch):
    model = tiny_model("qwen2")
    ekv = prefill(model, _log())
    forwards = []
    hook = model.get_decoder().register_forward_pre_hook(lambda *a: forwards.append(1))
    read_out(model, [serve(ekv, ["e1"], "compact")], [30, 31], generate=[False], score=[True], candidates=CANDS)
    hook.remove()
    assert len(forwards) == 1
