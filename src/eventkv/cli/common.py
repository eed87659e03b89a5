"""What the CLI's command modules share: mapping user errors to one line and exit 2, a batch command's
stop on SIGTERM or Ctrl-C (:func:`stops_resumably`: one line, exit 143 or 130), comma lists, the
run options every probe command takes (:func:`run_command`), and the start of a run from its
:class:`~eventkv.probes.run_options.RunOptions` (check every option, fill the default ``--out``, load the
model) for ``run``, ``contract``, ``audit``, ``harvest``, ``memory eval`` and ``splice``."""

from __future__ import annotations

import functools
import inspect
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

from eventkv.errors import EventKVError, cli_message
from eventkv.options import DEVICE_HELP, DTYPE_HELP

if TYPE_CHECKING:  # eventkv.probes imports torch: the commands import it when they run, not for --help
    from eventkv.probes.run_options import RunOptions

_err = Console(stderr=True)

MODEL_HELP = "packaged alias, local HF directory, hub id or GGUF file"
"""The help of every ``--model`` (what :func:`eventkv.models.load` accepts)."""

MODEL_OPTION = typer.Option(
    "qwen2.5-coder-1.5b",
    "--model",
    help=f"{MODEL_HELP} (default: the smallest packaged model whose donor-pair results are not at chance; see README)",
)
"""``--model`` of the Study 1 commands (the donor pair, the contract, the audit, the harvest, memory eval)."""


def model_option(default: str | EllipsisType, *short: str) -> Any:
    """A ``--model`` option with another ``default`` (``...``: required) and short names ``short``."""
    return typer.Option(default, "--model", *short, help=MODEL_HELP)


def out_option(default: str, what: str = "run directory") -> Any:
    """An ``--out`` option (default None: filled by :meth:`RunOptions.with_default_out`); its help names the
    default folder ``default``, e.g. ``runs/landing/MODEL-DTYPE-seedSEED``."""
    return typer.Option(None, "--out", help=f"{what} (default: {default})")


DTYPE_OPTION = typer.Option("auto", "--dtype", help=DTYPE_HELP)
"""``--dtype``, shared by every command that loads a model (checked by :func:`eventkv.models.resolve_dtype`)."""

DEVICE_OPTION = typer.Option("auto", "--device", help=DEVICE_HELP)
"""``--device``, shared by every command that loads a model (checked by
:func:`eventkv.models.resolve_device` before the model loads)."""

THREADS_OPTION = typer.Option(
    None, "--threads", help="torch CPU threads (default: torch decides; 1 is faster on a busy machine)"
)
"""``--threads`` of the commands that run in this process (checked by :func:`eventkv.options.check_threads`)."""

PROGRESS_OPTION = typer.Option(True, "--progress/--no-progress", help="show a progress bar")
"""``--progress/--no-progress``, shared by every command that shows a progress bar."""

SEED_OPTION = typer.Option(0, "--seed", help="item seed (item i depends only on seed and i)")
"""``--seed`` of the pair probes' commands."""

READOUT_OPTION = typer.Option("both", "--readout", help="generate | logits | both")
"""``--readout`` of the pair probes' commands."""

MAX_NEW_TOKENS_OPTION = typer.Option(64, "--max-new-tokens", help="greedy generation length limit")
"""``--max-new-tokens`` of the pair probes' commands."""

BATCH_PAIRS_OPTION = typer.Option(
    1,
    "--batch-pairs",
    help="donor pairs computed in one batch (prefills and readouts; records equal batch 1 up to float "
    "rounding); pays off on a GPU",
)
"""``--batch-pairs``, shared by the pair probes' commands (:attr:`RunOptions.batch_pairs`)."""

SHARED_OPTIONS: dict[str, tuple[Any, Any]] = {
    "model": (str, MODEL_OPTION),
    "seed": (int, SEED_OPTION),
    "readout": (str, READOUT_OPTION),
    "max_new_tokens": (int, MAX_NEW_TOKENS_OPTION),
    "dtype": (str, DTYPE_OPTION),
    "device": (str, DEVICE_OPTION),
    "threads": (Optional[int], THREADS_OPTION),
    "progress": (bool, PROGRESS_OPTION),
    "batch_pairs": (int, BATCH_PAIRS_OPTION),
}
"""The options :func:`run_command` can put into a command by name: ``name -> (type, typer.Option)``."""

