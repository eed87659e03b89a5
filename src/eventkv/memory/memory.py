"""EventMemory: the sparse event-KV agent memory (Study 1's engineering conclusion, "compute
globally, materialize locally, serve sparsely").

An agent's history is prefilled once, globally and causally, and its K/V rows are kept; each
query is answered from the rows of a few events served at their original positions (by default;
``positions="contiguous"`` re-rotates them to the positions right after the header, for histories
past the model's context), next to the header; an update is appended as a served **patch** (O(pL + p²) for a
p-token patch over an L-token history) instead of rewriting history (O(L²)); every event keeps its
text, the fallback for what served rows cannot carry.

The internal view is the data path's own types: a :class:`eventkv.kv.log.TokenizedLog` of the header
and every stored event (each tokenized alone, as :func:`eventkv.kv.log.tokenize` does; budgets
honoured) and an :class:`eventkv.kv.rows.EventKV` of their rows in row order, so
:func:`eventkv.kv.serve.serve` and :mod:`eventkv.kv.readout` do the serving and answering. The store on
disk is :mod:`eventkv.memory.store`.

Example (a tiny random model; a real one comes from :func:`eventkv.models.load`):

    >>> import tempfile
    >>> from eventkv.testing import tiny_lm
    >>> lm = tiny_lm("llama")
    >>> d = tempfile.mkdtemp()
    >>> with EventMemory.create(d + "/mem", lm, namespace="demo") as mem:
    ...     added = mem.add(["Dana lives in Lisbon.", {"text": "Ravi likes tea.", "id": "ravi"}])
    ...     patch = mem.update("ravi", "Ravi likes coffee now.")
    ...     rows = mem.prefill()
    ...     ans = mem.query("What does Ravi like?", select="view", max_new_tokens=4)
    >>> [a.id for a in added], patch.id, ans.served_ids
    (['e1', 'ravi'], 'ravi~1', ['e1', 'ravi~1'])
"""

from __future__ import annotations

import builtins
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence, cast

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.blend import BlendSchedule
from eventkv.kv.decoding import Decoding
from eventkv.kv.log import Event, encode, header_text
from eventkv.kv.model import check_context
from eventkv.kv.serve import PositionMode, ServeMode, ServeOrder, default_positions
from eventkv.kv.windowed import PrefillWindow, check_window
from eventkv.memory.answer import (
    PreparedQuery,
    answer_prepared,
    check_query,
    check_question,
    prepare,
    query_plan,
    question_ids,
    served_end,
)
from eventkv.memory.api import MemoryAPI, SelectSpec
from eventkv.memory.records import (
    Added,
    Hit,
    MemoryAnswer,
    MemoryEvent,
    MemoryRecord,
    MemoryStats,
    shows,
)
from eventkv.memory.select import (
    HEADER_TAG,
    Ranked,
    Selector,
    available,
    check_shaping,
    fraction_of,
    group_headers,
    relevance_order,
    selector_for,
    shape_units,
)
from eventkv.memory.store import SCHEMA_VERSION, Store, check_identity, model_identity
from eventkv.memory.upkeep import MemoryUpkeep

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.models.profile import LoadedModel


