"""The two-stage ``rerank`` selector (eventkv.memory.rerank): the candidate pool, the scores against a hand
computation from the two stages run apart, its errors, and a memory selecting by name."""

import collections

import numpy as np
import pytest

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.log import Event, EventLog, tokenize
from eventkv.kv.prefill import prefill
from eventkv.memory import EventMemory
from eventkv.memory.attention import AttentionSelector
from eventkv.memory.rerank import DEFAULT_LAYERS, DEFAULT_POOLING, RerankSelector, pool_of, rerank_scores
from eventkv.memory.select import BM25Selector, Ranked, SelectionContext
from eventkv.testing import TINY_FAMILIES, tiny_lm

Candidate = collections.namedtuple("Candidate", "id text n_rows tags", defaults=((),))
TEXTS = [
    "register A set to ON",
    "Dana moved the red key",
    "register B mirrors A",
    "the cat sat on a mat",
    "Dana found the key under the mat",
    "the lamp is blue",
]
QUESTION = "Who moved the key?"


class Fixed:
    """A first stage that ranks the events in a fixed order."""

    def __init__(self, order):
        self.name, self.order = "fixed", order

    def rank(self, question, events, k=None, budget=None, *, context=None):
        ids = {e.id for e in events}
        return [Ranked(i, 1.0 / (n + 1)) for n, i in enumerate(i for i in self.order if i in ids)][:k]


class Raw(BM25Selector):
    """A second stage whose scores are not shares in [0, 1] (as BM25's raw scores are not)."""

    def scores(self, question, events, context=None):
        return np.linspace(0.0, 3.5, len(events))


def setup(family):
    lm = tiny_lm(family)
    events = [Event(f"e{i}", t) for i, t in enumerate(TEXTS)]
    log = tokenize(EventLog(events), lm.tokenizer, lm.profile)
    ekv = prefill(lm.model, log)
    cands = [Candidate(e.id, e.text, log.span(e.id).n_tokens) for e in events]
    return lm, cands, SelectionContext(lm=lm, rows=lambda: ekv, history_end=log.history_end)


def test_the_pool_is_the_longest_prefix_within_its_share_of_the_rows():
    rows = [4, 6, 5, 5]  # 20 rows
    assert pool_of([2, 0, 1, 3], rows, 0.5) == [2, 0]  # 5 + 4 fit in 10, + 6 does not
    assert pool_of([2, 0, 1, 3], rows, 1.0) == [2, 0, 1, 3]
    assert pool_of([1, 0], rows, 0.1) == [1]  # the first event even when it alone is over the share
    assert pool_of([], rows, 0.5) == []


def test_scores_put_every_candidate_above_the_rest():
    got = rerank_scores([3, 1, 0, 2], [3, 1], np.array([0.2, 0.7]), 4)
    assert got.tolist() == pytest.approx([1 / 4, 1.7, 1 / 5, 1.2])


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_rerank_equals_the_two_stages_run_apart(family):
    lm, cands, ctx = setup(family)
    first = ["e3", "e1", "e4", "e0", "e5", "e2"]
    sel = RerankSelector(Fixed(first), pool=0.5, layers=[1], pooling="mass")
    rows = {c.id: c.n_rows for c in cands}
    pool, used = [], 0
    for i in first:  # the candidates by hand: the first stage's best events within half of the rows
        if pool and used + rows[i] > sum(rows.values()) // 2:
            break
        pool.append(i)
        used += rows[i]
    assert 1 < len(pool) < len(cands)
    picked = [c for c in cands if c.id in pool]
    second = AttentionSelector([1], "mass").scores(QUESTION, picked, ctx)  # the softmax over the pool's rows only
    by_id = dict(zip([c.id for c in picked], second))
    want = sorted(pool, key=lambda i: (-by_id[i], [c.id for c in cands].index(i))) + first[len(pool) :]
    got = sel.rank(QUESTION, cands, context=ctx)
    assert [r.id for r in got] == want
    assert [r.score for r in got[: len(pool)]] == pytest.approx(sorted((1 + s for s in second), reverse=True))
    assert all(r.score < 1 for r in got[len(pool) :])


def test_a_pool_of_every_row_is_the_second_stage_alone():
    lm, cands, ctx = setup("llama")
    got = RerankSelector(Fixed([c.id for c in cands]), pool=1.0).rank(QUESTION, cands, context=ctx)
    want = AttentionSelector(DEFAULT_LAYERS, DEFAULT_POOLING).rank(QUESTION, cands, context=ctx)
    assert [r.id for r in got] == [r.id for r in want]


def test_errors_name_the_bad_value():
    for bad in (0, 1.5, True, "half"):
        with pytest.raises(OptionError, match="^pool "):
            RerankSelector(pool=bad)
    with pytest.raises(OptionError, match="^pooling "):
        RerankSelector(pooling="median")
    lm, cands, ctx = setup("qwen3")
    with pytest.raises(EventKVError, match="scored outside \\[0, 1\\] \\(0 .. 3.5\\)"):  # not shares
        RerankSelector(Fixed([c.id for c in cands]), pool=0.5, second=Raw()).rank(QUESTION, cands, context=ctx)
    with pytest.raises(OptionError, match="^context "):  # the attention stage needs the model and rows
        RerankSelector("bm25", pool=0.5).rank(QUESTION, cands)


def test_a_memory_selects_by_rerank(tmp_path):
    lm = tiny_lm("qwen2")
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add(TEXTS)
        got = mem.select(QUESTION, k=2, selector="rerank")
        view = mem.list()
        want = [r.id for r in RerankSelector().rank(QUESTION, view, k=2, context=mem._selection_context())]
        assert len(got) == 2 and got == sorted(want, key=[r.id for r in view].index)
