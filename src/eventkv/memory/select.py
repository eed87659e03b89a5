"""Selection of events for a question: the :class:`Selector` protocol a memory ranks its view with
(``EventMemory.select`` ranks the view's events, then completes the served set with pins, a row
budget and the header), and its BM25 implementation, :class:`BM25Selector` (``"bm25"``, the default).

BM25 ranks events by their texts.

Scoring is the ``bm25s`` library's (Lù 2024, "BM25S: Orders of magnitude faster lexical search via
eager sparse scoring", arXiv 2407.03618); nothing here re-implements BM25. The choices, fixed so a
ranking is reproducible:

- **variant** ``method="lucene"`` (bm25s's default), with ``k1 = 1.5`` and ``b = 0.75``: a document
  ``D`` scores ``sum over query tokens t of idf(t) * tf(t, D) / (tf(t, D) + k1 * (1 - b + b * |D| / avgdl))``
  with ``idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))`` (Kamphuis et al. 2020, "Which BM25 do you
  mean?"). A query token given twice counts twice; a token absent from every text scores nothing.
- **tokenization** ``bm25s.tokenize``: lowercased, split by the pattern ``(?u)\\b\\w\\w+\\b`` (words of two
  or more word characters; one-character tokens are dropped), bm25s's English stopword list (NLTK's)
  removed, no stemming (stemming would need the PyStemmer package, which eventkv does not depend on).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import bm25s
import numpy as np

from eventkv.errors import EventKVError, OptionError
from eventkv.options import SELECTORS

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.memory.records import MemoryRecord
    from eventkv.models.profile import LoadedModel
    from eventkv.prefill import EventKV

#: bm25s's scoring variant and parameters used by :func:`rank` (see the module docstring)
METHOD, K1, B = "lucene", 1.5, 0.75
#: bm25s's stopword list used for texts and questions
STOPWORDS = "en"


def tokens(texts: Sequence[str]) -> list[list[str]]:
    """The BM25 tokens of each text, as :func:`rank` sees them (lowercased words of >= 2 characters,
    English stopwords removed; see the module docstring)."""
    return bm25s.tokenize(list(texts), stopwords=STOPWORDS, return_ids=False, show_progress=False)


def scores(texts: Sequence[str | None], question: str) -> np.ndarray:
    """BM25 score of every text for ``question``: ``[len(texts)]`` float32, in text order; 0 for a text
    sharing no token with the question (and for every text when the question has no token left after
    stopword removal, or no text has any token).

    Raises:
        EventKVError: no texts, or a blank question (see :func:`rank`).
    """
    texts = list(texts)
    _check(texts, question)
    checked = cast("list[str]", texts)  # _check refused every text that is not a string
    corpus = tokens(checked)
    query = tokens([question])[0]
    if not any(corpus) or not query:
        # why: bm25s cannot index an empty vocabulary, and get_scores refuses an empty query
        return np.zeros(len(texts), dtype=np.float32)
    retriever = bm25s.BM25(k1=K1, b=B, method=METHOD)
    retriever.index(corpus, show_progress=False)
    ids = retriever.get_tokens_ids(query)
    if not ids:
        return np.zeros(len(texts), dtype=np.float32)
    return np.asarray(retriever.get_scores_from_ids(ids), dtype=np.float32)


def rank(texts: list[str], question: str, k: int) -> list[int]:
    """Indices of the ``k`` texts that score highest for ``question`` under BM25 (bm25s, Lucene variant,
    k1 = 1.5, b = 0.75, English stopwords; module docstring), best first.

    Deterministic: equal scores are ordered by the lower index first, so texts sharing no token with the
    question come last in their original order. A ``k`` larger than ``len(texts)`` returns every index,
    ranked.

    Args:
        texts: the candidate texts (event texts), in history order.
        question: the query text.
        k: how many indices to return (>= 1).

    Raises:
        EventKVError: ``texts`` is empty or ``question`` is blank.
        OptionError: ``k`` is not a whole number >= 1.
    """
    check_k(k)
    return best_first(scores(texts, question))[:k]


def check_k(k) -> None:
    """Raise :class:`OptionError` unless ``k`` is a whole number >= 1 (how many events to select)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise OptionError("k", k, "select at least 1 text (a whole number >= 1).")


def best_first(s: np.ndarray) -> list[int]:
    """Indices by score, highest first; equal scores by the lower index first."""
    order = np.lexsort((np.arange(len(s)), -s.astype(np.float64)))  # last key first: score desc, then index
    return [int(i) for i in order]


def within_budget(items: Sequence, rows: Sequence[int], budget: int, used: int = 0) -> list:
    """The leading ``items`` (best first) kept while their ``rows`` fit ``budget`` on top of ``used``
    rows: stops at the first that does not fit (the lowest-ranked are dropped first)."""
    kept = []
    for item, n in zip(items, rows):
        if used + n > budget:
            break
        kept.append(item)
        used += n
    return kept


