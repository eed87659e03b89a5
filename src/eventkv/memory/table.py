"""The event table of a memory as plain data: the rules that turn stored rows into the view,
histories, listings and counts, shared by :class:`eventkv.memory.EventMemory`
and by the model-free :func:`eventkv.memory.reader.read_memory` the HTTP service reads with.
No model, no storage: records in, records out."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Sequence

from eventkv.errors import NotFound
from eventkv.memory.integrity import check_event_row, check_layout
from eventkv.memory.records import MemoryRecord, MemoryStats, canonical_event_id


def record_from_row(row, tags: tuple[str, ...] | None = None) -> MemoryRecord:
    """A :class:`MemoryRecord` from a row of the store's ``events`` table (``sqlite3.Row`` or mapping);
    ``tags`` already parsed, else read from the row's JSON (unchecked: see :meth:`EventTable.from_rows`)."""
    return MemoryRecord(
        seq=row["seq"],
        id=row["id"],
        kind=row["kind"],
        text=row["text"],
        role=row["role"],
        tags=tuple(json.loads(row["tags"])) if tags is None else tags,
        budget=row["budget"],
        position=row["position"],
        width=row["width"],
        row_start=row["row_start"],
        n_rows=row["n_rows"],
        segment=row["segment"],
        supersedes=row["supersedes"],
        deleted=bool(row["deleted"]),
        forgotten=bool(row["forgotten"]),
        pinned=bool(row["pinned"]),
        created=row["created"],
    )


def _position_end(rec: MemoryRecord) -> int:
    """First RoPE position after a stored event's reserved positions."""
    assert rec.position is not None  # the callers pass stored events; only a forgotten one has no position
    return rec.position + rec.width


def _row_end(rec: MemoryRecord) -> int:
    """First row of the stored history after a stored event's rows."""
    assert rec.row_start is not None  # the callers pass stored events; only a forgotten one has no rows
    return rec.row_start + rec.n_rows


