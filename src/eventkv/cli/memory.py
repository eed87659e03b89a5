"""``eventkv memory eval``: EventMemory on real multi-session dialogue (LoCoMo format), resumably
(:mod:`eventkv.studies.materialization.memory_eval`). User errors print one line (no traceback) and exit 2."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from eventkv.cli.common import MODEL_OPTION, comma_list, int_list, run_command, run_probe_command

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
    max_tokens: int = typer.Option(
        4000, "--max-tokens", help="history kept per conversation (tokens of turns); 0: the whole conversation"
    ),
    selectors: str = typer.Option(
        "", "--selectors", help="selectors compared, e.g. bm25,dense,attention,hybrid (default: every registered one)"
    ),
    budgets: str = typer.Option(
        "2.5%,5%,10%,20%", "--budgets", help="rows served per question, as fractions of the history's rows (5% or 0.05)"
    ),
    controls: str = typer.Option(
        "",
        "--controls",
        help="selectors whose served sets also get the text / isolated / blend arms (default: hybrid if compared, "
        "else the first selector)",
    ),
    positions: str = typer.Option(
        "contiguous", "--positions", help="contiguous | original | both (positions the served rows are read at)"
    ),
    order: str = typer.Option(
        "relevance",
        "--order",
        help="relevance | log (the text and contiguous arms' turns with the best-ranked last, as the memory's "
        "default plan serves them, or in history order)",
    ),
    neighbours: int = typer.Option(0, "--neighbours", help="also serve the W turns either side of each selected one"),
    with_headers: bool = typer.Option(
        True,
        "--with-headers/--no-headers",
        help="session header events carrying the date (turns undated), served with every served turn, as the "
        "memory's default plan serves them; --no-headers: the date written in every turn",
    ),
    resolve_dates: bool = typer.Option(
        True,
        "--resolve-dates/--no-resolve-dates",
        help="write the date each relative expression of a turn means after it ('yesterday [7 May 2023]'), as the "
        "memory stores a dated event; --no-resolve-dates: the turns as said",
    ),
    prefill_window: Optional[int] = typer.Option(
        None,
        "--prefill-window",
        help="positions each prefill forward of a memory spans at most (header + recent rows + new tokens): a row past "
        "it is computed with only the header and the rows just before it in view (default: the model's context)",
    ),
    rows: str = typer.Option(
        "native", "--rows", help="native | int8 | int4: the format the memories store their rows in"
    ),
    categories: str = typer.Option(
        "", "--categories", help="LoCoMo categories to draw questions from, e.g. 2 (temporal) (default: all)"
    ),
    k: Optional[int] = typer.Option(None, "--k", help="at most K turns per served set (default: fill to the budget)"),
    recompute: Optional[float] = typer.Option(
        None, "--recompute", help="the blend arm's recomputed fraction (default: the serve mode's)"
    ),
    arms: str = typer.Option(
        "rows,text,isolated,full,gold",
        "--arms",
        help="arm kinds, comma-separated, among: rows, text, isolated, blend, blend-layerwise, blend-epic, "
        "blend-suffix, full, gold (rows required)",
    ),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens", help="greedy answer length limit"),
    batch_arms: bool = typer.Option(
        True,
        "--batch-arms/--no-batch-arms",
        help="read the arms out in batches grouped by length (fast); --no-batch-arms: one readout per arm",
    ),
    max_padding: float = typer.Option(
        0.5,
        "--max-padding",
        help="the padding a batched readout may add, as a fraction of its rows (1: every arm of a question in one "
        "readout; on a CPU a decode step costs about the same for a batch as for one arm)",
    ),
    seed: int = typer.Option(0, "--seed", help="question sampling seed"),
    *,
    run: RunOptions,
) -> None:
    """Evaluate EventMemory on LoCoMo: per question, each selector's turns at each budget served as rows of one global prefill.

    Compared with the same turns as text, each encoded alone (and blended), the whole history, and the gold evidence.

    F1 / EM per arm with cluster-bootstrap intervals, paired differences per budget, cost, recall, and F1(rows at 10%) / F1(full).
    """  # noqa: E501
    from eventkv.studies.materialization.memory_eval import DEMO_DATA, MemoryEval, parse_budget

    probe = MemoryEval(
        data=DEMO_DATA if data == "demo" else data,
        conversations=conversations,
        questions_per_conversation=questions,
        max_tokens=max_tokens,
        selectors=comma_list(selectors, "--selectors") if selectors.strip() else (),
        budgets=tuple(parse_budget(b) for b in comma_list(budgets, "--budgets")),
        controls=comma_list(controls, "--controls") if controls.strip() else (),
        positions=positions,
        order=order,
        neighbours=neighbours,
        with_headers=with_headers,
        resolve_dates=resolve_dates,
        prefill_window=prefill_window,
        rows=rows,
        categories=int_list(categories, "--categories", "2,4") if categories.strip() else (),
        k=k,
        recompute=recompute,
        max_new_tokens=max_new_tokens,
        arm_names=comma_list(arms, "--arms"),
        batch_arms=batch_arms,
        max_padding=max_padding,
    )
    run_probe_command(probe, replace(run, items=conversations * questions))


@memory_app.command("compare")
def memory_compare(
    a: str = typer.Argument(..., help="run folder A (a memory eval's --out)"),
    b: str = typer.Argument(..., help="run folder B: the same questions with one option changed"),
    category: Optional[int] = typer.Option(None, "--category", help="only this LoCoMo category (default: 1-4)"),
    label_a: str = typer.Option("", "--label-a", help="A's name in the table (default: its folder's name)"),
    label_b: str = typer.Option("", "--label-b", help="B's name in the table (default: its folder's name)"),
) -> None:
    """Compare two memory eval runs of the same questions arm by arm: F1 of each, the paired difference B - A with its interval, better:worse and Wilcoxon p."""  # noqa: E501
    from eventkv.studies.materialization.memory_eval.compare import compare_folders

    typer.echo(compare_folders(a, b, category=category, label_a=label_a, label_b=label_b))


@memory_app.command("redact")
def memory_redact(
    source: str = typer.Argument(..., help="a memory eval's run folder (its --out)"),
    dest: str = typer.Argument(..., help="a new folder for the redacted copy"),
) -> None:
    """Copy a memory eval's run folder without the dataset's text, to share or commit it.

    Dropped: questions, gold answers, forced-choice options, the model's answers. `eventkv report DEST` reports the copy; the same `memory eval` command with `--out DEST` resumes it.
    """  # noqa: E501
    from eventkv.studies.materialization.memory_eval import redact_run

    n = redact_run(source, dest)
    typer.echo(f"{n} records redacted into {dest}: `eventkv report {dest}` reports them")


@memory_app.command("import")
def memory_import(
    data: str = typer.Argument(..., help="LoCoMo-format JSON, or 'demo': a tiny invented file shipped with eventkv"),
    server: str = typer.Option(..., "--server", help="the eventkv server, e.g. http://127.0.0.1:8000"),
    memory: str = typer.Option(
        ..., "--id", help="the memory's id: created when absent; an import stopped part-way gets the sessions it lacks"
    ),
    conversation: int = typer.Option(1, "--conversation", help="which conversation of the file (1 = the first)"),
    max_turns: int = typer.Option(0, "--max-turns", help="the conversation's first N turns (0: every turn)"),
    with_headers: bool = typer.Option(
        False, "--with-headers/--no-headers", help="a session header event carrying the date before each session"
    ),
    resolve_dates: bool = typer.Option(
        True,
        "--resolve-dates/--no-resolve-dates",
        help="follow relative dates with the date they mean, as the memory stores a dated event and `memory eval` "
        "builds its histories; --no-resolve-dates: the turns as said",
    ),
    rows: Optional[str] = typer.Option(
        None,
        "--rows",
        help="the memory's row format: native, int8 or int4 (default: native for a new memory; an existing one "
        "keeps its own, and another value is refused)",
    ),
    namespace: str = typer.Option("default", "--namespace", help="the namespace the memory is created in"),
    token_file: Optional[Path] = typer.Option(
        None, "--token-file", help="the server's bearer token: the first token of the file (eventkv serve's format)"
    ),
    prefill: bool = typer.Option(True, "--prefill/--lazy", help="prefill each session's rows as it is added"),
) -> None:
    """Create a memory on a running server from one conversation of a LoCoMo-format file: one event per turn, as `memory eval` builds its histories.

    Then open http://SERVER/ui to inspect it. Each session is one add (its rows prefilled unless --lazy), so a conversation of ~20,000 tokens takes a few minutes on a CPU.
    """  # noqa: E501
    from eventkv.cli.common import user_errors

    with user_errors():
        import re

        import httpx

        from eventkv.errors import EventKVError, OptionError
        from eventkv.kv.quant import check_row_format
        from eventkv.service.server import read_tokens
        from eventkv.studies.materialization.dialogue import load_locomo
        from eventkv.studies.materialization.memory_eval import DEMO_DATA
        from eventkv.studies.materialization.memory_eval.history import history_events
        from eventkv.wire import NAME, check_name

        if NAME.fullmatch(memory) is None:
            raise OptionError(
                "id",
                memory,
                "use 1-64 characters from A-Z, a-z, 0-9, '_' and '-', starting with a letter or digit.",
                flag="--id",
            )
        check_name(namespace, "namespace")
        if rows is not None:
            check_row_format(rows)
        if not re.match(r"^https?://[^/\s]+", server):
            raise OptionError("server", server, "give the server's URL, e.g. http://127.0.0.1:8000.", flag="--server")
        convs = load_locomo(DEMO_DATA if data == "demo" else data)
        if not 1 <= conversation <= len(convs):
            raise OptionError(
                "conversation",
                conversation,
                f"the file holds {len(convs)}: give 1-{len(convs)}.",
                flag="--conversation",
            )
        if max_turns < 0:
            raise OptionError("max_turns", max_turns, "give 0 (every turn) or more.", flag="--max-turns")
        conv = convs[conversation - 1]
        if max_turns:
            conv = replace(conv, turns=conv.turns[:max_turns])
        token = None
        if token_file is not None:  # the file's first token granted the namespace (eventkv serve's format)
            granted = [t for t, ns in read_tokens(token_file).items() if ns is None or namespace in ns]
            if not granted:
                raise OptionError(
                    "namespace", namespace, f"no token of {token_file} is granted it: add one.", flag="--namespace"
                )
            token = granted[0]
        sessions = history_events(conv, with_headers, resolve_dates)
        try:
            n, added, stats = import_sessions(server, memory, namespace, token, rows, sessions, prefill)
        except httpx.HTTPError as exc:
            raise EventKVError(
                f"the server at {server} cannot be reached ({type(exc).__name__}: {exc}): start it with "
                "`eventkv serve`, or give its URL with --server."
            ) from None
        typer.echo(
            f"memory {memory!r} in namespace {namespace!r}: {n} events "
            f"({f'{added} added' if added else 'none added: it held them all'}), {stats.rows} rows; "
            f"inspect it at {server.rstrip('/')}/ui/memory/{memory}?ns={namespace}"
        )


def import_sessions(server: str, memory: str, namespace: str, token, rows: str | None, sessions: list, prefill: bool):
    """Add ``sessions`` (``[(session, [MemoryEvent, ...]), ...]``) to memory ``memory`` on ``server``, one add
    per session: a new memory is created (in row format ``rows``; None: the server's default, native); an
    existing one whose events are a prefix of these (same ids and texts, in order: an import stopped part-way)
    gets the sessions it lacks, in its own row format. Returns ``(events, events added, stats)``.

    Raises:
        EventKVError: the memory exists with other events, or in another row format than a given ``rows`` (the
            message names its format); whatever the server refuses.
    """
    from eventkv.client import Client
    from eventkv.errors import Conflict, EventKVError, NotFound

    planned = [e for _, events in sessions for e in events]
    try:
        client = Client.open(server, memory, namespace=namespace, token=token)
    except NotFound:
        client = Client.create(server, memory, namespace=namespace, rows=rows, token=token)
    with client:
        have = [(r.id, r.text) for r in client.list()]
        if have != [(e.id, e.text) for e in planned[: len(have)]]:
            raise Conflict(
                f"memory {memory!r} already exists in namespace {namespace!r} with other events: give another --id, "
                "or delete it (DELETE /v1/memories/ID)."
            )
        stored = client.rows_format
        if rows is not None and stored != rows:
            raise EventKVError(
                f"memory {memory!r} stores its rows as {stored}, not --rows {rows} (a memory keeps the format it was "
                f"created with): give --rows {stored} or leave --rows out to add to it, or import into a new --id."
            )
        done, seen = len(have), 0
        for session, events in sessions:
            todo = events[max(0, done - seen) :]
            seen += len(events)
            if todo:
                client.add(todo, prefill=prefill)
                typer.echo(f"session {session}: {len(todo)} events", err=True)
        return len(planned), len(planned) - done, client.stats()
