"""Every SQL statement of a memory store, over one ``sqlite3`` connection: the schema, the pragmas,
the reads of the events, segments and meta tables, and the writes a transaction makes
(:class:`Writes`). :class:`eventkv.memory.store.Store` owns the connection, the writer lock and the
files; nothing outside these two modules speaks SQL.

An event row is written in one place: :class:`EventRow` (the columns of :data:`EVENT_COLUMNS`, one
tuple builder) through :meth:`Writes.insert_events`. Every write transaction seals the rows it
inserted with their checksums (:func:`seal_events`, :mod:`eventkv.memory.integrity`) before its
commit.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from eventkv.memory.integrity import MANIFEST_CHECKSUM, damaged, event_checksum, guard

#: the sentence embeddings of the events' texts (the dense selector's), one row per event and model;
#: deleted with the event's row (rebase) and by forget; a patch has its own
EMBEDDINGS_TABLE = """
CREATE TABLE IF NOT EXISTS embeddings (
    event_id TEXT NOT NULL REFERENCES events(id) ON DELETE CASCADE,
    model TEXT NOT NULL,              -- the sentence model's name (DenseSelector.embedding_model)
    dim INTEGER NOT NULL,
    vector BLOB NOT NULL,             -- dim float32, little-endian, L2 norm 1
    PRIMARY KEY (event_id, model)
);
"""

SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,          -- history order, never reused
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL CHECK (kind IN ('event', 'patch', 'carrier')),
    text TEXT,                        -- NULL once forgotten
    role TEXT,
    tags TEXT NOT NULL DEFAULT '[]',  -- JSON list of strings
    budget INTEGER,
    token_ids TEXT,                   -- JSON list of ints; NULL once forgotten
    position INTEGER,                 -- first RoPE position id; NULL once forgotten
    width INTEGER NOT NULL,           -- positions reserved (budget or token count); 0 once forgotten
    row_start INTEGER,                -- first row in the stored history; NULL once forgotten
    n_rows INTEGER NOT NULL,          -- rows = token count; 0 once forgotten
    segment INTEGER REFERENCES segments(id),  -- NULL until prefilled
    supersedes TEXT,                  -- a patch: the id of the event it updates
    deleted INTEGER NOT NULL DEFAULT 0,
    forgotten INTEGER NOT NULL DEFAULT 0,
    pinned INTEGER NOT NULL DEFAULT 0,
    created TEXT NOT NULL,
    checksum TEXT                     -- JSON {text, token_ids, fields}; NULL for a forgotten marker
);
CREATE TABLE IF NOT EXISTS segments (
    id INTEGER PRIMARY KEY,
    file TEXT NOT NULL UNIQUE,        -- relative to the store directory
    sha256 TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    n_rows INTEGER NOT NULL,
    row_start INTEGER NOT NULL,
    created TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
    + EMBEDDINGS_TABLE
)

#: the columns a new event row is written with (the rest keep their defaults: not deleted, not
#: forgotten, no segment yet, no checksum until :func:`seal_events`)
EVENT_COLUMNS = tuple(
    "seq id kind text role tags budget token_ids position width row_start n_rows supersedes pinned created".split()
)
INSERT_EVENT = f"INSERT INTO events ({', '.join(EVENT_COLUMNS)}) VALUES ({', '.join('?' for _ in EVENT_COLUMNS)})"
#: the meta key set, in the transaction that drops text (forget, rebase), until the purge completes
PURGE_KEY = "purge"


@dataclass(frozen=True)
class EventRow:
    """A new row of the ``events`` table: positions and rows in tokens (one row per token), ``width``
    the positions it reserves (its budget or its token count)."""

    seq: int
    id: str
    kind: str
    text: str
    role: str | None
    tags: tuple[str, ...]
    budget: int | None
    token_ids: list[int]
    position: int
    width: int
    row_start: int
    created: str
    supersedes: str | None = None
    pinned: bool = False

    def values(self) -> tuple:
        """The row's values in :data:`EVENT_COLUMNS` order, as stored (tags and token ids as JSON)."""
        return (
            self.seq,
            self.id,
            self.kind,
            self.text,
            self.role,
            json.dumps(list(self.tags)),
            self.budget,
            json.dumps(self.token_ids),
            self.position,
            self.width,
            self.row_start,
            len(self.token_ids),
            self.supersedes,
            int(self.pinned),
            self.created,
        )


# ---------------------------------------------------------------------- connection and schema
def configure(conn: sqlite3.Connection) -> None:
    """The pragmas of every writer connection: WAL journal, ``synchronous=FULL``, ``secure_delete``
    (forget must leave no copy of the text in freed database pages), foreign keys."""
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA secure_delete=ON")
    conn.execute("PRAGMA foreign_keys=ON")


