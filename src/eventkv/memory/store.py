"""The on-disk store of one memory: a manifest, an SQLite database and append-only segment files.

Layout of a store directory::

    manifest.json            schema version, namespace, model name, weights / tokenizer / chat-template
                             digests, dtype, instruction, header token ids (written once, atomically)
    memory.sqlite (+ -wal)   stdlib sqlite3, WAL journal, synchronous=FULL, secure_delete=ON:
                             tables events, segments, meta (see SCHEMA)
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
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import sqlite3
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file

from eventkv.errors import EventKVError
from eventkv.files import fsync_path, sha256_file, write_json_atomic

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.models.profile import LoadedModel

SCHEMA_VERSION = 1
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
    created TEXT NOT NULL
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
            raise EventKVError(
                f"the manifest of the memory in {str(d)!r} is not readable JSON ({exc}): the store is damaged; "
                "restore it from a backup or create a new memory."
            ) from None
        missing = [k for k in MANIFEST_KEYS if k not in manifest] if isinstance(manifest, dict) else list(MANIFEST_KEYS)
        if missing:
            raise EventKVError(
                f"the manifest of the memory in {str(d)!r} lacks {', '.join(missing)}: the store is damaged or was "
                "not written by eventkv; restore it from a backup or create a new memory."
            )
        if manifest.get("schema") != SCHEMA_VERSION:
            raise EventKVError(
                f"the memory in {str(d)!r} has schema version {manifest.get('schema')!r}, this eventkv reads "
                f"{SCHEMA_VERSION}: open it with the eventkv version that wrote it."
            )
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
        try:
            conn = cls.connect(d / DATABASE)
            conn.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()
        except sqlite3.DatabaseError as exc:
            lock.close()
            raise EventKVError(
                f"the database of the memory in {str(d)!r} is not readable ({exc}): the store is damaged; restore "
                "it from a backup or create a new memory."
            ) from None
        store = cls(d, manifest, conn, lock)
        store.discard_orphans()
        store.verify(verify or os.environ.get(VERIFY_ENV, "full"))
        return store

    def close(self) -> None:
        self.conn.close()
        self._lock.close()

    # ------------------------------------------------------------------ transactions
    @contextlib.contextmanager
    def transaction(self, bump: bool = True) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on any exception); bumps the version unless
        ``bump`` is False (a write that changes no event: computing rows)."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
            if bump:
                self.conn.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'version'")
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    @property
    def version(self) -> int:
        return int(self.conn.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()[0])

    def scrub(self) -> None:
        """Make deleted text unrecoverable from the files: checkpoint the WAL into the database and
        truncate it, rebuild the database (VACUUM; freed pages are zeroed by secure_delete), and
        checkpoint again."""
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.conn.execute("VACUUM")
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    # ------------------------------------------------------------------ segments
    def segment_rows(self) -> list[sqlite3.Row]:
        return self.conn.execute("SELECT * FROM segments ORDER BY row_start").fetchall()

    def next_segment_id(self) -> int:
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
            EventKVError: a file that does not hold ``n_layers`` layers of ``row['n_rows']`` rows.
        """
        t = load_file(self.directory / row["file"])
        try:
            keys = [t[f"keys.{i}"] for i in range(n_layers)]
            values = [t[f"values.{i}"] for i in range(n_layers)]
        except KeyError:
            raise EventKVError(
                f"segment {row['file']!r} of {str(self.directory)!r} does not hold {n_layers} layers: the store is "
                f"corrupted; restore it from a backup or create a new memory."
            ) from None
        if int(t["positions"].shape[0]) != row["n_rows"]:
            raise EventKVError(
                f"segment {row['file']!r} holds {int(t['positions'].shape[0])} rows, its database row says "
                f"{row['n_rows']}: the store is corrupted; restore it from a backup or create a new memory."
            )
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
            EventKVError: a missing or corrupted segment; an unknown ``how``.
        """
        if how not in ("full", "size"):
            raise EventKVError(f"{VERIFY_ENV}={how!r}: use 'full' (sha256 of every segment) or 'size'.")
        for row in self.segment_rows():
            f = self.directory / row["file"]
            fix = "the store is corrupted; restore the directory from a backup or create a new memory"
            if not f.is_file():
                raise EventKVError(f"segment {row['file']!r} of {str(self.directory)!r} is missing: {fix}.")
            if f.stat().st_size != row["bytes"]:
                raise EventKVError(
                    f"segment {row['file']!r} of {str(self.directory)!r} has {f.stat().st_size} bytes, not the "
                    f"{row['bytes']} recorded: {fix}."
                )
            if how == "full" and sha256_file(f) != row["sha256"]:
                raise EventKVError(
                    f"segment {row['file']!r} of {str(self.directory)!r} does not match its sha256 "
                    f"({row['sha256'][:16]}...): {fix}."
                )

    def remove_files(self, files: Sequence[str]) -> None:
        """Remove segment files that no committed row points to any more (after the commit)."""
        for f in files:
            (self.directory / f).unlink(missing_ok=True)
        if files:
            fsync_path(self.directory / SEGMENTS)

    def bytes_on_disk(self) -> int:
        return directory_bytes(self.directory)


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
