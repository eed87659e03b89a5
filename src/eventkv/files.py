"""Small file helpers every part of eventkv shares: a full-file sha256, an atomic, durable JSON
write (what "an acknowledged write survives a kill" needs: temp file in the same directory,
fsync, rename, fsync of the directory), and the one test of "the filesystem is full" for every
layer that writes (:func:`is_out_of_space`, :func:`out_of_space`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import sqlite3
import tempfile
from pathlib import Path
from typing import Any, Iterator

_CHUNK = 8 * 1024 * 1024
#: the errno values of a full filesystem and of an exceeded disk quota
NO_SPACE = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e is not None)
# safetensors (Rust) reports an io::Error in its message only: "... I/O error: No space left on device (os error 28)"
_OS_ERROR = re.compile(r"os error (\d+)")


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
    path: str | Path,
    obj: Any,
    *,
    indent: int | None = 2,
    sort_keys: bool = False,
    newline: bool = True,
    mode: int = 0o644,
) -> None:
    """Write ``obj`` as JSON to ``path`` so that a reader sees the old file or the whole new one, never
    a part, and the new one survives a crash once this returns: a temporary file in the same
    directory, flushed and fsynced, renamed over ``path`` (``mode``, default 0644), then the directory
    fsynced. A failed write removes its temporary file.

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
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


def is_out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` says the filesystem is full or over quota, whichever layer raised it: an
    ``OSError`` with errno ``ENOSPC``/``EDQUOT``, an ``sqlite3.Error`` with ``SQLITE_FULL`` ("database
    or disk is full"), or safetensors' ``SafetensorError`` wrapping such an OS error (it keeps only the
    message). The exception's cause and context are followed too."""
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        exc = current
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            return True
        if isinstance(exc, sqlite3.Error) and (
            getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "database or disk is full" in str(exc)
        ):
            return True
        if type(exc).__name__ == "SafetensorError":
            m = _OS_ERROR.search(str(exc))
            if m and int(m.group(1)) in NO_SPACE:
                return True
        current = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def out_of_space(directory: str | Path, what: str) -> Iterator[None]:
    """Turn a full filesystem (:func:`is_out_of_space`) met inside the block into
    :class:`eventkv.errors.OutOfSpace` naming ``what`` was being written and ``directory``; every
    other exception passes unchanged. The block must leave nothing behind when it raises (the
    error promises the write was not kept).

    Raises:
        OutOfSpace: the filesystem of ``directory`` is full or over quota.
    """
    from eventkv.errors import OutOfSpace

    try:
        yield
    except OutOfSpace:
        raise
    except Exception as exc:
        if not is_out_of_space(exc):
            raise
        raise OutOfSpace(
            f"cannot write {what} in {str(directory)!r}: the filesystem is full or over quota ({exc}). Nothing of "
            "this write was kept: free space (or raise the quota) and retry."
        ) from exc


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
