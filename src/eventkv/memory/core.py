"""The state and the one commit path of an event-KV memory (:class:`MemoryCore`), under the verbs of
:class:`eventkv.memory.EventMemory`: the store and its event table, the in-memory rows, validation and
tokenization of new events, the lazy prefill of pending events, and :meth:`MemoryCore._commit`, through
which every write goes all or nothing (a new segment fsynced before the transaction that points to it).
"""

from __future__ import annotations

import builtins
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Self, Sequence, cast

from eventkv.errors import EventKVError, OptionError, OutOfSpace, StoreDamaged
from eventkv.kv.log import HEADER_ID, Event, TokenizedLog
from eventkv.kv.model import model_device
from eventkv.kv.quant import decode_rows
from eventkv.kv.rows import EventKV
from eventkv.kv.windowed import PrefillWindow, check_window, windowed_prefill
from eventkv.memory.api import SelectSpec
from eventkv.memory.integrity import damaged
from eventkv.memory.records import Added, MemoryEvent, MemoryRecord, MemoryStats
from eventkv.memory.rows import RowCache, tail, with_tail
from eventkv.memory.select import SelectionContext, Selector, selector_for
from eventkv.memory.sql import EventRow, Writes
from eventkv.memory.store import Store, now
from eventkv.memory.table import EventTable
from eventkv.models.encoding import encode

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.memory.dense import StoredEmbeddings
    from eventkv.models.profile import LoadedModel


