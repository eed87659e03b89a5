"""Read a memory without its model: a consistent snapshot of a store's event table, counts and
version through a read-only SQLite connection (the HTTP service's ``GET`` routes and ``/metrics``
never wait behind model work). WAL lets this reader run while the store's one writer commits; it
sees the last committed state, checked as the writer checks it (a damaged store raises
:class:`eventkv.errors.StoreDamaged`, never a raw ``sqlite3`` or JSON error)."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from eventkv.errors import EventKVError
from eventkv.files import directory_bytes
from eventkv.memory import sql
from eventkv.memory.integrity import check_manifest, damaged, guard
from eventkv.memory.records import MemoryStats
from eventkv.memory.store import DATABASE, Store, check_segment_files, check_segment_row
from eventkv.memory.table import EventTable


@dataclass(frozen=True)
class MemorySnapshot:
    """One committed state of a memory: ``manifest`` (dict), ``table`` (:class:`EventTable`),
    ``version`` (the write counter) and ``stats`` (:class:`MemoryStats`)."""

    manifest: dict
    table: EventTable
    version: int
    stats: MemoryStats

    @property
    def namespace(self) -> str:
        return self.manifest["namespace"]


def read_memory(directory: str | Path) -> MemorySnapshot:
    """A read-only snapshot of the memory in ``directory`` (no model, no writer lock).

    The events, segments and version are read in one read transaction, so they belong to one
    commit. Every event row is checked (types, checksum, JSON fields, layout:
    :meth:`EventTable.from_rows`), the manifest against its recorded checksum, and every segment
    file's presence and size (a ``stat`` each; their sha256 is checked by the writer on open). A
    store of schema 1 (no checksums yet: upgraded by the first :meth:`EventMemory.open`) is read
    with every check but the checksums.

    Raises:
        StoreDamaged: the manifest, the database or a segment file is damaged (names the memory and
            the damaged part).
        EventKVError: no memory in ``directory``, a database that cannot be opened or read now.
    """
    d = Path(directory)
    manifest = Store.read_manifest(d)
    sealed, rows, segments, recorded, version = read_committed(d)
    if manifest["schema"] >= 2 and not sealed:
        raise damaged(d, "its events table has no checksum column, yet its manifest says schema 2")
    if sealed or recorded is not None:
        check_manifest(d, manifest, recorded)
    for seg in segments:
        check_segment_row(d, seg)
    check_segment_files(d, segments)
    table = EventTable.from_rows(rows, len(manifest["header_ids"]), d, sealed)
    stats = table.stats(
        rows_prefilled=table.rows_prefilled(), segments=len(segments), bytes_on_disk=directory_bytes(d), version=version
    )
    return MemorySnapshot(manifest, table, version, stats)


def read_committed(d: Path) -> tuple[bool, list, list, str | None, int]:
    """The last committed state of the store in ``d`` through a read-only connection (no writer lock;
    WAL lets it run while the writer commits): ``(sealed, event rows, segment rows, the manifest's
    recorded checksum, version)``, read in one read transaction (:func:`eventkv.memory.sql.snapshot`).

    Raises:
        StoreDamaged: the database's bytes are damaged.
        EventKVError: a database that cannot be opened or read now.
    """
    try:
        with guard(d, "its database does not open"):
            conn = sqlite3.connect(f"{(d / DATABASE).resolve().as_uri()}?mode=ro", uri=True, isolation_level=None)
    except sqlite3.Error as exc:
        raise EventKVError(f"the database of the memory in {str(d)!r} cannot be opened ({exc}).") from None
    try:
        conn.row_factory = sqlite3.Row
        with guard(d):
            return sql.snapshot(d, conn)
    except sqlite3.Error as exc:
        raise EventKVError(
            f"the database of the memory in {str(d)!r} is not readable now ({exc}): try again."
        ) from None
    finally:
        conn.close()
