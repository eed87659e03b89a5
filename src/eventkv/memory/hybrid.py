"""Fused selection: :class:`HybridSelector` (``"hybrid"``), reciprocal rank fusion of other selectors.

Reciprocal rank fusion (Cormack, Clarke & Büttcher 2009, "Reciprocal rank fusion outperforms
Condorcet and individual rank learning methods", SIGIR, §2): an event ranked ``r`` (1 = best) by
selector ``s`` earns ``1 / (k_rrf + r)`` from it, and its fused score is the sum over the selectors
(an event a selector does not rank earns nothing from it); ``k_rrf = 60`` as in the paper. Only
ranks are fused, so the selectors' scores need no common scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from eventkv.errors import OptionError
from eventkv.memory.select import ScoringSelector, SelectionContext, Selector, selector_for

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.memory.records import MemoryRecord

#: RRF's constant (Cormack et al. 2009, §2)
K_RRF = 60
#: The fused selectors by default (names in :data:`eventkv.options.SELECTORS`, resolved at rank)
DEFAULT_SELECTORS: tuple[str, ...] = ("bm25", "dense", "attention")


class HybridSelector(ScoringSelector):
    """Reciprocal rank fusion of ``selectors`` (module docstring): each ranks every event (no ``k``, no
    budget), the fused score is ``sum over selectors of 1 / (k_rrf + rank)``; ties by history order;
    then ``k`` and ``budget`` as :class:`eventkv.memory.select.BM25Selector` honours them.

    Args:
        selectors: names (:data:`eventkv.options.SELECTORS`) or selector objects; default
            :data:`DEFAULT_SELECTORS` (BM25, dense embeddings, the model's attention). Names are
            resolved at :meth:`rank` (:func:`eventkv.memory.select.selector_for`).
        k_rrf: the constant added to every rank (default 60), a number > 0.

    Raises:
        OptionError: no selectors, or ``k_rrf`` not a number > 0.
    """

    name = "hybrid"

    def __init__(self, selectors: Sequence[Selector | str] = DEFAULT_SELECTORS, k_rrf: float = K_RRF) -> None:
        if isinstance(selectors, str) or not isinstance(selectors, Sequence) or not selectors:
            raise OptionError("selectors", selectors, "give one or more selector names or Selector objects.")
        if isinstance(k_rrf, bool) or not isinstance(k_rrf, (int, float)) or not k_rrf > 0:
            raise OptionError("k_rrf", k_rrf, "give a number > 0 (60 in Cormack et al. 2009).")
        self.selectors, self.k_rrf = tuple(selectors), float(k_rrf)

    @property
    def embedding_model(self) -> str | None:
        """The first fused selector's ``embedding_model`` (the vectors a memory stores at add: see
        :class:`eventkv.memory.dense.DenseSelector`), or None when no fused selector embeds."""
        models = [getattr(selector_for(s), "embedding_model", None) for s in self.selectors]
        return next((m for m in models if m), None)

    @property
    def embedding_device(self) -> str:
        """Where the fused dense selector embeds (``"cpu"`` when none says)."""
        devices = [getattr(selector_for(s), "embedding_device", None) for s in self.selectors]
        return next((d for d in devices if d), "cpu")

    def scores(
        self, question: str, events: Sequence[MemoryRecord], context: SelectionContext | None = None
    ) -> np.ndarray:
        """``[len(events)]`` float64 fused RRF scores of the events, in the given order.

        Raises:
            OptionError: an unknown selector name; what the fused selectors raise.
        """
        events = list(events)
        where = {e.id: i for i, e in enumerate(events)}
        fused = np.zeros(len(events), dtype=np.float64)
        for s in self.selectors:
            for rank, r in enumerate(selector_for(s).rank(question, events, context=context), start=1):
                fused[where[r.id]] += 1.0 / (self.k_rrf + rank)
        return fused
