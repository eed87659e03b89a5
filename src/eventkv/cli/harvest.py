"""``eventkv harvest``: passive harvesting on real dialogue (:mod:`eventkv.studies.materialization.harvest`).
User errors print one line (no traceback) and exit 2."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eventkv.cli.common import DEVICE_OPTION, run_probe_command, user_errors
from eventkv.options import DIALOGUE_FORMATS, DTYPE_HELP


def harvest(
    data: str = typer.Option(..., "--data", help="LoCoMo JSON file, or a REALTALK Chat_*.json file or folder"),
    data_format: str = typer.Option("locomo", "--format", help=" or ".join(DIALOGUE_FORMATS)),
    model: str = typer.Option(
        "qwen2.5-coder-1.5b", "--model", help="packaged alias, local HF directory, hub id or GGUF file"
    ),
    conversations: Optional[int] = typer.Option(
        None, "--conversations", help="the first N conversations (default all)"
    ),
    max_tokens: int = typer.Option(4000, "--max-tokens", help="history kept per conversation (tokens of turns)"),
    max_questions: int = typer.Option(0, "--max-questions", help="questions per conversation at most (0: all)"),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="greedy answer length limit"),
    tost_margin: float = typer.Option(0.05, "--tost-margin", help="equivalence margin of the primary contrast"),
    out: Optional[Path] = typer.Option(None, "--out", help="run directory (default: runs/harvest/MODEL-DTYPE-seed0)"),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    device: str = DEVICE_OPTION,
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
) -> None:
    """Passive harvesting (Study 1, real dialogs): later natural turns served as rows of one global
    prefill (harvested) vs the same turns encoded alone (isolated) or as text; forced choice against a
    hard negative and token F1; cluster bootstrap and TOST. Resumable; one item per conversation."""
    with user_errors():
        from eventkv.options import check_int
        from eventkv.probes.run_options import RunOptions
        from eventkv.studies.materialization.harvest import Harvest

        probe = Harvest(
            data=data,
            data_format=data_format,
            max_tokens=max_tokens,
            max_new_tokens=max_new_tokens,
            tost_margin=tost_margin,
            max_questions=max_questions,
        )
        n = probe.max_items()
        items = (
            n
            if conversations is None
            else check_int("conversations", conversations, "give 1 or more.", flag="--conversations")
        )
        run_probe_command(probe, RunOptions(model, items, 0, out, dtype, threads, progress, device=device))
