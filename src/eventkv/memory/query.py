"""A memory's query as typed values, and the served set it is answered from (Study 1, "Setting":
sparse serving of a few events' rows).

- :class:`QueryOptions` is the one definition of how a question's served set is chosen (selector, ``k``,
  budgets, neighbours, group headers) and served (mode, positions, order, selective recompute): the
  library's ``select`` / ``search`` / ``query``, the HTTP bodies, the client, the chat surface, MCP and
  the memory eval all build one, and its ``check_*`` methods are the one validation.
- :class:`MemoryQuery` is one question with its plans, options and readout settings, a value a worker
  queues; with ``remember`` the memory stores the question and its answer as events once it is answered
  (``EventMemory.finish_query``).
- :class:`Selection` chooses the served set over a memory's view: the selector's ranking, shaped
  (:func:`eventkv.memory.select.shape_units`), ordered, and refused when there is nothing to serve
  (:class:`~eventkv.errors.Conflict`), when an explicit id is unknown (:class:`~eventkv.errors.NotFound`)
  or forgotten (:class:`~eventkv.errors.Gone`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, cast

from eventkv.errors import Conflict, EventKVError, Gone, OptionError
from eventkv.kv.blend import BlendSchedule, check_recompute, check_schedule
from eventkv.kv.decoding import Decoding
from eventkv.kv.serve import PositionMode, ServeMode, ServeOrder, check_order, check_position_mode
from eventkv.memory.api import SelectSpec
from eventkv.memory.records import Hit, MemoryRecord
from eventkv.memory.select import (
    HEADER_TAG,
    Ranked,
    SelectionContext,
    Selector,
    available,
    check_shaping,
    fraction_of,
    group_headers,
    relevance_order,
    selector_for,
    shape_units,
)

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.memory.table import EventTable

#: one way to serve a question: ``(select, mode)``
Plan = tuple[SelectSpec, ServeMode]

#: the option names that shape a selector's served set (``select``'s keywords besides ``k``)
SHAPING = ("budget_rows", "selector", "budget", "neighbours", "with_headers")

#: the rows (tokens, header excluded) a question that gives no ``k`` and no budget is served within: about 10%
#: of the 11,300-16,000-token LoCoMo histories of the development-split grid, the largest budget it measured
#: and the one at which rows answered best (``docs/memory.md``, "The default plan")
DEFAULT_BUDGET_ROWS = 1600


def default_budget_rows(max_context: int | None) -> int:
    """The row budget of a question that gives neither ``k`` nor a budget: :data:`DEFAULT_BUDGET_ROWS`, at
    most half the model's context (``max_context`` tokens; None: no such limit, at least 1 row), so that the
    question and its answer fit after the served rows at contiguous positions. Fixed in rows, not a fraction
    of the history, so a query's cost does not grow with the memory."""
    if max_context is None:
        return DEFAULT_BUDGET_ROWS
    return max(1, min(DEFAULT_BUDGET_ROWS, max_context // 2))


@dataclass(frozen=True)
class QueryOptions:
    """How a question's served set is chosen and served (``docs/memory.md``, "Selection and shaping" and
    "Serving positions").

    With ``k``, ``budget_rows`` and ``budget`` all None (the default) a question is served the best events
    within :func:`default_budget_rows` rows (:meth:`with_default_budget`).

    Attributes:
        k: at most this many ranked events are chosen (a pinned one ranked among them counts); None: as many
            as the budget holds (the default budget when no budget is given).
        budget_rows: rows (tokens, header excluded) the served events may take in all, their neighbours,
            headers and the pinned events included; never exceeded.
        selector: what ranks the events, a :class:`eventkv.memory.select.Selector` or a registered name
            (:data:`eventkv.options.SELECTORS`); None: the memory's own. Only a name travels over HTTP.
        budget: the budget as a fraction in (0, 1] of the view's rows (header excluded): ``floor(budget *
            rows)`` rows, at least 1 (the fraction as written: 0.29 of 100 rows is 29). Not with ``budget_rows``.
        neighbours: w >= 0: the events ``+-w`` around each chosen event in the view (history order) are
            served with it.
        with_headers: serve the group header of every served event: an event tagged ``"header"`` heads the
            events after it until the next header (default True: a memory without header events is served the
            same either way; on LoCoMo served session headers answered temporal questions better, docs/memory.md
            "The default plan").
        mode: how the served events are served (:mod:`eventkv.kv.serve`): ``compact`` | ``native`` |
            ``isolated`` | ``text`` | ``blend`` (the single plan of ``query``, HTTP, chat and MCP).
        positions: ``"contiguous"``: the header at its positions, the served rows re-rotated to the positions
            right after it (:mod:`eventkv.kv.rope`) and the question right after them, so the context check
            counts the served rows, not the history; ``"original"``: the rows at the positions they were
            computed at, the question after the whole history (the studies' protocol). None:
            :func:`eventkv.kv.serve.default_positions` (contiguous unless a plan is ``native`` or the model's
            RoPE cannot be re-rotated exactly); the answer's ``plan`` records the one used.
        order: ``"log"`` (the served rows in history order) or ``"relevance"`` (contiguous positions only):
            the served events in increasing selector score, the most relevant last before the question (Liu
            et al. 2023, "Lost in the Middle", arXiv 2307.03172, sections 2-3); each shaping unit stays one
            block in history order, a pin at its own rank, an event the selector does not rank first
            (:func:`eventkv.memory.select.relevance_order`). None (the default): ``"relevance"`` for a
            selector's choice at contiguous positions, else ``"log"`` (:meth:`order_for`; on LoCoMo the
            best-ranked turn last answered better, docs/memory.md "Served order"); the answer's ``plan``
            records the one used.
        recompute: mode ``blend`` only: the fraction of served event tokens recomputed, in [0, 1]; None: 0.15
            (:data:`eventkv.kv.blend.DEFAULT_RECOMPUTE`).
        blend_schedule: mode ``blend`` only: ``once`` (None), ``layerwise`` (CacheBlend's gradual filtering),
            ``epic`` (the first tokens of each served event) or ``suffix`` (the last served tokens: in the
            relevance order, the best-ranked) (:data:`eventkv.kv.blend.BlendSchedule`).
    """

    k: int | None = None
    budget_rows: int | None = None
    selector: Selector | str | None = None
    budget: float | None = None
    neighbours: int = 0
    with_headers: bool = True
    mode: ServeMode = "compact"
    positions: PositionMode | None = None
    order: ServeOrder | None = None
    recompute: float | None = None
    blend_schedule: BlendSchedule | None = None

    def check_shaping(self) -> None:
        """Raises:
        OptionError: ``k`` not a whole number >= 1 or None; ``budget_rows`` not a whole
            number >= 1; ``budget`` not in (0, 1]; both budgets; ``neighbours`` not a whole number >= 0;
            ``with_headers`` not a bool (:func:`eventkv.memory.select.check_shaping`)."""
        given = self.with_default_budget(None)  # none of k and the budgets: the default budget, never refused
        check_shaping(given.k, given.budget_rows, given.budget, self.neighbours, self.with_headers)

    def check_serving(self, modes: Sequence[str]) -> None:
        """The serving options for plans of ``modes`` (``positions`` resolved, not None).

        Raises:
            OptionError: ``"contiguous"`` with a ``native`` plan or an unknown ``positions``; an unknown
                ``order``, or ``"relevance"`` without contiguous positions; a ``recompute`` outside [0, 1] or
                given when no plan is ``blend``; an unknown ``blend_schedule`` or one given when no plan is ``blend``.
        """
        for mode in modes:
            check_position_mode(self.positions, mode)
        if self.order is not None:
            check_order(self.order, self.positions)
        check_recompute(self.recompute, "blend" if "blend" in modes else modes[0])
        check_schedule(self.blend_schedule, "blend" if "blend" in modes else modes[0])

    def order_for(self, select: SelectSpec) -> ServeOrder:
        """The order a plan serving ``select`` lays its rows out in: :attr:`order` when given, else
        ``"relevance"`` for a selector's choice (``select`` None) at contiguous positions (``positions``
        resolved) and ``"log"`` for listed ids, ``"view"``, ``"all"`` and original positions."""
        if self.order is not None:
            return self.order
        return "relevance" if select is None and self.positions == "contiguous" else "log"

    def shaping(self) -> dict[str, Any]:
        """``select``'s keywords besides ``k``: :data:`SHAPING` by name."""
        return {name: getattr(self, name) for name in SHAPING}

    def keywords(self) -> dict[str, Any]:
        """Every option by name: the keywords ``EventMemory.query`` (and ``Client.query``) take."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def body(self, *names: str) -> dict[str, Any]:
        """The options ``names`` (all when none are named) as a JSON body's fields (``selector`` by name).

        Raises:
            OptionError: ``selector`` is a Selector object (it cannot travel: give a registered name).
        """
        if self.selector is not None and not isinstance(self.selector, str):
            raise OptionError(
                "selector", self.selector, "give a registered selector's name: a Selector object cannot travel."
            )
        every = self.keywords()
        return {n: every[n] for n in names} if names else every

    def plan(self, select: SelectSpec, mode: str, default_selector: Any) -> dict[str, Any]:
        """The plan one answer was served by, as plain values (``MemoryAnswer.plan``; the HTTP, chat and MCP
        answers carry it): ``select`` (None: the selector's choice; ``"view"``, ``"all"`` or the listed ids),
        ``mode``, ``positions`` (resolved; ``contiguous`` for ``text``, which re-prefills the served events right
        after the header whatever ``positions`` says), ``order`` (resolved, :meth:`order_for`); for a selector's
        choice also ``selector`` (its name), ``k``, ``budget``, ``budget_rows``, ``neighbours``, ``with_headers``;
        for ``blend`` ``recompute`` and ``blend_schedule`` (resolved to their defaults). The memory adds ``rows``,
        its store's row format."""
        plan: dict[str, Any] = {
            "select": list(select) if isinstance(select, (list, tuple)) else select,
            "mode": mode,
            "positions": served_positions(mode, cast(PositionMode, self.positions)),
            "order": self.order_for(select),
        }
        if select is None:
            chosen = self.selector or default_selector
            plan["selector"] = chosen if isinstance(chosen, str) else getattr(chosen, "name", type(chosen).__name__)
            plan["k"] = self.k
            for key in ("budget", "budget_rows", "neighbours", "with_headers"):
                plan[key] = getattr(self, key)
        if mode == "blend":
            plan["recompute"] = check_recompute(self.recompute)
            plan["blend_schedule"] = check_schedule(self.blend_schedule)
        return plan

    def with_default_budget(self, max_context: int | None) -> QueryOptions:
        """These options, or, when ``k``, ``budget_rows`` and ``budget`` are all None, a copy with ``budget_rows``
        = :func:`default_budget_rows` of the model's context (``max_context`` tokens), which the answer's plan
        records."""
        if self.k is None and self.budget_rows is None and self.budget is None:
            return self.with_(budget_rows=default_budget_rows(max_context))
        return self

    def with_(self, **changes: Any) -> QueryOptions:
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return replace(self, **changes)


@dataclass(frozen=True)
class MemoryQuery:
    """One question on one memory, as a value: what ``EventMemory.prepare_query`` serves and
    ``EventMemory.finish_query`` completes, and what the service's worker queues and batches.

    Attributes:
        question: the question; it selects the served events (with ``messages``: the last user message's text).
        plans: ``(select, mode)`` pairs, each answered from its own served set in one batched readout;
            None: one plan, ``(select, options.mode)``.
        select: the served set of the single plan when ``plans`` is None (None: the selector's choice).
        options: :class:`QueryOptions`, shared by every plan.
        candidates: answers whose full continuations are scored (nats).
        max_new_tokens: the decoding budget (tokens, >= 1).
        keep_logits: keep each generated step's logits ``[vocab]`` (float32) in ``generation.logits``.
        messages: a chat conversation read after the served rows in place of the question
            (:func:`eventkv.memory.chat.chat_tail_ids`).
        decoding: how the answers are decoded (:class:`eventkv.kv.decoding.Decoding`); None: greedy.
        remember: after answering, store the question (role ``user``) and the first plan's answer (role
            ``assistant``, when not blank) as events, in one add.
    """

    question: str
    plans: Sequence[Plan] | None = None
    select: SelectSpec = None
    options: QueryOptions = field(default_factory=QueryOptions)
    candidates: Sequence[str] | None = None
    max_new_tokens: int = 32
    keep_logits: bool = False
    messages: Sequence[Mapping] | None = None
    decoding: Decoding | None = None
    remember: bool = False

    @classmethod
    def build(cls, question: str, **keywords: Any) -> MemoryQuery:
        """A query from ``EventMemory.query``'s keywords: those of :class:`QueryOptions` go to ``options``,
        the rest to the query's own fields.

        Raises:
            TypeError: a keyword that is neither (as Python does for an unknown keyword).
        """
        names = set(QueryOptions.__dataclass_fields__)
        own = set(cls.__dataclass_fields__) - {"question", "options"}
        unknown = sorted(set(keywords) - names - own)
        if unknown:
            raise TypeError(f"query() got an unexpected keyword argument {unknown[0]!r}")
        options = QueryOptions(**{n: v for n, v in keywords.items() if n in names})
        return cls(question, options=options, **{n: v for n, v in keywords.items() if n in own})

    def plan_list(self) -> list:
        """The plans as given, or the single plan ``[(select, options.mode)]``."""
        return [(self.select, self.options.mode)] if self.plans is None else list(self.plans)


def served_positions(mode: str, positions: PositionMode) -> PositionMode:
    """Where a plan of serving ``mode`` places its rows under ``positions``: ``text`` re-prefills the served
    events right after the header, so it is ``"contiguous"`` whatever ``positions`` says."""
    return "contiguous" if mode == "text" else positions


def check_question(question) -> None:
    """Raises:
    OptionError: ``question`` is not a non-empty string."""
    if not isinstance(question, str) or not question.strip():
        raise OptionError("question", question, "give a non-empty question.")


class Selection:
    """The served set of a question over one memory's view (``docs/memory.md``, "Selection and shaping"):
    the view's events ranked by a selector (a patched event ranked and served as its latest patch), the best
    ``k`` served each as one unit with its neighbours and group headers, within a row budget, every pinned
    event included.

    Args:
        table: the memory's events (:class:`eventkv.memory.table.EventTable`).
        selector: the memory's own selector (used where the options name none).
        context: what a selector may read (:class:`eventkv.memory.select.SelectionContext`), built on demand.
        max_context: the model's context in tokens, which bounds the default budget (:func:`default_budget_rows`).
    """

    def __init__(
        self,
        table: EventTable,
        selector: Selector,
        context: Callable[[], SelectionContext],
        max_context: int | None = None,
    ) -> None:
        self.table, self.selector, self.context, self.max_context = table, selector, context, max_context

    def chosen(self, options: QueryOptions) -> Selector:
        """The selector the options name (or the memory's). Raises OptionError: an unknown name."""
        return self.selector if options.selector is None else selector_for(options.selector)

    def rank(self, selector: Selector, question: str, events: Sequence[MemoryRecord], k: int | None) -> list[Ranked]:
        """``selector``'s ranking of ``events`` (a missing library or model refused as EventKVError)."""
        with available(getattr(selector, "name", type(selector).__name__)):
            return list(selector.rank(question, events, k=k, context=self.context()))

    def choose(
        self, question: str, options: QueryOptions, rank_all: bool = False
    ) -> tuple[list[tuple[MemoryRecord, MemoryRecord]], list[Ranked], list[int], list[tuple[int, list[int]]]]:
        """The view as ``(root, served record)`` units, the selector's ranking of their served records
        (``rank_all``: every one, else the top ``k`` when no budget may skip units), the indices of the units
        served, ascending, and the same indices as the shaping units that served them
        (:func:`eventkv.memory.select.shape_units`).

        Raises:
            OptionError: a bad shaping option (:meth:`QueryOptions.check_shaping`), an unknown selector, a
                blank question. EventKVError: the pinned events alone need more rows than the budget.
        """
        chosen = self.chosen(options)
        options = options.with_default_budget(self.max_context)
        options.check_shaping()
        check_question(question)
        units = self.table.units()
        if not units:
            return [], [], [], []
        served = [cur for _, cur in units]
        rows = [r.n_rows for r in served]
        index = {r.id: i for i, r in enumerate(served)}
        k, budget_rows = options.k, options.budget_rows
        # a budget may skip units: rank every event
        ask = k if budget_rows is None and options.budget is None and not rank_all else None
        ranking = self.rank(chosen, question, served, ask)
        if options.budget is not None:
            budget_rows = fraction_of(options.budget, sum(rows))
        taken = shape_units(
            [index[r.id] for r in ranking],
            rows,
            k=k,
            budget=budget_rows,
            pinned=[i for i, (root, _) in enumerate(units) if root.pinned],
            neighbours=options.neighbours,
            headers=group_headers([HEADER_TAG in r.tags for r in served]) if options.with_headers else None,
        )
        return units, ranking, sorted({j for _, members in taken for j in members}), taken

    def select(self, question: str, options: QueryOptions) -> list[str]:
        """The served set's event ids in history order (``EventMemory.select``)."""
        units, _, kept, _ = self.choose(question, options)
        return [units[i][1].id for i in kept]

    def search(self, question: str, options: QueryOptions) -> list[Hit]:
        """The served set's events ranked best first, with their texts and scores (``EventMemory.search``).

        Raises:
            EventKVError: the selector left a served event out of its ranking (a selector ranks every event
                when ``k`` is None).
        """
        units, ranking, kept, _ = self.choose(question, options, True)
        place = {r.id: (n, r.score) for n, r in enumerate(ranking, start=1)}
        hits = []
        for root, cur in (units[i] for i in kept):
            if cur.id not in place:
                raise EventKVError(
                    f"the selector left event {cur.id!r} out of its ranking: a selector ranks every event "
                    "when k is None (eventkv.memory.select.Selector)."
                )
            n, score = place[cur.id]
            hits.append(Hit(cur.id, cast(str, cur.text), float(score), n, cur.role, cur.tags, root.pinned))
        return sorted(hits, key=lambda h: h.rank)

    def listed(self, select: SelectSpec) -> list[str]:
        """The ids of an explicit served set (``"all"``: every stored event, deleted ones included; ``"view"``;
        or a list of ids, each in its stored spelling).

        Raises:
            OptionError: an unknown ``select`` word, an id that is not a string. NotFound: an unknown id.
            Gone: a forgotten id (it has no rows to serve).
        """
        if isinstance(select, str):
            if select == "all":
                return [r.id for r in self.table.stored()]
            if select == "view":
                return self.table.view_ids()
            raise OptionError("select", select, "give None (BM25 selection), 'all', 'view', or a list of event ids.")
        ids, out = list(cast(Sequence[str], select)), []
        for i in ids:
            if not isinstance(i, str):
                raise OptionError("select", ids, "give event ids as strings.")
            rec = self.table.lookup(i)
            if rec.forgotten:
                raise Gone(f"event {i!r} is forgotten: it has no rows to serve; leave it out of the served set.")
            out.append(rec.id)  # the stored spelling (an NFD id given for an NFC one)
        return out

    def served(self, question: str, select: SelectSpec, options: QueryOptions) -> tuple[list[str], list[str] | None]:
        """The ids a plan serves, in history order, and under ``order="relevance"`` the same ids in the order
        their rows are served (:func:`eventkv.memory.select.relevance_order`: the shaping units in increasing
        rank, the best-ranked last, and with ``with_headers`` each header's group one block at its best unit's
        rank; an explicitly listed event is a unit of its own, one the selector does not rank goes first); None
        under ``"log"``.

        Raises:
            Conflict: nothing to serve (the memory has no live events, and ``"all"`` no stored ones).
            NotFound, Gone: an explicit id unknown, or forgotten. EventKVError: an empty served set (no event
                within the budget, an empty list). OptionError: as :meth:`choose` and :meth:`listed`.
        """
        sequence = None
        order = options.order_for(select)
        if select is None and order == "relevance":
            units, ranking, kept, taken = self.choose(question, options, rank_all=True)
            where = {cur.id: i for i, (_, cur) in enumerate(units)}
            rank = {where[r.id]: n for n, r in enumerate(ranking) if r.id in where}
            ids = [units[i][1].id for i in kept]
            groups = group_headers([HEADER_TAG in cur.tags for _, cur in units]) if options.with_headers else None
            sequence = [units[i][1].id for i in relevance_order(taken, rank, groups)]
        elif select is None:
            ids = self.select(question, options)
        else:
            ids = self.listed(select)
            if order == "relevance":
                view = [cur for _, cur in self.table.units()]
                ranking = self.rank(self.chosen(options), question, view, None) if view else []
                seq = {r.id: r.seq for r in self.table.records}
                logged = sorted(dict.fromkeys(ids), key=lambda i: seq[i])  # history order, each once (as served)
                place = {i: n for n, i in enumerate(logged)}
                rank = {place[r.id]: n for n, r in enumerate(ranking) if r.id in place}
                sequence = [logged[i] for i in relevance_order([(n, [n]) for n in range(len(logged))], rank)]
        if not ids and not self.table.units():
            raise Conflict("nothing to serve: the memory has no live events; add some first.")
        if not ids:
            raise EventKVError(
                f"the served set is empty (select={select!r}): no event fits the budget "
                f"(budget_rows={options.budget_rows!r}, budget={options.budget!r}): give a larger one"
                if select is None
                else f"the served set is empty (select={select!r}): give event ids, 'view' or 'all'."
            )
        return ids, sequence


__all__ = ["MemoryQuery", "Plan", "QueryOptions", "SHAPING", "Selection", "check_question"]
