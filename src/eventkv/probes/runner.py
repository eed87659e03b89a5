"""Running a probe into a directory, resumably, and reporting from its records.

A run directory holds

* ``manifest.json`` — the run's **identity** (probe, record version, every option, seed, model,
  weights digest, dtype) plus provenance (eventkv version and git commit, package versions,
  the model profile with the device it was loaded on, the item count, and per invocation its
  timing, torch threads and device);
* ``records.jsonl`` — one JSON line per item, appended and fsynced as each item finishes;
* ``summary.md`` (and ``figure.png``) — rendered from ``records.jsonl`` alone.

Re-running into the same directory resumes: items already in ``records.jsonl`` are not
recomputed; a line cut short by a kill is dropped (only the item in flight is lost). A directory
whose identity differs from the new run's is refused with :class:`EventKVError`. The item count
is not part of the identity: asking for more items extends a run (item ``i`` depends only on the
seed and ``i``).

The device (the CPU or a CUDA GPU) is provenance, not identity: within one dtype it changes only
the rounding of the reductions, as the thread count and the CPU's kernels do, so a run may be
resumed on another device in the same dtype (``--dtype auto`` resolves per device, so an ``auto``
run started on a CPU without native bf16 resumes on a GPU only with ``--dtype float32``). Each
invocation records its device and why it was chosen (``docs/devices.md``).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Sequence

import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.files import write_json_atomic
from eventkv.options import check_items, check_out_dir
from eventkv.probes.base import Probe, Runtime, Summary, get_probe

RUN_MANIFEST = "manifest.json"
"""File name of a run folder's manifest (model, dtype, options, seed, versions, invocations)."""
RECORDS = "records.jsonl"
SUMMARY = "summary.md"
FIGURE = "figure.png"
PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "gguf",
    "scipy",
    "numpy",
    "typer",
    "rich",
    "matplotlib",
)


def identity(probe: Probe, model: str, rt: Runtime, seed: int) -> dict:
    """What must match for two invocations to write into the same directory."""
    return {
        "probe": probe.name,
        "record_version": probe.record_version,
        "options": probe.options(),
        "seed": seed,
        "model": model,
        "weights_digest": rt.weights_digest,
        "dtype": str(getattr(rt.profile, "dtype", "")).removeprefix("torch."),
    }


