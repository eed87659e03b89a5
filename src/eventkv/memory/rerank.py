"""Two-stage selection: :class:`RerankSelector` (``"rerank"``), a first selector's candidates re-ranked by the
model's attention.

A first-stage selector (``first``, default ``"hybrid"``) ranks every event; its best events up to
``pool`` of the view's rows (a fraction, the candidates) are scored again by the model's attention to
their stored keys (:class:`eventkv.memory.attention.AttentionSelector`, the softmax over the candidates'
rows only) and served in that order; the events outside the pool follow in the first stage's order. So
the attention decides among a few plausible turns instead of among every row of a long history, where
its scores are near chance (``docs/memory.md``, "Selectors"). This is the retrieve-then-rerank pipeline
of dense retrieval (Nogueira & Cho 2019, "Passage Re-ranking with BERT", arXiv 1901.04085, §1-3: a cheap
first stage over everything, an expensive scorer over its top candidates), with the serving model's
own attention as the second-stage scorer in place of a cross-encoder, as MemArt scores turns by
attention over their stored keys. A cross-encoder through sentence-transformers is not the default
because no such model is packaged with eventkv and the machines it runs on need not reach a model hub;
any scorer can take the second stage (``second=``: a selector name or object).

Scores: a candidate scores ``1 + s`` with ``s`` its second-stage score in [0, 1] (attention pooled to a
softmax share), an event outside the pool ``1 / (1 + r)`` with ``r`` its first-stage rank (1 = best), so
every candidate ranks above every other event and the scores never increase down the ranking.
The defaults (``layers``, ``pool``, ``pooling``) are measured with ``benchmarks/rerank_layers.py`` on the
LoCoMo development split at 16,000 tokens (see :data:`DEFAULT_LAYERS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from eventkv.errors import EventKVError, OptionError
from eventkv.memory.attention import AttentionSelector, Pooling
from eventkv.memory.select import ScoringSelector, SelectionContext, Selector, selector_for, within_budget

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.memory.records import MemoryRecord

#: The first stage by default (a name in :data:`eventkv.options.SELECTORS`).
DEFAULT_FIRST = "hybrid"
#: The candidates: the first stage's best events up to this fraction of the view's rows (measured with the layers
#: below: 0.1 beat 0.2 and 0.4 at every budget from 2.5% on both halves of the development split).
DEFAULT_POOL = 0.1
#: The attention layers of the second stage, as fractions of depth (:func:`eventkv.memory.attention.resolve_layers`):
#: layer 6 of qwen2.5-coder-1.5b's 28, chosen on LoCoMo dev conversations 0-2 (45 questions, 16,000 tokens, session
#: headers, every layer and two poolings swept; ``benchmarks/rerank_layers.py``) and checked on conversations 3-6
#: (60 questions): evidence recall of the served turns over ``hybrid`` alone +0.024 / +0.022 / +0.059 at budgets
#: 2.5% / 5% / 10% of the rows, but -0.10 at 1% (bfloat16; Intel Xeon, 2 cores, AVX512-BF16 + AMX).
DEFAULT_LAYERS: tuple[float, ...] = (0.22,)
#: The second stage's pooling of an event's rows.
DEFAULT_POOLING: Pooling = "max"


def pool_of(order: Sequence[int], rows: Sequence[int], pool: float) -> list[int]:
    """The candidates: the longest prefix of ``order`` (indices into ``rows``, best first) whose rows sum to at most
    ``floor(pool * sum(rows))`` (at least the first event).

    Returns:
        the prefix, in ``order``'s order (empty only when ``order`` is).
    """
    return within_budget(order, [rows[i] for i in order], int(pool * sum(rows))) or list(order[:1])


def rerank_scores(first: Sequence[int], candidates: Sequence[int], second: np.ndarray, n: int) -> np.ndarray:
    """The two-stage scores of ``n`` events (module docstring, "Scores").

    Args:
        first: the first stage's ranking, indices best first (every event).
        candidates: the indices re-ranked (a prefix of ``first``).
        second: ``[len(candidates)]`` second-stage scores of the candidates, in [0, 1].

    Returns:
        ``[n]`` float64 scores, in event order.
    """
    out = np.zeros(n, dtype=np.float64)
    for r, i in enumerate(first, start=1):
        out[i] = 1.0 / (1.0 + r)
    for i, s in zip(candidates, second):
        out[i] = 1.0 + float(s)
    return out


class RerankSelector(ScoringSelector):
    """A first selector's candidates re-ranked by a second (module docstring).

    Args:
        first: the first stage, a selector name or object (default ``"hybrid"``).
        pool: the candidates' share of the view's rows, in (0, 1] (default :data:`DEFAULT_POOL`).
        second: the second stage, a selector name or object; None (default): the model's attention at
            ``layers`` with ``pooling``.
        layers, pooling: the default second stage's (:class:`eventkv.memory.attention.AttentionSelector`).

    Raises:
        OptionError: ``pool`` not a number in (0, 1]; a bad ``layers`` or ``pooling``.
    """

    name = "rerank"

    def __init__(
        self,
        first: Selector | str = DEFAULT_FIRST,
        pool: float = DEFAULT_POOL,
        second: Selector | str | None = None,
        *,
        layers: Sequence[int | float] = DEFAULT_LAYERS,
        pooling: Pooling = DEFAULT_POOLING,
    ) -> None:
        if isinstance(pool, bool) or not isinstance(pool, (int, float)) or not 0 < pool <= 1:
            raise OptionError("pool", pool, "give the candidates' share of the view's rows, a number in (0, 1].")
        self.first, self.pool = first, float(pool)
        self.second = second if second is not None else AttentionSelector(layers, pooling)

    @property
    def embedding_model(self) -> str | None:
        """The first stage's ``embedding_model`` (the vectors a memory stores at add), or None."""
        return getattr(selector_for(self.first), "embedding_model", None)

    @property
    def embedding_device(self) -> str:
        """The first stage's ``embedding_device`` (``"cpu"`` when it has none)."""
        return getattr(selector_for(self.first), "embedding_device", "cpu")

    def scores(
        self, question: str, events: Sequence[MemoryRecord], context: SelectionContext | None = None
    ) -> np.ndarray:
        """``[len(events)]`` float64 two-stage scores (module docstring), in event order.

        Raises:
            EventKVError, OptionError: as the two stages' ``rank`` / ``scores`` (no events, a blank question, a
                context without the model or rows for the attention stage); a second stage that scores outside
                [0, 1] (rank it as a first stage instead).
        """
        events = list(events)
        first = selector_for(self.first).rank(question, events, context=context)
        index = {e.id: i for i, e in enumerate(events)}
        order = [index[r.id] for r in first]
        candidates = pool_of(order, [e.n_rows for e in events], self.pool)
        second_stage = selector_for(self.second)
        pick = [events[i] for i in candidates]
        if isinstance(second_stage, ScoringSelector):
            second = np.asarray(second_stage.scores(question, pick, context), dtype=np.float64)
        else:
            ranked = second_stage.rank(question, pick, context=context)
            by_id = {r.id: r.score for r in ranked}
            second = np.array([by_id.get(e.id, 0.0) for e in pick], dtype=np.float64)
        if second.size and (not np.isfinite(second).all() or second.min() < 0 or second.max() > 1):
            raise EventKVError(
                f"the second stage {getattr(second_stage, 'name', second_stage)!r} scored outside [0, 1] "
                f"({second.min():.3g} .. {second.max():.3g}): a re-ranker's scores must be shares in [0, 1]; use "
                "the attention selector, or that selector as the first stage."
            )
        return rerank_scores(order, candidates, second, len(events))
