"""The on-disk store of one memory: a manifest, an SQLite database and append-only segment files.

Layout of a store directory::

    manifest.json            schema version, namespace, model name, weights / tokenizer / chat-template
                             digests, dtype, instruction, header token ids (written once, atomically)
    memory.sqlite (+ -wal)   stdlib sqlite3, WAL journal, synchronous=FULL, secure_delete=ON:
                             tables events, segments, meta (see SCHEMA); every stored event row
                             carries a checksum of its text, token ids and fields, and meta the
                             manifest's checksum (:mod:`eventkv.memory.integrity`)
    segments/NNNNNN.safetensors
                             one file per prefill call: ``keys.{layer}`` / ``values.{layer}``
                             ``[kv_heads, rows, head_dim]`` and ``positions`` ``[rows]`` int64; never
                             modified after it is written (a rewrite is a new file)

Durability protocol (what "an acknowledged write survives a kill" rests on): a segment file is
written under a temporary name, fsynced, renamed into ``segments/`` and the directory fsynced
*before* the database transaction that points to it commits; SQLite with ``synchronous=FULL``
makes a committed transaction durable. A kill between the two leaves a segment file no committed
row points to: :meth:`Store.open` deletes it (and any ``*.tmp``). Each segment's sha256 is in the
database and checked on open (full hash by default; ``EVENTKV_MEMORY_VERIFY=size`` checks only the
file size, for very large stores). Nothing here is pickled: JSON, safetensors and SQLite only.

Damage: every read of the store's state that fails because the stored bytes are damaged (an SQLite
page that does not read, a checksum that does not match, a manifest or field that does not parse, a
segment file missing, short or unreadable) raises :class:`eventkv.errors.StoreDamaged` naming the
memory and the damaged part; :meth:`Store.open` also runs SQLite's ``PRAGMA quick_check``.

Schema versions: 2 (event and manifest checksums). A store of schema 1 (written before checksums
existed) is upgraded by the first :meth:`Store.open`: the ``checksum`` column is added and every
stored event and the manifest are sealed as they are then (one transaction), and the manifest is
rewritten with ``schema`` 2. Damage done before that open cannot be told from the content.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import re
import sqlite3
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file

from eventkv.errors import EventKVError
from eventkv.files import fsync_path, sha256_file, write_json_atomic
from eventkv.memory.integrity import (
    MANIFEST_CHECKSUM,
    check_manifest,
    damaged,
    guard,
    has_checksums,
    manifest_checksum,
    read_meta,
    read_version,
    seal_events,
)

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.models.profile import LoadedModel

SCHEMA_VERSION = 2
#: schema versions this eventkv opens (1: upgraded on open, see the module docstring)
READABLE_SCHEMAS = (1, 2)
MANIFEST = "manifest.json"
DATABASE = "memory.sqlite"
SEGMENTS = "segments"
VERIFY_ENV = "EVENTKV_MEMORY_VERIFY"
LOCK = ".lock"
#: what a manifest must hold for EventMemory to open the store
MANIFEST_KEYS = (
    "schema",
    "namespace",
    "weights_digest",
    "tokenizer_digest",
    "chat_template_digest",
    "dtype",
    "header_ids",
)
"""``full`` (default): sha256 of every segment on open; ``size``: only each file's size."""
#: manifest fields every reader uses, and their JSON types (``list``: a list of token ids)
MANIFEST_TYPES = {
    "namespace": str,
    "model": str,
    "instruction": str,
    "weights_digest": str,
    "tokenizer_digest": str,
    "chat_template_digest": str,
    "dtype": str,
    "header_ids": list,
}
#: how a segment's ``file`` column reads (a damaged one must not name a file outside the store)
SEGMENT_FILE = re.compile(rf"{SEGMENTS}/[0-9]{{6,}}\.safetensors")

SCHEMA = """
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


def now() -> str:
    """The current UTC time, ISO 8601 with microseconds."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds")


def tokenizer_digest(tokenizer) -> str:
    """sha256 (hex) of a tokenizer's serialized form: the fast tokenizer's JSON
    (``backend_tokenizer.to_str()``), else the files ``save_pretrained`` writes (sorted by name)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return hashlib.sha256(backend.to_str().encode()).hexdigest()
    h = hashlib.sha256()
    with tempfile.TemporaryDirectory() as d:
        tokenizer.save_pretrained(d)
        for f in sorted(Path(d).iterdir()):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def chat_template_digest(tokenizer) -> str:
    """sha256 (hex) of the tokenizer's chat template, or ``"none"`` when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return "none"
    if not isinstance(template, str):  # a dict of named templates
        template = json.dumps(template, sort_keys=True)
    return hashlib.sha256(template.encode()).hexdigest()


