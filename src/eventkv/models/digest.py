"""Content digests of model files: the full sha256 of every file a model is loaded from, hashed once and
cached by each file's stat so that later loads of unchanged files read nothing.

`model_files` lists the files of a local model directory that ``from_pretrained`` builds the model from, found
as transformers finds them: ``config.json`` and ``generation_config.json``; the checkpoint transformers picks
(``transformers_weights`` in the config, else ``model.safetensors``, ``model.safetensors.index.json``,
``pytorch_model.bin``, ``pytorch_model.bin.index.json``) with every shard its index names, in subfolders too;
a PEFT adapter's ``adapter_config.json`` and weights, and the files of the base model it names when the
directory has no ``config.json`` of its own; the remote-code ``.py`` files named in the config's ``auto_map``
(and ``custom_generate/generate.py``) with the folder's python files they import. Every top-level weight file
and shard index (`WEIGHT_PATTERNS`) is covered too, with the shards every index names, so a checkpoint another
transformers version would pick is covered as well: a file covered but not read only ever refuses, a file read
but not covered would accept other weights. The tokenizer's files are not covered (a store has a digest of its
own for the tokenizer).

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

from eventkv.errors import EventKVError
from eventkv.files import sha256_file, write_json_atomic
from eventkv.models.cache_dir import cache_root

__all__ = ["DIGEST_CACHE", "WEIGHT_PATTERNS", "directory_digest", "file_digest", "file_digests", "model_files"]

DIGEST_CACHE = "file-digests.json"
"""File name of the digest cache under the cache root."""
_FORMAT = 1
RACY_NS = 2_000_000_000
"""A file changed less than this many nanoseconds before it was hashed is not cached (timestamps are
coarse: a second write within the same tick could leave size, mtime and ctime as they were)."""

WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")
"""The top-level files of a model directory its digest always covers, besides those `model_files` finds by
following the config, the shard indexes and an adapter's base model: every weight file and shard index."""


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
    """The content digest of a local model directory: sha256 over the files of `model_files`, sorted by name,
    each as its name (its path relative to ``directory``; ``../base/<path>`` for a file of an adapter's base
    model, relative to that model's directory) and the full sha256 of its content. ``"unhashed"`` when the directory
    has none of them.

    Raises:
        EventKVError: a shard index or the config names a file outside the directory or one that is missing
            (see `model_files`).
        OSError: a file cannot be read.
    """
    named = _named_files(Path(directory), set())
    if not named:
        return "unhashed"
    digests = file_digests(list(named.values()))
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(f"{name}\0{digests[named[name]]}\n".encode())
    return h.hexdigest()


def model_files(directory: Path) -> list[Path]:
    """The files of the local model directory ``directory`` that ``from_pretrained`` reads to build the model,
    plus every top-level weight file and shard index (see the module docstring): the set `directory_digest`
    hashes, sorted by name. A file of an adapter's base model lies in that model's directory.

    Raises:
        EventKVError: the shard index transformers reads (or ``transformers_weights`` in ``config.json``) names a
            file outside the directory (an absolute path or one through ``..``) or a file that does not exist;
            transformers refuses such a model too. An adapter without ``config.json`` names a base model that
            is neither a local directory nor in the Hugging Face cache.
    """
    named = _named_files(Path(directory), set())
    return [named[name] for name in sorted(named)]


