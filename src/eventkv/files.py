"""Small file helpers every part of eventkv shares: a full-file sha256 and an atomic, durable JSON
write (what "an acknowledged write survives a kill" needs: temp file in the same directory,
fsync, rename, fsync of the directory)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

_CHUNK = 8 * 1024 * 1024


def sha256_file(path: str | Path) -> str:
    """Full sha256 (hex) of one file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: str | Path) -> None:
    """Flush a file's data, or a directory's entries (a rename into it), to disk (``os.fsync``).
    Directories cannot be opened for fsync on Windows; there the directory sync is skipped."""
    if os.name == "nt" and os.path.isdir(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(
    path: str | Path, obj: Any, *, indent: int | None = 2, sort_keys: bool = False, newline: bool = True
) -> None:
    """Write ``obj`` as JSON to ``path`` so that a reader sees the old file or the whole new one, never
    a part, and the new one survives a crash once this returns: a temporary file in the same
    directory, flushed and fsynced, renamed over ``path`` (mode 0644), then the directory fsynced.
    A failed write removes its temporary file.

    Raises:
        OSError: the directory is not writable, the disk is full, ...
        TypeError: ``obj`` is not JSON-serialisable.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=indent, sort_keys=sort_keys)
            if newline:
                f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


def data_digest(path: str | Path, recorded: str = "") -> str:
    """The sha256 of the data file ``path`` (``"dir"`` for a directory), checked against the digest a
    run recorded when it started (``recorded``; empty: nothing recorded yet).

    Raises:
        EventKVError: the data changed since the run started.
    """
    from eventkv.errors import EventKVError

    digest = sha256_file(path) if Path(path).is_file() else "dir"
    if recorded and recorded != digest:
        raise EventKVError(
            f"{str(path)!r} changed since this run started (sha256 {digest[:12]}, run has {recorded[:12]}): "
            "use a new --out for the new data."
        )
    return digest
