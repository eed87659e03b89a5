"""What the CLI's command modules share: mapping user errors to one line and exit 2, comma lists,
and the run of one probe (load the model, run resumably, print the summary)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from eventkv.errors import EventKVError, cli_message

_err = Console(stderr=True)


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


def run_probe_command(
    probe, model: str, items: int, seed: int, out: Path | None, dtype: str, threads: int | None, progress: bool
) -> None:
    """Check the run options, load the model, run ``probe`` resumably into ``out`` and print its summary."""
    import torch

    from eventkv.models import load, resolve_dtype
    from eventkv.options import check_out_dir, check_threads
    from eventkv.probes.base import Runtime
    from eventkv.probes.runner import check_run_items, run_probe

    check_run_items(probe, items)  # before the model loads (run_probe checks again for library callers)
    if check_threads(threads) is not None:
        torch.set_num_threads(threads)
    resolved = resolve_dtype(dtype)[0]  # a bad --dtype fails here, before the model loads
    if out is None:
        out = Path("runs") / probe.name / f"{Path(model).name}-{resolved}-seed{seed}"
    check_out_dir(out)

    console = Console()
    with console.status(f"loading {model} ({dtype})"):
        lm = load(model, dtype=dtype)
    rt = Runtime(lm.model, lm.tokenizer, lm.profile)
    summary = run_probe(probe, rt, model=model, items=items, seed=seed, out=out, progress=progress, console=console)
    print_summary(console, summary)
    console.print(f"records: {out / 'records.jsonl'}  summary: {out / 'summary.md'}  figure: {out / 'figure.png'}")


def print_summary(console: Console, summary) -> None:
    """Print summary.md as it is written (plain markdown: tables stay copy-pastable)."""
    console.print(summary.data["markdown"], markup=False, highlight=False, soft_wrap=True)
