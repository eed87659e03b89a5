"""``eventkv audit``: the eviction audit on donor-pair histories (:mod:`eventkv.studies.materialization.audit`).
User errors print one line (no traceback) and exit 2."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eventkv.cli.common import DEVICE_OPTION, comma_list, run_probe_command, user_errors
from eventkv.options import DTYPE_HELP, POLICIES


def audit(
    policy: str = typer.Option("streaming,snapkv,knorm", "--policy", help=", ".join(POLICIES)),
    ratio: str = typer.Option("0.5,0.75", "--ratio", help="compression ratios: the fraction of rows evicted"),
    model: str = typer.Option(
        "qwen2.5-coder-1.5b", "--model", help="packaged alias, local HF directory, hub id or GGUF file"
    ),
    items: int = typer.Option(24, "--items", help="donor pairs"),
    window: int = typer.Option(
        32, "--window", help="observation window of snapkv and expected attention (tokens at the end of the history)"
    ),
    sinks: int = typer.Option(4, "--sinks", help="attention sinks kept by streaming"),
    seed: int = typer.Option(0, "--seed", help="item seed (the donor-pair probe's pairs for the same seed)"),
    out: Optional[Path] = typer.Option(None, "--out", help="run directory (default: runs/audit/MODEL-DTYPE-seedSEED)"),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    device: str = DEVICE_OPTION,
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
) -> None:
    """Audit eviction policies on donor pairs: does a kept-rows accuracy that holds after evicting the
    source hide state the kept rows carry (ablation false negatives), and does it survive re-encoding
    the kept events in isolation? Resumable."""
    with user_errors():
        from eventkv.errors import OptionError
        from eventkv.probes.run_options import RunOptions
        from eventkv.studies.materialization.audit import EvictionAudit

        ratios = []
        for r in comma_list(ratio, "--ratio"):
            try:
                ratios.append(float(r))
            except ValueError:
                raise OptionError(
                    "ratios", r, "give compression ratios as numbers in [0, 1).", flag="--ratio"
                ) from None
        probe = EvictionAudit(policies=comma_list(policy, "--policy"), ratios=tuple(ratios), window=window, sinks=sinks)
        run_probe_command(probe, RunOptions(model, items, seed, out, dtype, threads, progress, device=device))
