"""The memory-contract battery (Study 1, "The memory contract", "Programmed carriers", "Updates"):
run every contract probe on one model, resumably, and write the contract.

``run_contract`` runs donor-pair, trigger-bank, landing, access, carriers and patch, each into
its own run directory ``OUT/<probe>/`` through the probe runner's records and manifests (so each
is resumable, refuses other settings, and ``eventkv report OUT/<probe>`` re-renders it), under
one progress display. It then writes, through :func:`eventkv.studies.materialization.contract.report.write_contract`
(which assembles each probe's own contract section),

* ``OUT/contract.md`` — one row per contract clause: the measured figure, its interval or
  test, and the study's figure beside it; followed by every probe's summary;
* ``OUT/contract.json`` — the machine-readable contract: which constructions write and how
  strongly, the capacity envelope, landing, programming and update figures;
* ``OUT/figures/`` — write-through vs comprehension (``trigger.png``), access recovery vs chance
  (``access.png``), patch vs re-prefill time against L (``patch.png``).

Item counts per probe follow from ``--items N`` (see :func:`plan`); ``--quick`` is a smaller
preset with the candidate-logit readout only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eventkv.files import write_json_atomic
from eventkv.options import check_int
from eventkv.probes.base import Runtime, get_probe
from eventkv.probes.runner import RUN_MANIFEST, environment, open_run, progress_bar, render, run_items
from eventkv.studies.materialization.contract.report import CONTRACT_PROBES, write_contract


@dataclass(frozen=True)
class Step:
    """One probe of the battery: its name, options and item count."""

    probe: str
    options: dict
    items: int


def plan(items: int = 24, quick: bool = False) -> list[Step]:
    """The battery for ``--items N``: donor pairs N; trigger bank 16 x max(2, N // 4) pairs
    (N // 4 per construction); landing N; access 4 x max(2, N // 2) (N // 2 per cardinality);
    carriers N; patch 4 x max(2, N // 4) over lengths 16, 32, 64, 128 events. Both readouts,
    64 new tokens. ``quick``: candidate logits only (no generation), trigger bank 2 per
    construction, access 4 per cardinality, patch lengths 16, 32, 64, and N as given for the rest
    (default 8).

    Raises:
        OptionError: ``items`` is not a whole number >= 2.
    """
    check_int("items", items, "the contract needs at least 2 items per probe.", minimum=2)
    if quick:
        ro = {"readout": "logits"}
        return [
            Step("donor-pair", ro, items),
            Step("trigger-bank", ro, 32),
            Step("landing", ro, items),
            Step("access", ro, 16),
            Step("carriers", ro, items),
            Step("patch", {**ro, "lengths": (16, 32, 64), "timing_repeats": 1}, 6),
        ]
    return [
        Step("donor-pair", {}, items),
        Step("trigger-bank", {}, 16 * max(2, items // 4)),
        Step("landing", {}, items),
        Step("access", {}, 4 * max(2, items // 2)),
        Step("carriers", {}, items),
        Step("patch", {"lengths": (16, 32, 64, 128), "timing_repeats": 1}, 4 * max(2, items // 4)),
    ]


def run_contract(
    rt: Runtime,
    *,
    model: str,
    out: str | Path,
    items: int = 24,
    quick: bool = False,
    seed: int = 0,
    console=None,
    progress: bool = True,
    only: tuple[str, ...] = CONTRACT_PROBES,
    batch: int = 1,
) -> dict:
    """Run the battery into ``out`` (resuming every probe directory), ``batch`` items at a time in the
    probes that batch them (``--batch-pairs``), and write the contract.

    Returns:
        the contract dict (also written to ``out/contract.json``).

    Raises:
        EventKVError: a probe directory made with other settings, or a probe/model error.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    steps = [s for s in plan(items, quick) if s.probe in only]
    jobs = []
    for s in steps:
        probe = get_probe(s.probe)(**s.options)
        jobs.append(
            (s, probe, out / s.probe, *open_run(probe, rt, model=model, items=s.items, seed=seed, out=out / s.probe))
        )
    write_json_atomic(
        out / "contract-manifest.json",
        {
            "model": model,
            "items": items,
            "quick": quick,
            "seed": seed,
            "dtype": str(getattr(rt.profile, "dtype", "")).removeprefix("torch."),
            "dtype_reason": getattr(rt.profile, "dtype_reason", ""),
            "device": rt.device,
            "device_reason": getattr(rt.profile, "device_reason", ""),
            "environment": environment(),
            "plan": [{"probe": s.probe, "options": probe.options(), "items": s.items} for s, probe, *_ in jobs],
        },
    )

    total = sum(s.items for s in steps)
    left = sum(len(j[4]) for j in jobs)
    with progress_bar(progress, console) as bar:
        task = bar.add_task("contract", total=total, completed=total - left) if bar else None
        for s, probe, d, manifest, todo in jobs:

            def describe(i: int, s=s) -> None:
                bar.update(task, description=f"contract: {s.probe} item {i + 1}/{s.items}")

            run_items(
                probe,
                rt,
                seed,
                d,
                manifest,
                todo,
                before=describe if bar else None,
                after=(lambda i: bar.advance(task)) if bar else None,
                batch=batch if probe.batches_items else 1,
            )
    summaries = {s.probe: render(out / s.probe) for s in steps}
    return write_contract(out, model, summaries, provenance(out, summaries), quick=quick)


def provenance(out: Path, probes) -> dict:
    """Model, dtype, seed and compute time of a contract directory, from its probes' manifests:
    ``{"dtype", "seed", "weights_digest", "seconds": {probe: s}, "total_seconds", "torch_threads":
    [...], "devices": [...]}`` (seconds summed over every invocation that computed items; the weights digest lets a
    memory check that a contract was measured on its own checkpoint)."""
    info: dict = {"seconds": {}, "torch_threads": set(), "devices": set()}
    for p in probes:
        m = json.loads((out / p / RUN_MANIFEST).read_text())
        info.setdefault("dtype", m["identity"].get("dtype"))
        info.setdefault("seed", m["identity"].get("seed"))
        info.setdefault("weights_digest", m["identity"].get("weights_digest"))
        inv = m.get("invocations", [])
        info["seconds"][p] = round(sum(i.get("seconds", 0) for i in inv), 1)
        info["torch_threads"] |= {i["torch_threads"] for i in inv if "torch_threads" in i}
        info["devices"] |= {i["device"] for i in inv if "device" in i}
    info["total_seconds"] = round(sum(info["seconds"].values()), 1)
    info["torch_threads"] = sorted(info["torch_threads"])
    info["devices"] = sorted(info["devices"])
    return info