RUN_FIELDS = ("model", "items", "seed", "out", "dtype", "threads", "progress", "device", "batch_pairs")
"""The options that make a command's :class:`~eventkv.probes.run_options.RunOptions` (its fields)."""

RUN_TAIL = ("out", "dtype", "device", "threads", "progress")
"""The options that end ``audit``, ``harvest`` and ``memory eval``, in help order."""

PAIR_HEAD = ("model", "items", "seed", "out", "readout")
"""The options that start a pair probe's command (``eventkv run <pair probe>``), in help order."""

PAIR_TAIL = ("max_new_tokens", "dtype", "device", "threads", "progress", "batch_pairs")
"""The options that end a contract clause's command, in help order."""


def run_command(
    *,
    out: str,
    head: tuple[str, ...] = (),
    tail: tuple[str, ...] = RUN_TAIL,
    items: Any = None,
    out_what: str = "run directory",
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorator: a typer command from ``fn``, whose options are the shared options ``head``, then ``fn``'s
    own parameters, then the shared options ``tail`` (names from :data:`SHARED_OPTIONS`; ``"items"`` is the
    option ``items``, ``"out"`` is ``out_option(out, out_what)``). The help is ``fn``'s docstring.

    The command runs ``fn`` inside :func:`user_errors` with ``fn``'s own parameters, the shared options
    ``fn`` names as keyword-only parameters without a default, and, where ``fn`` has a keyword-only
    parameter ``run``, the :class:`~eventkv.probes.run_options.RunOptions` made of the command's
    :data:`RUN_FIELDS` (``seed`` 0 and ``items`` 0 where the command has none: ``fn`` sets them with
    :func:`dataclasses.replace`).
    """

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        sig = inspect.signature(fn)  # the keyword-only annotations may name what imports torch: left as text
        own = [p for p in sig.parameters.values() if p.kind is not p.KEYWORD_ONLY]
        given = [p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
        shared = {**SHARED_OPTIONS, "items": (int, items), "out": (Optional[Path], out_option(out, out_what))}

        def option(name: str) -> inspect.Parameter:
            annotation, default = shared[name]
            return inspect.Parameter(
                name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation
            )

        def ordinary(p: inspect.Parameter) -> inspect.Parameter:
            annotation = (
                eval(p.annotation, inspect.unwrap(fn).__globals__) if isinstance(p.annotation, str) else p.annotation
            )
            return p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation)

        params = [*map(option, head), *map(ordinary, own), *map(option, tail)]

        @functools.wraps(fn)
        def command(**options: Any) -> None:
            with user_errors(), stops_resumably():
                from eventkv.probes.run_options import RunOptions

                run = RunOptions(**{"items": 0, **{k: v for k, v in options.items() if k in RUN_FIELDS}})
                extra = {name: run if name == "run" else options[name] for name in given}
                fn(**{p.name: options[p.name] for p in own}, **extra)

        command.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def pair_probe_command(items: int, items_help: str, name: str) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Decorator: the command ``eventkv run NAME`` of a contract clause from ``make_probe``, which takes the
    clause's own options and, as ``**shared``, the pair probes' ``readout`` and ``max_new_tokens``, and returns
    the probe; the command runs it with :func:`run_probe_command`.

    Its options: :data:`PAIR_HEAD` (``--items`` default ``items``, help ``items_help``; ``--out``
    ``runs/NAME/MODEL-DTYPE-seedSEED``), ``make_probe``'s own, :data:`PAIR_TAIL`.
    """
    option = typer.Option(items, "--items", help=items_help)
    as_command = run_command(out=f"runs/{name}/MODEL-DTYPE-seedSEED", head=PAIR_HEAD, tail=PAIR_TAIL, items=option)

    def decorate(make_probe: Callable[..., Any]) -> Callable[..., None]:
        def clause(*, readout: str, max_new_tokens: int, run: RunOptions, **own: Any) -> None:
            run_probe_command(make_probe(**own, readout=readout, max_new_tokens=max_new_tokens), run)

        functools.update_wrapper(clause, make_probe)
        sig = inspect.signature(make_probe)
        own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        given = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in ("readout", "max_new_tokens", "run")]
        clause.__signature__ = sig.replace(parameters=[*own, *given])  # type: ignore[attr-defined]
        return as_command(clause)

    return decorate


