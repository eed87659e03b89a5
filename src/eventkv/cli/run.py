"""CLI of the probes: ``eventkv run donor-pair ...`` and ``eventkv report DIR``.

Mounted into the main app as ``app.add_typer(run_app, name="run")`` and
``app.command("report")(report)``. User errors print one line (no traceback) and exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from eventkv.cli.common import (
    MAX_NEW_TOKENS_OPTION,
    PAIR_HEAD,
    comma_list,
    print_summary,
    run_command,
    run_probe_command,
    user_errors,
)
from eventkv.errors import EventKVError

if TYPE_CHECKING:
    from eventkv.probes.run_options import RunOptions

run_app = typer.Typer(
    help="Run a probe on a model: writes manifest.json, records.jsonl and summary.md "
    "into --out, and resumes an interrupted run.",
    no_args_is_help=True,
)
_err = Console(stderr=True)


def _slots(text: str) -> tuple[int, int]:
    parts = text.replace(" ", "").split("-")
    try:
        if len(parts) == 1:
            return int(parts[0]), int(parts[0])
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise EventKVError(f"--source-slots {text!r}: give a slot range like 8-11 (0-based slots, inclusive) or one slot.")


@run_app.command("donor-pair")
@run_command(
    head=(*PAIR_HEAD, "dtype", "device"),
    tail=("threads", "progress", "batch_pairs"),
    items=typer.Option(16, "--items", help="number of donor pairs"),
    out="runs/donor-pair/MODEL-DTYPE-seedSEED",
)
def donor_pair(
    n_events: int = typer.Option(24, "--n-events", help="events per history"),
    decoy_slot: int = typer.Option(0, "--decoy-slot", help="slot of the decoy (0-based; slot i is <step i+1>)"),
    source_slots: str = typer.Option("8-11", "--source-slots", help="range the source slot is drawn from (inclusive)"),
    root_slot: int = typer.Option(13, "--root-slot", help="slot of the root 'register M mirrors register S'"),
    decoy: str = typer.Option("independent", "--decoy", help="independent | opposite | none"),
    states: str = typer.Option("ONLINE,OFFLINE", "--states", help="state words, comma-separated"),
    max_new_tokens: int = MAX_NEW_TOKENS_OPTION,
    arms: str = typer.Option("kv,isolated,text-all,kv-all", "--arms", help="arms to run (kv is required)"),
    query_at: str = typer.Option(
        "last-served",
        "--query-at",
        help="where the kv and isolated arms ask: last-served (right after the served events, as the study's "
        "scripts ask) or history (after the whole history, where a memory asks)",
    ),
    *,
    readout: str,
    run: RunOptions,
) -> None:
    """Donor pairs (Study 1): does the answer follow an omitted source through the served rows?"""
    from eventkv.studies.materialization.donor_pair import DonorPair

    probe = DonorPair(
        n_events=n_events,
        decoy_slot=decoy_slot,
        source_slots=_slots(source_slots),
        root_slot=root_slot,
        decoy=decoy,
        states=comma_list(states, "--states"),
        readout=readout,
        max_new_tokens=max_new_tokens,
        arm_names=comma_list(arms, "--arms"),
        query_at=query_at,
    )
    run_probe_command(probe, run)


def report(
    directory: Path = typer.Argument(
        ...,
        help="a run directory: the --out of 'eventkv run', 'splice', 'audit', 'harvest' or 'memory eval', "
        "or a probe folder DIR/<probe> of 'eventkv contract'",
    ),
) -> None:
    """Re-render a run directory's summary.md and figures from its records alone, and print the summary.

    The figures are figure.png, and heatmap.png for a splice run.
    """
    with user_errors():
        from eventkv.probes.runner import render

        summary = render(directory)
        console = Console()
        print_summary(console, summary)
        figure = Path(directory) / "figure.png"
        console.print(
            f"summary: {Path(directory) / 'summary.md'}" + (f"  figure: {figure}" if figure.is_file() else "")
        )