class EventMemory(MemoryUpkeep):
    """A sparse event-KV memory over one store directory and one model (Study 1, "Setting" and the
    closing engineering conclusion). Build it with :meth:`create` or :meth:`open`; see the module
    docstring for an example and ``docs/memory.md`` for the guarantees. Implements
    :class:`eventkv.memory.api.MemoryAPI` (as the HTTP client does).

    Not thread-safe: one writer (one process, one thread) per store directory at a time.
    """

    # ================================================================== create / open / close
    @classmethod
    def create(
        cls,
        directory: str | Path,
        lm: LoadedModel,
        *,
        namespace: str,
        instruction: str | None = None,
        contract: str | Path | None = None,
        selector: Selector | str = "bm25",
        window: PrefillWindow | None = None,
    ) -> "EventMemory":
        """Make a new, empty memory in ``directory`` (absent or empty) for model ``lm``.

        Args:
            namespace: the tenant / agent this memory belongs to (kept in the manifest).
            instruction: optional fixed task instruction placed in the header after the chat head.
            contract: optional path of the model's ``contract.json`` (kept in the manifest for carriers).
            selector: what :meth:`select` ranks events with: a :class:`eventkv.memory.select.Selector`
                or its name (``"bm25"``, the default); not stored (give it again to :meth:`open`).
            window: how events past the model's context are prefilled (:class:`eventkv.kv.windowed.PrefillWindow`;
                default ``PrefillWindow.for_context(max_context)``: the whole context, chunks of a quarter of
                it); not stored (give it again to :meth:`open`; rows already computed are kept as they are).

        Raises:
            EventKVError: ``directory`` is a file, holds a memory already, or holds other files.
            OptionError: a namespace with no character that shows (blank, or only spaces, combining marks
                or U+2800 braille pattern blank: :func:`eventkv.memory.records.shows`), an instruction that
                is not a string, an unknown selector, a window larger than the model's context.
        """
        selector = selector_for(selector)
        window = check_window(window, lm.profile.max_context)
        if not isinstance(namespace, str) or not any(shows(ch) for ch in namespace):
            raise OptionError(
                "namespace",
                namespace,
                "give the memory a namespace with a letter, number, punctuation mark or symbol "
                "(e.g. the agent's name).",
            )
        if instruction is not None and not isinstance(instruction, str):
            raise OptionError("instruction", instruction, "give the task instruction as a string, or None.")
        header_ids = encode(lm.tokenizer, header_text(lm.profile, instruction or ""))
        check_context(len(header_ids), lm.profile.max_context, what="header")
        if contract is not None:
            from eventkv.memory.carriers import check_contract

            check_contract(contract, lm.profile.weights_digest, lm.profile.name)  # fail now, not at the first carrier
        manifest = {
            "namespace": namespace,
            "model": lm.profile.name,
            **model_identity(lm),
            "instruction": instruction or "",
            "header_ids": header_ids,
            "contract": str(Path(contract).resolve()) if contract is not None else None,
        }
        return cls(Store.create(directory, manifest), lm, selector, window)

    @classmethod
    def open(
        cls,
        directory: str | Path,
        lm: LoadedModel,
        *,
        verify: str | None = None,
        selector: Selector | str = "bm25",
        window: PrefillWindow | None = None,
    ) -> "EventMemory":
        """Open a memory written by :meth:`create`, check it was made by ``lm`` and load its rows.

        Segment files no committed row points to are deleted first (a kill between a segment's write
        and its commit); every segment is then checked against its sha256 (``verify="size"`` or
        ``EVENTKV_MEMORY_VERIFY=size``: its size only).

        A store of schema 1 (before event checksums) is upgraded first (``docs/memory.md``).
        ``selector``, ``window``: as :meth:`create`.

        Raises:
            StoreDamaged: the manifest, the database (SQLite's ``quick_check``, an event's checksum,
                a field that does not parse, the layout) or a segment file is damaged; the message
                names the memory, the event and the damaged part.
            EventKVError: no memory in ``directory``; one made by other weights, tokenizer, chat
                template or dtype (the message names both values: stale KV is refused, never used);
                a store of a newer schema.
            OptionError: an unknown selector, a window larger than the model's context.
        """
        selector = selector_for(selector)
        window = check_window(window, lm.profile.max_context)
        store = Store.open(directory, verify=verify)
        try:
            check_identity(store.directory, store.manifest, lm)
            mem = cls(store, lm, selector, window)
            mem._load_rows()
        except BaseException:
            store.close()
            raise
        return mem

    # ================================================================== internal state

    # ================================================================== writes

    # ================================================================== the one commit path

    def add(
        self, events: Iterable[MemoryEvent | dict | str] | MemoryEvent | dict | str, *, prefill: bool = False
    ) -> list[Added]:
        """Append events to the history (Study 1, "Setting": an agent history is a sequence of events).

        Each event is tokenized alone (``[role + ": "] + text + "\\n"``) and placed right after the
        history: its first RoPE position is the history's end, and it reserves ``budget`` positions
        (or its token count). The history may grow past the model's context: positions keep growing,
        and the events past :attr:`window` are prefilled windowed (``docs/memory.md``, "Histories
        longer than the model's context"). All events of one call are committed in one transaction; the call
        returns only after the commit. With ``prefill=True`` the rows (of these events and of any
        pending ones) are computed and their segment file and its directory fsynced *before* that
        transaction, which commits the events and the segment together: an add either returns with
        everything on disk, or raises having kept nothing.

        Args:
            events: MemoryEvent objects, dicts with the same keys, or plain strings (a single one is
                accepted too).
            prefill: compute the new rows now (eager); default lazy (the next query or :meth:`prefill`).

        Returns:
            one :class:`Added` (id, position, width) per event, in order.

        Raises:
            EventKVError: empty text, a duplicate or reserved id, an id with a comma, a budget smaller
                than the event's token count, or an event wider than the prefill window minus the header
                (checked before anything is written or computed).
            OptionError: no events, or an event id that :func:`eventkv.memory.records.canonical_event_id`
                refuses (invisible or look-alike characters; an id that looks like nothing, such as a
                lone combining mark or U+2800 braille pattern blank).
            OutOfSpace: the store's filesystem is full: nothing was kept (the memory is as before).
        """
        if isinstance(events, (str, dict, MemoryEvent)):
            events = [events]
        evs = [MemoryEvent.coerce(e) for e in events]
        if not evs:
            raise OptionError("events", [], "give at least one event to add.")
        return self._add(evs, prefill)

    def prefill(self) -> int:
        """Compute the rows of every event not yet prefilled, continuing from the stored rows
        (:func:`eventkv.kv.prefill.prefill` with ``prefix=`` the stored EventKV: O(pL + p²) attention for
        p new tokens over L stored ones; past :attr:`window`, :func:`eventkv.kv.windowed.windowed_prefill`:
        each chunk attends to the header and the window's recent rows only), and store them as one new
        segment file.

        Returns:
            rows computed (0 when every event has rows).

        Raises:
            OutOfSpace: the store's filesystem is full: no rows were kept (the events stay pending).
        """
        self._check_open()
        return self._prefill()

    def update(self, event_id: str, text: str, *, prefill: bool = False) -> Added:
        """Append a **patch** event superseding ``event_id`` (Study 1, "Patch": an update is a served
        patch, O(pL + p²), instead of a rewrite of history, O(L²)). History is never rewritten: the
        old event keeps its text and rows; the default served set (:meth:`view_ids`) serves the
        latest patch in its place. The patch takes the event's role and tags, has no budget, and is
        named ``{root id}~{n}`` (the n-th update). Updating a patch updates the event it supersedes.

        Returns:
            the patch's :class:`Added`.

        Raises:
            EventKVError: unknown id, a deleted or forgotten event, empty text, or a history longer
                than the model's context.
            OutOfSpace: the store's filesystem is full: nothing was kept.
        """
        self._check_open()
        root = self._root(self._lookup(event_id))
        if not root.live:
            how = "forgotten" if root.forgotten else "deleted"
            raise EventKVError(f"event {root.id!r} is {how}: it cannot be updated; add a new event instead.")
        n = 1 + sum(1 for r in self._recs if r.kind == "patch" and r.supersedes == root.id)
        ids = {r.id for r in self._recs}
        pid = f"{root.id}~{n}"
        while pid in ids:
            n += 1
            pid = f"{root.id}~{n}"
        item = {"id": pid, "text": text, "role": root.role, "tags": root.tags, "budget": None, "kind": "patch"}
        (added,) = self._append([{**item, "supersedes": root.id}], prefill=prefill)
        return added

    def delete(self, event_id: str) -> None:
        """Tombstone an event: its text and rows are kept (they are part of the stored history, and
        ``select="all"`` still serves them) but it leaves the default served set; a deleted event's
        patches leave with it. Deleting a patch falls back to the previous live patch (or the event).

        Raises:
            EventKVError: unknown id, or an event already deleted or forgotten.
        """
        self._check_open()
        rec = self._lookup(event_id)
        if not rec.live:
            raise EventKVError(f"event {event_id!r} is already {'forgotten' if rec.forgotten else 'deleted'}.")
        self._commit(lambda tx: tx.mark_deleted(rec.seq))

    def pin(self, event_id: str, pinned: bool = True) -> None:
        """Keep an event in every served set :meth:`select` builds (or release it with ``pinned=False``).
        Pinning a patch pins the event it supersedes (the view serves its latest patch).

        Raises:
            EventKVError: unknown id; pinning a deleted or forgotten event.
        """
        self._check_open()
        self._pin([event_id], pinned)

    # ================================================================== reads
    def get(self, event_id: str) -> MemoryRecord:
        """The stored record of one event (a forgotten event: its marker, ``text=None``).

        Raises:
            EventKVError: unknown id.
        """
        self._check_open()
        return self._lookup(event_id)

    def history(self, event_id: str) -> list[MemoryRecord]:
        """The event and its patches (deleted ones included, flagged), oldest first. Given a patch's
        id, the history of the event it supersedes.

        Raises:
            EventKVError: unknown id.
        """
        self._check_open()
        return self._table.history(event_id)

    def list(self, include_superseded: bool = False, include_deleted: bool = False) -> list[MemoryRecord]:
        """Records in history order. Default: the view (:meth:`view_ids`): live events, each superseded
        one replaced by its latest patch. ``include_superseded``: also superseded events and older
        patches; ``include_deleted``: also tombstoned ones (and the patches of a deleted event).
        Forgotten markers are never listed (see :meth:`get`)."""
        self._check_open()
        return self._table.list(include_superseded, include_deleted)

    def view_ids(self) -> builtins.list[str]:
        """The default served set, in history order: live events (not deleted or forgotten), each
        superseded event replaced by its latest live patch; pinned events are live events, so included."""
        self._check_open()
        return self._table.view_ids()

    def stats(self) -> MemoryStats:
        """Counts and sizes (see :class:`MemoryStats`); ``bytes_on_disk`` sums every file of the store."""
        self._check_open()
        return self._table.stats(
            rows_prefilled=self._rows.n_rows,
            segments=len(self.store.segment_rows()),
            bytes_on_disk=self.store.bytes_on_disk(),
            version=self.store.version,
        )

    # ================================================================== selection and answers
    def select(
        self,
        question: str,
        k: int | None = 8,
        budget_rows: int | None = None,
        *,
        selector: Selector | str | None = None,
        budget: float | None = None,
        neighbours: int = 0,
        with_headers: bool = False,
    ) -> builtins.list[str]:
        """The served set for a question (``docs/memory.md``, "Selection and shaping"): the view's
        events ranked by a selector (a patched event is ranked and served as its latest patch), the
        best ``k`` served each as one unit with its neighbours and group headers, within a row budget,
        every pinned event included; in history order. The header is always served by
        :func:`eventkv.kv.serve.serve` besides. The fill is :func:`eventkv.memory.select.shape`.

        Args:
            k: at most this many ranked events are chosen (a pinned one ranked among them counts);
                None: as many as the budget holds (needs ``budget_rows`` or ``budget``).
            budget_rows: rows (tokens, header excluded) the served events may take in all, their
                neighbours, headers and the pinned events included; never exceeded.
            selector: what ranks the events for this call, a :class:`eventkv.memory.select.Selector`
                or a registered name (:data:`eventkv.options.SELECTORS`); None: the memory's own
                (:attr:`selector`, from :meth:`create` / :meth:`open`).
            budget: the budget as a fraction in (0, 1] of the view's rows (the rows of
                :meth:`view_ids`' events, header excluded): ``floor(budget * rows)`` rows, at least 1
                (the fraction as written: 0.29 of 100 rows is 29). Not with ``budget_rows``.
            neighbours: w >= 0: the events ``+-w`` around each chosen event in the view (history
                order) are served with it.
            with_headers: serve the group header of every served event: an event tagged ``"header"``
                (``MemoryEvent(tags=("header",))``) heads the events after it until the next header.

        Returns:
            event ids (empty when the memory has no live events, or no event fits the budget).

        Raises:
            OptionError: ``k`` not a whole number >= 1 (or None without a budget); ``budget_rows`` not
                a whole number >= 1; ``budget`` not in (0, 1]; both budgets; ``neighbours`` not a whole
                number >= 0; ``with_headers`` not a bool; an unknown selector; a blank question.
            EventKVError: the pinned events alone need more rows than the budget.
        """
        units, _, kept, _ = self._choose(question, k, budget_rows, selector, budget, neighbours, with_headers)
        return [units[i][1].id for i in kept]

    def search(
        self,
        query: str,
        k: int | None = 8,
        budget_rows: int | None = None,
        *,
        selector: Selector | str | None = None,
        budget: float | None = None,
        neighbours: int = 0,
        with_headers: bool = False,
    ) -> builtins.list[Hit]:
        """The events :meth:`select` would serve for ``query``, ranked, with their texts and scores:
        the search verb of an agent that composes its own prompt from the events (mem0's ``search``).

        The same served set as ``select(query, k, budget_rows, ...)`` (the same shaping: pins,
        neighbours, group headers, a row budget), each event once, ordered by its rank in the
        selector's ranking of the whole view (best first: the score never increases down the list;
        an event served only as a neighbour, a header or a pin comes at its own rank). Every view
        event is ranked (the selector is called with ``k=None``), so each hit has its score.

        Args:
            query: the question or search text (not blank).
            k, budget_rows, selector, budget, neighbours, with_headers: as :meth:`select`.

        Returns:
            :class:`eventkv.memory.records.Hit` per served event (id, text, score, rank, role, tags,
            pinned), best first; empty when the memory has no live events or none fits the budget.

        Raises:
            OptionError, EventKVError: as :meth:`select`; EventKVError when the selector leaves a served
                event out of its ranking (a :class:`eventkv.memory.select.Selector` ranks every event
                when ``k`` is None).
        """
        units, ranking, kept, _ = self._choose(query, k, budget_rows, selector, budget, neighbours, with_headers, True)
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

    def _choose(
        self,
        question: str,
        k: int | None,
        budget_rows: int | None,
        selector: Selector | str | None,
        budget: float | None,
        neighbours: int,
        with_headers: bool,
        rank_all: bool = False,
    ) -> tuple[
        builtins.list[tuple[MemoryRecord, MemoryRecord]],
        builtins.list[Ranked],
        builtins.list[int],
        builtins.list[tuple[int, builtins.list[int]]],
    ]:
        """The view as ``(root, served record)`` units, the selector's ranking of their served records
        (``rank_all``: every one, else the top ``k`` when no budget may skip units), the indices of
        the units served (:func:`eventkv.memory.select.shape`), ascending, and the same indices as the
        shaping units that served them (:func:`eventkv.memory.select.shape_units`). Checks as :meth:`select`."""
        self._check_open()
        chosen = self.selector if selector is None else selector_for(selector)
        check_shaping(k, budget_rows, budget, neighbours, with_headers)
        check_question(question)
        units = self._units()
        if not units:
            return [], [], [], []
        served = [cur for _, cur in units]
        rows = [r.n_rows for r in served]
        index = {r.id: i for i, r in enumerate(served)}
        # a budget may skip units: rank every event
        ask = k if budget_rows is None and budget is None and not rank_all else None
        with available(getattr(chosen, "name", type(chosen).__name__)):  # a missing library or model: refused
            ranking = chosen.rank(question, served, k=ask, context=self._selection_context())
        if budget is not None:
            budget_rows = fraction_of(budget, sum(rows))
        taken = shape_units(
            [index[r.id] for r in ranking],
            rows,
            k=k,
            budget=budget_rows,
            pinned=[i for i, (root, _) in enumerate(units) if root.pinned],
            neighbours=neighbours,
            headers=group_headers([HEADER_TAG in r.tags for r in served]) if with_headers else None,
        )
        return units, ranking, sorted({j for _, members in taken for j in members}), taken

    # ------------------------------------------------------------------ sentence embeddings (eventkv.memory.dense)

    def _served_ids(self, question: str, select: SelectSpec, k: int | None, shaping: dict) -> builtins.list[str]:
        """The ids a plan serves; ``shaping``: :meth:`select`'s keywords (budget_rows, selector, budget,
        neighbours, with_headers), used when ``select`` is None."""
        if select is None:
            return self.select(question, k, **shaping)
        if isinstance(select, str):
            if select == "all":
                return [r.id for r in self._stored()]
            if select == "view":
                return self.view_ids()
            raise OptionError("select", select, "give None (BM25 selection), 'all', 'view', or a list of event ids.")
        ids, out = list(select), []
        for i in ids:
            if not isinstance(i, str):
                raise OptionError("select", ids, "give event ids as strings.")
            rec = self._lookup(i)
            if rec.forgotten:
                raise EventKVError(
                    f"event {i!r} is forgotten: it has no rows to serve; leave it out of the served set."
                )
            out.append(rec.id)  # the stored spelling (an NFD id given for an NFC one)
        return out

    def _served_in_order(
        self, question: str, select: SelectSpec, k: int | None, shaping: dict, order: ServeOrder
    ) -> tuple[builtins.list[str], builtins.list[str] | None]:
        """The ids a plan serves (:meth:`_served_ids`) and, under ``order="relevance"``, the same ids in the
        order their rows are served (:func:`eventkv.memory.select.relevance_order`: the shaping units in
        increasing rank under the selector's ranking of the view, the best-ranked last); None under ``"log"``.
        An explicitly listed event is a unit of its own; one outside the view (a replaced or deleted event,
        which the selector does not rank) goes first."""
        if order == "log":
            return self._served_ids(question, select, k, shaping), None
        if select is None:
            units, ranking, kept, taken = self._choose(question, k, **shaping, rank_all=True)
            where = {cur.id: i for i, (_, cur) in enumerate(units)}
            rank = {where[r.id]: n for n, r in enumerate(ranking) if r.id in where}
            return [units[i][1].id for i in kept], [units[i][1].id for i in relevance_order(taken, rank)]
        ids = self._served_ids(question, select, k, shaping)
        chosen = self.selector if shaping["selector"] is None else selector_for(shaping["selector"])
        view = [cur for _, cur in self._units()]
        ranking = []
        if view:
            with available(getattr(chosen, "name", type(chosen).__name__)):
                ranking = chosen.rank(question, view, k=None, context=self._selection_context())
        seq = {r.id: r.seq for r in self._recs}
        logged = sorted(dict.fromkeys(ids), key=lambda i: seq[i])  # history order, each once (as served)
        place = {i: n for n, i in enumerate(logged)}
        rank = {place[r.id]: n for n, r in enumerate(ranking) if r.id in place}
        return ids, [logged[i] for i in relevance_order([(n, [n]) for n in range(len(logged))], rank)]

    def query(
        self,
        question: str,
        select: SelectSpec = None,
        k: int | None = 8,
        mode: ServeMode = "compact",
        candidates: Sequence[str] | None = None,
        max_new_tokens: int = 32,
        *,
        # selection: passed to select() when select is None
        budget_rows: int | None = None,
        selector: Selector | str | None = None,
        budget: float | None = None,
        neighbours: int = 0,
        with_headers: bool = False,
        # readout
        keep_logits: bool = False,
        # serving positions and the served rows' order under contiguous positions
        positions: PositionMode | None = None,
        order: ServeOrder = "log",
        # selective recompute (mode "blend")
        recompute: float | None = None,
        blend_schedule: BlendSchedule | None = None,
        # a conversation read in place of the question, and how the answer is decoded
        messages: Sequence[Mapping] | None = None,
        decoding: Decoding | None = None,
    ) -> MemoryAnswer:
        """Answer a question from served rows (Study 1, "Setting": sparse serving, then a readout).

        Pending events are prefilled first (lazy prefill) and their segment committed; when the
        store's filesystem is full the query is answered from the rows computed in memory, which
        are not kept (the events stay pending; the next query or :meth:`prefill` tries again), so a
        full disk never fails a read. By default the served events' rows are re-rotated to the
        positions right after the header and the question follows them (``positions``, below;
        ``"original"`` keeps the rows where they were computed); the answer is the
        greedy continuation (:func:`eventkv.kv.readout.read_out`), and each candidate's full
        continuation is scored (nats) when candidates are given.

        Args:
            select: None = :meth:`select` (BM25 top-``k`` + patches + pins); ``"view"`` = :meth:`view_ids`;
                ``"all"`` = every stored event, deleted ones included (their rows are part of the stored
                history): with ``mode="compact"`` this equals a fresh prefill of header + events; or a list of ids.
            mode: ``compact`` | ``native`` | ``isolated`` | ``text`` | ``blend`` (:mod:`eventkv.kv.serve`).
                ``isolated`` encodes each served event alone once and keeps that encoding while the memory
                is open (at most one copy of each event's rows), as a chunked-encoding store would.
                ``blend`` re-prefills the ``recompute`` fraction of the served tokens whose rows deviate
                most once the served events see only each other (:mod:`eventkv.kv.blend`, CacheBlend).
            budget_rows, selector, budget, neighbours, with_headers: the served set's shaping, passed
                to :meth:`select` when ``select`` is None (ignored otherwise).
            keep_logits: keep each generated step's logits ``[vocab]`` (float32) in ``generation.logits``.
            positions: ``"contiguous"``: the header at its positions, the served rows re-rotated to the positions
                right after it (RoPE re-rotation, :mod:`eventkv.kv.rope`) and the question right after them, so the
                question's context check counts the served rows, not the history (histories past the model's
                context are answered); or ``"original"``: the served rows at the positions they were computed at,
                the question after the whole history (the studies' protocol). None (default):
                :func:`eventkv.kv.serve.default_positions`, contiguous unless a plan is ``native`` or the model's
                RoPE cannot be re-rotated exactly; ``MemoryAnswer.plan`` records the one used. Contiguous is for
                ``compact``, ``isolated``, ``blend`` and ``text`` (already contiguous); ``native`` refuses it.
                ``MemoryAnswer.positions`` reports each event's first served position and its rows.
            order: ``"log"`` (default: the served rows in history order) or ``"relevance"`` (with
                ``positions="contiguous"`` only): the served events in increasing selector score, so the most
                relevant one is the last before the question, where a long-context reader uses it best (Liu et
                al. 2023, "Lost in the Middle", arXiv 2307.03172, sections 2-3). Each shaping unit (an event with
                its neighbours and group headers) stays one block in history order, placed at its event's rank;
                a pin sits at its own rank; ties follow the selector's ranking (history order for BM25); an
                event the selector does not rank (a replaced or deleted event listed explicitly) goes first
                (:func:`eventkv.memory.select.relevance_order`). The rows are re-rotated to their new positions;
                their contents stay those of the prefill. ``served_ids`` and ``positions`` list the events in
                the order served. Opt-in; not measured on LoCoMo yet.
            recompute: mode ``blend`` only: the fraction of served event tokens recomputed, in [0, 1];
                None = 0.15 (:data:`eventkv.kv.blend.DEFAULT_RECOMPUTE`).
            blend_schedule: mode ``blend`` only: which tokens are recomputed on which layer, ``once`` (None: the
                default), ``layerwise`` (CacheBlend's gradual filtering) or ``epic`` (the first tokens of each
                served event) (:data:`eventkv.kv.blend.BlendSchedule`).
            messages: a chat conversation read after the served rows in place of the question
                (:func:`eventkv.memory.chat.chat_tail_ids`: the model's chat template continues the
                header's user turn; one user message ``q`` reads exactly as ``question=q``). The
                ``question`` still selects the served events: give the last user message's text.
            decoding: how the answer is decoded (:class:`eventkv.kv.decoding.Decoding`: seeded sampling,
                stop strings, a per-step text callback); None: greedy.

        Returns:
            :class:`MemoryAnswer` (text, generation, candidates, served ids, their positions, rows
            served, tokens read after them, timings in ms).

        Raises:
            OptionError: a blank question, unknown mode or select, ``max_new_tokens`` < 1 or past the
                context, empty or repeated candidates, a bad shaping keyword (as :meth:`select`), an
                unknown ``positions`` or ``"contiguous"`` with ``native``, an unknown ``order`` or
                ``"relevance"`` without ``positions="contiguous"``, ``recompute`` outside [0, 1] or
                with a mode other than ``blend``, an unknown ``blend_schedule`` or one with a mode other than
                ``blend``.
            EventKVError: an unknown or forgotten id, nothing to serve (an empty memory or selection, no
                event within the budget), pinned events over the budget, history (served rows, under
                ``"contiguous"``) + question beyond the model's context (a history longer than the context
                is answered with ``positions="contiguous"``: the message says so), a rope type that cannot
                be re-rotated (``"contiguous"``: :func:`eventkv.kv.rope.rerotate`).
        """
        return self.query_batch(
            question,
            [(select, mode)],
            k=k,
            candidates=candidates,
            max_new_tokens=max_new_tokens,
            budget_rows=budget_rows,
            selector=selector,
            budget=budget,
            neighbours=neighbours,
            with_headers=with_headers,
            keep_logits=keep_logits,
            positions=positions,
            order=order,
            recompute=recompute,
            blend_schedule=blend_schedule,
            messages=messages,
            decoding=decoding,
        )[0]

    def query_batch(
        self,
        question: str,
        plans: Sequence[tuple[SelectSpec, ServeMode]],
        *,
        k: int | None = 8,
        candidates: Sequence[str] | None = None,
        max_new_tokens: int = 32,
        # selection: passed to select() for a plan whose select is None
        budget_rows: int | None = None,
        selector: Selector | str | None = None,
        budget: float | None = None,
        neighbours: int = 0,
        with_headers: bool = False,
        # readout
        keep_logits: bool = False,
        # serving positions and the served rows' order under contiguous positions
        positions: PositionMode | None = None,
        order: ServeOrder = "log",
        # selective recompute (mode "blend")
        recompute: float | None = None,
        blend_schedule: BlendSchedule | None = None,
        # a conversation read in place of the question, and how the answers are decoded
        messages: Sequence[Mapping] | None = None,
        decoding: Decoding | None = None,
    ) -> builtins.list[MemoryAnswer]:
        """Answer one question under several serving plans in one batched readout: e.g. the same
        selection served as rows and re-prefilled as text, side by side. Each plan is a
        ``(select, mode)`` pair as in :meth:`query`; the served caches are read out together
        (:func:`eventkv.kv.readout.read_out`: left-padded, each row at its own positions), so the
        answers equal separate :meth:`query` calls within float tolerance (tested: greedy tokens
        equal, logits within 1e-4 in float32) while decoding costs about one batched pass instead of
        one pass per plan — decode on a CPU reads the weights once per step whatever the batch size.

        ``positions`` and ``order`` apply to every plan (as in :meth:`query`); under ``"contiguous"`` the
        question's context check counts the largest plan's header and served rows.

        Returns:
            one :class:`MemoryAnswer` per plan, in order. ``timings_ms``: ``prefill`` (lazy prefill,
            shared), ``serve`` (this plan's served cache), ``decode`` (the whole batch's readout, shared).
            ``recompute`` applies to every ``blend`` plan (and is refused when no plan is ``blend``).

        The keywords are :meth:`query`'s, shared by every plan (``decoding``: each plan samples from its
        own generator, seeded alike).

        Raises:
            OptionError / EventKVError: as :meth:`query`, for any plan; no plan given; a ``decoding``
                with a step callback and several plans (whose pieces would interleave).
        """
        prepared = self.prepare_query(
            question,
            plans,
            k=k,
            candidates=candidates,
            max_new_tokens=max_new_tokens,
            budget_rows=budget_rows,
            selector=selector,
            budget=budget,
            neighbours=neighbours,
            with_headers=with_headers,
            keep_logits=keep_logits,
            positions=positions,
            order=order,
            recompute=recompute,
            blend_schedule=blend_schedule,
            messages=messages,
            decoding=decoding,
        )
        return answer_prepared(self.lm, [prepared])[0]

    def prepare_query(
        self,
        question: str,
        plans: Sequence[tuple[SelectSpec, ServeMode]],
        *,
        k: int | None = 8,
        candidates: Sequence[str] | None = None,
        max_new_tokens: int = 32,
        budget_rows: int | None = None,
        selector: Selector | str | None = None,
        budget: float | None = None,
        neighbours: int = 0,
        with_headers: bool = False,
        keep_logits: bool = False,
        positions: PositionMode | None = None,
        order: ServeOrder = "log",
        recompute: float | None = None,
        blend_schedule: BlendSchedule | None = None,
        messages: Sequence[Mapping] | None = None,
        decoding: Decoding | None = None,
    ) -> PreparedQuery:
        """The first phase of :meth:`query_batch` (same arguments): the checks, the served ids of
        every plan, the lazy prefill and the served caches, as a
        :class:`eventkv.memory.answer.PreparedQuery` that holds no reference to this memory.
        :func:`eventkv.memory.answer.answer_prepared` reads it out, alone or batched with the
        prepared queries of other memories (what ``eventkv serve`` does with concurrent queries);
        ``answer_prepared(lm, [mem.prepare_query(q, plans, ...)])[0]`` is ``mem.query_batch(q, plans, ...)``.

        Raises:
            OptionError / EventKVError: as :meth:`query_batch`.
        """
        self._check_open()
        check_question(question)
        if positions is None:  # the plans are checked next, with the positions resolved
            modes = [p[1] for p in plans if isinstance(p, tuple) and len(p) == 2]
            positions = default_positions(self.lm.model, modes)
        plans, cands = check_query(plans, max_new_tokens, candidates, positions, recompute, blend_schedule, order)
        if decoding is not None:
            decoding.check()
            if decoding.on_step is not None and len(plans) > 1:
                raise OptionError("decoding", "a step callback", f"stream one plan at a time (got {len(plans)} plans).")
        shaping = dict(
            budget_rows=budget_rows, selector=selector, budget=budget, neighbours=neighbours, with_headers=with_headers
        )
        served_ids, sequences = [], []
        for select, _ in plans:
            ids, sequence = self._served_in_order(question, select, k, shaping, order)
            sequences.append(sequence)
            if not ids:
                raise EventKVError(
                    "nothing to serve: the memory has no live events; add some first"
                    if not self._units()
                    else f"the served set is empty (select={select!r}): no event fits the budget "
                    f"(budget_rows={budget_rows!r}, budget={budget!r}): give a larger one"
                    if select is None
                    else f"the served set is empty (select={select!r}): give event ids, 'view' or 'all'."
                )
            served_ids.append(ids)
        records = {r.id: r for r in self._recs}
        where = "contiguous" if all(mode == "text" for _, mode in plans) else positions  # text re-prefills contiguously
        end = self._history_end() if where == "original" else served_end(len(self.header_ids), records, served_ids)
        q = question_ids(self.lm, question, end, max_new_tokens, where, messages)
        t0 = time.perf_counter()
        ekv = self._lazy_prefill()
        prefill_ms = 1e3 * (time.perf_counter() - t0)
        assert ekv is not None  # every served set is non-empty (checked above): the history has events, with rows
        return prepare(
            self.lm,
            ekv,
            served_ids,
            [mode for _, mode in plans],
            q,
            records=records,
            isolated=self._rows.isolated,
            prefill_ms=prefill_ms,
            max_new_tokens=max_new_tokens,
            candidates=cands,
            keep_logits=keep_logits,
            positions=positions,
            sequences=sequences,
            recompute=recompute,
            blend_schedule=blend_schedule,
            decoding=decoding,
            version=self.store.version,
            plans=[
                query_plan(
                    select,
                    mode,
                    positions=positions,
                    order=order,
                    k=k,
                    shaping=shaping,
                    recompute=recompute,
                    blend_schedule=blend_schedule,
                    default_selector=self.selector,
                )
                for select, mode in plans
            ],
        )

    def event_log(self, select: SelectSpec = "all"):
        """The stored events as an :class:`eventkv.kv.log.EventLog` (header instruction included), e.g. for
        a fresh prefill to compare against. ``select``: ``"all"`` (stored history) or ``"view"``."""
        from eventkv.kv.log import EventLog

        self._check_open()
        recs = self._stored() if select == "all" else [cur for _, cur in self._units()]
        return EventLog(
            # stored and live events alike have their text (only a forgotten one has none)
            [Event(r.id, cast(str, r.text), r.role, r.budget) for r in recs],
            instruction=self.store.manifest["instruction"],
        )


if TYPE_CHECKING:  # mypy checks EventMemory against the protocol it implements
    _implements: type[MemoryAPI] = EventMemory

__all__ = ["EventMemory", "SCHEMA_VERSION"]
