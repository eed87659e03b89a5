"""Read a memory without its model: a consistent snapshot of a store's event table, counts and
version through a read-only SQLite connection (issue 12, point 4: the HTTP service's ``GET``
routes never wait behind model work). WAL lets this reader run while the store's one writer
commits; it sees the last committed state."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from eventkv.errors import EventKVError
from eventkv.memory.records import MemoryStats
from eventkv.memory.store import DATABASE, Store, directory_bytes
from eventkv.memory.table import EventTable, record_from_row


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
    commit. Segment checksums are not verified here (the writer verifies on open).

    Raises:
        EventKVError: no memory in ``directory``, a damaged manifest or database.
    """
    d = Path(directory)
    manifest = Store.read_manifest(d)
    try:
        conn = sqlite3.connect(f"{(d / DATABASE).resolve().as_uri()}?mode=ro", uri=True, isolation_level=None)
    except sqlite3.Error as exc:
        raise EventKVError(f"the database of the memory in {str(d)!r} cannot be opened ({exc}).") from None
    try:
        conn.row_factory = sqlite3.Row
        conn.execute("BEGIN")
        rows = conn.execute("SELECT * FROM events ORDER BY seq").fetchall()
        segments = conn.execute("SELECT COUNT(*) FROM segments").fetchone()[0]
        version = int(conn.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()[0])
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        raise EventKVError(
            f"the database of the memory in {str(d)!r} is not readable ({exc}): the store is damaged; restore it "
            "from a backup or create a new memory."
        ) from None
    finally:
        conn.close()
    table = EventTable([record_from_row(r) for r in rows], len(manifest["header_ids"]))
    stats = table.stats(
        rows_prefilled=table.rows_prefilled(), segments=segments, bytes_on_disk=directory_bytes(d), version=version
    )
    return MemorySnapshot(manifest, table, version, stats)