class EventTable:
    """A memory's records in history order plus its header length (in tokens = rows = positions)."""

    def __init__(
        self,
        records: Sequence[MemoryRecord],
        header_len: int,
        tokens: dict[str, list[int]] | None = None,
    ) -> None:
        self.records: list[MemoryRecord] = list(records)
        self.header_len = header_len
        self.by_id = {r.id: r for r in self.records}
        #: token ids of every stored event, by id (filled by :meth:`from_rows`)
        self.tokens: dict[str, list[int]] = tokens or {}

    @classmethod
    def from_rows(cls, rows: Sequence, header_len: int, directory: str | Path, sealed: bool = True) -> "EventTable":
        """The table of a store's ``events`` rows (history order), every row checked
        (:func:`eventkv.memory.integrity.check_event_row`: types, checksum when ``sealed``, JSON
        fields) and the layout checked (:func:`eventkv.memory.integrity.check_layout`).

        Raises:
            StoreDamaged: a row or the layout fails its check (names the memory, the event, the field).
        """
        records, tokens = [], {}
        for raw in rows:
            row = dict(zip(raw.keys(), raw)) if isinstance(raw, sqlite3.Row) else raw  # by name: a dict is faster
            tags, toks = check_event_row(directory, row, sealed)
            rec = record_from_row(row, tags)
            records.append(rec)
            if toks is not None:
                tokens[rec.id] = toks
        check_layout(directory, records, header_len)
        return cls(records, header_len, tokens)

    def lookup(self, event_id: str) -> MemoryRecord:
        """The record of ``event_id`` (a forgotten event: its marker). The id is looked up as given,
        then in its :func:`eventkv.memory.records.canonical_event_id` form (NFC), so every spelling
        of one id finds it.

        Raises:
            NotFound: unknown id (the message lists some known ids).
            OptionError: an id no event can have (invisible or look-alike characters, or an id that
                looks like nothing: see :func:`eventkv.memory.records.canonical_event_id`).
        """
        rec = self.by_id.get(event_id) if isinstance(event_id, str) else None
        if rec is None and isinstance(event_id, str):
            rec = self.by_id.get(canonical_event_id(event_id))
        if rec is not None:
            return rec
        known = [r.id for r in self.records if not r.forgotten]
        shown = ", ".join(known[:8]) + (" ..." if len(known) > 8 else "") if known else "none"
        raise NotFound(f"unknown event id {event_id!r}: this memory's events are {shown} (see list()).")

    def root(self, rec: MemoryRecord) -> MemoryRecord:
        """The event a patch supersedes; any other record itself."""
        if rec.kind != "patch":
            return rec
        assert rec.supersedes is not None  # every patch names the event it updates
        return self.lookup(rec.supersedes)

    def stored(self) -> list[MemoryRecord]:
        """Every event with rows in the history (deleted included, forgotten excluded), in history order."""
        return [r for r in self.records if not r.forgotten]

    def units(self) -> list[tuple[MemoryRecord, MemoryRecord]]:
        """The current view as ``(root event, served record)`` pairs, by the served record's history
        order: live non-patch events, each replaced by its latest live patch."""
        latest: dict[str, MemoryRecord] = {}
        for r in self.records:
            if r.kind == "patch" and r.live:
                assert r.supersedes is not None  # every patch names the event it updates
                latest[r.supersedes] = r
        units = [(r, latest.get(r.id, r)) for r in self.records if r.kind != "patch" and r.live]
        return sorted(units, key=lambda u: u[1].seq)

    def view_ids(self) -> list[str]:
        """The default served set (see :meth:`eventkv.memory.EventMemory.view_ids`)."""
        return [cur.id for _, cur in self.units()]

    def history(self, event_id: str) -> list[MemoryRecord]:
        """The event and its patches, oldest first (see :meth:`eventkv.memory.EventMemory.history`).

        Raises:
            NotFound: unknown id.
        """
        root = self.root(self.lookup(event_id))
        return [root] + [r for r in self.records if r.kind == "patch" and r.supersedes == root.id and not r.forgotten]

    def list(self, include_superseded: bool = False, include_deleted: bool = False) -> list[MemoryRecord]:
        """Records in history order (see :meth:`eventkv.memory.EventMemory.list`)."""
        view = {cur.seq for _, cur in self.units()}
        out = []
        for r in self.records:
            if r.forgotten:
                continue
            if r.deleted or self.root(r).deleted:
                if include_deleted:
                    out.append(r)
            elif include_superseded or r.seq in view:
                out.append(r)
        return out

    def history_end(self) -> int:
        """First position after the whole stored history (where a query starts)."""
        stored = self.stored()
        return _position_end(stored[-1]) if stored else self.header_len

    def n_rows(self) -> int:
        """Rows of the whole stored history, header included."""
        stored = self.stored()
        return _row_end(stored[-1]) if stored else self.header_len

    def rows_prefilled(self) -> int:
        """Rows computed and stored: the header and every prefilled stored event (0 when none is)."""
        pre = [r for r in self.stored() if r.prefilled]
        return _row_end(pre[-1]) if pre else 0

    def stats(self, *, rows_prefilled: int, segments: int, bytes_on_disk: int, version: int) -> MemoryStats:
        """:class:`MemoryStats` from the table and the store's file facts."""
        stored = self.stored()
        pre = [r for r in stored if r.prefilled]
        return MemoryStats(
            events=len(stored),
            live=len(self.units()),
            patches=sum(r.kind == "patch" for r in stored),
            deleted=sum(r.deleted for r in stored),
            forgotten=sum(r.forgotten for r in self.records),
            pinned=sum(r.pinned for r in stored),
            carriers=sum(r.kind == "carrier" for r in stored),
            rows=self.n_rows(),
            rows_prefilled=rows_prefilled,
            prefilled_up_to=_position_end(pre[-1]) if pre else self.header_len,
            history_end=self.history_end(),
            segments=segments,
            bytes_on_disk=bytes_on_disk,
            version=version,
        )
