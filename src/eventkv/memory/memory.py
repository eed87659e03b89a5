"""EventMemory: the sparse event-KV agent memory (Study 1's engineering conclusion, "compute
globally, materialize locally, serve sparsely").

An agent's history is prefilled once, globally and causally, and its K/V rows are kept; each
query is answered from the rows of a few events served next to the header — by default re-rotated to
the positions right after it (``positions="contiguous"``, where the model's RoPE re-rotates exactly; so
histories past the model's context are answered), or at the positions they were computed at
(``"original"``, the studies' protocol); an update is appended as a served **patch** (O(pL + p²) for a
p-token patch over an L-token history) instead of rewriting history (O(L²)); every event keeps its
text, the fallback for what served rows cannot carry. A query is a typed value
(:class:`eventkv.memory.query.MemoryQuery` with its :class:`eventkv.memory.query.QueryOptions`), its
served set chosen by :class:`eventkv.memory.query.Selection`.

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
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence, cast

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.blend import BlendSchedule
from eventkv.kv.decoding import Decoding
from eventkv.kv.log import header_text
from eventkv.kv.model import check_context
from eventkv.kv.quant import check_row_format
from eventkv.kv.serve import PositionMode, ServeMode, ServeOrder, default_positions
from eventkv.kv.windowed import PrefillWindow, check_window
from eventkv.memory.answer import (
    PreparedQuery,
    answer_prepared,
    check_query,
    prepare,
    question_ids,
    served_end,
)
from eventkv.memory.api import MemoryAPI, SelectSpec
from eventkv.memory.identity import check_identity, model_identity
from eventkv.memory.query import MemoryQuery, Plan, QueryOptions, Selection, check_question, served_positions
from eventkv.memory.records import (
    Added,
    Hit,
    MemoryAnswer,
    MemoryEvent,
    shows,
)
from eventkv.memory.select import (
    Selector,
    selector_for,
)
from eventkv.memory.store import SCHEMA_VERSION, Store
from eventkv.memory.upkeep import MemoryUpkeep
from eventkv.models.encoding import encode

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
        rows: str = "native",
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
            rows: the format the memory stores its rows in, for its life (kept in the manifest; ``docs/memory.md``,
                "Row formats"): ``native`` (the model's rows, bit for bit), ``int8`` or ``int4`` (quantized as KIVI
                lays rows out, :mod:`eventkv.kv.quant`; the header's rows and each write's last rows that fill no
                group of 32 stay native). The open memory serves and extends the rows its store holds, so a memory
                answers the same before and after it is reopened.

        Raises:
            EventKVError: ``directory`` is a file, holds a memory already, or holds other files.
            OptionError: a namespace with no character that shows (blank, or only spaces, combining marks
                or U+2800 braille pattern blank: :func:`eventkv.memory.records.shows`), an instruction that
                is not a string, an unknown selector, a window larger than the model's context, an unknown row
                format (or ``int4`` for a model whose ``head_dim`` is odd).
        """
        selector = selector_for(selector)
        check_row_format(rows)
        if rows == "int4" and lm.profile.head_dim % 2:
            raise OptionError("rows", rows, f"int4 packs two channels per byte: head_dim {lm.profile.head_dim} is odd.")
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
            "rows": rows,
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
        rows: str | None = None,
    ) -> "EventMemory":
        """Open a memory written by :meth:`create`, check it was made by ``lm`` and load its rows.

        Segment files no committed row points to are deleted first (a kill between a segment's write
        and its commit); every segment is then checked against its sha256 (``verify="size"`` or
        ``EVENTKV_MEMORY_VERIFY=size``: its size only).

        A store of schema 1 (before event checksums) is upgraded first (``docs/memory.md``).
        ``selector``, ``window``: as :meth:`create`. ``rows``: the row format the caller expects (None: the
        store's own, recorded at :meth:`create` and kept for the memory's life); another one is refused.

        Raises:
            StoreDamaged: the manifest, the database (SQLite's ``quick_check``, an event's checksum,
                a field that does not parse, the layout) or a segment file is damaged; the message
                names the memory, the event and the damaged part.
            EventKVError: no memory in ``directory``; one made by other weights, tokenizer, chat
                template or dtype (the message names both values: stale KV is refused, never used);
                a store of a newer schema.
            OptionError: an unknown selector, a window larger than the model's context; ``rows`` not a row
                format, or not the store's (the message names the store's).
        """
        selector = selector_for(selector)
        window = check_window(window, lm.profile.max_context)
        if rows is not None:
            check_row_format(rows)
        store = Store.open(directory, verify=verify)
        try:
            if rows is not None and rows != store.rows_format:
                raise OptionError(
                    "rows",
                    rows,
                    f"the memory in {str(store.directory)!r} stores its rows as {store.rows_format} (a memory keeps "
                    f"the format it was created with): open it with rows={store.rows_format!r} or without rows=, or "
                    f"create a new memory with rows={rows!r}.",
                )
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

    @property
    def rows_bytes(self) -> int:
        """Bytes of K/V rows this open memory holds in RAM: its rows (the model's dtype; a quantized store's
        dequantized) unless released, plus a quantized store's packed tensors (:meth:`release_rows`)."""
        return self._rows.held_bytes()

    def release_rows(self) -> int:
        """Drop the dequantized rows of a memory whose store is quantized (``rows="int8"`` / ``"int4"``): it keeps
        the packed tensors its files hold (an eighth to a half of the rows' bytes, scales included) and rebuilds
        the rows from them at its next query or write, without reading the disk. What a service does with open
        memories it did not use lately. A native store keeps its rows (they are its only copy in RAM).

        Returns:
            bytes freed (0 for a native store or when the rows were already released).
        """
        self._check_open()
        return self._rows.release()

    @property
    def pending(self) -> bool:
        """Whether events wait for their rows (added without ``prefill``: the next query or :meth:`prefill`
        computes them)."""
        return self._pending_job() is not None

    def update(self, event_id: str, text: str, *, prefill: bool = False, when: str | date | None = None) -> Added:
        """Append a **patch** event superseding ``event_id`` (Study 1, "Patch": an update is a served
        patch, O(pL + p²), instead of a rewrite of history, O(L²)). History is never rewritten: the
        old event keeps its text and rows; the default served set (:meth:`view_ids`) serves the
        latest patch in its place. The patch takes the event's role and tags, has no budget, and is
        named ``{root id}~{n}`` (the n-th update). Updating a patch updates the event it supersedes. With
        ``when`` the patch's text is stored dated, as :attr:`MemoryEvent.when` makes an added event's.

        Returns:
            the patch's :class:`Added`.

        Raises:
            EventKVError: unknown id, a deleted or forgotten event, empty text, or a history longer
                than the model's context. OptionError: ``when`` is not a date.
            OutOfSpace: the store's filesystem is full: nothing was kept.
        """
        self._check_open()
        if when is not None:
            text = MemoryEvent(text, when=when).stored_text()
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

    # ================================================================== selection and answers
    def selection(self) -> Selection:
        """What chooses served sets over the current view (:class:`eventkv.memory.query.Selection`), with the
        memory's selector and a :class:`eventkv.memory.select.SelectionContext` built on demand."""
        self._check_open()
        return Selection(self._table, self.selector, self._selection_context, self.lm.profile.max_context)

    def select(
        self,
        question: str,
        k: int | None = None,
        budget_rows: int | None = None,
        *,
        selector: Selector | str | None = None,
        budget: float | None = None,
        neighbours: int = 0,
        with_headers: bool = True,
    ) -> builtins.list[str]:
        """The served set for a question (``docs/memory.md``, "Selection and shaping"): the view's events
        ranked by a selector (a patched event ranked and served as its latest patch), the best ``k`` served
        each as one unit with its neighbours and group headers, within a row budget, every pinned event
        included; in history order. The header is always served by :func:`eventkv.kv.serve.serve` besides.

        Args:
            k, budget_rows, selector, budget, neighbours, with_headers: the shaping options, as
                :class:`eventkv.memory.query.QueryOptions` documents them (``selector`` None: :attr:`selector`).

        Returns:
            event ids (empty when the memory has no live events, or no event fits the budget).

        Raises:
            OptionError: a bad shaping option (:meth:`QueryOptions.check_shaping`), an unknown selector, a
                blank question.
            EventKVError: the pinned events alone need more rows than the budget.
        """
        options = QueryOptions(
            k=k,
            budget_rows=budget_rows,
            selector=selector,
            budget=budget,
            neighbours=neighbours,
            with_headers=with_headers,
        )
        return self.selection().select(question, options)

    def search(
        self,
        query: str,
        k: int | None = None,
        budget_rows: int | None = None,
        *,
        selector: Selector | str | None = None,
        budget: float | None = None,
        neighbours: int = 0,
        with_headers: bool = True,
    ) -> builtins.list[Hit]:
        """The events :meth:`select` would serve for ``query``, ranked, with their texts and scores: the
        search verb of an agent that composes its own prompt from the events (mem0's ``search``).

        The same served set as ``select(query, k, budget_rows, ...)``, each event once, ordered by its rank in
        the selector's ranking of the whole view (best first; an event served only as a neighbour, a header
        or a pin comes at its own rank). Every view event is ranked, so each hit has its score.

        Returns:
            :class:`eventkv.memory.records.Hit` per served event (id, text, score, rank, role, tags, pinned),
            best first; empty when the memory has no live events or none fits the budget.

        Raises:
            OptionError, EventKVError: as :meth:`select`; EventKVError when the selector leaves a served event
                out of its ranking.
        """
        options = QueryOptions(
            k=k,
            budget_rows=budget_rows,
            selector=selector,
            budget=budget,
            neighbours=neighbours,
            with_headers=with_headers,
        )
        return self.selection().search(query, options)

    def query(
        self,
        question: str,
        select: SelectSpec = None,
        k: int | None = None,
        mode: ServeMode = "compact",
        candidates: Sequence[str] | None = None,
        max_new_tokens: int = 32,
        *,
        budget_rows: int | None = None,
        selector: Selector | str | None = None,
        budget: float | None = None,
        neighbours: int = 0,
        with_headers: bool = True,
        keep_logits: bool = False,
        positions: PositionMode | None = None,
        order: ServeOrder | None = None,
        recompute: float | None = None,
        blend_schedule: BlendSchedule | None = None,
        messages: Sequence[Mapping] | None = None,
        decoding: Decoding | None = None,
    ) -> MemoryAnswer:
        """Answer a question from the served rows (Study 1, "Setting": sparse serving, then a readout).

        The served set's rows are served next to the header (:func:`eventkv.kv.serve.serve`, lazily
        prefilling pending events first) and the question is read after them; the answer is the greedy
        continuation (:func:`eventkv.kv.readout.read_out`), and each candidate's full continuation is scored
        (nats) when candidates are given. One :class:`eventkv.memory.query.MemoryQuery` answered by :meth:`ask`.

        Args:
            select: None = :meth:`select`'s choice; ``"view"`` = :meth:`view_ids`; ``"all"`` = every stored
                event, deleted ones included (with ``mode="compact"`` this equals a fresh prefill of header +
                events); or a list of ids.
            mode: ``compact`` | ``native`` | ``isolated`` | ``text`` | ``blend`` (:mod:`eventkv.kv.serve`).
                ``isolated`` encodes each served event alone once and keeps that encoding while the memory is
                open; ``blend`` re-prefills the ``recompute`` fraction of the served tokens whose rows deviate
                most once the served events see only each other (:mod:`eventkv.kv.blend`, CacheBlend).
            k, budget_rows, selector, budget, neighbours, with_headers, positions, order, recompute,
                blend_schedule: :class:`eventkv.memory.query.QueryOptions` (the shaping applies when
                ``select`` is None; ``positions`` None: contiguous where exact, recorded in the answer's plan).
            candidates, max_new_tokens, keep_logits, messages, decoding: as
                :class:`eventkv.memory.query.MemoryQuery` documents them.

        Returns:
            :class:`MemoryAnswer` (text, generation, candidates, served ids, their positions, rows served,
            tokens read after them, timings in ms, the plan it was served by).

        Raises:
            OptionError: a blank question, unknown mode or select, ``max_new_tokens`` < 1 or past the context,
                empty or repeated candidates, a bad shaping or serving option (:class:`QueryOptions`).
            NotFound, Gone: an explicit id unknown, or forgotten. Conflict: nothing to serve (no live events).
            EventKVError: no event within the budget, pinned events over the budget, history (served rows,
                under ``"contiguous"``) + question beyond the model's context (the message names
                ``positions="contiguous"`` where it answers), a rope type that cannot be re-rotated.
        """
        options = QueryOptions(
            k,
            budget_rows,
            selector,
            budget,
            neighbours,
            with_headers,
            mode,
            positions,
            order,
            recompute,
            blend_schedule,
        )
        q = MemoryQuery(question, None, select, options, candidates, max_new_tokens, keep_logits, messages, decoding)
        return self.ask(q)[0]

    def query_batch(self, question: str, plans: Sequence[Plan], **keywords: Any) -> builtins.list[MemoryAnswer]:
        """Answer one question under several serving plans in one batched readout: e.g. the same selection
        served as rows and re-prefilled as text, side by side. Each plan is a ``(select, mode)`` pair as in
        :meth:`query`, whose keywords (but ``select`` and ``mode``) apply to every plan; the served caches are
        read out together (left-padded, each row at its own positions), so the answers equal separate
        :meth:`query` calls within float tolerance (tested: greedy tokens equal, logits within 1e-4 in float32)
        at about the cost of one pass (decode on a CPU reads the weights once per step whatever the batch).

        Returns:
            one :class:`MemoryAnswer` per plan, in order. ``timings_ms``: ``prefill`` (lazy prefill, shared),
            ``serve`` (this plan's served cache), ``decode`` (the whole batch's readout, shared).

        Raises:
            OptionError / EventKVError: as :meth:`query`, for any plan; no plan given; a ``decoding`` with a
                step callback and several plans; a keyword :meth:`query` does not take (TypeError).
        """
        return self.ask(MemoryQuery.build(question, plans=plans, **keywords))

    def ask(self, query: MemoryQuery) -> builtins.list[MemoryAnswer]:
        """Answer ``query`` (:class:`eventkv.memory.query.MemoryQuery`): :meth:`prepare_query`, one batched
        readout (:func:`eventkv.memory.answer.answer_prepared`), then :meth:`finish_query`.

        Returns:
            one :class:`MemoryAnswer` per plan. Raises: as :meth:`query`.
        """
        prepared = self.prepare_query(query)
        answers = answer_prepared(self.lm, [prepared])[0]
        self.finish_query(query, answers)
        return answers

    def prepare_query(self, query: MemoryQuery) -> PreparedQuery:
        """The first phase of :meth:`ask`: the checks, the served ids of every plan, the lazy prefill and the
        served caches, as a :class:`eventkv.memory.answer.PreparedQuery` that holds no reference to this memory.
        :func:`eventkv.memory.answer.answer_prepared` reads it out, alone or batched with the prepared queries
        of other memories (what ``eventkv serve`` does with concurrent queries).

        Raises:
            OptionError / EventKVError: as :meth:`query`.
        """
        selection = self.selection()  # the memory checked open, its current view
        question, options = query.question, query.options
        check_question(question)
        plans = query.plan_list()
        if options.positions is None:  # the plans are checked next, with the positions resolved
            modes = [p[1] for p in plans if isinstance(p, tuple) and len(p) == 2]
            options = options.with_(positions=default_positions(self.lm.model, modes))
        options = options.with_default_budget(self.lm.profile.max_context)  # recorded in every answer's plan
        plans, cands = check_query(plans, query.max_new_tokens, query.candidates, options)
        decoding = query.decoding
        if decoding is not None:
            decoding.check()
            if decoding.on_step is not None and len(plans) > 1:
                raise OptionError("decoding", "a step callback", f"stream one plan at a time (got {len(plans)} plans).")
        served_ids, sequences = [], []
        for select, _ in plans:
            ids, sequence = selection.served(question, select, options)
            served_ids.append(ids)
            sequences.append(sequence)
        records = {r.id: r for r in self._recs}
        positions = cast(PositionMode, options.positions)  # resolved above
        # the question follows the served rows where every plan places them contiguously
        where = "contiguous" if all(served_positions(m, positions) == "contiguous" for _, m in plans) else positions
        end = self._history_end() if where == "original" else served_end(len(self.header_ids), records, served_ids)
        q = question_ids(self.lm, question, end, query.max_new_tokens, where, query.messages)
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
            max_new_tokens=query.max_new_tokens,
            candidates=cands,
            keep_logits=query.keep_logits,
            positions=positions,
            sequences=sequences,
            recompute=options.recompute,
            blend_schedule=options.blend_schedule,
            decoding=decoding,
            version=self.store.version,
            plans=[
                {**options.plan(select, mode, self.selector), "rows": self.store.rows_format} for select, mode in plans
            ],
        )

    def finish_query(self, query: MemoryQuery, answers: Sequence[MemoryAnswer]) -> builtins.list[str]:
        """The last phase of :meth:`ask`, after the readout: with ``query.remember``, store the question (role
        ``user``) and the first answer (role ``assistant``, unless blank) as events in one add (both or
        neither). Returns the ids stored (empty without ``remember``).

        Raises:
            OutOfSpace: the filesystem is full: nothing was stored (as :meth:`add`).
        """
        if not query.remember:
            return []
        turns = [MemoryEvent(query.question, role="user")]
        if answers and answers[0].text.strip():
            turns.append(MemoryEvent(answers[0].text, role="assistant"))
        return [a.id for a in self.add(turns)]


if TYPE_CHECKING:  # mypy checks EventMemory against the protocol it implements
    _implements: type[MemoryAPI] = EventMemory

__all__ = ["EventMemory", "SCHEMA_VERSION"]
