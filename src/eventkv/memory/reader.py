"""Read a memory without its model: a consistent snapshot of a store's event table, counts and
version through a read-only SQLite connection (the HTTP service's ``GET`` routes and ``/metrics``
never wait behind model work). WAL lets this reader run while the store's one writer commits; it
sees the last committed state, checked as the writer checks it (a damaged store raises
:class:`eventkv.errors.StoreDamaged`, never a raw ``sqlite3`` or JSON error)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eventkv.memory.integrity import check_manifest, damaged
from eventkv.memory.records import MemoryStats
from eventkv.memory.store import Store, check_segment_files, check_segment_row, directory_bytes, read_committed
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
