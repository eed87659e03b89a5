"""What the CLI's command modules share: mapping user errors to one line and exit 2, comma lists,
and the start of a run from its :class:`~eventkv.probes.run_options.RunOptions` (check every option,
fill the default ``--out``, load the model) for ``run``, ``contract`` and ``splice``."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape

from eventkv.errors import EventKVError, cli_message
from eventkv.options import DEVICE_HELP

if TYPE_CHECKING:  # eventkv.probes imports torch: the commands import it when they run, not for --help
    from eventkv.probes.run_options import RunOptions

_err = Console(stderr=True)

DEVICE_OPTION = typer.Option("auto", "--device", help=DEVICE_HELP)
"""``--device``, shared by every command that loads a model (checked by
:func:`eventkv.models.resolve_device` before the model loads)."""

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
    figure = f"  figure: {out / 'figure.png'}" if (out / "figure.png").is_file() else ""
    console.print(f"records: {out / 'records.jsonl'}  summary: {out / 'summary.md'}{figure}")


def print_summary(console: Console, summary) -> None:
    """Print summary.md as it is written (plain markdown: tables stay copy-pastable)."""
    console.print(summary.data["markdown"], markup=False, highlight=False, soft_wrap=True)
