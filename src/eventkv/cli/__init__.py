"""The ``eventkv`` command line: one module per command group, mounted here explicitly.

``models`` (:mod:`.models`), ``query`` (:mod:`.query`), ``run <probe>`` and ``report``
(:mod:`.run`; the contract clauses' run commands from :mod:`.contract`), ``contract``
(:mod:`.contract`), ``splice`` (:mod:`.splice`), ``memory`` (:mod:`.memory`), ``serve``
(:mod:`.serve`), ``mcp`` (:mod:`.mcp`), ``sweep`` (:mod:`.sweep`), ``audit`` (:mod:`.audit`) and ``harvest``
(:mod:`.harvest`). User errors print one line and exit with code 2.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, cast

import typer
from rich.console import Console
from rich.markup import escape

from eventkv.cli import contract, splice
from eventkv.cli.audit import audit
from eventkv.cli.harvest import harvest
from eventkv.cli.mcp import mcp
from eventkv.cli.memory import memory_app
from eventkv.cli.models import models_app
from eventkv.cli.query import query
from eventkv.cli.run import report, run_app
from eventkv.cli.service import serve
from eventkv.cli.sweep import sweep
from eventkv.errors import EventKVError, cli_message

if TYPE_CHECKING:
    from typer._click.exceptions import ClickException

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="eventkv: prefill an event log once, serve any subset of events' KV rows, probe what they carry.",
)
app.add_typer(models_app, name="models")
app.add_typer(memory_app, name="memory")
app.command("query")(query)
for _name, _command in contract.RUN_COMMANDS.items():
    run_app.command(_name)(_command)
app.add_typer(run_app, name="run", help="Run a registered probe.")
app.command("report")(report)
app.command("splice")(splice.splice)
app.command("contract")(contract.contract)
app.command("serve")(serve)
app.command("mcp")(mcp)
app.command("audit")(audit)
app.command("harvest")(harvest)
app.command("sweep")(sweep)


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
        assert param is not None  # value is None whenever param is
        msg = exc.message.rstrip(".")
        _error(f"{max(param.opts, key=len)} {value!r}: {msg[:1].lower() + msg[1:]}.")
    except typer.TyperException as exc:  # other usage errors (unknown option, missing value, no arguments)
        # typer annotates rich_format_error for its click exceptions, but it reads only format_message(), which
        # every TyperException has, and ``ctx`` through getattr
        rich_utils.rich_format_error(cast("ClickException", exc))
        sys.exit(getattr(exc, "exit_code", 2))
    except typer.Abort:
        Console(stderr=True).print("Aborted!")
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