def initialize(conn: sqlite3.Connection, created: str, manifest_checksum: str) -> None:
    """Create the tables of a new store and its meta rows (version 0, creation time, the manifest's
    checksum) in one transaction, then checkpoint the WAL into the database file."""
    conn.executescript(SCHEMA)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO meta VALUES ('version', '0')")
    conn.execute("INSERT INTO meta VALUES ('created', ?)", (created,))
    conn.execute("INSERT INTO meta VALUES (?, ?)", (MANIFEST_CHECKSUM, manifest_checksum))
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def quick_check(conn: sqlite3.Connection) -> list[str]:
    """SQLite's ``PRAGMA quick_check``: ``["ok"]``, or the problems it finds."""
    return [r[0] for r in conn.execute("PRAGMA quick_check").fetchall()]


def begin(conn: sqlite3.Connection) -> None:
    conn.execute("BEGIN IMMEDIATE")


def bump_version(conn: sqlite3.Connection) -> None:
    conn.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'version'")


def commit(conn: sqlite3.Connection) -> None:
    conn.execute("COMMIT")


def rollback(conn: sqlite3.Connection) -> None:
    conn.execute("ROLLBACK")


def upgrade(conn: sqlite3.Connection, manifest_checksum: str) -> None:
    """Inside a transaction: a schema-1 or schema-2 database to schema 3. Schema 1 to 2: the ``checksum``
    column, every stored event sealed, the manifest's checksum recorded unless one is; 2 to 3: the
    ``embeddings`` table, empty (vectors are computed at their first need). Idempotent."""
    if not has_checksums(conn):
        conn.execute("ALTER TABLE events ADD COLUMN checksum TEXT")
    seal_events(conn)
    conn.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (MANIFEST_CHECKSUM, manifest_checksum))
    conn.execute(EMBEDDINGS_TABLE)


def seal_events(conn: sqlite3.Connection) -> int:
    """Inside a write transaction, before its commit: write the checksum of every stored event row that
    has none and drop the checksum of every forgotten marker. Returns the rows sealed.

    The rows without one are those this transaction inserted: a row another connection committed
    without a checksum is refused by the memory's next read (``PRAGMA data_version`` moved), before
    any write of its own. Every write transaction must call this (``Store.transaction`` does)."""
    rows = conn.execute("SELECT * FROM events WHERE checksum IS NULL AND forgotten = 0").fetchall()
    conn.executemany("UPDATE events SET checksum = ? WHERE seq = ?", [(event_checksum(r), r["seq"]) for r in rows])
    conn.execute("UPDATE events SET checksum = NULL WHERE forgotten = 1 AND checksum IS NOT NULL")
    return len(rows)


# ---------------------------------------------------------------------- reads
def has_checksums(conn: sqlite3.Connection) -> bool:
    """Whether the ``events`` table has the ``checksum`` column (schema 2)."""
    return any(c[1] == "checksum" for c in conn.execute("PRAGMA table_info(events)").fetchall())


def read_version(directory: str | Path, conn: sqlite3.Connection) -> int:
    """The store's write counter (``meta.version``).

    Raises:
        StoreDamaged: missing or not a whole number.
    """
    with guard(directory):
        row = conn.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()
    try:
        return int(row[0])
    except (TypeError, ValueError):
        raise damaged(
            directory, f"its version counter is {None if row is None else row[0]!r}, not a whole number"
        ) from None


def read_meta(directory: str | Path, conn: sqlite3.Connection, key: str) -> str | None:
    """One value of the ``meta`` table, or None when absent."""
    with guard(directory):
        row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else row[0]


def event_rows(conn: sqlite3.Connection) -> list[sqlite3.Row]:
    """Every row of the ``events`` table, in history order."""
    return conn.execute("SELECT * FROM events ORDER BY seq").fetchall()


def embedding_rows(conn: sqlite3.Connection, model: str, ids: Sequence[str]) -> list[sqlite3.Row]:
    """The stored vectors of the events ``ids`` under ``model`` (``event_id, dim, vector``); an event
    without one has no row."""
    rows: list[sqlite3.Row] = []
    for i in range(0, len(ids), 500):  # SQLite's limit on bound parameters
        chunk = list(ids[i : i + 500])
        marks = ", ".join("?" * len(chunk))
        rows += conn.execute(
            f"SELECT event_id, dim, vector FROM embeddings WHERE model = ? AND event_id IN ({marks})", [model, *chunk]
        ).fetchall()
    return rows


def segment_rows(conn: sqlite3.Connection) -> list[sqlite3.Row]:
    """Every row of the ``segments`` table, by first row."""
    return conn.execute("SELECT * FROM segments ORDER BY row_start").fetchall()


def max_segment_id(conn: sqlite3.Connection) -> int | None:
    return conn.execute("SELECT MAX(id) FROM segments").fetchone()[0]


def data_version(conn: sqlite3.Connection) -> int:
    return conn.execute("PRAGMA data_version").fetchone()[0]


