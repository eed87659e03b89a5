"""The memory contract's report (Study 1, "The memory contract", "Programmed carriers",
"Updates"): contract.md, contract.json and the figures, assembled from the contract probes' own
sections.

Each contract probe turns its summary into a
:class:`~eventkv.studies.materialization.contract_rows.ContractSection` (its rows of the contract table, its
section of contract.json, its figure); this module only puts them together in
:data:`CONTRACT_PROBES` order, adds the header (preset, model, dtype, seed, pairs, compute time)
and appends every probe's summary. It reads no probe's statistics itself.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from eventkv.errors import EventKVError
from eventkv.files import write_json_atomic
from eventkv.probes.base import Summary, Table, get_probe
from eventkv.probes.runner import load_records
from eventkv.studies.materialization.contract_rows import ContractSection

#: the probes of the contract, in the order of the battery and of the contract's rows
CONTRACT_PROBES = ("donor-pair", "trigger-bank", "landing", "access", "carriers", "patch")
#: the contract table's header
COLUMNS = ["clause", "measure", "measured", "interval / test", "study (Qwen3-8B et al.)"]


def probe_section(probe: str, summary: Summary) -> ContractSection:
    """The contract section of one probe's summary: ``contract_section(summary)`` of the probe
    class registered as ``probe``.

    Raises:
        EventKVError: an unknown probe, or one without a ``contract_section``.
    """
    cls = get_probe(probe)
    make = getattr(cls, "contract_section", None)
    if make is None:
        raise EventKVError(f"probe {probe!r} has no contract_section: give {cls.__name__} one to use it in a contract.")
    return make(summary)


def contract_sections(summaries: dict[str, Summary]) -> list[ContractSection]:
    """The sections of the contract probes present in ``summaries`` (probe name -> Summary), in
    :data:`CONTRACT_PROBES` order; other probes contribute no section.

    Raises:
        EventKVError: see :func:`probe_section`.
    """
    return [probe_section(p, summaries[p]) for p in CONTRACT_PROBES if p in summaries]


def write_contract(out: Path, model: str, summaries: dict[str, Summary], provenance: dict, quick: bool = False) -> dict:
    """Write ``out/contract.md``, ``out/contract.json`` and ``out/figures/*.png`` from the probes'
    summaries (probe name -> Summary, each probe's run in ``out/<probe>/``).

    ``provenance`` is :func:`~.battery.provenance` of ``out`` (dtype, seed, compute
    seconds per probe, torch threads, devices). contract.json holds the model, the preset, the pairs per
    probe, the provenance and one section per contract probe (NaN written as null).

    Returns:
        the contract dict as written (NaN kept as NaN), plus ``markdown_table``: the contract
        table in markdown.

    Raises:
        EventKVError: see :func:`probe_section`.
        OSError: ``out`` cannot be written.
    """
    sections = contract_sections(summaries)
    figs = out / "figures"
    figs.mkdir(exist_ok=True)
    written = []
    for s in sections:
        if s.figure:
            name, draw = s.figure
            draw(figs / name)
            written.append(name)
    js: dict[str, Any] = {
        "model": model,
        "quick": quick,
        "pairs": {k: len(load_records(out / k)) for k in summaries},
        "provenance": provenance,
        **{s.key: s.data for s in sections},
    }
    write_json_atomic(out / "contract.json", _clean(js))
    table = Table(f"Memory contract of {model}", COLUMNS, [list(r) for s in sections for r in s.rows])
    md = [
        f"# Memory contract: {model}",
        "",
        (
            "Preset: --quick (candidate-logit readout only, few items per cell: intervals are wide; the sign tests can "
            "detect only large effects)."
            if quick
            else "Preset: full."
        ),
        "",
        f"Model {model}, {provenance['dtype']}, seed {provenance['seed']}; pairs per probe: "
        + ", ".join(f"{k} {v}" for k, v in js["pairs"].items())
        + f". Compute time {_hms(provenance['total_seconds'])} ("
        + ", ".join(f"{k} {_hms(v)}" for k, v in provenance["seconds"].items())
        + ")"
        + (f", torch threads {', '.join(map(str, provenance['torch_threads']))}" if provenance["torch_threads"] else "")
        + (f", device {', '.join(provenance['devices'])}" if provenance.get("devices") else "")
        + ".",
        "",
        table.to_markdown(),
        "",
        "Figures: " + ", ".join(f"[{n}](figures/{n})" for n in written),
        "",
    ]
    md += [f"![{n}](figures/{n})" for n in written] + [""]
    md += [
        "Study figures are from Study 1 (8B-class checkpoints, one A100): not directly comparable with a small "
        "checkpoint or a CPU's timings. Graded rows (donor shift d) are eventkv's candidate-log-odds readout; "
        "the study reports follow:anti only. See docs/contract.md in the eventkv repository for how to read this "
        "table.",
        "",
    ]
    for summary in summaries.values():
        md += [
            "---",
            "",
            summary.data.get("markdown", summary.to_markdown()).replace("\n# ", "\n## ").replace("# ", "## ", 1),
            "",
        ]
    (out / "contract.md").write_text("\n".join(md))
    js["markdown_table"] = table.to_markdown()
    return js


def _hms(s: float) -> str:
    """Seconds as ``H h M min`` (an hour or more) or ``M min S s``."""
    h, rem = divmod(int(round(s)), 3600)
    return f"{h} h {rem // 60} min" if h else f"{rem // 60} min {rem % 60} s"


def _clean(x):
    """NaN to None (valid JSON), recursively; tuples to lists."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        return None
    return x