def environment() -> dict:
    """eventkv version and git commit, package versions, Python and platform."""
    from eventkv import __version__

    versions: dict[str, str | None] = {}
    for p in PACKAGES:
        try:
            versions[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            versions[p] = None
    commit, dirty = None, None
    here = Path(__file__).resolve().parent
    try:
        commit = (
            subprocess.run(
                ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
        if commit:
            dirty = bool(
                subprocess.run(
                    ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout.strip()
            )
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "eventkv": __version__,
        "git_commit": commit,
        "git_dirty": dirty,
        "packages": versions,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def load_records(directory: str | Path, repair: bool = False) -> list[dict]:
    """The records of a run, in file order. A last line cut short by a kill (no newline, or not
    JSON) is ignored, and removed from the file when ``repair``.

    Raises:
        EventKVError: a broken line before the last one, or two records with the same index.
    """
    path = Path(directory) / RECORDS
    if not path.is_file():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # tail: bytes after the last newline (partial line or b"")
    records, good_bytes = [], 0
    for n, line in enumerate(complete, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(complete) and not tail:
                tail = line  # the last newline-terminated line is broken: treat as cut short
                break
            raise EventKVError(
                f"{path}:{n} is not a JSON record: the file is damaged; delete that line "
                "(the item will be recomputed) and run again."
            ) from None
        good_bytes += len(line) + 1
    if tail and repair:
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    seen: set[int] = set()
    for r in records:
        if r["index"] in seen:
            raise EventKVError(f"{path} holds item {r['index']} twice: delete one of the two lines and run again.")
        seen.add(r["index"])
    return records


def check_or_create(directory: Path, ident: dict) -> dict:
    """Read the directory's manifest (creating the directory if needed) and refuse a different
    identity. Returns the existing manifest or ``{}``.

    A directory whose run stopped before finishing any record (e.g. a bad option found after the
    manifest was written) is taken over by the new settings.

    Raises:
        EventKVError: the path is a file, or the directory holds records of a run with other
            options, seed or model.
    """
    check_out_dir(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RUN_MANIFEST
    if not path.is_file():
        if (directory / RECORDS).is_file():
            raise EventKVError(
                f"{str(directory)!r} has {RECORDS} but no {RUN_MANIFEST}: it was not made by eventkv run; "
                "choose another --out directory."
            )
        return {}
    old = json.loads(path.read_text())
    prev = old.get("identity", {})
    records = directory / RECORDS
    if prev != ident and not (records.is_file() and records.read_text().strip()):
        return {}  # a run that failed before its first record: nothing to lose, start it afresh
    if prev != ident:
        diffs = []
        for k in sorted(set(prev) | set(ident)):
            if k == "options":
                po, no = prev.get(k, {}), ident.get(k, {})
                diffs += [
                    f"{o}: {po.get(o)!r} -> {no.get(o)!r}" for o in sorted(set(po) | set(no)) if po.get(o) != no.get(o)
                ]
            elif prev.get(k) != ident.get(k):
                diffs.append(f"{k}: {prev.get(k)!r} -> {ident.get(k)!r}")
        raise EventKVError(
            f"{str(directory)!r} holds a run made with different settings ({'; '.join(diffs)}): "
            "give a new --out directory, or repeat the original settings to resume it."
        )
    return old


def run_probe(
    probe: Probe,
    rt: Runtime,
    *,
    model: str,
    items: int,
    seed: int,
    out: str | Path,
    progress: bool = True,
    console=None,
    figure: bool = True,
    batch: int = 1,
) -> Summary:
    """Run ``probe`` on ``items`` items into ``out`` (resuming), ``batch`` items at a time
    (:meth:`Probe.run_batch`), then write summary.md and the figure.

    Returns:
        the Summary of every record in the directory.

    Raises:
        EventKVError: a directory made with other settings, ``items < 1``, or a probe/model error.
    """
    check_run_items(probe, items)
    out = Path(out)
    manifest, todo = open_run(probe, rt, model=model, items=items, seed=seed, out=out)
    if len(todo) < items:  # a resumed run says so (a fresh one and a resumed one look alike otherwise)
        say_resuming(out, items - len(todo), len(todo))
    with progress_bar(progress, console) as bar:
        task = bar.add_task(f"{probe.name}", total=items, completed=items - len(todo)) if bar else None
        run_items(
            probe, rt, seed, out, manifest, todo, after=(lambda i: bar.advance(task)) if bar else None, batch=batch
        )
    return render(out, figure=figure)


def say_resuming(out: Path, done: int, todo: int) -> None:
    """One line on stderr before a run that resumes ``out``: how many items are already recorded there
    and how many are left to compute (``resuming runs/x: 1 item already recorded, 2 to compute``)."""
    from rich.console import Console

    items = "item" if done == 1 else "items"
    Console(stderr=True).print(
        f"resuming {out}: {done} {items} already recorded, {todo} to compute",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def check_run_items(probe: Probe, items) -> int:
    """``items`` if it is a whole number >= 1 that ``probe`` can make (see :meth:`Probe.max_items`).

    Raises:
        OptionError: naming ``items`` and what is allowed.
    """
    check_items(items)
    n = probe.max_items()
    if n is not None and items > n:
        raise OptionError("items", items, f"the task file holds {n} items: use --items {n} or fewer.")
    return items


def open_run(probe: Probe, rt: Runtime, *, model: str, items: int, seed: int, out: Path) -> tuple[dict, list[int]]:
    """Validate ``probe``, check or create the run directory ``out`` (refusing other settings,
    dropping a record cut short by a kill), write its manifest for ``items`` items and hand the
    directory to the probe (:meth:`Probe.use_run_directory`).

    Returns:
        the manifest (to pass to :func:`run_items`) and the indices still to compute.

    Raises:
        EventKVError: invalid options, or a directory holding records made with other settings.
    """
    probe.validate()
    check_run_items(probe, items)
    probe.check_model(rt)  # before the directory is made: a bad option leaves nothing behind
    opened = open_folder(out, identity(probe, model, rt, seed), profile_dict(rt), items)
    probe.use_run_directory(out)
    return opened


def profile_dict(rt: Runtime) -> dict:
    """The model profile of ``rt`` as the JSON-able dict a manifest stores."""
    return rt.profile.to_dict() if hasattr(rt.profile, "to_dict") else dict(vars(rt.profile))


def open_folder(out: Path, ident: dict, profile: dict, items: int) -> tuple[dict, list[int]]:
    """Check or create the run directory ``out`` for a run of identity ``ident`` (see :func:`identity`;
    refusing a directory holding records of other settings, dropping a record cut short by a kill) and
    write its manifest for ``items`` items. The part of :func:`open_run` that needs no model: a sweep
    computes ``ident`` and ``profile`` where the model is loaded and opens the folder where records are
    written.

    Returns:
        the manifest (to pass to :func:`add_invocation`) and the indices still to compute, in order
        (any subset of ``range(items)``: records may have been appended in any order).

    Raises:
        EventKVError: ``out`` is a file, or holds records made with other settings.
    """
    old = check_or_create(out, ident)
    done = {r["index"] for r in load_records(out, repair=True)}
    manifest = {
        "identity": ident,
        "items": max(items, old.get("items", 0)),
        "profile": profile,
        "environment": environment(),
        "created": old.get("created") or now(),
        "invocations": old.get("invocations", []),
    }
    write_json_atomic(out / RUN_MANIFEST, manifest)
    return manifest, [i for i in range(items) if i not in done]


def compute_record(probe: Probe, rt: Runtime, seed: int, index: int) -> dict:
    """The record of item ``index`` of ``probe`` at ``seed``: what every runner writes for that item."""
    return probe.run_item(rt, probe.items(seed, [index])[0])


def append_record(out: Path, record: dict) -> None:
    """Append ``record`` as one JSON line to ``out/records.jsonl`` and fsync it (a kill loses at most
    the line being written, which :func:`load_records` drops). Records may come in any index order."""
    with open(out / RECORDS, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def add_invocation(
    out: Path, manifest: dict, *, started: str, seconds: float, items_computed: int, torch_threads: int, **extra
) -> None:
    """Add one invocation (start time, items computed, wall seconds, torch threads per worker, and
    ``extra`` such as a sweep's backend and workers) to ``manifest`` and write it to ``out``."""
    # torch CPU threads change the reduction order, so float scores are reproducible bit for bit only
    # at the same thread count: record it with every invocation.
    manifest["invocations"].append(
        {
            "started": started,
            "items_computed": items_computed,
            "seconds": round(seconds, 3),
            "torch_threads": torch_threads,
            **extra,
        }
    )
    write_json_atomic(out / RUN_MANIFEST, manifest)


def run_items(
    probe: Probe,
    rt: Runtime,
    seed: int,
    out: Path,
    manifest: dict,
    todo: Sequence[int],
    before=None,
    after=None,
    batch: int = 1,
) -> None:
    """Compute the items ``todo`` in order, ``batch`` at a time (:meth:`Probe.run_batch`; 1:
    :func:`compute_record` per item), appending each record to ``out/records.jsonl`` as its batch
    finishes (``before(i)`` / ``after(i)`` are called around item ``i``, e.g. for a progress bar;
    a kill loses at most the batch in flight), then add this invocation (start, items computed,
    seconds, torch threads, device and why it was chosen, batch) to the manifest."""
    t0, started = time.perf_counter(), now()
    for a in range(0, len(todo), max(1, batch)):
        chunk = list(todo[a : a + max(1, batch)])
        if before:
            for i in chunk:
                before(i)
        if len(chunk) == 1:
            records = [compute_record(probe, rt, seed, chunk[0])]
        else:
            records = probe.run_batch(rt, probe.items(seed, chunk))
        for i, record in zip(chunk, records):
            append_record(out, record)
            if after:
                after(i)
    add_invocation(
        out,
        manifest,
        started=started,
        seconds=time.perf_counter() - t0,
        items_computed=len(todo),
        torch_threads=torch.get_num_threads(),
        device=rt.device,
        # the profile's reason is this invocation's; an earlier invocation's reason is kept here
        device_reason=getattr(rt.profile, "device_reason", ""),
        # the linear kernel orders float32 sums as the thread count does: provenance of each invocation
        linear_kernel=getattr(rt.profile, "linear_kernel", "torch"),
        # and the attention kernel rounds half-precision scores: the same provenance
        attention_kernel=getattr(rt.profile, "attention_kernel", "sdpa"),
        batch_pairs=batch,
    )


def render(directory: str | Path, figure: bool = True) -> Summary:
    """Re-render summary.md (and figure.png) of a run directory from its manifest's options and
    ``records.jsonl`` alone. Returns the Summary.

    Raises:
        EventKVError: not a run directory, or no records yet.
    """
    d = Path(directory)
    if not (d / RUN_MANIFEST).is_file():
        raise EventKVError(
            f"{str(d)!r} is not a run directory (no {RUN_MANIFEST}): give the --out directory of an "
            "'eventkv run' invocation."
        )
    manifest = json.loads((d / RUN_MANIFEST).read_text())
    ident = manifest["identity"]
    probe = get_probe(ident["probe"]).for_records(ident["options"])
    records = sorted(load_records(d), key=lambda r: r["index"])
    if not records:
        raise EventKVError(f"{str(d)!r} has no records yet: run the probe into it first.")
    summary = probe.summarize(records)
    head = (
        f"model: {ident['model']} ({ident['dtype']}, weights {str(ident['weights_digest'])[:12]}), "
        f"seed {ident['seed']}, {len(records)} items; eventkv {manifest['environment'].get('eventkv')} "
        f"@ {str(manifest['environment'].get('git_commit'))[:10]}"
    )
    text = summary.to_markdown().replace("\n", f"\n\n{head}\n", 1)
    (d / SUMMARY).write_text(text)
    if figure:
        probe.figure(records, d / FIGURE)
    summary.data["markdown"] = text
    return summary


def now() -> str:
    """The current UTC time, ISO 8601 to the second (the manifest's time stamps)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def progress_bar(enabled: bool, console):
    """A rich progress bar (description, bar, done/total, elapsed, remaining) as a context
    manager, or ``contextlib.nullcontext()`` (which yields ``None``) when disabled."""
    if not enabled:
        return contextlib.nullcontext()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


def records_equal(a: Sequence[dict], b: Sequence[dict]) -> bool:
    """Two record lists hold the same items with the same contents (order ignored)."""
    return sorted(map(json.dumps, a)) == sorted(map(json.dumps, b))