def purge_flagged(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM meta WHERE key = ?", (PURGE_KEY,)).fetchone() is not None


def snapshot(directory: Path, conn: sqlite3.Connection) -> tuple[bool, list, list, str | None, int]:
    """One committed state, read in one read transaction: ``(sealed, event rows, segment rows, the
    manifest's recorded checksum, version)`` (``sealed``: the events table has checksums)."""
    conn.execute("BEGIN")
    sealed = has_checksums(conn)
    rows = event_rows(conn)
    segments = segment_rows(conn)
    recorded = read_meta(directory, conn, MANIFEST_CHECKSUM)
    version = read_version(directory, conn)
    conn.execute("COMMIT")
    return sealed, rows, segments, recorded, version


# ---------------------------------------------------------------------- purge
def set_busy_timeout(conn: sqlite3.Connection, ms: int) -> None:
    conn.execute(f"PRAGMA busy_timeout = {ms}")


def checkpoint(conn: sqlite3.Connection) -> int:
    """``PRAGMA wal_checkpoint(TRUNCATE)``: 1 when a reader kept it from completing, else 0."""
    busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    return busy


# ---------------------------------------------------------------------- writes
class Writes:
    """The writes of one transaction (:meth:`eventkv.memory.store.Store.transaction`), each a verb of
    the memory; ``seqs`` name events by their ``seq`` (history order)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def insert_events(self, rows: Sequence[EventRow]) -> None:
        self._conn.executemany(INSERT_EVENT, [r.values() for r in rows])

    def insert_embeddings(self, model: str, ids: Sequence[str], vectors) -> None:
        """Store the vectors of the events ``ids`` under ``model`` (``vectors``: ``[len(ids), dim]``
        float32 numpy rows), replacing any stored ones."""
        dim = int(vectors.shape[1])
        self._conn.executemany(
            "INSERT OR REPLACE INTO embeddings (event_id, model, dim, vector) VALUES (?, ?, ?, ?)",
            [(i, model, dim, v.astype("<f4").tobytes()) for i, v in zip(ids, vectors)],
        )

    def mark_deleted(self, seq: int) -> None:
        self._conn.execute("UPDATE events SET deleted = 1 WHERE seq = ?", (seq,))

    def set_pinned(self, seqs: Sequence[int], pinned: bool) -> None:
        self._conn.executemany("UPDATE events SET pinned = ? WHERE seq = ?", [(int(bool(pinned)), q) for q in seqs])

    def add_segment(self, row: dict, row_start: int, seqs: Sequence[int]) -> None:
        """Insert a segment's row (``row``: as :meth:`Store.write_segment` returns it) and point the
        events ``seqs`` at it."""
        self._conn.execute(
            "INSERT INTO segments (id, file, sha256, bytes, n_rows, row_start, created) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (row["id"], row["file"], row["sha256"], row["bytes"], row["n_rows"], row_start, row["created"]),
        )
        self._conn.executemany("UPDATE events SET segment = ? WHERE seq = ?", [(row["id"], q) for q in seqs])

    def drop_segment(self, file: str) -> None:
        """Unlink the segment ``file`` from every event and remove its row (the file stays until the caller
        removes it after the commit)."""
        self._conn.execute(
            "UPDATE events SET segment = NULL WHERE segment = (SELECT id FROM segments WHERE file = ?)", (file,)
        )
        self._conn.execute("DELETE FROM segments WHERE file = ?", (file,))

    def forget_events(self, seqs: Iterable[int]) -> None:
        """Erase the events ``seqs`` down to a forgotten marker (id, kind and creation time kept), their
        sentence embeddings deleted."""
        seqs = list(seqs)
        self._conn.executemany(
            "DELETE FROM embeddings WHERE event_id = (SELECT id FROM events WHERE seq = ?)", [(q,) for q in seqs]
        )
        self._conn.executemany(
            "UPDATE events SET text = NULL, role = NULL, tags = '[]', budget = NULL, token_ids = NULL, "
            "position = NULL, width = 0, row_start = NULL, n_rows = 0, segment = NULL, forgotten = 1, "
            "pinned = 0, deleted = 0 WHERE seq = ?",
            [(q,) for q in seqs],
        )

    def move_event(self, seq: int, position: int, row_start: int) -> None:
        self._conn.execute("UPDATE events SET position = ?, row_start = ? WHERE seq = ?", (position, row_start, seq))

    def replace_history(self, rows: Sequence[EventRow]) -> None:
        """Drop every stored event (forgotten markers stay) with its embeddings and every segment row, then
        insert ``rows``."""
        self._conn.execute("DELETE FROM events WHERE forgotten = 0")
        self._conn.execute("DELETE FROM segments")
        self.insert_events(rows)

    def mark_purge(self) -> None:
        """Flag the store as holding dropped text's bytes, committed with the drop (forget, rebase), so a
        kill before the purge completes is purged at open."""
        self._conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, '1')", (PURGE_KEY,))

    def clear_purge(self) -> None:
        self._conn.execute("DELETE FROM meta WHERE key = ?", (PURGE_KEY,))