def _named_files(directory: Path, seen: set[Path]) -> dict[str, Path]:
    """`model_files` of ``directory`` as ``{name: path}``, names relative to ``directory`` (posix);
    ``seen`` holds the directories already followed (an adapter chain that loops is followed once)."""
    from transformers.utils import (
        ADAPTER_CONFIG_NAME,
        ADAPTER_SAFE_WEIGHTS_NAME,
        ADAPTER_WEIGHTS_NAME,
        CONFIG_NAME,
        GENERATION_CONFIG_NAME,
        find_adapter_config_file,
    )

    if not directory.is_dir():  # (find_adapter_config_file would take any other name for a hub id)
        return {}
    seen.add(directory.resolve())
    files: dict[str, Path] = {}

    def add(name: str) -> None:
        path = directory / name
        if path.is_file():
            files[Path(name).as_posix()] = path

    for name in (CONFIG_NAME, GENERATION_CONFIG_NAME):
        add(name)
    for pattern in WEIGHT_PATTERNS:
        for p in directory.glob(pattern):
            add(p.name)
    config = _read_json(directory / CONFIG_NAME)
    checkpoint = _checkpoint(directory, config)
    if checkpoint is not None:
        add(checkpoint)
        if checkpoint.endswith(".index.json"):
            for shard in _shards(directory, checkpoint):
                add(shard)
    for index in sorted(p.name for p in directory.glob("*.index.json")):
        if index != checkpoint:
            for shard in _listed_shards(directory, index):
                add(shard)
    for name in _remote_code(directory, config):
        add(name)
    # An adapter: transformers loads it when peft is installed; followed whether or not it is here, since
    # covering files that are not read only ever refuses.
    adapter = find_adapter_config_file(str(directory))
    if adapter is not None:
        for name in (ADAPTER_CONFIG_NAME, ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME):
            add(name)
        # transformers (integrations/peft.py, maybe_load_adapters) loads the base model the adapter names
        # only when the directory has no config.json of its own
        if not (directory / CONFIG_NAME).exists():
            base = _base_model_dir(directory, _read_json(Path(adapter)))
            if base.resolve() not in seen:
                for name, path in _named_files(base, seen).items():
                    files[f"../base/{name}"] = path  # no name inside the folder has a '..' part: no clash
    return files


def _read_json(path: Path) -> dict | None:
    """The JSON object in ``path``; None when the file is absent, unreadable or not a JSON object (the file
    itself is still covered: transformers refuses such a config, the digest need not read it)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _inside(name: str) -> bool:
    """Whether the relative path ``name`` stays in its folder: not absolute, no ``..`` part. Checked on the
    name, as transformers checks shard names, not on the resolved file (a hub snapshot's files are symlinks
    into the cache's blobs)."""
    path = Path(name)
    return not path.anchor and ".." not in path.parts


def _checkpoint(directory: Path, config: dict | None) -> str | None:
    """The checkpoint file (relative name) ``from_pretrained`` reads from ``directory``, or None when there is
    none (an adapter whose base model holds the weights; or a model transformers refuses).

    Mirrors the local-directory branch of transformers' ``modeling_utils._get_resolved_checkpoint_files``
    (private, and its signature changes between releases) for the arguments `eventkv.models.readers.load_hf`
    passes: no variant, ``use_safetensors`` unset. Its file names are transformers' public constants.
    """
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    explicit = (config or {}).get("transformers_weights")
    if isinstance(explicit, str):
        if not _inside(explicit):
            raise EventKVError(
                f"config.json in {directory} names its weights file transformers_weights={explicit!r}, which points "
                "outside the model directory; name a file inside it"
            )
        if not (directory / explicit).is_file():
            raise EventKVError(
                f"config.json in {directory} names its weights file transformers_weights={explicit!r}, which does "
                "not exist; restore the file or fix the config"
            )
        return explicit
    for name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME):
        if (directory / name).is_file():
            return name
    return None


