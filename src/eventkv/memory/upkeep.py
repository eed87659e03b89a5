"""The memory's upkeep, the writes that recompute or rewrite rows: :meth:`MemoryUpkeep.carrier`
(Study 1, "Programmed carriers"), :meth:`MemoryUpkeep.forget` (the privacy path: the event's rows and
every later event's re-prefilled, then the bytes purged) and :meth:`MemoryUpkeep.rebase` (the view
re-prefilled as a new history). Every one goes through :meth:`eventkv.memory.core.MemoryCore._commit`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Sequence

from eventkv.errors import EventKVError, OptionError, PurgePending
from eventkv.kv.log import Event, TokenizedLog
from eventkv.memory.records import CarrierResult, MemoryEvent
from eventkv.memory.rows import contiguous
from eventkv.memory.sql import EventRow, Writes
from eventkv.models.encoding import encode

if TYPE_CHECKING:  # pragma: no cover
    pass

from eventkv.memory.core import MemoryCore

#: seconds rebase waits for readers before leaving its purge to close / open
REBASE_PURGE_S = 1.0


class MemoryUpkeep(MemoryCore):
    """The upkeep verbs of :class:`eventkv.memory.EventMemory` (see the module docstring)."""

    def carrier(
        self, sources: Sequence[str], subject: str, kind: str = "auto", *, prefill: bool = False
    ) -> CarrierResult:
        """Append an answer-free **carrier** event about ``subject`` after its source events (Study 1,
        "Programmed carriers"): its rows, computed with the sources in view, may carry their state once
        the sources are no longer served. The text names the subject and the sources' ids, never a value
        (:func:`eventkv.memory.carriers.carrier_text`).

        ``kind="auto"`` reads the model's contract (the ``contract=`` given to :meth:`create`) and
        writes the kind with the largest donor shift significantly above 0 on this checkpoint
        (:func:`eventkv.memory.carriers.choose_kind`); when none qualifies, or no contract was given,
        it writes **no** carrier and pins the sources instead, so their text is served with every
        query (the study's fallback), and says so in the result (every source in one transaction).
        An explicit kind is always written.

        Args:
            sources: ids of the events the carrier is about (each must be live).
            subject: what the carrier is about, e.g. ``"the user's home city"``.
            kind: ``auto`` | ``passive`` | ``binding`` | ``directive`` | ``compute``.
            prefill: compute the carrier's rows now (as :meth:`add`).

        Raises:
            OptionError: an unknown kind, an empty subject, no sources.
            EventKVError: an unknown, deleted or forgotten source; a contract that cannot be read or
                was measured on other weights.
        """
        from eventkv.memory.carriers import plan_carrier

        self._check_open()
        ids = list(sources) if not isinstance(sources, str) else [sources]
        if not ids:
            raise OptionError("sources", ids, "give the ids of the events the carrier is about.")
        for sid in ids:
            rec = self._root(self._lookup(sid))
            if not rec.live:
                raise EventKVError(
                    f"source {sid!r} is {'forgotten' if rec.forgotten else 'deleted'}: a carrier needs live sources."
                )
        plan = plan_carrier(
            kind,
            subject,
            ids,
            self.store.manifest.get("contract"),
            self.lm.profile.weights_digest,
            self.lm.profile.name,
        )
        if plan.kind is None:
            self._pin(ids, True)  # every source or none
            return CarrierResult(None, None, tuple(ids), plan.reason)
        assert plan.text is not None  # a plan with a kind has its carrier's text
        added = self._add([MemoryEvent(plan.text, kind="carrier", tags=("carrier", plan.kind))], prefill)[0]
        return CarrierResult(plan.kind, added, (), plan.reason)

    def forget(self, event_id: str, *, purge_wait_s: float = 10.0) -> int:
        """The privacy path: remove an event's text and rows **and re-prefill every later event**.

        Why later events too: every row after the event was computed with the event in view, so it
        can carry the event's content (the study's materialization: Study 1, "Access" and
        "Programmed carriers"); dropping the event's own rows would leave that state behind. Cost:
        the rows from the event on are recomputed, O(L_after · L) attention — O(L²) for an event
        near the start of an L-token history, against O(pL + p²) for an update.

        Forgetting an event forgets its patches too (forgetting a patch forgets that patch only).
        The event's database row is kept as a ``forgotten`` marker holding only its id, kind and
        creation time (text, role, tags, token ids, positions and rows are erased), so the id cannot
        be reused; later events move down to contiguous positions. All or nothing: the later rows
        are recomputed and written as a new segment file (with the rows before the event that
        shared a segment with it) *before* one transaction commits the markers, the new layout and
        the new segment; the old segment files are unlinked after the commit. Then the purge: the
        WAL is checkpointed into the database (whose freed bytes ``secure_delete`` zeroed) and
        truncated, so the text is in no file of the store directory when this returns.

        Args:
            purge_wait_s: how long the purge waits (seconds) for other connections' read snapshots,
                which keep the old pages alive, to end.

        Returns:
            rows recomputed (the later events that had rows; 0 when the event had none, and when a
            second call completes a pending purge).

        Raises:
            EventKVError: unknown id, or an event already forgotten (and purged).
            PurgePending: the event is forgotten, but a reader held its snapshot past
                ``purge_wait_s`` (or the filesystem was too full to checkpoint), so its bytes are still
                in ``memory.sqlite-wal``; call ``forget`` on the id again, or close the memory, to
                complete the purge.
            OutOfSpace: the filesystem is full before the commit: nothing was forgotten.
        """
        self._check_open()
        rec = self._lookup(event_id)
        if rec.forgotten:
            if self.store.purge_pending:
                self._purge(event_id, purge_wait_s)
                return 0
            raise EventKVError(f"event {event_id!r} is already forgotten.")
        targets = [rec] + [r for r in self._recs if rec.kind != "patch" and r.supersedes == rec.id and not r.forgotten]
        gone = {r.seq for r in targets}
        first = min(gone)
        remaining = [r for r in self._stored() if r.seq not in gone]
        before = [r for r in remaining if r.seq < first]
        rows, drop_files, recomputed = None, [], 0
        if any(r.prefilled for r in targets):
            cut = self._rows.cut_for_forget(self.store.segment_rows(), before, remaining, first, self._log)
            new, drop_files = cut.kept, cut.drop_files
            if cut.later:  # the later events up to the last one that had rows, at their new positions
                new = self._compute(self._log(list(before) + cut.later), cut.kept)
                recomputed = new.n_rows - cut.keep
            # the new segment holds rows start: — the kept rows that shared a dropped segment, then the later ones
            rows = (new, cut.start, cut.seqs)

        def write(tx: Writes) -> None:
            for f in drop_files:
                tx.drop_segment(f)
            tx.forget_events(gone)
            for seq, pos, row in contiguous(remaining, len(self.header_ids)):  # later events move down
                tx.move_event(seq, pos, row)
            tx.mark_purge()

        self._commit(write, rows, drop_files=drop_files)
        self._rows.relaid_out()
        self._purge(event_id, purge_wait_s)
        return recomputed

    def _purge(self, event_id: str, wait_s: float) -> None:
        try:
            self.store.purge(wait_s)
        except PurgePending as exc:
            raise PurgePending(
                f"event {event_id!r} is forgotten (its text, token ids and rows are in no committed state; it is "
                f"never served or returned), but its bytes are not erased yet. {exc}"
            ) from None

    def rebase(self) -> int:
        """Re-prefill the current view as a new history: the live events in history order, each with
        its latest patch's text folded in (keeping its id, role, tags, pin, and budget when the new
        text fits it), at contiguous positions. Tombstoned events, patches and their rows are dropped
        (forgotten markers stay). The new rows are written to a new segment and committed with the
        new event table in one transaction (all or nothing); the old segment files are removed after
        the commit, and the dropped text is purged from the WAL as :meth:`forget` does (if a reader
        blocks it for ``REBASE_PURGE_S``, it completes at close or the next open).

        Returns:
            rows computed (the whole new history, header included).

        Raises:
            OutOfSpace: the filesystem is full: nothing was changed.
        """
        self._check_open()
        units = sorted(self._units(), key=lambda u: u[0].seq)
        rows, events = [], []
        pos = row = len(self.header_ids)
        for root, cur in units:
            assert cur.text is not None  # units are live events; only a forgotten one has no text
            ev = Event(root.id, cur.text, root.role)
            toks = encode(self.lm.tokenizer, ev.render())
            budget = root.budget if root.budget is not None and root.budget >= len(toks) else None
            width = budget or len(toks)
            rows.append(
                EventRow(
                    seq=root.seq,
                    id=root.id,
                    kind=root.kind,
                    text=cur.text,
                    role=root.role,
                    tags=root.tags,
                    budget=budget,
                    token_ids=toks,
                    position=pos,
                    width=width,
                    row_start=row,
                    created=root.created,
                    pinned=root.pinned,
                )
            )
            events.append((root.id, toks, budget))
            pos, row = pos + width, row + len(toks)
        old_files = [s["file"] for s in self.store.segment_rows()]
        ekv = None
        if events:
            ekv = self._compute(TokenizedLog.from_ids(self.header_ids, events), None)

        store_vectors = self._vectors.at_add([r.id for r in rows], [r.text for r in rows])

        def write(tx: Writes) -> None:
            tx.replace_history(rows)
            store_vectors(tx)
            tx.mark_purge()  # the dropped events' text

        self._commit(write, (ekv, 0, [r.seq for r in rows]), drop_files=old_files)
        self._rows.relaid_out()
        with contextlib.suppress(PurgePending):  # not the privacy path: a blocked purge completes at close or open
            self.store.purge(REBASE_PURGE_S)
        return ekv.n_rows if ekv is not None else 0