class MemoryCore:
    """One store directory and one model, with the events read from the store (:class:`EventTable`)
    and their rows in memory (:class:`RowCache`); the base of :class:`eventkv.memory.EventMemory`,
    which builds it (``create`` / ``open``). Not thread-safe: one writer per store directory.
    """

    def __init__(
        self, store: Store, lm: LoadedModel, selector: Selector | str = "bm25", window: PrefillWindow | None = None
    ) -> None:
        self.store = store
        self.lm = lm
        #: ranks the view's events for :meth:`select` (:class:`eventkv.memory.select.Selector`)
        self.selector = selector_for(selector)
        #: how events past the model's context are prefilled (:class:`eventkv.kv.windowed.PrefillWindow`)
        self.window = check_window(window, lm.profile.max_context)
        self.header_ids: list[int] = list(store.manifest["header_ids"])
        self._closed = False
        self._recs: list[MemoryRecord] = []
        self._tokens: dict[str, list[int]] = {}
        self._rows = RowCache(store.rows_format)
        self._reload()

    @property
    def directory(self) -> Path:
        return self.store.directory

    @property
    def namespace(self) -> str:
        return self.store.manifest["namespace"]

    @property
    def rows_format(self) -> str:
        """The format the store keeps its rows in (``native``, ``int8`` or ``int4``: ``docs/memory.md``, "Row
        formats"), chosen at create and recorded in the manifest; every reader reads the store in it."""
        return self.store.rows_format

    @property
    def version(self) -> int:
        """The store's write counter: bumped by every committed write that changes the events (add,
        update, delete, forget, pin, carrier, rebase) — not by a prefill, which only computes rows, so
        a query (which prefills pending events) never moves it; what an HTTP client sends as
        ``expected_version``."""
        self._check_open()
        return self.store.version

    def close(self) -> None:
        """Close the database connection (idempotent). Every acknowledged write is already on disk; a
        purge a reader blocked (:class:`eventkv.errors.PurgePending`) is tried once more first (at
        most 1 s), else the next open completes it."""
        if not self._closed:
            self.store.close()
            self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        """Every verb starts here: refuse a closed memory; when another connection committed to the
        database since the last read (an ``sqlite3`` shell, a process without the writer lock), read
        the events again, so a change made behind the memory's back is checked before it is used."""
        if self._closed:
            raise EventKVError(f"the memory {str(self.store.directory)!r} is closed: open it again.")
        if self.store.data_version() != self._data_version:
            self._reload()

    def _reload(self) -> None:
        """Read every event row and check it (:meth:`EventTable.from_rows`: checksums, JSON fields,
        layout); raises StoreDamaged naming the event and the damaged field (and again at every verb
        until the store reads whole)."""
        seen = self.store.data_version()
        rows = self.store.event_rows()
        self._table = EventTable.from_rows(rows, len(self.header_ids), self.store.directory)
        self._recs = self._table.records
        self._by_id = self._table.by_id
        self._tokens = self._table.tokens
        self._data_version = seen

    def _stored(self) -> list[MemoryRecord]:
        """Every event with rows in the history (deleted included, forgotten excluded), in history order."""
        return self._table.stored()

    def _log(self, recs: Sequence[MemoryRecord]) -> TokenizedLog:
        return TokenizedLog(
            list(self.header_ids), [r.id for r in recs], [self._tokens[r.id] for r in recs], [r.budget for r in recs]
        )

    def _history_end(self) -> int:
        return self._table.history_end()

    def _n_rows(self) -> int:
        return self._table.n_rows()

    @property
    def _ekv(self) -> EventKV | None:
        """The in-memory rows of the stored history (:class:`eventkv.memory.rows.RowCache`)."""
        return self._rows.ekv

    @property
    def _isolated(self) -> dict[tuple, tuple]:
        """The isolated encodings of served events (``serve(..., isolated_memo=)``)."""
        return self._rows.isolated

    def _load_rows(self) -> None:
        """Read every segment (row order), check the rows line up with the prefilled events, and keep
        them as the in-memory EventKV."""
        prefilled = [r for r in self._stored() if r.prefilled]
        self._rows.load(
            self.store.segment_rows(),
            self.store.read_segment,
            self.lm.profile.num_layers,
            self._log(prefilled) if prefilled else None,
            model_device(self.lm.model),  # segments are read on the CPU; the rows go to the model once
            self.lm.profile.weights_digest,
            self._corrupt,
        )

    def _corrupt(self, what: str) -> StoreDamaged:
        return damaged(self.store.directory, what)

    def _lookup(self, event_id: str) -> MemoryRecord:
        return self._table.lookup(event_id)

    def _root(self, rec: MemoryRecord) -> MemoryRecord:
        return self._table.root(rec)

    def _units(self) -> list[tuple[MemoryRecord, MemoryRecord]]:
        """The current view as ``(root event, served record)`` pairs (:meth:`EventTable.units`)."""
        return self._table.units()

    def _add(self, events: Sequence[MemoryEvent], prefill: bool) -> list[Added]:
        """:meth:`_append` of checked :class:`MemoryEvent` s (``EventMemory.add``'s work)."""
        items = [
            {"id": e.id, "text": e.stored_text(), "role": e.role, "tags": e.tags, "budget": e.budget, "kind": e.kind}
            for e in events
        ]
        return self._append(items, prefill=prefill)

    def _append(self, items: list[dict], prefill: bool = False) -> list[Added]:
        """Validate, tokenize and insert events in one transaction; nothing is written if any is bad.
        With ``prefill``, the rows of every pending event and of the new ones are computed first and
        their segment committed in the same transaction (:meth:`_commit`): all or nothing.

        ``items``: dicts with text, role, id (or None), tags, budget, kind, supersedes.
        """
        self._check_open()
        taken = {r.id for r in self._recs}
        seq = (self._recs[-1].seq if self._recs else 0) + 1
        pos, row = self._history_end(), self._n_rows()
        rows, added = [], []
        for it in items:
            eid = it["id"]
            if eid is None:
                eid, n = f"e{seq}", 1
                while eid in taken:
                    eid, n = f"e{seq}-{n}", n + 1
            if not isinstance(eid, str) or eid in taken:
                if any(r.id == eid and r.forgotten for r in self._recs):
                    where = "a forgotten event of this memory had it (forgotten ids stay reserved)"
                elif any(r.id == eid for r in self._recs):
                    where = "an event of this memory already has it"
                else:
                    where = "it is given twice in this call"
                raise EventKVError(
                    f"duplicate event id {eid!r}: {where}; give another id (or leave id out and the memory names it)."
                )
            if it.get("kind") != "patch" and "~" in eid:
                raise EventKVError(
                    f"event id {eid!r}: '~' is reserved for patch ids (id~n, made by update): give an id without '~'."
                )
            if eid == HEADER_ID:
                raise EventKVError(f"event id {HEADER_ID!r} is reserved for the header: give another id.")
            ev = Event(eid, it["text"], it["role"], it["budget"])  # the log's schema: raises EventKVError
            toks = encode(self.lm.tokenizer, ev.render())
            if not toks:
                raise EventKVError(f"event {eid!r} tokenizes to no tokens: give it some text.")
            width = len(toks) if ev.budget is None else ev.budget
            if width < len(toks):
                raise EventKVError(
                    f"event {eid!r} has {len(toks)} tokens but a position budget of {ev.budget}: raise its budget "
                    f"to at least {len(toks)} or leave it out."
                )
            widest = self.window.max_event(len(self.header_ids))
            if width > widest:
                raise EventKVError(
                    f"event {eid!r} takes {width} positions but the prefill window ({self.window.size} positions, "
                    f"{len(self.header_ids)} of them the header) holds at most {widest}: split it into shorter events."
                )
            taken.add(eid)
            rows.append(
                EventRow(
                    seq=seq,
                    id=eid,
                    kind=it["kind"],
                    text=ev.text,
                    role=ev.role,
                    tags=tuple(it["tags"]),
                    budget=ev.budget,
                    token_ids=toks,
                    position=pos,
                    width=width,
                    row_start=row,
                    created=now(),
                    supersedes=it.get("supersedes"),
                )
            )
            added.append(Added(eid, pos, width))
            seq, pos, row = seq + 1, pos + width, row + len(toks)
        store_vectors = self._vectors.at_add([r.id for r in rows], [r.text for r in rows])

        def insert(tx: Writes) -> None:
            tx.insert_events(rows)
            store_vectors(tx)

        new_rows = None
        if prefill:
            stored = self._stored()
            log = TokenizedLog(
                list(self.header_ids),
                [r.id for r in stored] + [r.id for r in rows],
                [self._tokens[r.id] for r in stored] + [list(r.token_ids) for r in rows],
                [r.budget for r in stored] + [r.budget for r in rows],
            )
            pending = [r.seq for r in stored if not r.prefilled] + [r.seq for r in rows]
            new_rows = (self._compute(log, self._ekv), self._n_prefilled(), pending)
        self._commit(insert, new_rows)
        return added

    def _n_prefilled(self) -> int:
        return self._rows.n_rows

    def _compute(self, log: TokenizedLog, prefix: EventKV | None) -> EventKV:
        """The rows of ``log``, continuing from ``prefix`` (its rows are reused, not recomputed): one causal
        pass while the history fits :attr:`window`, windowed past it (:func:`eventkv.kv.windowed.windowed_prefill`)."""
        lm = self.lm
        return windowed_prefill(lm.model, log, self.window, prefix=prefix, weights_digest=lm.profile.weights_digest)

    def _commit(
        self,
        write: Callable[[Writes], None] | None,
        rows: tuple[EventKV | None, int, Sequence[int]] | None = None,
        *,
        bump: bool = True,
        drop_files: Sequence[str] = (),
    ) -> None:
        """Every write of EventMemory goes through here, all or nothing:

        1. with ``rows = (ekv, start, seqs)``: rows ``start:`` of ``ekv`` are written as one new
           segment file, fsynced (:meth:`Store.write_segment`), before anything is committed;
        2. one transaction: ``write(tx)`` (:class:`eventkv.memory.sql.Writes`), the segment's row,
           the events ``seqs`` pointed at the segment, the version bumped (unless ``bump`` is False);
        3. only after the commit: the in-memory rows become ``ekv``, the event table is reloaded from
           the database, and ``drop_files`` (segments the transaction unlinked from every row) are
           removed.

        On any failure in 1-2 (``OutOfSpace`` for a full filesystem) the transaction is rolled back,
        the new segment file removed and the in-memory state left as it was: the store on disk and
        the open memory both equal the state before the call.
        """
        seg = None
        ekv = rows[0] if rows is not None else self._ekv
        if rows is not None and ekv is not None and ekv.n_rows > rows[1]:
            _, start, seqs = rows
            native_head = len(self.header_ids) - start  # the header's rows stay native in every row format
            seg, tensors = self.store.write_segment(
                self.store.next_segment_id(), *tail(ekv, start), native_head=native_head
            )
            if self.store.rows_format != "native":  # the open memory holds what a reopened one reads
                ekv = with_tail(ekv, start, *decode_rows(tensors, self.store.rows_format, ekv.n_layers))
        try:
            with self.store.transaction(bump=bump) as tx:
                if write is not None:
                    write(tx)
                if seg is not None:
                    tx.add_segment(seg, start, seqs)
        except BaseException:
            if seg is not None:
                self.store.remove_files([seg["file"]])
            raise
        if rows is not None:
            self._rows.commit(ekv, rows[1], tensors if seg is not None else None)
        self._reload()
        self.store.remove_files([f for f in drop_files if seg is None or f != seg["file"]])

    def _pending_job(self) -> tuple[TokenizedLog, EventKV | None, list[int]] | None:
        """What a prefill of the pending events computes: ``(log, prefix, seqs)``, the whole stored history's
        log, the stored rows it continues from and the pending events' seqs; None when nothing is pending."""
        stored = self._stored()
        pending = [r.seq for r in stored if not r.prefilled]
        return (self._log(stored), self._ekv, pending) if pending else None

    def _pending(self) -> tuple[EventKV | None, int, list[int]]:
        """``(ekv, start, seqs)``: the rows of the whole stored history (the stored ones reused, the
        pending events' computed), the first computed row, and the pending events' seqs (empty:
        nothing pending, ``ekv`` is the stored rows)."""
        job = self._pending_job()
        if job is None:
            return self._ekv, self._n_prefilled(), []
        log, prefix, pending = job
        return self._compute(log, prefix), self._n_prefilled(), pending

    def _prefill(self) -> int:
        ekv, start, seqs = self._pending()
        if not seqs:
            return 0
        assert ekv is not None  # events were pending, so _pending computed their rows
        return self._commit_prefill(ekv, start, seqs)

    def _commit_prefill(self, ekv: EventKV, start: int, seqs: Sequence[int]) -> int:
        """Store rows ``start:`` of ``ekv`` (the whole history's rows, the pending events' computed) for the
        pending events ``seqs``; returns the rows stored."""
        # rows only: the events are unchanged, so the version (what expected_version compares) stays
        self._commit(None, (ekv, start, seqs), bump=False)
        return ekv.n_rows - start

    def _pin(self, event_ids: Sequence[str], pinned: bool) -> None:
        """Pin (or release) several events in one transaction: all of them, or none."""
        roots = [self._root(self._lookup(e)) for e in event_ids]
        for root in roots:
            if pinned and not root.live:
                raise EventKVError(
                    f"event {root.id!r} is {'forgotten' if root.forgotten else 'deleted'}: it cannot be pinned."
                )
        self._commit(lambda tx: tx.set_pinned([r.seq for r in roots], pinned))

    def _selection_context(self) -> SelectionContext:
        """What a selector may read (:class:`eventkv.memory.select.SelectionContext`); the rows are
        prefilled only when a selector asks for them."""
        return SelectionContext(
            lm=self.lm, rows=self._rows_prefilled, embeddings=self._vectors, history_end=self._history_end()
        )

    @property
    def _vectors(self) -> StoredEmbeddings:
        """The memory's sentence vectors (:class:`eventkv.memory.dense.StoredEmbeddings`), written through
        :meth:`_commit`."""
        from eventkv.memory.dense import StoredEmbeddings

        return StoredEmbeddings(self.store, self.selector, self._commit, lambda i: i in self._by_id)

    def _lazy_prefill(self) -> EventKV | None:
        """The stored history's rows with every pending event prefilled and committed (a read's lazy
        prefill): the rows as committed, which in a quantized row format are the stored rows read back, so
        the query that commits them answers as every later one and a reopened memory do. On a full disk the
        rows computed here are returned unkept and the events stay pending (the next query or :meth:`prefill`
        retries), so a full disk never fails a read. None: no events."""
        ekv, start, seqs = self._pending()
        if seqs:
            try:
                self._commit(None, (ekv, start, seqs), bump=False)
            except OutOfSpace:
                return ekv  # used from memory; the next query or prefill() retries the commit
            return self._ekv
        return ekv

    def _rows_prefilled(self) -> EventKV:
        """:meth:`_lazy_prefill`'s rows, for a selector that reads them (``SelectionContext.rows``)."""
        ekv = self._lazy_prefill()
        if ekv is None:
            raise EventKVError("the memory has no stored events: add some before selecting by rows.")
        return ekv

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


