"""``eventkv memory eval``: EventMemory on real multi-session dialogue (LoCoMo format), resumably
(:mod:`eventkv.studies.materialization.memory_eval`). User errors print one line (no traceback) and exit 2."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import typer

from eventkv.cli.common import MODEL_OPTION, comma_list, run_command, run_probe_command

if TYPE_CHECKING:
    from eventkv.probes.run_options import RunOptions

memory_app = typer.Typer(no_args_is_help=True, help="The event-KV agent memory: evaluate it on real dialogue.")


@memory_app.command("eval")
@run_command(out="runs/memory-eval/MODEL-DTYPE-seedSEED")
def memory_eval(
    data: str = typer.Option(
        ...,
        "--data",
        help="LoCoMo-format JSON (e.g. locomo10.json), or 'demo': a tiny invented file shipped with eventkv",
    ),
    model: str = MODEL_OPTION,
    conversations: int = typer.Option(2, "--conversations", help="conversations to evaluate (the file's first N)"),
    questions: int = typer.Option(30, "--questions-per-conversation", help="questions per conversation (seeded)"),
    max_tokens: int = typer.Option(4000, "--max-tokens", help="history kept per conversation (tokens of turns)"),
    k: int = typer.Option(8, "--k", help="turns BM25 selects per question"),
    arms: str = typer.Option("rows,text,isolated,full,gold", "--arms", help="rows,text,isolated,full,gold"),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens", help="greedy answer length limit"),
    batch_arms: bool = typer.Option(
        True,
        "--batch-arms/--no-batch-arms",
        help="read the arms out in one batch (fast); --no-batch-arms: one readout per arm (per-arm latency)",
    ),
    seed: int = typer.Option(0, "--seed", help="question sampling seed"),
    *,
    run: RunOptions,
) -> None:
    """Evaluate EventMemory on LoCoMo: per question, BM25-selected turns served as rows of one global prefill.

    Compared with the same turns as text, each encoded alone, the whole history, and the gold evidence.

    Token F1 / EM by category with cluster-bootstrap intervals, and latency p50/p95.
    """
    from eventkv.studies.materialization.memory_eval import DEMO_DATA, MemoryEval

    probe = MemoryEval(
        data=DEMO_DATA if data == "demo" else data,
        conversations=conversations,
        questions_per_conversation=questions,
        max_tokens=max_tokens,
        k=k,
        max_new_tokens=max_new_tokens,
        arm_names=comma_list(arms, "--arms"),
        batch_arms=batch_arms,
    )
    run_probe_command(probe, replace(run, items=conversations * questions))
