"""The on-disk model cache: where it lives, its manifest, and how a cached directory is verified.

Layout::

    $EVENTKV_CACHE (else ~/.cache/eventkv)/
        models/<alias>/                 one converted model (config, safetensors, tokenizer, ...)
            eventkv-cache.json          the manifest, written last; lists every other file
        models/.staging-<alias>-*/      a pull in progress (removed when it ends)

A directory counts as cached only when its manifest exists and every file it lists has the
recorded size and sha256, and no other file is present. Everything here is plain file handling
with no model code, so it can be tested without torch.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eventkv.files import sha256_file, write_json_atomic  # noqa: F401  (sha256_file: re-exported, it lived here)

CACHE_ENV = "EVENTKV_CACHE"
MODEL_MANIFEST = "eventkv-cache.json"
"""File name of a cached model directory's manifest (file hashes, weights digest, source)."""
MANIFEST_FORMAT = 1


def cache_root() -> Path:
    """The cache root: ``$EVENTKV_CACHE`` if set and non-empty, else ``~/.cache/eventkv``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eventkv"


def model_dir(alias: str) -> Path:
    """The directory that holds (or will hold) the converted model of ``alias``."""
    return cache_root() / "models" / alias


def hash_files(directory: Path, names: list[str], workers: int | None = None) -> dict[str, str]:
    """sha256 of several files of ``directory`` in parallel threads (hashlib releases the GIL).

    Returns ``{name: sha256 hex}``. Raises ``OSError`` when a file cannot be read.
    """
    workers = workers or max(1, min(len(names), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = pool.map(lambda n: sha256_file(directory / n), names)
        return dict(zip(names, digests))


def dir_files(directory: Path) -> list[str]:
    """Relative paths (POSIX style, sorted) of all regular files under ``directory``, manifest excluded."""
    out = []
    for p in directory.rglob("*"):
        if p.is_file():
            rel = p.relative_to(directory).as_posix()
            if rel != MODEL_MANIFEST and not rel.startswith(MODEL_MANIFEST + "."):
                out.append(rel)
    return sorted(out)


def dir_size(directory: Path) -> int:
    """Total size in bytes of the regular files under ``directory`` (0 if it does not exist)."""
    if not directory.exists():
        return 0
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def write_manifest(directory: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Hash every file of ``directory`` and write the manifest atomically (tmp file, then ``os.replace``).

    ``info`` holds the caller's provenance fields (alias, source, weights digest, ...); this adds
    ``format`` and ``files: {relative path: {"size": bytes, "sha256": hex}}``. Call it after every
    other file is in place: a directory without a manifest is treated as a partial download.
    Returns the manifest written.
    """
    names = dir_files(directory)
    digests = hash_files(directory, names)
    manifest = {
        "format": MANIFEST_FORMAT,
        **info,
        "files": {n: {"size": (directory / n).stat().st_size, "sha256": digests[n]} for n in names},
    }
    write_json_atomic(directory / MODEL_MANIFEST, manifest, sort_keys=True, newline=False)
    return manifest


@dataclass(frozen=True)
class CacheCheck:
    """Outcome of checking one cached directory.

    ``ok`` is True only if the directory may be used; otherwise ``reason`` says what is wrong
    (missing, partial, corrupted) in words fit for a warning. ``manifest`` is the parsed manifest
    when it could be read.
    """

    ok: bool
    reason: str
    manifest: dict[str, Any] | None = None


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The parsed manifest of ``directory``, or None if it is absent or unreadable."""
    try:
        with open(directory / MODEL_MANIFEST) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None
    return manifest


STAMP_NAME = MODEL_MANIFEST + ".verified"
FULL_VERIFY_ENV = "EVENTKV_FULL_VERIFY"


def _now_ns() -> int:
    import time

    return time.time_ns()


def _file_stamps(directory: Path, names: list[str]) -> dict[str, list[int]]:
    stamps = {}
    for n in [*names, MODEL_MANIFEST]:
        st = (directory / n).stat()
        stamps[n] = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
    return stamps


def _stamp_matches(directory: Path, names: list[str]) -> bool:
    try:
        with open(directory / STAMP_NAME) as f:
            return json.load(f) == _file_stamps(directory, names)
    except (OSError, ValueError):
        return False


def _write_stamp(directory: Path, names: list[str]) -> None:
    """Record the stamps of a directory that just passed a full check. Files modified (mtime or ctime)
    within the last 2 s are not trusted (timestamps are coarse: a write in the same tick could keep
    the stamp), so then no stamp is written and the next check hashes again."""
    stamps = _file_stamps(directory, names)
    if any(max(st[1], st[3]) > _now_ns() - 2_000_000_000 for st in stamps.values()):
        return
    try:
        write_json_atomic(directory / STAMP_NAME, stamps, indent=None, newline=False)
    except OSError:
        pass  # a read-only cache is still usable; it is re-hashed next time


def check_dir(directory: Path, full: bool = True) -> CacheCheck:
    """Check a cached directory against its manifest.

    Always compares the set of files and their sizes (bytes). With ``full=True`` it also
    re-hashes every file (sha256, in parallel threads), which reads the whole directory; with
    ``full=False`` it is a quick check (no file contents read) for listings.

    A full check that passes records each file's (size, mtime, inode, ctime) in
    ``eventkv-cache.json.verified``; a later full check whose files all still carry exactly those
    stamps skips the re-hash (seconds instead of ~10 s per 7 GB). Any write to a file — a partial
    copy, a flipped byte, a replaced file — changes its stamp (its ctime, even when ``os.utime`` puts
    the mtime back) and brings the full sha256 check back. Set ``EVENTKV_FULL_VERIFY=1`` to re-hash on
    every load regardless.
    """
    if not directory.is_dir():
        return CacheCheck(False, f"{directory} does not exist")
    manifest = read_manifest(directory)
    if manifest is None:
        return CacheCheck(False, f"{directory} has no readable {MODEL_MANIFEST} (partial download or conversion)")
    if manifest.get("format") != MANIFEST_FORMAT:
        return CacheCheck(
            False,
            f"{directory}/{MODEL_MANIFEST} has format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}",
            manifest,
        )
    files: dict[str, dict] = manifest["files"]
    present = dir_files(directory)
    missing = sorted(set(files) - set(present))
    extra = sorted(set(present) - set(files))
    if missing or extra:
        return CacheCheck(False, f"{directory}: files missing {missing}, unexpected {extra}", manifest)
    for name, rec in files.items():
        size = (directory / name).stat().st_size
        if size != rec.get("size"):
            return CacheCheck(
                False, f"{directory / name}: size {size} bytes, manifest says {rec.get('size')}", manifest
            )
    if full:
        names = list(files)
        if os.environ.get(FULL_VERIFY_ENV) != "1" and _stamp_matches(directory, names):
            return CacheCheck(True, "ok (unchanged since its last full sha256 check)", manifest)
        digests = hash_files(directory, names)
        for name, rec in files.items():
            if digests[name] != rec.get("sha256"):
                return CacheCheck(
                    False,
                    f"{directory / name}: sha256 {digests[name][:16]}… differs from the manifest's "
                    f"{str(rec.get('sha256'))[:16]}…",
                    manifest,
                )
        _write_stamp(directory, names)
    return CacheCheck(True, "ok", manifest)
