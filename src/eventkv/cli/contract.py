"""Command line of the memory contract: ``eventkv run trigger-bank|landing|access|carriers|patch``
(mounted on ``eventkv run`` by ``eventkv.cli`` from :data:`RUN_COMMANDS`) and ``eventkv contract``.

The main app mounts the battery with ``app.command("contract")(contract)``. User errors print
one line (no traceback) and exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eventkv.cli.common import (
    BATCH_PAIRS_OPTION,
    DEVICE_OPTION,
    DTYPE_OPTION,
    MAX_NEW_TOKENS_OPTION,
    MODEL_OPTION,
    PROGRESS_OPTION,
    READOUT_OPTION,
    SEED_OPTION,
    THREADS_OPTION,
    comma_list,
    int_list,
    out_option,
    run_probe_command,
    start_run,
    user_errors,
)
from eventkv.options import CARRIER_KINDS

_ITEMS = "number of items (donor pairs)"


def trigger_bank(
    model: str = MODEL_OPTION,
    items: int = typer.Option(32, "--items", help="donor pairs; item i uses construction i mod 16"),
    seed: int = SEED_OPTION,
    out: Optional[Path] = out_option("runs/trigger-bank/MODEL-DTYPE-seedSEED"),
    readout: str = READOUT_OPTION,
    arms: str = typer.Option("kv,text", "--arms", help="kv,text[,isolated]"),
    max_new_tokens: int = MAX_NEW_TOKENS_OPTION,
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    threads: Optional[int] = THREADS_OPTION,
    progress: bool = PROGRESS_OPTION,
    batch_pairs: int = BATCH_PAIRS_OPTION,
) -> None:
    """Trigger bank (Study 1): write-through vs comprehension over 16 carrier constructions."""
    with user_errors():
        from eventkv.probes.run_options import RunOptions
        from eventkv.studies.materialization.trigger_bank import TriggerBank

        probe = TriggerBank(readout=readout, arm_names=comma_list(arms, "--arms"), max_new_tokens=max_new_tokens)
        opts = RunOptions(model, items, seed, out, dtype, threads, progress, device=device, batch_pairs=batch_pairs)
        run_probe_command(probe, opts)


def landing(
    model: str = MODEL_OPTION,
    items: int = typer.Option(16, "--items", help=_ITEMS),
    seed: int = SEED_OPTION,
    out: Optional[Path] = out_option("runs/landing/MODEL-DTYPE-seedSEED"),
    readout: str = READOUT_OPTION,
    tost_margin: float = typer.Option(0.075, "--tost-margin", help="equivalence margin of the mention-donor TOST"),
    max_new_tokens: int = MAX_NEW_TOKENS_OPTION,
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    threads: Optional[int] = THREADS_OPTION,
    progress: bool = PROGRESS_OPTION,
    batch_pairs: int = BATCH_PAIRS_OPTION,
) -> None:
    """Landing (Study 1): root vs reference edge, co-served mention, root x mention factorial (TOST), depth-3 chains."""
    with user_errors():
        from eventkv.probes.run_options import RunOptions
        from eventkv.studies.materialization.landing import Landing

        probe = Landing(readout=readout, tost_margin=tost_margin, max_new_tokens=max_new_tokens)
        opts = RunOptions(model, items, seed, out, dtype, threads, progress, device=device, batch_pairs=batch_pairs)
        run_probe_command(probe, opts)


def access(
    model: str = MODEL_OPTION,
    items: int = typer.Option(32, "--items", help="donor pairs; item i uses cardinality i mod 4"),
    seed: int = SEED_OPTION,
    out: Optional[Path] = out_option("runs/access/MODEL-DTYPE-seedSEED"),
    readout: str = READOUT_OPTION,
    cardinalities: str = typer.Option("binary,compass,phonetic,number", "--cardinalities"),
    max_new_tokens: int = MAX_NEW_TOKENS_OPTION,
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    threads: Optional[int] = THREADS_OPTION,
    progress: bool = PROGRESS_OPTION,
    batch_pairs: int = BATCH_PAIRS_OPTION,
) -> None:
    """Access (Study 1): recovery vs chance for binary, 4-way, 8-way and 3-digit payloads."""
    with user_errors():
        from eventkv.probes.run_options import RunOptions
        from eventkv.studies.materialization.access import Access

        probe = Access(
            readout=readout, cardinalities=comma_list(cardinalities, "--cardinalities"), max_new_tokens=max_new_tokens
        )
        opts = RunOptions(model, items, seed, out, dtype, threads, progress, device=device, batch_pairs=batch_pairs)
        run_probe_command(probe, opts)


def carriers(
    model: str = MODEL_OPTION,
    items: int = typer.Option(16, "--items", help=_ITEMS),
    seed: int = SEED_OPTION,
    out: Optional[Path] = out_option("runs/carriers/MODEL-DTYPE-seedSEED"),
    readout: str = READOUT_OPTION,
    kinds: str = typer.Option(",".join([*CARRIER_KINDS, "explicit"]), "--kinds"),
    fix_query_position: bool = typer.Option(
        True, "--fixed-position/--own-position", help="ask every arm at the item's common query position"
    ),
    max_new_tokens: int = MAX_NEW_TOKENS_OPTION,
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    threads: Optional[int] = THREADS_OPTION,
    progress: bool = PROGRESS_OPTION,
    batch_pairs: int = BATCH_PAIRS_OPTION,
) -> None:
    """Programmed carriers (Study 1): answer-free carriers served alone and beside the shared row."""
    with user_errors():
        from eventkv.probes.run_options import RunOptions
        from eventkv.studies.materialization.carriers import Carriers

        probe = Carriers(
            readout=readout,
            kinds=comma_list(kinds, "--kinds"),
            fix_query_position=fix_query_position,
            max_new_tokens=max_new_tokens,
        )
        opts = RunOptions(model, items, seed, out, dtype, threads, progress, device=device, batch_pairs=batch_pairs)
        run_probe_command(probe, opts)


def patch(
    model: str = MODEL_OPTION,
    items: int = typer.Option(16, "--items", help="items; item i uses length i mod len(--lengths)"),
    seed: int = SEED_OPTION,
    out: Optional[Path] = out_option("runs/patch/MODEL-DTYPE-seedSEED"),
    readout: str = READOUT_OPTION,
    lengths: str = typer.Option("24,48,96,192", "--lengths", help="history lengths in events"),
    timing: bool = typer.Option(True, "--timing/--no-timing", help="time patch vs re-prefill (wall clock)"),
    timing_repeats: int = typer.Option(2, "--timing-repeats"),
    max_new_tokens: int = MAX_NEW_TOKENS_OPTION,
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    threads: Optional[int] = THREADS_OPTION,
    progress: bool = PROGRESS_OPTION,
    batch_pairs: int = BATCH_PAIRS_OPTION,
) -> None:
    """Served patches (Study 1, Updates): patch event vs re-prefill time against L, stale-value leak."""
    with user_errors():
        from eventkv.probes.run_options import RunOptions
        from eventkv.studies.materialization.patch import Patch

        probe = Patch(
            readout=readout,
            lengths=int_list(lengths, "--lengths", "24,48,96"),
            timing=timing,
            timing_repeats=timing_repeats,
            max_new_tokens=max_new_tokens,
        )
        opts = RunOptions(model, items, seed, out, dtype, threads, progress, device=device, batch_pairs=batch_pairs)
        run_probe_command(probe, opts)


def contract(
    model: str = MODEL_OPTION,
    items: Optional[int] = typer.Option(
        None,
        "--items",
        help="items per probe, default 24 (8 with --quick); trigger "
        "bank N//4 per construction, access N//2 per cardinality (docs/contract.md)",
    ),
    quick: bool = typer.Option(False, "--quick", help="small preset, candidate logits only (default --items 8)"),
    seed: int = SEED_OPTION,
    out: Optional[Path] = out_option("runs/contract/MODEL-DTYPE[-quick]", "output directory"),
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    threads: Optional[int] = THREADS_OPTION,
    progress: bool = PROGRESS_OPTION,
    batch_pairs: int = BATCH_PAIRS_OPTION,
) -> None:
    """The memory contract (Study 1): run the whole battery, resumably, and write its report.

    The battery: donor pair, trigger bank, landing, access, programmed carriers and patches.

    The report: contract.md, contract.json and figures in --out.
    """
    with user_errors():
        from eventkv.probes.run_options import RunOptions
        from eventkv.studies.materialization.contract.battery import plan, run_contract

        if items is None:
            items = 8 if quick else 24
        plan(items, quick)  # bad --items fails here, before the model loads or --out is made
        opts, console, rt = start_run(
            RunOptions(model, items, seed, out, dtype, threads, progress, device=device, batch_pairs=batch_pairs),
            folder="contract",
            name="{model}-{dtype}-quick" if quick else "{model}-{dtype}",
        )
        out = opts.out
        js = run_contract(
            rt,
            model=model,
            out=out,
            items=items,
            quick=quick,
            seed=seed,
            console=console,
            progress=progress,
            batch=batch_pairs,
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
