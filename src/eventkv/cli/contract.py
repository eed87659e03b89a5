"""Command line of the memory contract: ``eventkv run trigger-bank|landing|access|carriers|patch``
(mounted on ``eventkv run`` by ``eventkv.cli`` from :data:`RUN_COMMANDS`) and ``eventkv contract``.

The main app mounts the battery with ``app.command("contract")(contract)``. User errors print
one line (no traceback) and exit 2.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import typer

from eventkv.cli.common import (
    SEED_OPTION,
    comma_list,
    int_list,
    pair_probe_command,
    run_command,
    start_run,
)
from eventkv.options import CARRIER_KINDS

if TYPE_CHECKING:
    from eventkv.probes.base import Probe
    from eventkv.probes.run_options import RunOptions

_ITEMS = "number of items (donor pairs)"


@pair_probe_command(32, "donor pairs; item i uses construction i mod 16", "trigger-bank")
def trigger_bank(
    arms: str = typer.Option("kv,text", "--arms", help="kv,text[,isolated]"),
    **shared: Any,
) -> Probe:
    """Trigger bank (Study 1): write-through vs comprehension over 16 carrier constructions."""
    from eventkv.studies.materialization.trigger_bank import TriggerBank

    return TriggerBank(arm_names=comma_list(arms, "--arms"), **shared)


@pair_probe_command(16, _ITEMS, "landing")
def landing(
    tost_margin: float = typer.Option(0.075, "--tost-margin", help="equivalence margin of the mention-donor TOST"),
    **shared: Any,
) -> Probe:
    """Landing (Study 1): root vs reference edge, co-served mention, root x mention factorial (TOST), depth-3 chains."""
    from eventkv.studies.materialization.landing import Landing

    return Landing(tost_margin=tost_margin, **shared)


@pair_probe_command(32, "donor pairs; item i uses cardinality i mod 4", "access")
def access(
    cardinalities: str = typer.Option("binary,compass,phonetic,number", "--cardinalities"),
    **shared: Any,
) -> Probe:
    """Access (Study 1): recovery vs chance for binary, 4-way, 8-way and 3-digit payloads."""
    from eventkv.studies.materialization.access import Access

    return Access(cardinalities=comma_list(cardinalities, "--cardinalities"), **shared)


@pair_probe_command(16, _ITEMS, "carriers")
def carriers(
    kinds: str = typer.Option(",".join([*CARRIER_KINDS, "explicit"]), "--kinds"),
    fix_query_position: bool = typer.Option(
        True, "--fixed-position/--own-position", help="ask every arm at the item's common query position"
    ),
    **shared: Any,
) -> Probe:
    """Programmed carriers (Study 1): answer-free carriers served alone and beside the shared row."""
    from eventkv.studies.materialization.carriers import Carriers

    return Carriers(kinds=comma_list(kinds, "--kinds"), fix_query_position=fix_query_position, **shared)


@pair_probe_command(16, "items; item i uses length i mod len(--lengths)", "patch")
def patch(
    lengths: str = typer.Option("24,48,96,192", "--lengths", help="history lengths in events"),
    timing: bool = typer.Option(True, "--timing/--no-timing", help="time patch vs re-prefill (wall clock)"),
    timing_repeats: int = typer.Option(2, "--timing-repeats"),
    **shared: Any,
) -> Probe:
    """Served patches (Study 1, Updates): patch event vs re-prefill time against L, stale-value leak."""
    from eventkv.studies.materialization.patch import Patch

    lengths_events = int_list(lengths, "--lengths", "24,48,96")
    return Patch(lengths=lengths_events, timing=timing, timing_repeats=timing_repeats, **shared)


@run_command(
    head=("model",),
    tail=("out", "dtype", "device", "threads", "progress", "batch_pairs"),
    out="runs/contract/MODEL-DTYPE[-quick]",
    out_what="output directory",
)
def contract(
    items: Optional[int] = typer.Option(
        None,
        "--items",
        help="items per probe, default 24 (8 with --quick); trigger "
        "bank N//4 per construction, access N//2 per cardinality (docs/contract.md)",
    ),
    quick: bool = typer.Option(False, "--quick", help="small preset, candidate logits only (default --items 8)"),
    seed: int = SEED_OPTION,
    *,
    run: RunOptions,
) -> None:
    """The memory contract (Study 1): run the whole battery, resumably, and write its report.

    The battery: donor pair, trigger bank, landing, access, programmed carriers and patches.

    The report: contract.md, contract.json and figures in --out.
    """
    from eventkv.studies.materialization.contract.battery import plan, run_contract

    if items is None:
        items = 8 if quick else 24
    plan(items, quick)  # bad --items fails here, before the model loads or --out is made
    opts, console, rt = start_run(
        replace(run, items=items),
        folder="contract",
        name="{model}-{dtype}-quick" if quick else "{model}-{dtype}",
    )
    out = opts.out
    js = run_contract(
        rt,
        model=run.model,
        out=out,
        items=items,
        quick=quick,
        seed=seed,
        console=console,
        progress=run.progress,
        batch=run.batch_pairs,
    )
    console.print(js["markdown_table"], markup=False, highlight=False, soft_wrap=True)
    console.print(f"contract: {out / 'contract.md'}  json: {out / 'contract.json'}  figures: {out / 'figures'}")


RUN_COMMANDS = {
    "trigger-bank": trigger_bank,
    "landing": landing,
    "access": access,
    "carriers": carriers,
    "patch": patch,
}
"""The contract clauses as ``eventkv run <name>`` commands (mounted explicitly by ``eventkv.cli``)."""
