"""What the CLI's command modules share: mapping user errors to one line and exit 2, comma lists,
and the start of a run from its :class:`~eventkv.probes.run_options.RunOptions` (check every option,
fill the default ``--out``, load the model) for ``run``, ``contract`` and ``splice``."""

from __future__ import annotations

from contextlib import contextmanager
from types import EllipsisType
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape

from eventkv.errors import EventKVError, cli_message
from eventkv.options import DEVICE_HELP, DTYPE_HELP

if TYPE_CHECKING:  # eventkv.probes imports torch: the commands import it when they run, not for --help
    from eventkv.probes.run_options import RunOptions

_err = Console(stderr=True)

MODEL_HELP = "packaged alias, local HF directory, hub id or GGUF file"
"""The help of every ``--model`` (what :func:`eventkv.models.load` accepts)."""

MODEL_OPTION = typer.Option(
    "qwen2.5-coder-1.5b",
    "--model",
    help=f"{MODEL_HELP} (default: the smallest packaged model whose donor-pair results are not at chance; see README)",
)
"""``--model`` of the Study 1 commands (the donor pair, the contract, the audit, the harvest, memory eval)."""


def model_option(default: str | EllipsisType, *short: str) -> Any:
    """A ``--model`` option with another ``default`` (``...``: required) and short names ``short``."""
    return typer.Option(default, "--model", *short, help=MODEL_HELP)


def out_option(default: str, what: str = "run directory") -> Any:
    """An ``--out`` option (default None: filled by :meth:`RunOptions.with_default_out`); its help names the
    default folder ``default``, e.g. ``runs/landing/MODEL-DTYPE-seedSEED``."""
    return typer.Option(None, "--out", help=f"{what} (default: {default})")


DTYPE_OPTION = typer.Option("auto", "--dtype", help=DTYPE_HELP)
"""``--dtype``, shared by every command that loads a model (checked by :func:`eventkv.models.resolve_dtype`)."""

DEVICE_OPTION = typer.Option("auto", "--device", help=DEVICE_HELP)
"""``--device``, shared by every command that loads a model (checked by
:func:`eventkv.models.resolve_device` before the model loads)."""

THREADS_OPTION = typer.Option(
    None, "--threads", help="torch CPU threads (default: torch decides; 1 is faster on a busy machine)"
)
"""``--threads`` of the commands that run in this process (checked by :func:`eventkv.options.check_threads`)."""

PROGRESS_OPTION = typer.Option(True, "--progress/--no-progress", help="show a progress bar")
"""``--progress/--no-progress``, shared by every command that shows a progress bar."""

SEED_OPTION = typer.Option(0, "--seed", help="item seed (item i depends only on seed and i)")
"""``--seed`` of the pair probes' commands."""

READOUT_OPTION = typer.Option("both", "--readout", help="generate | logits | both")
"""``--readout`` of the pair probes' commands."""

MAX_NEW_TOKENS_OPTION = typer.Option(64, "--max-new-tokens", help="greedy generation length limit")
"""``--max-new-tokens`` of the pair probes' commands."""

BATCH_PAIRS_OPTION = typer.Option(
    1,
    "--batch-pairs",
    help="donor pairs computed in one batch (prefills and readouts; records equal batch 1 up to float "
    "rounding); pays off on a GPU",
)
"""``--batch-pairs``, shared by the pair probes' commands (:attr:`RunOptions.batch_pairs`)."""


@contextmanager
def user_errors():
    """Print an EventKVError as one line ``error: ...`` and exit 2 (no traceback)."""
    try:
        yield
    except EventKVError as exc:
        _err.print(f"[bold red]error:[/] {escape(cli_message(exc))}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def comma_list(text: str, what: str) -> tuple[str, ...]:
    """The non-empty, stripped entries of a comma-separated option value.

    Raises:
        EventKVError: no entry (names the option ``what`` and the value).
    """
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    if not items:
        raise EventKVError(f"{what} {text!r}: give a comma-separated list.")
    return items


def int_list(text: str, what: str, example: str) -> tuple[int, ...]:
    """The integers of a comma-separated option value (empty entries skipped).

    Raises:
        EventKVError: an entry that is not an integer, or none at all (names the option ``what``, the
            value, and shows ``example``).
    """
    try:
        vals = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise EventKVError(f"{what} {text!r}: give comma-separated integers, e.g. {example}.") from None
    if not vals:
        raise EventKVError(f"{what} {text!r}: give at least one integer.")
    return vals


def start_run(opts: RunOptions, probe=None, *, folder: str | None = None, name: str | None = None, **fields: str):
    """Check ``opts`` (and ``probe``'s options) before anything loads, fill the default ``--out``
    ``runs/FOLDER/NAME`` (``FOLDER`` defaults to the probe's name, ``NAME`` to
    :data:`~eventkv.probes.run_options.RUN_DIR`; see :meth:`RunOptions.default_out`), apply ``--threads``
    and load the model.

    Returns:
        ``(options with out set, console, Runtime)``.

    Raises:
        OptionError: a bad option (the CLI prints its flag); EventKVError: the model cannot be loaded.
    """
    from eventkv.probes.run_options import RUN_DIR

    opts.validate(probe)
    opts = opts.with_default_out(folder or probe.name, name or RUN_DIR, **fields)
    console = Console()
    return opts, console, opts.load_runtime(console)


def run_probe_command(probe, opts: RunOptions) -> None:
    """Start the run (:func:`start_run`), run ``probe`` resumably into ``--out`` and print its summary."""
    opts, console, rt = start_run(opts, probe)
    summary = opts.run(probe, rt, console)
    print_summary(console, summary)
    out = opts.out
    assert out is not None  # start_run filled the default --out
    figure = f"  figure: {out / 'figure.png'}" if (out / "figure.png").is_file() else ""
    console.print(f"records: {out / 'records.jsonl'}  summary: {out / 'summary.md'}{figure}")


def print_summary(console: Console, summary) -> None:
    """Print summary.md as it is written (plain markdown: tables stay copy-pastable)."""
    console.print(summary.data["markdown"], markup=False, highlight=False, soft_wrap=True)