@contextmanager
def user_errors():
    """Print an EventKVError as one line ``error: ...`` and exit 2 (no traceback)."""
    try:
        yield
    except EventKVError as exc:
        _err.print(f"[bold red]error:[/] {escape(cli_message(exc))}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
"""A batch command's exit status when a signal stops it: 128 + the signal's number, the shell's convention
(what a shell reports for a process the signal killed)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread where the command is, as Ctrl-C raises KeyboardInterrupt: it
    passes every ``except Exception`` and every ``finally`` runs on its way out.

    Attributes:
        signum: the signal's number.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminated(signum, frame) -> None:
    raise Terminated(signum)


@contextmanager
def stops_resumably() -> Iterator[None]:
    """A batch command (a probe run, ``contract``, ``splice``, ``audit``, ``harvest``, ``memory eval``,
    ``sweep``) stopped by SIGTERM or Ctrl-C (SIGINT): the signal becomes an exception where the command
    is, so its ``finally`` blocks run (records already appended stay whole; a sweep marks its invocation
    interrupted), then one line on stderr, ``interrupted: every finished record is kept; run the same
    command again to resume. (stopped by SIGTERM: exit 143)``, and exit 143 (SIGTERM) or 130 (SIGINT);
    see :data:`SIGNAL_EXIT`.
    The SIGTERM handler is installed in the main thread only and restored on leaving.

    Raises:
        typer.Exit: with the signal's exit status.
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main else None
    try:
        yield
    except KeyboardInterrupt as exc:
        _stopped(exc.signum if isinstance(exc, Terminated) else signal.SIGINT)
    except SystemExit as exc:
        # why: ray.init (a sweep's ray backend) replaces any SIGTERM handler with one that calls
        # sys.exit(signal number); its SystemExit has run the same finally blocks on its way here
        if exc.code != signal.SIGTERM:
            raise
        _stopped(signal.SIGTERM)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _stopped(signum: int) -> None:
    code = SIGNAL_EXIT[signal.Signals(signum)]
    _err.print(
        "interrupted: every finished record is kept; run the same command again to resume. "
        f"(stopped by {signal.Signals(signum).name}: exit {code})",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    raise typer.Exit(code) from None


def comma_list(text: str, what: str) -> tuple[str, ...]:
    """The non-empty, stripped entries of a comma-separated option value.

    Raises:
        EventKVError: no entry (names the option ``what`` and the value).
    """
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    if not items:
        raise EventKVError(f"{what} {text!r}: give a comma-separated list.")
    return items


def int_list(text: str, what: str, example: str) -> tuple[int, ...]:
    """The integers of a comma-separated option value (empty entries skipped).

    Raises:
        EventKVError: an entry that is not an integer, or none at all (names the option ``what``, the
            value, and shows ``example``).
    """
    try:
        vals = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise EventKVError(f"{what} {text!r}: give comma-separated integers, e.g. {example}.") from None
    if not vals:
        raise EventKVError(f"{what} {text!r}: give at least one integer.")
    return vals


def start_run(opts: RunOptions, probe=None, *, folder: str | None = None, name: str | None = None, **fields: str):
    """Check ``opts`` (and ``probe``'s options) before anything loads, fill the default ``--out``
    ``runs/FOLDER/NAME`` (``FOLDER`` defaults to the probe's name, ``NAME`` to
    :data:`~eventkv.probes.run_options.RUN_DIR`; see :meth:`RunOptions.default_out`), apply ``--threads``
    and load the model.

    Returns:
        ``(options with out set, console, Runtime)``.

    Raises:
        OptionError: a bad option (the CLI prints its flag); EventKVError: the model cannot be loaded.
    """
    from eventkv.probes.run_options import RUN_DIR

    opts.validate(probe)
    opts = opts.with_default_out(folder or probe.name, name or RUN_DIR, **fields)
    console = Console()
    return opts, console, opts.load_runtime(console)


def run_probe_command(probe, opts: RunOptions) -> None:
    """Start the run (:func:`start_run`), run ``probe`` resumably into ``--out`` and print its summary."""
    opts, console, rt = start_run(opts, probe)
    summary = opts.run(probe, rt, console)
    print_summary(console, summary)
    out = opts.out
    assert out is not None  # start_run filled the default --out
    figure = f"  figure: {out / 'figure.png'}" if (out / "figure.png").is_file() else ""
    console.print(f"records: {out / 'records.jsonl'}  summary: {out / 'summary.md'}{figure}")


def print_summary(console: Console, summary) -> None:
    """Print summary.md as it is written (plain markdown: tables stay copy-pastable)."""
    console.print(summary.data["markdown"], markup=False, highlight=False, soft_wrap=True)
