"""Content digests of model files: the full sha256 of every file a model is loaded from, hashed once and
cached by each file's stat so that later loads of unchanged files read nothing.

The cache is one JSON file, ``<cache root>/file-digests.json`` (the cache root of
`eventkv.models.cache_dir.cache_root`)::

    {"format": 1, "files": {"/abs/path/model.safetensors":
        {"size": 123, "mtime_ns": ..., "ctime_ns": ..., "ino": ..., "dev": ..., "sha256": "…"}}}

An entry is used only when the file's current (size, mtime_ns, ctime_ns, inode, device) all equal the
recorded ones. Any write to a file moves its ctime (the kernel sets it; ``os.utime`` can put the mtime
back but not the ctime), and a replaced file has another inode, so a changed file is hashed again.
What the key cannot see: a rewrite within the same timestamp tick as the hash that recorded it. So a
file changed (mtime or ctime) less than `RACY_NS` before it was hashed is not cached; it is hashed
again on the next load. A cache file that cannot be read or parsed is ignored and rewritten; one that
cannot be written (a read-only cache) only costs a re-hash next time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path

from eventkv.files import sha256_file, write_json_atomic
from eventkv.models.cache_dir import cache_root

__all__ = ["DIGEST_CACHE", "WEIGHT_PATTERNS", "directory_digest", "file_digest", "file_digests"]

DIGEST_CACHE = "file-digests.json"
"""File name of the digest cache under the cache root."""
_FORMAT = 1
RACY_NS = 2_000_000_000
"""A file changed less than this many nanoseconds before it was hashed is not cached (timestamps are
coarse: a second write within the same tick could leave size, mtime and ctime as they were)."""

WEIGHT_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")
"""The files of a model directory that its digest covers: what ``from_pretrained`` builds the model
from (its config and every weight file or shard index; the tokenizer has its own digest in a store)."""


def _now_ns() -> int:
    return time.time_ns()


def _stat_key(st: os.stat_result) -> dict[str, int]:
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "ino": st.st_ino,
        "dev": st.st_dev,
    }


def _cache_path() -> Path:
    return cache_root() / DIGEST_CACHE


def _read_cache(path: Path) -> dict[str, dict]:
    """The cache's entries; ``{}`` when the file is absent, unreadable or not in the expected shape."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("files"), dict):
        return {}
    return {k: v for k, v in data["files"].items() if isinstance(v, dict) and isinstance(v.get("sha256"), str)}


def _write_cache(path: Path, entries: dict[str, dict]) -> None:
    """Write the entries atomically, dropping those whose file no longer exists; a failure is ignored."""
    entries = {k: v for k, v in entries.items() if os.path.exists(k)}
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"format": _FORMAT, "files": entries}, indent=None, sort_keys=True)


def file_digests(paths: list[Path]) -> dict[Path, str]:
    """Full sha256 (hex) of each file in ``paths``, from the digest cache where the file is unchanged.

    Files the cache does not hold (or holds for another stat) are read in full and hashed; their
    digests are recorded unless the file changed within `RACY_NS` of the hash.

    Returns ``{path: sha256 hex}`` in the order of ``paths``.

    Raises:
        OSError: a file cannot be read.
    """
    cache = _cache_path()
    entries = _read_cache(cache)
    out: dict[Path, str] = {}
    changed = False
    for p in paths:
        key = str(Path(p).resolve())
        before = _stat_key(os.stat(key))
        hit = entries.get(key)
        if hit is not None and {k: hit.get(k) for k in before} == before:
            out[p] = hit["sha256"]
            continue
        digest = sha256_file(key)
        after = _stat_key(os.stat(key))
        out[p] = digest
        settled = _now_ns() - RACY_NS
        if after == before and max(after["mtime_ns"], after["ctime_ns"]) < settled:
            entries[key] = {**after, "sha256": digest}
            changed = True
        elif entries.pop(key, None) is not None:
            changed = True
    if changed:
        _write_cache(cache, entries)
    return out


def file_digest(path: str | Path) -> str:
    """Full sha256 (hex) of one file, cached as in `file_digests`.

    Raises:
        OSError: the file cannot be read.
    """
    return file_digests([Path(path)])[Path(path)]


def directory_digest(directory: Path) -> str:
    """The content digest of a local model directory: sha256 over the sorted files that match
    `WEIGHT_PATTERNS` (top level only), each as its name and the full sha256 of its content.
    ``"unhashed"`` when the directory has none of them.

    Raises:
        OSError: a file cannot be read.
    """
    files = sorted({p for pattern in WEIGHT_PATTERNS for p in directory.glob(pattern) if p.is_file()})
    if not files:
        return "unhashed"
    digests = file_digests(files)
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{digests[p]}\n".encode())
    return h.hexdigest()