def prefill_many(memories: Sequence[MemoryCore]) -> list[int]:
    """:meth:`eventkv.memory.EventMemory.prefill` of several memories of one model, their pending events computed in
    one batched forward (:func:`eventkv.kv.batched.prefill_batch`: each memory's rows continue its own stored rows,
    each row at its own history's position) where more than one has pending events inside the model's context; a
    memory whose history passes its ``window`` is prefilled alone (windowed). Each memory's rows equal its own
    ``prefill()``'s up to float rounding (the matmuls run at another shape) and are committed as
    that call commits them: one new segment per memory, all or nothing per memory; the memories' commits run
    side by side, one thread each (each writes and fsyncs its own store).

    What a service does when queries on several memories with pending events are answered together: one forward
    instead of one per memory.

    Returns:
        rows computed per memory, in order (0 where nothing was pending).

    Raises:
        OptionError: a memory given twice, or memories of different models.
        EventKVError: a closed memory. The first error of a memory's commit (``OutOfSpace``) is raised after
            every other memory's rows were committed; that memory's events stay pending.
    """
    from eventkv.kv.batched import prefill_batch
    from eventkv.kv.windowed import plan_chunks

    if len({id(m) for m in memories}) != len(memories):
        twice = next(m for k, m in enumerate(memories) if any(m is n for n in memories[:k]))
        raise OptionError("memories", str(twice.directory), "it is given twice: give each memory once.")
    if len({id(m.lm.model) for m in memories}) > 1:
        raise OptionError("memories", len(memories), "give memories of one model (one forward serves one model).")
    out = [0] * len(memories)
    batch = []
    for k, mem in enumerate(memories):
        mem._check_open()
        job = mem._pending_job()
        if job is None:
            continue
        if plan_chunks(job[0], mem.window):  # past the window: chunk by chunk, alone
            out[k] = mem._prefill()
        else:
            batch.append((k, mem, job))
    if not batch:
        return out
    lm = batch[0][1].lm
    rows = prefill_batch(
        lm.model,
        [(log, prefix) for _, _, (log, prefix, _) in batch],
        max_context=lm.profile.max_context,
        weights_digest=lm.profile.weights_digest,
    )
    # each memory commits to its own store: the commits run side by side, so one memory's segment fsync (and a
    # quantized format's encoding, torch work that releases the GIL) does not wait for another's
    with ThreadPoolExecutor(max_workers=len(batch), thread_name_prefix="eventkv-commit") as pool:
        commits = [
            pool.submit(mem._commit_prefill, ekv, prefix.n_rows if prefix is not None else 0, seqs)
            for (_, mem, (_, prefix, seqs)), ekv in zip(batch, rows)
        ]
    failed: BaseException | None = None
    for (k, _, _), commit in zip(batch, commits):
        try:
            out[k] = commit.result()
        except Exception as exc:  # this memory's rows are not kept; the others' are
            failed = failed or exc
    if failed is not None:
        raise failed
    return out
