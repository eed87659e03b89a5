"""CLI of sweeps: ``eventkv sweep PLAN.yaml [--backend serial|process|ray]``.

Mounted into the main app as ``app.command("sweep")(sweep)``. The plan is read and every run checked
before anything loads; user errors print one line (no traceback) and exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from eventkv.cli.common import PROGRESS_OPTION, stops_resumably, user_errors
from eventkv.options import BACKENDS

# a module constant: mypy does not resolve a generator's variable inside a parameter default
_BACKEND_HELP = " | ".join(f"{name} ({escape(BACKENDS.help(name))})" for name in BACKENDS)


def sweep(
    plan: Path = typer.Argument(
        ..., help="a YAML plan: models x probes x seeds x options and the run-folder template (docs/sweep.md)"
    ),
    backend: str = typer.Option(
        "serial",
        "--backend",
        help=_BACKEND_HELP,
    ),
    workers: Optional[int] = typer.Option(
        None,
        "--workers",
        help="workers, each holding its own copy of a model (default: serial 1, process 2, ray as many as the "
        "cluster's CPUs allow at --threads each)",
    ),
    threads: Optional[int] = typer.Option(
        None,
        "--threads",
        help="torch CPU threads (for ray: CPUs reserved) of each worker (default: the plan's threads, else serial "
        "all cores, process cores / workers, ray 1). Float scores match across backends at the same count",
    ),
    ray_address: Optional[str] = typer.Option(
        None,
        "--ray-address",
        help="the Ray cluster (ray only): auto (started with `ray start` here), ray://HOST:10001 (Ray Client) or "
        "HOST:6379 (default: RAY_ADDRESS, else a new local Ray on this machine's cores)",
    ),
    gpus_per_worker: float = typer.Option(
        0.0, "--gpus-per-worker", help="GPUs each Ray worker reserves (ray only; e.g. 1 with device: cuda)"
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="check the plan and list its runs; load nothing"),
    progress: bool = PROGRESS_OPTION,
) -> None:
    """Run a sweep plan: every (model, probe, options, seed) into its own run folder, resumably.

    The three backends (--backend) write the same records.
    """
    with user_errors():
        from eventkv.sweep import SweepOptions, load_plan, run_sweep

        opts = SweepOptions(backend, workers, threads, ray_address, gpus_per_worker, progress)
        opts.validate()
        p = load_plan(plan, check_devices=backend != "ray")  # Ray workers may have GPUs this machine lacks
        console = Console()
        if dry_run:
            rows = p.describe()
            _table(console, ["folder", "probe", "model", "seed", "items", "probe options", "run options"], rows)
            console.print(f"{len(rows)} runs; nothing loaded (--dry-run)", highlight=False)
            return
        with stops_resumably():  # SIGTERM, Ctrl-C: the finished records are on disk; say how to go on
            results = run_sweep(p, opts, console)
        rows = [
            [r.out.as_posix(), r.probe, r.model, str(r.seed), str(r.items), str(r.computed), r.summary.as_posix()]
            for r in results
        ]
        _table(console, ["folder", "probe", "model", "seed", "items", "computed now", "summary"], rows)


def _table(console: Console, columns: list[str], rows: list[list[str]]) -> None:
    """A markdown table (copy-pastable, like the summaries)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)