def _shards(directory: Path, index: str) -> list[str]:
    """The shards (names relative to ``directory``) that the index ``index``, the one ``from_pretrained`` reads,
    names: every one must lie inside the directory and exist, as transformers requires.

    Raises:
        EventKVError: the index cannot be read, names a shard outside the directory, or one that is missing.
    """
    from transformers.utils.hub import get_checkpoint_shard_files

    path = directory / index
    try:
        # transformers' own reading of an index (and its check that no shard name leaves the model directory);
        # for a local directory it only joins each name to the directory, downloading nothing
        shard_paths, _ = get_checkpoint_shard_files(str(directory), str(path))
    except ValueError as e:  # a shard name outside the directory, or a file that is not JSON
        detail = str(e).replace(str(path), index)
        raise EventKVError(f"the checkpoint index {path} cannot be used: {detail}; fix or replace the index") from e
    except (KeyError, TypeError, AttributeError) as e:  # no "metadata" / "weight_map", or not of their shape
        raise EventKVError(
            f"the checkpoint index {path} is not a shard index (no 'metadata' and 'weight_map' of shard names: "
            f"{type(e).__name__}: {e}); fix or replace the index"
        ) from e
    names = [Path(p).relative_to(directory).as_posix() for p in shard_paths]
    for name in names:
        if not (directory / name).is_file():
            raise EventKVError(
                f"the checkpoint index {path} names the shard {name}, which does not exist in {directory}; restore "
                "the shard or fix the index"
            )
    return names


def _listed_shards(directory: Path, index: str) -> list[str]:
    """The shards (names relative to ``directory``) an index transformers does not read names that lie in the
    directory and exist: covered in case another transformers version reads that index; nothing is refused for
    it, since the model loads without it."""
    data = _read_json(directory / index)
    weight_map = data.get("weight_map") if data else None
    if not isinstance(weight_map, dict):
        return []
    return [s for s in {*weight_map.values()} if isinstance(s, str) and _inside(s) and (directory / s).is_file()]


def _remote_code(directory: Path, config: dict | None) -> list[str]:
    """The python files (names relative to ``directory``) that remote code would run from the folder: the module
    of each class in the config's ``auto_map`` (``"module.Class"``; a ``"repo--module.Class"`` names another
    repository's code, not in this folder) and ``custom_generate/generate.py``, with the folder's files they
    import relatively (``from .x import y``), recursively. Only files that exist are listed: transformers reads
    them only with ``trust_remote_code``, and without it a missing one refuses nothing."""
    from transformers.dynamic_module_utils import get_relative_imports

    refs: list[object] = []
    auto_map = (config or {}).get("auto_map")
    if isinstance(auto_map, dict):
        for value in auto_map.values():
            refs.extend(value if isinstance(value, list | tuple) else [value])
    # transformers' dynamic_module_utils.get_class_from_dynamic_module: "module.Class" -> module.py
    todo = [f"{ref.rsplit('.', 1)[0]}.py" for ref in refs if isinstance(ref, str) and "--" not in ref and "." in ref]
    todo.append("custom_generate/generate.py")
    found: list[str] = []
    # Mirrors dynamic_module_utils.get_relative_import_files, which raises on a missing file: here a missing file
    # is skipped (the model may load without its remote code), the others are still followed. A dotted import
    # (`from .a.b import c`) is followed both as transformers spells its file (a.b.py) and as Python does (a/b.py).
    while todo:
        name = todo.pop()
        if name in found or not _inside(name) or not (directory / name).is_file():
            continue
        found.append(name)
        parent = Path(name).parent
        for module in get_relative_imports(directory / name):
            todo += [(parent / f"{module}.py").as_posix(), (parent / f"{module.replace('.', '/')}.py").as_posix()]
    return found


def _base_model_dir(directory: Path, adapter_config: dict | None) -> Path:
    """The directory of the base model an adapter's ``adapter_config.json`` names (``base_model_name_or_path``):
    a local directory, or the snapshot of a hub id in the Hugging Face cache.

    Raises:
        EventKVError: the adapter config names no base model, or one found neither on disk nor in the cache.
    """
    base = (adapter_config or {}).get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise EventKVError(
            f"the adapter in {directory} has no config.json and its adapter_config.json names no base model "
            "(base_model_name_or_path); add one, or a config.json"
        )
    if Path(base).expanduser().is_dir():
        return Path(base).expanduser()
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(base, "config.json")
    if isinstance(cached, str):
        return Path(cached).parent
    raise EventKVError(
        f"the adapter in {directory} names the base model {base!r}, which is neither a local directory nor in "
        "the Hugging Face cache, so its weights cannot be hashed; download it first (or point "
        "base_model_name_or_path at its directory)"
    )