def model_identity(lm: LoadedModel) -> dict[str, str]:
    """What a store's rows depend on: weights, tokenizer, chat template, dtype (manifest fields)."""
    return {
        "weights_digest": lm.profile.weights_digest,
        "tokenizer_digest": tokenizer_digest(lm.tokenizer),
        "chat_template_digest": chat_template_digest(lm.tokenizer),
        "dtype": lm.profile.dtype,
    }


IDENTITY_NAMES = {
    "weights_digest": "weights",
    "tokenizer_digest": "tokenizer",
    "chat_template_digest": "chat template",
    "dtype": "dtype",
}


def check_identity(directory: Path, manifest: dict, lm: LoadedModel) -> None:
    """Refuse a store whose rows were made by other weights, tokenizer, chat template or dtype.

    Raises:
        EventKVError: naming the field, the stored and the given value, and the fix.
    """
    given = model_identity(lm)
    for key, what in IDENTITY_NAMES.items():
        stored = manifest.get(key)
        if stored != given[key]:
            raise EventKVError(
                f"the memory in {str(directory)!r} was made with {what} {str(stored)[:16]!r} (model "
                f"{manifest.get('model')!r}, {manifest.get('dtype')}) but the model given has {what} "
                f"{str(given[key])[:16]!r} ({lm.profile.name!r}, {lm.profile.dtype}): its stored KV rows would be "
                f"stale. Open it with the model it was made with, or create a new memory for this model and add "
                f"the events again."
            )


