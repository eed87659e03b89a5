"""``eventkv harvest``: passive harvesting on real dialogue (:mod:`eventkv.studies.materialization.harvest`).
User errors print one line (no traceback) and exit 2."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Optional

import typer

from eventkv.cli.common import MODEL_OPTION, run_command, run_probe_command
from eventkv.options import DIALOGUE_FORMATS

if TYPE_CHECKING:
    from eventkv.probes.run_options import RunOptions


@run_command(out="runs/harvest/MODEL-DTYPE-seed0")
def harvest(
    data: str = typer.Option(..., "--data", help="LoCoMo JSON file, or a REALTALK Chat_*.json file or folder"),
    data_format: str = typer.Option("locomo", "--format", help=" or ".join(DIALOGUE_FORMATS)),
    model: str = MODEL_OPTION,
    conversations: Optional[int] = typer.Option(
        None, "--conversations", help="the first N conversations (default all)"
    ),
    max_tokens: int = typer.Option(4000, "--max-tokens", help="history kept per conversation (tokens of turns)"),
    max_questions: int = typer.Option(0, "--max-questions", help="questions per conversation at most (0: all)"),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="greedy answer length limit"),
    tost_margin: float = typer.Option(0.05, "--tost-margin", help="equivalence margin of the primary contrast"),
    *,
    run: RunOptions,
) -> None:
    """Passive harvesting (Study 1, real dialogs): later turns served as rows of one global prefill, resumably.

    Arms: harvested (the rows of the global prefill), isolated (the same turns encoded alone) and text.

    Scored by forced choice against a hard negative and token F1; cluster bootstrap and TOST.

    One item per conversation.
    """
    from eventkv.options import check_int
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
    run_probe_command(probe, replace(run, items=items))
