"""``eventkv audit``: the eviction audit on donor-pair histories (:mod:`eventkv.studies.materialization.audit`).
User errors print one line (no traceback) and exit 2."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from eventkv.cli.common import MODEL_OPTION, comma_list, run_command, run_probe_command
from eventkv.options import POLICIES

if TYPE_CHECKING:
    from eventkv.probes.run_options import RunOptions


@run_command(out="runs/audit/MODEL-DTYPE-seedSEED")
def audit(
    policy: str = typer.Option(
        "streaming,snapkv,knorm",
        "--policy",
        help=f"{', '.join(POLICIES)}; settings in parentheses, e.g. snapkv(window=64,kernel=5)",
    ),
    ratio: str = typer.Option("0.5,0.75", "--ratio", help="compression ratios: the fraction of rows evicted"),
    model: str = MODEL_OPTION,
    items: int = typer.Option(24, "--items", help="donor pairs"),
    window: int = typer.Option(
        64,
        "--window",
        help="observation window (tokens at the end of the history) every policy reads; the window of a bare "
        "snapkv, pyramidkv or finch",
    ),
    sinks: int = typer.Option(4, "--sinks", help="attention sinks kept by streaming"),
    seed: int = typer.Option(0, "--seed", help="item seed (the donor-pair probe's pairs for the same seed)"),
    *,
    run: RunOptions,
) -> None:
    """Audit eviction policies on donor pairs, resumably: what do the kept rows carry once the source is evicted?

    Does a kept-rows accuracy that holds after evicting the source hide state the kept rows carry?

    Such state makes ablation false negatives. Does the accuracy survive re-encoding the kept events in isolation?
    """
    from eventkv.errors import OptionError
    from eventkv.studies.materialization.audit import EvictionAudit

    ratios = []
    for r in comma_list(ratio, "--ratio"):
        try:
            ratios.append(float(r))
        except ValueError:
            raise OptionError("ratios", r, "give compression ratios as numbers in [0, 1).", flag="--ratio") from None
    from eventkv.eviction.specs import split_policy_specs

    probe = EvictionAudit(policies=tuple(split_policy_specs(policy)), ratios=tuple(ratios), window=window, sinks=sinks)
    run_probe_command(probe, run)
