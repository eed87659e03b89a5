"""What makes a memory store's state trustworthy when it is read back: the checksum of every event
row, the checksum of the manifest, the checks of each stored field, and the one mapping from "the
stored bytes are damaged" (an SQLite page that does not read, a field that does not parse, a value
that does not match its checksum) to :class:`eventkv.errors.StoreDamaged`.

Checksums (schema 2): each stored event row carries ``checksum``, a JSON object of three 64-bit
sha256 prefixes (hex): ``text`` (the event's text), ``token_ids`` (its token ids as stored, the
JSON list the rows were computed from) and ``fields`` (seq, id, kind, role, tags, budget, width,
n_rows, supersedes, created). They are written by :func:`eventkv.memory.sql.seal_events` inside
the transaction that writes the row, from the values as stored. Not covered, because they change after the add: the
flags (deleted, pinned), the segment link (set by a prefill), and position / row_start (moved by
``forget``), which are checked instead as the contiguous layout every store has (each stored event
starts at the position and row where the one before it ends, the first where the header ends). A
forgotten marker has no checksum (a hash of a short text would let it be guessed back).

The manifest's checksum (sha256 of every field but ``schema`` and ``created``: namespace, model,
identity digests, dtype, instruction, header token ids, contract) is kept in the database's
``meta`` table, so a manifest edited on disk — another header, another identity — is refused too.

These are checksums against damage (bit rot, a torn copy, an edit by hand), not a signature: whoever
can write the files can write matching checksums.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
from pathlib import Path
from typing import Iterator

from eventkv.errors import StoreDamaged
from eventkv.memory.records import KINDS

#: the columns the ``fields`` checksum covers, in order
FIELDS = ("seq", "id", "kind", "role", "tags", "budget", "width", "n_rows", "supersedes", "created")
#: the checksum's parts and how a message names each
PARTS = {
    "text": "text",
    "token_ids": "token ids",
    "fields": "fields (id, kind, role, tags, budget, width, rows, patch link, creation time)",
}
#: the meta key of the manifest's checksum
MANIFEST_CHECKSUM = "manifest_checksum"
#: manifest fields a checksum does not cover: the schema (moved by an upgrade) and the creation time
UNSEALED_MANIFEST_KEYS = ("schema", "created")
#: the SQLite result codes (``sqlite_errorname``) that mean the file's bytes are damaged, not busy or full
DAMAGE_CODES = ("SQLITE_CORRUPT", "SQLITE_NOTADB", "SQLITE_FORMAT", "SQLITE_IOERR_SHORT_READ")
#: messages of errors the sqlite3 module raises on damaged content without a result code
DAMAGE_MESSAGES = ("Could not decode to UTF-8", "no such table", "no such column", "malformed")

RECOVER = "restore the store directory from a backup, or delete the memory and add its events again"


def damaged(directory: str | Path, what: str) -> StoreDamaged:
    """The error for a memory whose stored state fails a check: names the memory (its directory),
    the damaged part and how to recover."""
    return StoreDamaged(f"the memory in {str(directory)!r} is damaged: {what}. To recover, {RECOVER}.")


def is_damage(exc: BaseException) -> bool:
    """Whether an ``sqlite3`` error says the database file's bytes are damaged (a malformed page, not a
    database, a short read, text that is not UTF-8, a table gone) rather than busy, locked or full."""
    if not isinstance(exc, sqlite3.Error):
        return False
    name = getattr(exc, "sqlite_errorname", None) or ""
    return any(name.startswith(c) for c in DAMAGE_CODES) or any(m in str(exc) for m in DAMAGE_MESSAGES)


@contextlib.contextmanager
def guard(directory: str | Path, what: str = "its database does not read") -> Iterator[None]:
    """Turn an ``sqlite3`` error that means damage (:func:`is_damage`) raised inside the block into
    :class:`StoreDamaged`; any other error passes unchanged (busy, full: not this module's)."""
    try:
        yield
    except sqlite3.Error as exc:
        if is_damage(exc):
            raise damaged(directory, f"{what} ({exc})") from None
        raise


def _h(value) -> str:
    # a tag byte keeps NULL, a string and a JSON value apart (text None is not the text "null")
    if isinstance(value, str):
        data = b"s" + value.encode("utf-8", "surrogatepass")
    elif value is None:
        data = b"n"
    else:
        data = b"j" + json.dumps(value, ensure_ascii=True, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _parts(row) -> dict[str, str]:
    return {"text": _h(row["text"]), "token_ids": _h(row["token_ids"]), "fields": _h([row[f] for f in FIELDS])}


def event_checksum(row) -> str:
    """The checksum of one event row (``sqlite3.Row`` or mapping of the ``events`` columns), as stored
    in its ``checksum`` column: ``{"text", "token_ids", "fields"}`` (see the module docstring)."""
    return json.dumps(_parts(row), separators=(",", ":"))


def manifest_checksum(manifest: dict) -> str:
    """sha256 (hex) of a manifest's fields but ``schema`` and ``created`` (sorted keys, compact JSON)."""
    sealed = {k: v for k, v in manifest.items() if k not in UNSEALED_MANIFEST_KEYS}
    return hashlib.sha256(
        json.dumps(sealed, sort_keys=True, ensure_ascii=True, separators=(",", ":")).encode()
    ).hexdigest()


def check_manifest(directory: str | Path, manifest: dict, recorded: str | None) -> None:
    """Refuse a manifest that does not match the checksum its database recorded (``recorded``; None:
    the database holds none, itself damage for a schema-2 store).

    Raises:
        StoreDamaged: naming what the manifest holds.
    """
    if recorded != manifest_checksum(manifest):
        what = "has no checksum of its manifest" if recorded is None else "its manifest does not match its checksum"
        raise damaged(
            directory,
            f"{what} (the header token ids, instruction and model identity the rows were computed with)",
        )


# ---------------------------------------------------------------------- event rows
_TYPES: dict[str, tuple[type, ...]] = {
    "seq": (int,),
    "id": (str,),
    "kind": (str,),
    "text": (str, type(None)),
    "role": (str, type(None)),
    "tags": (str,),
    "budget": (int, type(None)),
    "token_ids": (str, type(None)),
    "position": (int, type(None)),
    "width": (int,),
    "row_start": (int, type(None)),
    "n_rows": (int,),
    "segment": (int, type(None)),
    "supersedes": (str, type(None)),
    "deleted": (int,),
    "forgotten": (int,),
    "pinned": (int,),
    "created": (str,),
}
_SQL_TYPE = {str: "text", int: "an integer", type(None): "NULL", bytes: "bytes", float: "a real number"}


def _name(row) -> str:
    eid = row["id"]
    return f"event {eid!r} (seq {row['seq']})" if isinstance(eid, str) else f"the event at seq {row['seq']!r}"


def check_event_row(directory: str | Path, row, sealed: bool = True) -> tuple[tuple[str, ...], list[int] | None]:
    """Check one row of the ``events`` table and parse its JSON fields.

    Checks: every column of its SQL type; a stored event's checksum (when ``sealed``: a store of
    schema 2) matches its text, token ids and fields; tags a JSON list of strings; token ids a
    non-empty JSON list of integers, as many as its rows; a kind the memory writes; a patch names
    the event it supersedes; a forgotten marker holds no text or token ids.

    Returns:
        ``(tags, token ids)``; token ids None for a forgotten marker.

    Raises:
        StoreDamaged: naming the event (id and seq) and the damaged field.
    """
    for col, types in _TYPES.items():
        try:
            value = row[col]
        except (IndexError, KeyError):
            raise damaged(directory, f"its events table has no column {col!r}") from None
        if type(value) not in types:
            got = _SQL_TYPE.get(type(value), type(value).__name__)
            want = " or ".join(_SQL_TYPE[t] for t in types)
            raise damaged(directory, f"{_name(row)}: its {col} is stored as {got}, not {want}")
    who = _name(row)
    if row["kind"] not in KINDS:
        raise damaged(directory, f"{who}: its kind {row['kind']!r} is none of {', '.join(KINDS)}")
    if row["forgotten"]:
        for col in ("text", "token_ids", "role"):
            if row[col] is not None:
                raise damaged(directory, f"{who} is marked forgotten but still holds its {col}")
        return (), None
    if sealed:
        checksum = row["checksum"]
        try:
            stored = json.loads(checksum) if isinstance(checksum, str) else None
        except json.JSONDecodeError:
            stored = None
        if not isinstance(stored, dict):
            raise damaged(directory, f"{who}: its checksum is missing or unreadable ({str(checksum)[:40]!r})")
        now = _parts(row)
        bad = [PARTS[p] for p in PARTS if stored.get(p) != now[p]]
        if bad:
            verb = "does" if bad == [PARTS["text"]] else "do"  # "token ids" and "fields" are plural
            raise damaged(directory, f"{who}: its {' and '.join(bad)} {verb} not match the checksum written with it")
    try:
        tags = json.loads(row["tags"])
    except json.JSONDecodeError as exc:
        raise damaged(directory, f"{who}: its tags are not valid JSON ({exc.msg})") from None
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise damaged(directory, f"{who}: its tags are not a JSON list of strings ({row['tags'][:40]!r})")
    if row["text"] is None or row["token_ids"] is None:
        raise damaged(directory, f"{who} is not forgotten but has no {'text' if row['text'] is None else 'token ids'}")
    try:
        tokens = json.loads(row["token_ids"])
    except json.JSONDecodeError as exc:
        raise damaged(directory, f"{who}: its token ids are not valid JSON ({exc.msg})") from None
    if type(tokens) is not list or not tokens or not all(type(t) is int for t in tokens) or min(tokens) < 0:
        raise damaged(directory, f"{who}: its token ids are not a non-empty JSON list of token ids")
    if len(tokens) != row["n_rows"] or row["width"] < row["n_rows"]:
        raise damaged(
            directory,
            f"{who}: it has {len(tokens)} token ids, {row['n_rows']} rows and a width of {row['width']} positions "
            "(rows = token ids <= width)",
        )
    if row["kind"] == "patch" and row["supersedes"] is None:
        raise damaged(directory, f"{who}: a patch that names no event it supersedes")
    return tuple(tags), tokens


def check_layout(directory: str | Path, records, header_len: int) -> None:
    """Every stored event (forgotten markers excluded), in history order, starts at the position and
    row where the one before it ends (the first where the header ends); ids are unique and every
    patch's ``supersedes`` names an event of the table.

    Args:
        records: :class:`eventkv.memory.records.MemoryRecord` in history (seq) order.
        header_len: the header's tokens (= rows = positions).

    Raises:
        StoreDamaged: naming the first event out of place.
    """
    pos = row = header_len
    ids = set()
    for r in records:
        if r.id in ids:
            raise damaged(directory, f"the event id {r.id!r} is stored twice")
        ids.add(r.id)
        if r.forgotten:
            continue
        if r.position != pos or r.row_start != row:
            raise damaged(
                directory,
                f"event {r.id!r} (seq {r.seq}) is stored at position {r.position}, row {r.row_start}, but the events "
                f"before it end at position {pos}, row {row}",
            )
        pos, row = pos + r.width, row + r.n_rows
    for r in records:
        if r.supersedes is not None and r.supersedes not in ids:
            raise damaged(directory, f"patch {r.id!r} (seq {r.seq}) supersedes {r.supersedes!r}, which is not stored")