@dataclass(frozen=True)
class Ranked:
    """One ranked event: its id and its score under the selector (higher is better; units are the
    selector's own, e.g. BM25's)."""

    id: str
    score: float


def ranked(events: Sequence[MemoryRecord], s: np.ndarray, k: int | None, budget: int | None) -> list[Ranked]:
    """``events`` best first by their scores ``s`` (``[len(events)]``; equal scores in history order:
    :func:`best_first`), the first ``k`` (None: all), then with ``budget`` (rows) cut before the first
    event whose ``n_rows`` do not fit (:func:`within_budget`): what :meth:`Selector.rank` returns.

    Raises:
        OptionError: ``k`` not a whole number >= 1.
    """
    order = best_first(s)
    if k is not None:
        check_k(k)
        order = order[:k]
    if budget is not None:
        order = within_budget(order, [events[i].n_rows for i in order], budget)
    return [Ranked(events[i].id, float(s[i])) for i in order]


@dataclass(frozen=True)
class SelectionContext:
    """What a selector may read beyond the events' texts, handed to :meth:`Selector.rank` by the
    memory (``context=``); each part is computed only when a selector asks for it.

    Attributes:
        lm: the memory's model (tokenizer, profile, weights).
        rows: returns the stored history's rows (:class:`eventkv.prefill.EventKV`, header first, every
            candidate event prefilled: pending events are prefilled and committed on the first call).
        embeddings: ``embeddings(events, model_name)`` returns ``[len(events), dim]`` float32 unit
            vectors of the events' texts under a sentence-embedding model, read from the store
            (computed and stored for an event that has none under that model).
        history_end: the first position after the stored history (where a query's tokens start in
            ``positions="original"``).
    """

    lm: LoadedModel | None = None
    rows: Callable[[], EventKV] | None = None
    embeddings: Callable[[Sequence[MemoryRecord], str], np.ndarray] | None = None
    history_end: int = 0


@runtime_checkable
class Selector(Protocol):
    """What ranks a memory's events for a question (``EventMemory.create(..., selector=)``).

    ``rank`` gets the candidate events (the view: each event as its latest patch, in history order;
    each has ``id``, ``text`` and ``n_rows``) and returns them best first, ``k`` at most (None: every
    one); with ``budget`` (rows, header excluded) the ranking stops before the first event whose rows
    would not fit (:func:`within_budget`). It never reorders ties at random: the same question and
    events give the same ranking. ``context`` (:class:`SelectionContext`) gives what a selector needs
    beyond the texts (the model, the stored rows, stored embeddings); a selector that needs a part
    the context lacks raises :class:`eventkv.errors.EventKVError` naming it.
    """

    name: str

    def rank(
        self,
        question: str,
        events: Sequence[MemoryRecord],
        k: int | None = None,
        budget: int | None = None,
        *,
        context: SelectionContext | None = None,
    ) -> list[Ranked]: ...


class BM25Selector:
    """BM25 over the events' texts (:func:`scores`: bm25s, Lucene variant, k1 = 1.5, b = 0.75,
    English stopwords); ties by history order (:func:`rank`)."""

    name = "bm25"

    def rank(
        self,
        question: str,
        events: Sequence[MemoryRecord],
        k: int | None = None,
        budget: int | None = None,
        *,
        context: SelectionContext | None = None,
    ) -> list[Ranked]:
        """The events best first (see :class:`Selector`; BM25 reads only the texts, not ``context``).

        Raises:
            EventKVError: no events, a blank question, an event without text.
            OptionError: ``k`` not a whole number >= 1.
        """
        events = list(events)
        return ranked(events, scores([e.text for e in events], question), k, budget)


def selector_for(selector: Selector | str) -> Selector:
    """A :class:`Selector` from itself or its name (a name in :data:`eventkv.options.SELECTORS`).

    Raises:
        OptionError: an unknown name, or an object without a ``rank`` method.
    """
    if isinstance(selector, str):
        return SELECTORS.get(selector)()
    if not isinstance(selector, Selector):
        raise OptionError("selector", selector, "give a selector name or an object with name and rank().")
    return selector


def _check(texts: Sequence[str | None], question: str) -> None:
    if not texts:
        raise EventKVError("BM25 selection got no texts to rank: give at least one event text.")
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise EventKVError(
            f"BM25 selection got a text that is not a string at index {bad[0]} "
            f"({type(texts[bad[0]]).__name__}): give every event's text as a string."
        )
    if not isinstance(question, str) or not question.strip():
        raise EventKVError(f"BM25 selection got the question {question!r}: give a non-empty question.")