class Store:
    """One store directory: manifest, database connection, segment files. Used by EventMemory;
    it knows nothing about models beyond the manifest's identity fields.

    The connection is in autocommit mode; every write goes through :meth:`transaction`
    (``BEGIN IMMEDIATE`` ... ``COMMIT``, the write counter bumped inside).
    """

    def __init__(self, directory: Path, manifest: dict, conn: sqlite3.Connection, lock) -> None:
        self.directory = directory
        self.manifest = manifest
        self.conn = conn
        self._lock = lock

    @staticmethod
    def lock(directory: Path):
        """Take the store's writer lock (an exclusive ``fcntl.flock`` on ``directory/.lock``, released
        when the file is closed or the process dies): one EventMemory per store at a time.

        Raises:
            EventKVError: another EventMemory (in this or another process) has the store open.
        """
        import fcntl

        f = open(directory / LOCK, "a+")  # noqa: SIM115 - held open for the store's lifetime
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise EventKVError(
                f"the memory in {str(directory)!r} is open in another EventMemory (this or another process): "
                "close that one first (a store has one writer at a time)."
            ) from None
        return f

    # ------------------------------------------------------------------ create / open
    @staticmethod
    def connect(path: Path) -> sqlite3.Connection:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        # why secure_delete: forget() must leave no copy of the text in freed database pages
        conn.execute("PRAGMA secure_delete=ON")
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    @classmethod
    def create(cls, directory: str | Path, manifest: dict) -> "Store":
        """Make a new store in ``directory`` (absent or empty). The manifest is written last, so a
        directory with a manifest is a complete store.

        Raises:
            EventKVError: ``directory`` is a file, already holds a memory, or holds other files.
        """
        d = Path(directory)
        if d.exists() and not d.is_dir():
            raise EventKVError(f"memory directory {str(d)!r} is a file: give a new or empty directory.")
        if (d / MANIFEST).is_file():
            raise EventKVError(
                f"{str(d)!r} already holds a memory: open it with EventMemory.open(directory, lm), "
                "or give a new directory."
            )
        if d.is_dir() and any(d.iterdir()):
            raise EventKVError(
                f"{str(d)!r} exists and is not a memory (it holds {', '.join(sorted(p.name for p in d.iterdir())[:4])}"
                f"): give a new or empty directory."
            )
        (d / SEGMENTS).mkdir(parents=True, exist_ok=True)
        lock = cls.lock(d)
        (d / DATABASE).touch(mode=0o600)  # the database holds every event's text: owner-only, like the segments
        conn = cls.connect(d / DATABASE)
        conn.executescript(SCHEMA)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO meta VALUES ('version', '0')")
        conn.execute("INSERT INTO meta VALUES ('created', ?)", (now(),))
        conn.execute("INSERT INTO meta VALUES (?, ?)", (MANIFEST_CHECKSUM, manifest_checksum(manifest)))
        conn.execute("COMMIT")
        manifest = {"schema": SCHEMA_VERSION, **manifest, "created": now()}
        write_json_atomic(d / MANIFEST, manifest)
        fsync_path(d / SEGMENTS)
        fsync_path(d)
        return cls(d, manifest, conn, lock)

    @staticmethod
    def read_manifest(d: Path) -> dict:
        """The manifest of the store in ``d``, checked (keys present, this schema version).

        Raises:
            EventKVError: no memory in ``d``, an unreadable or incomplete manifest, another schema version.
        """
        if not (d / MANIFEST).is_file() or not (d / DATABASE).is_file():
            what = "does not exist" if not d.exists() else "is not a memory (no manifest.json / memory.sqlite)"
            raise EventKVError(
                f"memory directory {str(d)!r} {what}: create one with EventMemory.create(directory, lm)."
            )
        if not d.is_dir():
            raise EventKVError(f"memory directory {str(d)!r} is a file: give the directory of a memory.")
        try:
            manifest = json.loads((d / MANIFEST).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise damaged(d, f"its manifest is not readable JSON ({exc})") from None
        missing = [k for k in MANIFEST_KEYS if k not in manifest] if isinstance(manifest, dict) else list(MANIFEST_KEYS)
        if missing:
            raise damaged(d, f"its manifest lacks {', '.join(missing)}")
        schema = manifest["schema"]
        if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
            raise damaged(d, f"its manifest's schema version is {schema!r}, not a version number")
        if schema not in READABLE_SCHEMAS:
            raise EventKVError(
                f"the memory in {str(d)!r} has schema version {schema!r}, this eventkv reads "
                f"{', '.join(map(str, READABLE_SCHEMAS))}: open it with the eventkv version that wrote it."
            )
        for key, kind in MANIFEST_TYPES.items():
            value = manifest.get(key)
            ok = (
                isinstance(value, str)
                if kind is str
                else isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
            )
            if not ok:
                what = "a string" if kind is str else "a list of token ids"
                raise damaged(d, f"its manifest's {key} is {str(value)[:40]!r}, not {what}")
        return manifest

    @classmethod
    def open(cls, directory: str | Path, verify: str | None = None) -> "Store":
        """Open a store: read the manifest, connect, discard segment files no committed row points to
        (and ``*.tmp`` leftovers), check every segment file against its row.

        Args:
            verify: ``"full"`` (sha256) or ``"size"``; default: ``$EVENTKV_MEMORY_VERIFY`` or ``"full"``.

        Raises:
            EventKVError: no memory in ``directory``, a manifest of another schema version, a segment
                file missing or failing its checksum.
        """
        d = Path(directory)
        manifest = cls.read_manifest(d)
        lock = cls.lock(d)
        conn = None
        try:
            with guard(d, "its database does not open"):
                conn = cls.connect(d / DATABASE)
            store = cls(d, manifest, conn, lock)
            store.check_database()
            if manifest["schema"] < SCHEMA_VERSION:
                store.upgrade()
            check_manifest(d, store.manifest, read_meta(d, conn, MANIFEST_CHECKSUM))
            store.discard_orphans()
            store.verify(verify or os.environ.get(VERIFY_ENV, "full"))
        except BaseException:
            if conn is not None:
                conn.close()
            lock.close()
            raise
        return store

    def check_database(self) -> None:
        """SQLite's ``PRAGMA quick_check`` (every page and b-tree of the file reads and is well formed)
        and a readable version counter.

        Raises:
            StoreDamaged: the first problem SQLite reports.
        """
        with guard(self.directory):
            problems = [r[0] for r in self.conn.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            shown = "; ".join(" ".join(str(x).split())[:200] for x in problems[:3])
            raise damaged(self.directory, f"SQLite's check of its database fails ({shown})")
        read_version(self.directory, self.conn)

    def upgrade(self) -> None:
        """Upgrade a schema-1 store to schema 2 in place (writer lock held): add the ``checksum`` column,
        seal every stored event and the manifest as they are (one transaction, the version unchanged),
        then rewrite the manifest with ``schema`` 2. Idempotent: a kill between the commit and the
        manifest's rewrite is finished by the next open."""
        d = self.directory
        with guard(d):
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                if not has_checksums(self.conn):
                    self.conn.execute("ALTER TABLE events ADD COLUMN checksum TEXT")
                seal_events(self.conn)
                self.conn.execute(
                    "INSERT OR IGNORE INTO meta VALUES (?, ?)", (MANIFEST_CHECKSUM, manifest_checksum(self.manifest))
                )
                self.conn.execute("COMMIT")
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise
        self.manifest = {**self.manifest, "schema": SCHEMA_VERSION}
        write_json_atomic(d / MANIFEST, self.manifest)

    def close(self) -> None:
        self.conn.close()
        self._lock.close()

    # ------------------------------------------------------------------ transactions
    @contextlib.contextmanager
    def transaction(self, bump: bool = True) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on any exception); bumps the version unless
        ``bump`` is False (a write that changes no event: computing rows). Before the commit every
        event row the transaction inserted is sealed with its checksum
        (:func:`eventkv.memory.integrity.seal_events`).

        Raises:
            StoreDamaged: the database's bytes are damaged (nothing is committed).
        """
        with guard(self.directory):
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
                seal_events(self.conn)
                if bump:
                    self.conn.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'version'")
                self.conn.execute("COMMIT")
            except BaseException:
                if self.conn.in_transaction:  # SQLite may have rolled back already (a damaged page, a full disk)
                    self.conn.execute("ROLLBACK")
                raise

    @property
    def version(self) -> int:
        return read_version(self.directory, self.conn)

    def event_rows(self) -> list[sqlite3.Row]:
        """Every row of the ``events`` table in history order (unchecked: see ``EventTable.from_rows``).

        Raises:
            StoreDamaged: the database does not read.
        """
        with guard(self.directory):
            return self.conn.execute("SELECT * FROM events ORDER BY seq").fetchall()

    def data_version(self) -> int:
        """SQLite's ``PRAGMA data_version``: moves when another connection (another process, an
        ``sqlite3`` shell) commits to the database, never for this connection's own commits."""
        with guard(self.directory):
            return self.conn.execute("PRAGMA data_version").fetchone()[0]

    def scrub(self) -> None:
        """Make deleted text unrecoverable from the files: checkpoint the WAL into the database and
        truncate it, rebuild the database (VACUUM; freed pages are zeroed by secure_delete), and
        checkpoint again."""
        with guard(self.directory):
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self.conn.execute("VACUUM")
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    # ------------------------------------------------------------------ segments
    def segment_rows(self) -> list[sqlite3.Row]:
        """Every row of the ``segments`` table by first row, each checked (:func:`check_segment_row`).

        Raises:
            StoreDamaged: the database does not read, or a row's fields are damaged.
        """
        with guard(self.directory):
            rows = self.conn.execute("SELECT * FROM segments ORDER BY row_start").fetchall()
        for row in rows:
            check_segment_row(self.directory, row)
        return rows

    def next_segment_id(self) -> int:
        with guard(self.directory):
            row = self.conn.execute("SELECT MAX(id) FROM segments").fetchone()
        return (row[0] or 0) + 1

    def write_segment(
        self, seg_id: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], positions: torch.Tensor
    ) -> dict:
        """Write one segment file durably (temp file, fsync, rename, fsync of ``segments/``) and
        return its database row (not yet inserted: the caller commits it).

        Args:
            keys, values: per layer ``[kv_heads, rows, head_dim]``.
            positions: ``[rows]`` int64 RoPE position ids of the rows.
        """
        tensors = {"positions": positions.detach().to("cpu", torch.int64).contiguous()}
        for i, (k, v) in enumerate(zip(keys, values)):
            # clone: a contiguous copy of its own (safetensors refuses views sharing memory)
            tensors[f"keys.{i}"] = k.detach().to("cpu").clone(memory_format=torch.contiguous_format)
            tensors[f"values.{i}"] = v.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        seg_dir = self.directory / SEGMENTS
        name = f"{seg_id:06d}.safetensors"
        fd, tmp = tempfile.mkstemp(dir=seg_dir, prefix=f".{name}-", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"format": "eventkv-memory-segment", "schema": str(SCHEMA_VERSION)})
            fsync_path(tmp)
            digest = sha256_file(tmp)
            size = os.path.getsize(tmp)
            os.replace(tmp, seg_dir / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_path(seg_dir)
        return {
            "id": seg_id,
            "file": f"{SEGMENTS}/{name}",
            "sha256": digest,
            "bytes": size,
            "n_rows": int(positions.shape[0]),
            "created": now(),
        }

    def insert_segment(self, conn: sqlite3.Connection, row: dict, row_start: int) -> None:
        conn.execute(
            "INSERT INTO segments (id, file, sha256, bytes, n_rows, row_start, created) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (row["id"], row["file"], row["sha256"], row["bytes"], row["n_rows"], row_start, row["created"]),
        )

    def read_segment(
        self, row: sqlite3.Row, n_layers: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """A segment's rows: per layer keys and values ``[kv_heads, rows, head_dim]``, and positions ``[rows]``.

        Raises:
            StoreDamaged: a file that does not read as safetensors, or does not hold ``n_layers`` layers
                of ``row['n_rows']`` rows and their positions.
        """
        seg = row["file"]
        try:
            t = load_file(self.directory / seg)
        except Exception as exc:  # safetensors raises its own error type for a malformed file
            raise damaged(self.directory, f"segment {seg!r} does not read ({type(exc).__name__}: {exc})") from None
        try:
            keys = [t[f"keys.{i}"] for i in range(n_layers)]
            values = [t[f"values.{i}"] for i in range(n_layers)]
            n = int(t["positions"].shape[0])
        except KeyError:
            raise damaged(self.directory, f"segment {seg!r} does not hold {n_layers} layers and positions") from None
        if n != row["n_rows"] or any(k.shape[1] != n for k in keys + values):
            raise damaged(self.directory, f"segment {seg!r} holds {n} rows, its database row says {row['n_rows']}")
        return keys, values, t["positions"]

    def discard_orphans(self) -> list[str]:
        """Delete segment files no committed segment row points to (a kill between a segment's write and
        its commit, or after a rewrite's commit and before the old file's removal) and ``*.tmp`` files.
        Returns the removed names."""
        seg_dir = self.directory / SEGMENTS
        seg_dir.mkdir(exist_ok=True)
        known = {Path(r["file"]).name for r in self.segment_rows()}
        removed = []
        for f in sorted(seg_dir.iterdir()):
            if f.is_file() and f.name not in known:
                f.unlink()
                removed.append(f.name)
        if removed:
            fsync_path(seg_dir)
        return removed

    def verify(self, how: str = "full") -> None:
        """Check every segment file against its database row: present, of the recorded size, and
        (``how="full"``) of the recorded sha256.

        Raises:
            StoreDamaged: a missing, short, long or (``full``) changed segment file.
            EventKVError: an unknown ``how``.
        """
        if how not in ("full", "size"):
            raise EventKVError(f"{VERIFY_ENV}={how!r}: use 'full' (sha256 of every segment) or 'size'.")
        check_segment_files(self.directory, self.segment_rows())
        if how == "full":
            for row in self.segment_rows():
                if sha256_file(self.directory / row["file"]) != row["sha256"]:
                    raise damaged(
                        self.directory, f"segment {row['file']!r} does not match its sha256 ({row['sha256'][:16]}...)"
                    )

    def remove_files(self, files: Sequence[str]) -> None:
        """Remove segment files that no committed row points to any more (after the commit)."""
        for f in files:
            (self.directory / f).unlink(missing_ok=True)
        if files:
            fsync_path(self.directory / SEGMENTS)

    def bytes_on_disk(self) -> int:
        return directory_bytes(self.directory)


def check_segment_row(directory: Path, row) -> None:
    """One ``segments`` row's fields: of their SQL types, and a file name inside ``segments/``.

    Raises:
        StoreDamaged: naming the segment and the field.
    """
    for col, kind in (("id", int), ("file", str), ("sha256", str), ("bytes", int), ("n_rows", int), ("row_start", int)):
        if not isinstance(row[col], kind):
            raise damaged(directory, f"segment {row['id']!r}: its {col} is {str(row[col])[:40]!r}, not of its type")
    if not SEGMENT_FILE.fullmatch(row["file"]):
        raise damaged(directory, f"segment {row['id']!r} names the file {row['file'][:80]!r}, not one in {SEGMENTS}/")


def check_segment_files(directory: Path, rows: Sequence[sqlite3.Row]) -> None:
    """Every segment file of ``rows`` present and of its recorded size (a ``stat`` each).

    Raises:
        StoreDamaged: a missing, short or long segment file.
    """
    for row in rows:
        f = directory / row["file"]
        if not f.is_file():
            raise damaged(directory, f"segment {row['file']!r} is missing")
        if f.stat().st_size != row["bytes"]:
            raise damaged(
                directory, f"segment {row['file']!r} has {f.stat().st_size} bytes, not the {row['bytes']} recorded"
            )


def directory_bytes(directory: Path) -> int:
    """Bytes of every file under ``directory`` (files removed while counting are skipped)."""
    total = 0
    for f in directory.rglob("*"):
        try:
            if f.is_file():
                total += f.stat().st_size
        except FileNotFoundError:  # a temporary file of a concurrent write
            pass
    return total
