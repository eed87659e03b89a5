"""``eventkv splice``: the prompt-KV splice probe (Study 2) from the command line.

The command function is :func:`splice`; the main app mounts it with ``app.command("splice")(splice)``.
It runs through the probe runner (``manifest.json``, ``records.jsonl``, ``summary.md``; resumable:
re-running into the same ``--out`` computes only the missing items) and writes ``figure.png``
(accuracy vs cutoff) and ``heatmap.png`` (scaffold, cutoff x step). User errors print one line and
exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional, cast

import typer
from rich.markdown import Markdown

from eventkv.cli.common import (
    DEVICE_OPTION,
    DTYPE_OPTION,
    PROGRESS_OPTION,
    THREADS_OPTION,
    int_list,
    model_option,
    out_option,
    start_run,
    stops_resumably,
    user_errors,
)
from eventkv.errors import EventKVError

if TYPE_CHECKING:
    from eventkv.studies.splice.probe import SpliceProbe, SpliceReadout

SPLICE_DIR = "{model}-{task}-{dtype}-seed{seed}"
"""The default ``--out`` name under ``runs/splice/`` (``{task}``: the task name, or a JSONL file's stem)."""


def build_probe(
    task: str,
    cutoffs: str,
    steps: str,
    arms: str,
    filler: Optional[str],
    heads: Optional[str],
    layer_set: str,
    tail: str,
    max_new_tokens: int,
    batch_size: int,
    match: str = "word",
    readout: str = "generate",
) -> SpliceProbe:
    """The SpliceProbe for the CLI options (``task`` is a built-in name or a JSONL path)."""
    from eventkv.studies.splice.engine import DEFAULT_FILLER
    from eventkv.studies.splice.probe import SpliceProbe
    from eventkv.studies.splice.tasks import TASKS, file_digest

    task_file = digest = None
    name = task
    if task not in TASKS:
        p = Path(task)
        if not (task.endswith(".jsonl") or p.is_file()):
            raise EventKVError(
                f"--task {task!r}: use one of {', '.join(TASKS)} or the path of a JSONL file "
                "('prompt', 'answer', optional 'options' per line)."
            )
        if not p.is_file():
            raise EventKVError(f"--task {task!r}: no such file; give an existing JSONL file.")
        name, task_file, digest = "jsonl", str(p.resolve()), file_digest(p)
    arm_names = tuple(a.strip() for a in arms.split(",") if a.strip() and a.strip() != "clean")
    probe = SpliceProbe(
        task=name,
        task_file=task_file,
        task_digest=digest,
        cutoffs=cutoffs,
        steps=int_list(steps, "--steps", "0,1,2"),
        arm_names=arm_names,
        filler=filler if filler is not None else DEFAULT_FILLER,
        heads=int_list(heads, "--heads", "0,1,2") if heads else None,
        layer_set=layer_set,
        tail=tail,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        match=match,
        readout=cast("SpliceReadout", readout),  # checked by validate() below
    )
    probe.validate()
    return probe


def splice(
    model: str = model_option("smollm2-135m"),
    task: str = typer.Option(
        "lookup",
        "--task",
        help="lookup | arithmetic | choose | copy | sentiment, or a JSONL "
        "file with 'prompt', 'answer', optional 'options' per line",
    ),
    cutoffs: str = typer.Option(
        "all", "--cutoffs", help="'all' (0..n_layers) or a list like 0,4,8-12 (n_layers = no splice)"
    ),
    steps: str = typer.Option("0", "--steps", help="decoding steps the splice takes effect from, e.g. 0,1,2"),
    arms: str = typer.Option(
        "scaffold,zero-kv,mask",
        "--arms",
        help="comma list of scaffold, zero-kv, zero-k, zero-v, mask, mean (clean always runs)",
    ),
    items: int = typer.Option(32, "--items", help="number of items (prompts)"),
    seed: int = typer.Option(0, "--seed", help="task seed (item i depends only on seed and i)"),
    out: Optional[Path] = out_option("runs/splice/MODEL-TASK-DTYPE-seedS"),
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    filler: Optional[str] = typer.Option(None, "--filler", help="scaffold filler text (default: a neutral sentence)"),
    heads: Optional[str] = typer.Option(None, "--heads", help="KV heads to splice, e.g. 0,1 (default: all)"),
    layer_set: str = typer.Option("from", "--layer-set", help="from = layers >= cutoff; only = the cutoff layer alone"),
    tail: str = typer.Option(
        "clean", "--tail", help="clean = tail rows keep clean K/V; spliced = recomputed over the splice"
    ),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="greedy generation budget (tokens)"),
    batch_size: int = typer.Option(16, "--batch-size", help="splices decoded together in one batch"),
    match: str = typer.Option(
        "word",
        "--match",
        help="how a generation is scored: word = its first line contains the "
        "answer as a whole word and no other option/number; exact = "
        "the first line equals the answer",
    ),
    readout: str = typer.Option(
        "generate",
        "--readout",
        help="generate = greedy answer scored by --match; choice = forced choice among the item's options (step 0)",
    ),
    threads: Optional[int] = THREADS_OPTION,
    progress: bool = PROGRESS_OPTION,
) -> None:
    """Prompt-KV splice (Study 2): accuracy when the prompt span's K/V in layers >= a cutoff are replaced.

    The K/V are replaced by a scaffold, zeroed, masked or averaged (--arms), from a decoding step on (--steps).

    Each cell is compared with the clean run by McNemar's exact test.
    """
    with user_errors(), stops_resumably():
        from eventkv.probes.run_options import RunOptions

        probe = build_probe(
            task, cutoffs, steps, arms, filler, heads, layer_set, tail, max_new_tokens, batch_size, match, readout
        )
        tname = Path(task).stem if probe.task == "jsonl" else task
        opts, console, rt = start_run(
            RunOptions(model, items, seed, out, dtype, threads, progress, device=device),
            probe,
            name=SPLICE_DIR,
            task=tname,
        )
        summary = opts.run(probe, rt, console)
        console.print(Markdown(summary.data["markdown"]))
        out = opts.out
        console.print(
            f"records: {out / 'records.jsonl'}  summary: {out / 'summary.md'}  "
            f"figures: {out / 'figure.png'}, {out / 'heatmap.png'}"
        )
