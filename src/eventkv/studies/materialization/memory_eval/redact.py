"""A run folder of ``eventkv memory eval`` (:mod:`eventkv.studies.materialization.memory_eval`) copied without
the dataset's text, to share or commit it (:func:`redact_run`; ``eventkv memory redact``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

DATASET_TEXT = ("question", "gold", "choice")
"""Record fields that quote the dialogue data (LoCoMo's questions, answers, forced-choice options);
with each arm's ``answer`` (the model's reply, which often quotes the conversation) they are what
:func:`redact_run` drops. Every statistic of the summary is computed without them."""


def redact_run(source: str | Path, dest: str | Path) -> int:
    """Copy the run folder ``source`` into ``dest`` without the dataset's text: its ``manifest.json`` and
    each record of ``records.jsonl`` less :data:`DATASET_TEXT` and the arms' answers (scores, rows, KV
    bytes, timings, served ids and evidence ids kept). LoCoMo's licence (CC BY-NC 4.0) lets its text be
    read, not redistributed: the redacted folder can be shared or committed, reported
    (``eventkv report DEST``) and resumed (the same ``eventkv memory eval`` command with ``--out DEST``
    computes only the items it lacks; the memories are prefilled again). A record cut short by a kill
    is left out. Returns the number of records written.

    Raises:
        EventKVError: ``source`` is not a run folder (no ``manifest.json``), ``dest`` is ``source``, or
            ``dest`` already holds records.
    """
    from eventkv.errors import EventKVError
    from eventkv.files import fsync_path
    from eventkv.probes.runner import RECORDS, RUN_MANIFEST, load_records

    src, dst = Path(source), Path(dest)
    if not (src / RUN_MANIFEST).is_file():
        raise EventKVError(f"{str(src)!r} is not a run folder (no {RUN_MANIFEST}): give the --out of a memory eval.")
    if dst.resolve() == src.resolve():
        raise EventKVError(f"{str(dst)!r} is the run folder itself: give another destination to redact into.")
    if (dst / RECORDS).is_file() and (dst / RECORDS).stat().st_size:
        raise EventKVError(f"{str(dst)!r} already holds {RECORDS}: give a new or empty destination.")
    dst.mkdir(parents=True, exist_ok=True)
    lines = []
    for rec in load_records(src):
        out = {k: v for k, v in rec.items() if k not in DATASET_TEXT}
        if "arms" in out:
            out["arms"] = {n: {k: v for k, v in arm.items() if k != "answer"} for n, arm in out["arms"].items()}
        lines.append(json.dumps(out) + "\n")
    tmp = dst / f".{RECORDS}.tmp"
    tmp.write_text("".join(lines))
    fsync_path(tmp)
    shutil.copyfile(src / RUN_MANIFEST, dst / RUN_MANIFEST)
    fsync_path(dst / RUN_MANIFEST)
    tmp.replace(dst / RECORDS)
    fsync_path(dst)
    return len(lines)
