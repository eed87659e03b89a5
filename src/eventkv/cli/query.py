"""``eventkv query``: answer a question from the served events' KV rows."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional, cast

import typer
from rich.console import Console
from rich.table import Table

from eventkv.cli.common import DEVICE_OPTION, DTYPE_OPTION, model_option

if TYPE_CHECKING:
    from eventkv.kv.serve import PositionMode, ServeMode

console = Console()


def query(
    model: str = model_option("smollm2-135m", "-m"),
    log: Path = typer.Option(
        ...,
        "--log",
        help="Event log, JSONL: one event per line with 'id', 'text', optional 'role' and 'budget' (position "
        "budget, tokens).",
    ),
    serve: str = typer.Option(..., "--serve", help="Served set: comma-separated event ids, or 'all'."),
    question: str = typer.Option(..., "--question", "-q", help="The question to answer from the served rows."),
    mode: str = typer.Option(
        "compact",
        "--mode",
        help="compact | native | isolated | text | blend (blend recomputes 15% of the served tokens).",
    ),
    candidates: Optional[str] = typer.Option(
        None, "--candidates", help="Comma-separated answers to score by log-probability."
    ),
    instruction: str = typer.Option(
        "", "--instruction", help="Task instruction placed in the header before the events."
    ),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Greedy decoding budget (tokens)."),
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    store: Optional[Path] = typer.Option(
        None, "--store", help="Where the EventKV is stored/reused (default: content-addressed under the cache)."
    ),
    chunk_size: Optional[int] = typer.Option(
        None, "--chunk-size", help="Prefill at most this many tokens per forward."
    ),
    positions: Optional[str] = typer.Option(
        None,
        "--positions",
        help="contiguous | original: served rows re-rotated right after the header with the question right after "
        "them (compact, isolated, text), or at their own positions. Default: contiguous where the model's RoPE "
        "re-rotates exactly and the mode allows it, else original.",
        show_default=False,
    ),
) -> None:
    """Answer a question from the served events' KV rows (prefills the log once, then reuses it)."""
    from eventkv.kv.log import EventLog
    from eventkv.kv.query import AnswerOptions, answer, check_query
    from eventkv.models import load, resolve_device, resolve_dtype

    elog = EventLog.from_jsonl(log, instruction=instruction)
    cands = candidates.split(",") if candidates is not None else []
    # mode and positions are checked by check_query below, before anything uses them
    options = AnswerOptions(
        mode=cast("ServeMode", mode),
        candidates=cands,
        max_new_tokens=max_new_tokens,
        chunk_size=chunk_size,
        store=store,
        positions=cast("PositionMode | None", positions),
    )
    check_query(elog, serve, question, **options)  # fail before the model loads
    resolve_dtype(dtype, resolve_device(device)[0])
    with console.status(f"loading {model}"):
        lm = load(model, dtype=dtype, device=device)
    with console.status("prefill / serve / answer"):
        ans = answer(lm, elog, serve, question, **options)
    console.print(
        f"[dim]{lm.profile.dtype} ({lm.profile.dtype_reason}) on {lm.profile.device} ({lm.profile.device_reason}); "
        f"served {', '.join(ans.served)} ({mode}, {ans.positions} positions): "
        f"{ans.n_rows_served} of {ans.n_rows_total} rows; "
        f"EventKV {'reused' if ans.reused else 'prefilled'} at {ans.store}[/dim]"
    )
    console.print(f"[bold]answer:[/bold] {ans.generation.text.strip()}")
    if ans.candidates:
        table = Table("candidate", "log-prob (nats)", "share")
        for c in sorted(ans.candidates, key=lambda c: -c.logprob):
            table.add_row(c.text, f"{c.logprob:.3f}", f"{c.prob:.3f}")
        console.print(table)
