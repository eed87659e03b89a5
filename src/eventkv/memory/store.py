"""The on-disk store of one memory: a manifest, an SQLite database and append-only segment files.

Layout of a store directory::

    manifest.json            schema version, namespace, model name, weights / tokenizer / chat-template
                             digests, dtype, row format (``rows``; absent = ``native``), instruction, header
                             token ids (written once, atomically)
    memory.sqlite (+ -wal)   stdlib sqlite3, WAL journal, synchronous=FULL, secure_delete=ON:
                             tables events, segments, meta, embeddings (:data:`eventkv.memory.sql.SCHEMA`);
                             every stored event row carries a checksum of its text, token ids and
                             fields, and meta the manifest's checksum (:mod:`eventkv.memory.integrity`);
                             embeddings holds sentence vectors of event texts (the dense selector's,
                             :mod:`eventkv.memory.dense`), derived data without checksums
    segments/NNNNNN.safetensors
                             one file per prefill call: ``keys.{layer}`` / ``values.{layer}``
                             ``[kv_heads, rows, head_dim]`` (``int8`` / ``int4`` stores: the tensors of
                             :func:`eventkv.kv.quant.encode_rows`) and ``positions`` ``[rows]`` int64; never
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

Schema versions: 2 (event and manifest checksums), 3 (the ``embeddings`` table). A store of an older
schema is upgraded by the first :meth:`Store.open` (one transaction, then the manifest is rewritten
with ``schema`` 3): from schema 1 (written before checksums existed) the ``checksum`` column is added
and every stored event and the manifest are sealed as they are then (damage done before that open
cannot be told from the content); from schema 2 the empty ``embeddings`` table is added (the vectors
are computed at their first need and stored).

All or nothing: a write that fails (a full filesystem included, raised as
:class:`eventkv.errors.OutOfSpace`) rolls its transaction back and removes the segment file it
wrote, so the store is as it was. A store is created in a staging directory beside its final
place (``.<name>.creating-<random>``), fsynced and renamed into place in one step: a directory
with a manifest is a complete store, and a kill mid-create leaves only a staging directory, which
:func:`remove_leftovers` removes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import json
import os
import re
import shutil
import sqlite3
import tempfile
import uuid
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eventkv.errors import EventKVError, OutOfSpace, PurgePending, StoreLocked
from eventkv.files import directory_bytes, fsync_path, out_of_space, sha256_file, write_json_atomic
from eventkv.kv.quant import ROW_FORMATS, decode_rows, encode_rows
from eventkv.memory import sql
from eventkv.memory.integrity import MANIFEST_CHECKSUM, check_manifest, damaged, guard, manifest_checksum

SCHEMA_VERSION = 3
#: schema versions this eventkv opens (1 and 2: upgraded on open, see the module docstring)
READABLE_SCHEMAS = (1, 2, 3)
MANIFEST = "manifest.json"
DATABASE = "memory.sqlite"
SEGMENTS = "segments"
VERIFY_ENV = "EVENTKV_MEMORY_VERIFY"
LOCK = ".lock"
#: the infix of a staging directory, ``.<name>.creating-<random>``, beside the store being created
STAGING = ".creating-"
#: what a store directory holds before its manifest lands (an interrupted creation leaves a subset)
STORE_FILES = frozenset({DATABASE, DATABASE + "-wal", DATABASE + "-shm", DATABASE + "-journal", SEGMENTS, LOCK})
#: SQLite's busy timeout (ms) for every statement but a purge's checkpoint, which has its own deadline
BUSY_MS = 5000
#: seconds ``close`` and ``open`` wait for readers to let a pending purge complete
CLOSE_PURGE_S = 1.0
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


def now() -> str:
    """The current UTC time, ISO 8601 with microseconds."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds")


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
            StoreLocked: another EventMemory (in this or another process) has the store open.
        """
        import fcntl

        f = open(directory / LOCK, "a+")  # noqa: SIM115 - held open for the store's lifetime
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise StoreLocked(
                f"the memory in {str(directory)!r} is open in another EventMemory (this or another process): "
                "close that one first (a store has one writer at a time)."
            ) from None
        return f

    # ------------------------------------------------------------------ create / open
    @staticmethod
    def connect(path: Path) -> sqlite3.Connection:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=BUSY_MS / 1000)
        conn.row_factory = sqlite3.Row
        try:
            sql.configure(conn)
        except BaseException:
            conn.close()  # not left to the garbage collector: its files stay open until then
            raise
        return conn

    @classmethod
    def create(cls, directory: str | Path, manifest: dict) -> "Store":
        """Make a new store in ``directory`` (absent or empty), atomically: the store is built in a
        staging directory beside it (``.<name>.creating-<random>``: database, schema, ``segments/``,
        manifest), every file and directory fsynced, then renamed onto ``directory`` in one step and
        the parent fsynced. A kill at any point leaves either no store or the whole store; what an
        interrupted creation left (stale staging directories of this name, a manifest-less directory
        holding only store files) is removed first (:func:`remove_leftovers`).

        Raises:
            EventKVError: ``directory`` is a file, already holds a memory, or holds other files.
            OutOfSpace: the filesystem is full (nothing is left behind).
        """
        d = Path(directory)
        if d.exists() and not d.is_dir():
            raise EventKVError(f"memory directory {str(d)!r} is a file: give a new or empty directory.")
        if (d / MANIFEST).is_file():
            raise EventKVError(
                f"{str(d)!r} already holds a memory: open it with EventMemory.open(directory, lm), "
                "or give a new directory."
            )
        d.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(d.parent, d.name)
        if d.is_dir() and any(d.iterdir()):
            raise EventKVError(
                f"{str(d)!r} exists and is not a memory (it holds {', '.join(sorted(p.name for p in d.iterdir())[:4])}"
                f"): give a new or empty directory."
            )
        manifest = {"schema": SCHEMA_VERSION, **manifest, "created": now()}
        stage = d.parent / f".{d.name}{STAGING}{uuid.uuid4().hex[:12]}"
        lock, placed = None, False
        try:
            with out_of_space(d.parent, f"the new memory {d.name!r}"):
                stage.mkdir()
                lock = cls.lock(stage)  # held through the rename (same inode): a live creation is never a leftover
                (stage / SEGMENTS).mkdir()
                (stage / DATABASE).touch(mode=0o600)  # the database holds every event's text: owner-only
                conn = cls.connect(stage / DATABASE)
                try:
                    sql.initialize(conn, now(), manifest_checksum(manifest))
                finally:
                    # closed before the rename: SQLite reopens its -wal and -shm files by path
                    conn.close()
                write_json_atomic(stage / MANIFEST, manifest)
                for f in (stage / DATABASE, stage / SEGMENTS, stage):
                    fsync_path(f)
                try:
                    os.rename(stage, d)  # replaces an empty directory; fails on a non-empty one
                except OSError as exc:
                    if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                        raise EventKVError(
                            f"{str(d)!r} was filled by another process while this memory was being created: "
                            "give another directory."
                        ) from None
                    raise
                placed = True
                fsync_path(d.parent)
                conn = cls.connect(d / DATABASE)
        except BaseException:
            if placed:  # a create that raises leaves nothing: moved back aside (one step), then removed
                with contextlib.suppress(OSError):
                    os.rename(d, stage)
            if lock is not None:
                lock.close()
            shutil.rmtree(stage, ignore_errors=True)
            raise
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
        rows = manifest.get("rows", "native")
        if rows not in ROW_FORMATS:
            raise EventKVError(
                f"the memory in {str(d)!r} stores its rows as {rows!r}, this eventkv reads "
                f"{', '.join(ROW_FORMATS)}: open it with the eventkv version that wrote it."
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
            check_manifest(d, store.manifest, sql.read_meta(d, conn, MANIFEST_CHECKSUM))
            store.discard_orphans()
            store.verify(verify or os.environ.get(VERIFY_ENV, "full"))
            if store.purge_pending:  # a forget committed but killed (or blocked) before its purge completed
                with contextlib.suppress(PurgePending):  # still blocked: the flag stays, close tries again
                    store.purge(CLOSE_PURGE_S)
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
            problems = sql.quick_check(self.conn)
        if problems != ["ok"]:
            shown = "; ".join(" ".join(str(x).split())[:200] for x in problems[:3])
            raise damaged(self.directory, f"SQLite's check of its database fails ({shown})")
        sql.read_version(self.directory, self.conn)

    def upgrade(self) -> None:
        """Upgrade a schema-1 or schema-2 store to schema 3 in place (writer lock held): one transaction
        (the version unchanged) of :func:`eventkv.memory.sql.upgrade` (checksums of every stored event and
        the manifest as they are, for schema 1; the ``embeddings`` table), then rewrite the manifest with
        ``schema`` 3. Idempotent: a kill between the commit and the manifest's rewrite is finished by the
        next open."""
        d = self.directory
        with guard(d):
            sql.begin(self.conn)
            try:
                sql.upgrade(self.conn, manifest_checksum(self.manifest))
                sql.commit(self.conn)
            except BaseException:
                if self.conn.in_transaction:
                    sql.rollback(self.conn)
                raise
        self.manifest = {**self.manifest, "schema": SCHEMA_VERSION}
        write_json_atomic(d / MANIFEST, self.manifest)

    def close(self, purge: bool = True) -> None:
        """Close the connection and release the writer lock. A pending purge (:meth:`purge`) is
        tried first, for at most ``CLOSE_PURGE_S`` seconds; if it is still blocked the flag stays in
        the database and the next open tries again."""
        try:
            if purge and self.purge_pending:
                with contextlib.suppress(EventKVError, sqlite3.Error, OSError):  # the flag stays for the next open
                    self.purge(CLOSE_PURGE_S)
        finally:
            self.conn.close()
            self._lock.close()

    # ------------------------------------------------------------------ transactions
    @contextlib.contextmanager
    def transaction(self, bump: bool = True) -> Iterator[sql.Writes]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on any exception), yielding the
        transaction's writes (:class:`eventkv.memory.sql.Writes`); bumps the version unless ``bump``
        is False (a write that changes no event: computing rows). Before the commit every event row
        the transaction inserted is sealed with its checksum (:func:`eventkv.memory.sql.seal_events`).

        Raises:
            StoreDamaged: the database's bytes are damaged (nothing is committed).
            OutOfSpace: the filesystem is full (the transaction is rolled back: nothing of it is kept).
        """
        with out_of_space(self.directory, "the transaction"), guard(self.directory):
            sql.begin(self.conn)
            try:
                yield sql.Writes(self.conn)
                sql.seal_events(self.conn)
                if bump:
                    sql.bump_version(self.conn)
                sql.commit(self.conn)
            except BaseException:
                # why the check: SQLite rolls a transaction back by itself on SQLITE_FULL / SQLITE_IOERR, and
                # a ROLLBACK then fails ("no transaction is active") and would hide the real error
                if self.conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        sql.rollback(self.conn)
                raise

    @property
    def version(self) -> int:
        return sql.read_version(self.directory, self.conn)

    def event_rows(self) -> list[sqlite3.Row]:
        """Every row of the ``events`` table in history order (unchecked: see ``EventTable.from_rows``).

        Raises:
            StoreDamaged: the database does not read.
        """
        with guard(self.directory):
            return sql.event_rows(self.conn)

    def embeddings(self, model: str, ids: Sequence[str]) -> dict[str, np.ndarray]:
        """The stored sentence vectors of the events ``ids`` under ``model``: ``{id: [dim] float32}``
        (an event without one is absent).

        Raises:
            StoreDamaged: the database does not read, or a vector's bytes are not ``dim`` float32s.
        """
        with guard(self.directory):
            rows = sql.embedding_rows(self.conn, model, ids)
        out = {}
        for r in rows:
            dim, blob = r["dim"], r["vector"]
            if not isinstance(dim, int) or dim < 1 or not isinstance(blob, bytes) or len(blob) != 4 * dim:
                raise damaged(
                    self.directory, f"event {r['event_id']!r}: its {model!r} embedding is not {dim!r} float32 values"
                )
            out[r["event_id"]] = np.frombuffer(blob, dtype="<f4").astype(np.float32)
        return out

    def data_version(self) -> int:
        """SQLite's ``PRAGMA data_version``: moves when another connection (another process, an
        ``sqlite3`` shell) commits to the database, never for this connection's own commits."""
        with guard(self.directory):
            return sql.data_version(self.conn)

    # ------------------------------------------------------------------ purge (erasing dropped text)
    @property
    def purge_pending(self) -> bool:
        """Whether a committed drop of text (forget, rebase) may still have its bytes in the files."""
        return sql.purge_flagged(self.conn)

    def purge(self, wait_s: float) -> None:
        """Erase dropped text from the files: ``PRAGMA wal_checkpoint(TRUNCATE)`` copies the WAL into
        the database (whose freed bytes ``secure_delete`` has zeroed) and truncates it to 0 bytes, then
        the purge flag is cleared. SQLite waits (its busy handler, retrying) at most ``wait_s`` seconds
        for readers whose snapshot needs the old pages.

        Raises:
            PurgePending: a reader still held its snapshot at the deadline, or the filesystem was too
                full to checkpoint; the flag stays set (a later purge, close or open completes it).
        """
        conn = self.conn
        wal = self.directory / (DATABASE + "-wal")
        sql.set_busy_timeout(conn, max(0, int(wait_s * 1000)))
        try:
            busy = sql.checkpoint(conn)
        except sqlite3.Error as exc:  # SQLITE_FULL: the checkpoint could not grow the database file
            busy, why = 1, f"the checkpoint failed ({exc}): free space on the store's filesystem"
        else:
            why = (
                f"another connection held a read snapshot of the database for more than {wait_s:g} s, so the "
                "write-ahead log could not be checkpointed and truncated: end that reader (a long read "
                "transaction, a backup, an open sqlite3 shell)"
            )
        finally:
            sql.set_busy_timeout(conn, BUSY_MS)
        if busy or (wal.exists() and wal.stat().st_size):
            raise PurgePending(
                f"The memory in {str(self.directory)!r} still holds the dropped text's bytes in {DATABASE}-wal or "
                f"in database pages a reader needs: {why}; then call forget on the same id again (or close the "
                "memory, or open it again) to complete the purge."
            )
        with contextlib.suppress(OutOfSpace), self.transaction(bump=False) as tx:  # kept: the next purge is a no-op
            tx.clear_purge()
        # the flag's own frames hold no text: truncating them again is tidiness, not privacy
        sql.set_busy_timeout(conn, 0)
        try:
            with contextlib.suppress(sqlite3.Error):
                sql.checkpoint(conn)
        finally:
            sql.set_busy_timeout(conn, BUSY_MS)

    # ------------------------------------------------------------------ segments
    def segment_rows(self) -> list[sqlite3.Row]:
        """Every row of the ``segments`` table by first row, each checked (:func:`check_segment_row`).

        Raises:
            StoreDamaged: the database does not read, or a row's fields are damaged.
        """
        with guard(self.directory):
            rows = sql.segment_rows(self.conn)
        for row in rows:
            check_segment_row(self.directory, row)
        return rows

    @property
    def rows_format(self) -> str:
        """The row format of the store (the manifest's ``rows``; ``native`` where it names none)."""
        return self.manifest.get("rows", "native")

    def next_segment_id(self) -> int:
        with guard(self.directory):
            last = sql.max_segment_id(self.conn)
        return (last or 0) + 1

    def write_segment(
        self,
        seg_id: int,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        positions: torch.Tensor,
        *,
        native_head: int = 0,
    ) -> tuple[dict, dict[str, torch.Tensor]]:
        """Write one segment file durably (temp file, fsync, rename, fsync of ``segments/``) in the store's row
        format (:attr:`rows_format`) and return its database row (not yet inserted: the caller commits it) and
        the tensors the file holds (:func:`eventkv.kv.quant.encode_rows` and ``positions``: what
        :meth:`read_segment` reads back).

        Args:
            keys, values: per layer ``[kv_heads, rows, head_dim]``.
            positions: ``[rows]`` int64 RoPE position ids of the rows.
            native_head: the first rows kept native in every format (the instruction header's rows in this
                segment; :func:`eventkv.kv.quant.encode_rows`).
        """
        fmt = self.rows_format
        tensors = {"positions": positions.detach().to("cpu", torch.int64).contiguous()}
        tensors.update(encode_rows(keys, values, fmt, native_head=native_head))
        seg_dir = self.directory / SEGMENTS
        name = f"{seg_id:06d}.safetensors"
        with out_of_space(self.directory, f"segment {name}"):
            fd, tmp = tempfile.mkstemp(dir=seg_dir, prefix=f".{name}-", suffix=".tmp")
            os.close(fd)
            try:
                meta = {"format": "eventkv-memory-segment", "schema": str(SCHEMA_VERSION), "rows": fmt}
                save_file(tensors, tmp, metadata=meta)
                fsync_path(tmp)
                digest = sha256_file(tmp)
                size = os.path.getsize(tmp)
                os.replace(tmp, seg_dir / name)
                fsync_path(seg_dir)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                (seg_dir / name).unlink(missing_ok=True)  # renamed but not fsynced: no row points to it yet
                raise
        row = {
            "id": seg_id,
            "file": f"{SEGMENTS}/{name}",
            "sha256": digest,
            "bytes": size,
            "n_rows": int(positions.shape[0]),
            "created": now(),
        }
        return row, tensors

    def read_segment(
        self, row: sqlite3.Row, n_layers: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
        """A segment's rows: per layer keys and values ``[kv_heads, rows, head_dim]`` (in the store's row format,
        dequantized into the native dtype), positions ``[rows]``, and the tensors the file holds.

        Raises:
            StoreDamaged: a file that does not read as safetensors, holds rows of another format than the store's
                (its metadata's ``rows``; absent = ``native``), or does not hold ``n_layers`` layers of
                ``row['n_rows']`` rows and their positions.
        """
        seg = row["file"]
        try:
            with safe_open(self.directory / seg, framework="pt") as f:
                written = (f.metadata() or {}).get("rows", "native")
                t = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:  # safetensors raises its own error type for a malformed file
            raise damaged(self.directory, f"segment {seg!r} does not read ({type(exc).__name__}: {exc})") from None
        if written != self.rows_format:  # read as another format, its tensors would be decoded wrongly or not at all
            raise damaged(
                self.directory,
                f"segment {seg!r} holds rows in format {written!r} but the store's manifest says {self.rows_format!r} "
                "(a store keeps one row format for its life: a segment from another store was copied in, or the "
                "manifest was edited)",
            )
        try:
            keys, values = decode_rows(t, self.rows_format, n_layers)
            n = int(t["positions"].shape[0])
        except (KeyError, RuntimeError):  # a tensor missing, or quantized tensors whose shapes do not fit together
            raise damaged(self.directory, f"segment {seg!r} does not hold {n_layers} layers and positions") from None
        if n != row["n_rows"] or any(k.shape[1] != n for k in keys + values):
            raise damaged(self.directory, f"segment {seg!r} holds {n} rows, its database row says {row['n_rows']}")
        return keys, values, t["positions"], t

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
        """Remove segment files that no committed row points to any more (after the commit, or after
        a failed write). Best effort: a file that cannot be removed now is an orphan, which
        :meth:`open` removes (no committed row points to it)."""
        for f in files:
            with contextlib.suppress(OSError):
                (self.directory / f).unlink(missing_ok=True)
        if files:
            with contextlib.suppress(OSError):
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


def _lock_is_free(directory: Path) -> bool:
    """Whether no live process holds ``directory``'s writer lock (a missing lock file counts as free)."""
    if not (directory / LOCK).exists():
        return True
    try:
        Store.lock(directory).close()
    except (EventKVError, OSError):  # held by a live process, or not even openable: not free
        return False
    return True


def is_partial(directory: Path) -> bool:
    """Whether ``directory`` is what an interrupted creation left: a directory with no manifest that
    holds only store files (database, WAL, segments, lock, a manifest's ``*.tmp``) and whose lock no
    live process holds. An empty directory is not partial (``create`` accepts it as it is)."""
    if not directory.is_dir() or directory.is_symlink() or (directory / MANIFEST).exists():
        return False
    names = {p.name for p in directory.iterdir()}
    if not names:
        return False
    stray = {n for n in names if n not in STORE_FILES and not (n.startswith(f".{MANIFEST}-") and n.endswith(".tmp"))}
    return not stray and _lock_is_free(directory)


def remove_leftovers(parent: str | Path, name: str | None = None) -> list[str]:
    """Remove what interrupted creations left in ``parent`` (a directory of stores): staging
    directories (``.<name>.creating-*``) whose creator is gone (its lock is free), and partial
    store directories (:func:`is_partial`). With ``name``, only those of that store name.

    Returns:
        the names removed, sorted.
    """
    parent = Path(parent)
    if not parent.is_dir():
        return []
    removed = []
    for p in sorted(parent.iterdir()):
        stem = p.name[1:].partition(STAGING)[0] if p.name.startswith(".") and STAGING in p.name else None
        if stem is not None and (name is None or stem == name) and p.is_dir() and not p.is_symlink():
            if not _lock_is_free(p):
                continue
        elif not (p.name == name or (name is None and not p.name.startswith("."))) or not is_partial(p):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    if removed:
        with contextlib.suppress(OSError):
            fsync_path(parent)
    return removed
