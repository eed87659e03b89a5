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
    comma_list,
    int_list,
    run_probe_command,
    start_run,
    user_errors,
)
from eventkv.options import CARRIER_KINDS, DTYPE_HELP

_MODEL = typer.Option(
    "qwen2.5-coder-1.5b",
    "--model",
    help="packaged alias, local HF directory, hub id or GGUF file "
    "(default: the smallest packaged model not at chance on the donor pair)",
)
_SEED = typer.Option(0, "--seed")
_READOUT = typer.Option("both", "--readout", help="generate | logits | both")
_MAX_NEW = typer.Option(64, "--max-new-tokens")
_DTYPE = typer.Option("auto", "--dtype", help=DTYPE_HELP)
_THREADS = typer.Option(None, "--threads", help="torch CPU threads")
_PROGRESS = typer.Option(True, "--progress/--no-progress")
_ITEMS = "number of items (donor pairs)"


def trigger_bank(
    model: str = _MODEL,
    items: int = typer.Option(32, "--items", help="donor pairs; item i uses construction i mod 16"),
    seed: int = _SEED,
    out: Optional[Path] = typer.Option(
        None, "--out", help="run directory (default: runs/trigger-bank/MODEL-DTYPE-seedSEED)"
    ),
    readout: str = _READOUT,
    arms: str = typer.Option("kv,text", "--arms", help="kv,text[,isolated]"),
    max_new_tokens: int = _MAX_NEW,
    dtype: str = _DTYPE,
    device: str = DEVICE_OPTION,
    threads: Optional[int] = _THREADS,
    progress: bool = _PROGRESS,
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
    model: str = _MODEL,
    items: int = typer.Option(16, "--items", help=_ITEMS),
    seed: int = _SEED,
    out: Optional[Path] = typer.Option(
        None, "--out", help="run directory (default: runs/landing/MODEL-DTYPE-seedSEED)"
    ),
    readout: str = _READOUT,
    tost_margin: float = typer.Option(0.075, "--tost-margin", help="equivalence margin of the mention-donor TOST"),
    max_new_tokens: int = _MAX_NEW,
    dtype: str = _DTYPE,
    device: str = DEVICE_OPTION,
    threads: Optional[int] = _THREADS,
    progress: bool = _PROGRESS,
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
    model: str = _MODEL,
    items: int = typer.Option(32, "--items", help="donor pairs; item i uses cardinality i mod 4"),
    seed: int = _SEED,
    out: Optional[Path] = typer.Option(None, "--out", help="run directory (default: runs/access/MODEL-DTYPE-seedSEED)"),
    readout: str = _READOUT,
    cardinalities: str = typer.Option("binary,compass,phonetic,number", "--cardinalities"),
    max_new_tokens: int = _MAX_NEW,
    dtype: str = _DTYPE,
    device: str = DEVICE_OPTION,
    threads: Optional[int] = _THREADS,
    progress: bool = _PROGRESS,
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
    model: str = _MODEL,
    items: int = typer.Option(16, "--items", help=_ITEMS),
    seed: int = _SEED,
    out: Optional[Path] = typer.Option(
        None, "--out", help="run directory (default: runs/carriers/MODEL-DTYPE-seedSEED)"
    ),
    readout: str = _READOUT,
    kinds: str = typer.Option(",".join([*CARRIER_KINDS, "explicit"]), "--kinds"),
    fix_query_position: bool = typer.Option(
        True, "--fixed-position/--own-position", help="ask every arm at the item's common query position"
    ),
    max_new_tokens: int = _MAX_NEW,
    dtype: str = _DTYPE,
    device: str = DEVICE_OPTION,
    threads: Optional[int] = _THREADS,
    progress: bool = _PROGRESS,
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
    model: str = _MODEL,
    items: int = typer.Option(16, "--items", help="items; item i uses length i mod len(--lengths)"),
    seed: int = _SEED,
    out: Optional[Path] = typer.Option(None, "--out", help="run directory (default: runs/patch/MODEL-DTYPE-seedSEED)"),
    readout: str = _READOUT,
    lengths: str = typer.Option("24,48,96,192", "--lengths", help="history lengths in events"),
    timing: bool = typer.Option(True, "--timing/--no-timing", help="time patch vs re-prefill (wall clock)"),
    timing_repeats: int = typer.Option(2, "--timing-repeats"),
    max_new_tokens: int = _MAX_NEW,
    dtype: str = _DTYPE,
    device: str = DEVICE_OPTION,
    threads: Optional[int] = _THREADS,
    progress: bool = _PROGRESS,
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
    model: str = _MODEL,
    items: Optional[int] = typer.Option(
        None,
        "--items",
        help="items per probe, default 24 (8 with --quick); trigger "
        "bank N//4 per construction, access N//2 per cardinality (docs/contract.md)",
    ),
    quick: bool = typer.Option(False, "--quick", help="small preset, candidate logits only (default --items 8)"),
    seed: int = _SEED,
    out: Optional[Path] = typer.Option(
        None, "--out", help="output directory (default: runs/contract/MODEL-DTYPE[-quick])"
    ),
    dtype: str = _DTYPE,
    device: str = DEVICE_OPTION,
    threads: Optional[int] = _THREADS,
    progress: bool = _PROGRESS,
    batch_pairs: int = BATCH_PAIRS_OPTION,
) -> None:
    """The memory contract (Study 1): run the whole battery (donor pair, trigger bank, landing, access,
    programmed carriers, patches), resumably, and write contract.md, contract.json and figures."""
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
