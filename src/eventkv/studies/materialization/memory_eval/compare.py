"""Two ``eventkv memory eval`` runs of the same questions compared arm by arm (``eventkv memory compare``): what
changes when one option of the memory changes and everything else stays -- rows stored as ``int4`` against
``native``, turns with their relative dates resolved against turns without.

Each question is paired across the runs (the same index, conversation, slot and category, and the same question
where both records quote it); for every arm both runs hold, the table gives each run's token F1 with its
cluster-bootstrap interval (categories 1-4, clusters = conversations), the paired difference B - A with its
interval, how many questions B answers better and worse, and Wilcoxon's signed-rank p on the differences
(:func:`eventkv.stats.wilcoxon_d`); with ``category`` only the questions of that LoCoMo category count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from eventkv.errors import EventKVError
from eventkv.probes.base import Table
from eventkv.studies.materialization.memory_eval.history import CATEGORIES


@dataclass(frozen=True)
class ArmComparison:
    """One arm of two runs: F1 of each (mean and 95% interval), the paired difference B - A, its interval,
    ``better`` / ``worse`` (questions where B's F1 is above / below A's), Wilcoxon's p (NaN when every
    difference is 0) and ``n`` paired questions."""

    arm: str
    f1_a: tuple[float, float, float]
    f1_b: tuple[float, float, float]
    diff: tuple[float, float, float]
    better: int
    worse: int
    wilcoxon_p: float
    n: int


def pair_records(a: Sequence[dict], b: Sequence[dict]) -> list[tuple[dict, dict]]:
    """The questions both runs answered, paired by index.

    Raises:
        EventKVError: a record of one run whose conversation, slot, category or question differs from the record of
            the same index in the other (the runs did not ask the same questions: compare runs of the same data,
            seed, conversations, questions per conversation, history length and categories).
    """
    by_index = {r["index"]: r for r in b if "arms" in r}
    out = []
    for r in a:
        other = by_index.get(r["index"])
        if "arms" not in r or other is None:
            continue
        for key in ("conversation", "slot", "category", "question"):
            if key in r and key in other and r[key] != other[key]:
                raise EventKVError(
                    f"question {r['index']} differs between the runs ({key} {r[key]!r} vs {other[key]!r}): compare "
                    "runs of the same data, seed, conversations, questions per conversation, max tokens and categories."
                )
        out.append((r, other))
    return out


def compare_runs(a: Sequence[dict], b: Sequence[dict], category: int | None = None) -> list[ArmComparison]:
    """Every arm both runs hold, compared on the paired questions of categories 1-4 (or of ``category``), in run
    A's arm order.

    Raises:
        EventKVError: as :func:`pair_records`; no question paired; a category outside 1-5.
    """
    import numpy as np

    from eventkv.stats import cluster_bootstrap, wilcoxon_d

    if category is not None and category not in CATEGORIES:
        raise EventKVError(f"category {category!r}: give one of {', '.join(map(str, CATEGORIES))}.")
    keep = (category,) if category is not None else (1, 2, 3, 4)
    pairs = [(x, y) for x, y in pair_records(a, b) if x["category"] in keep]
    if not pairs:
        raise EventKVError("the runs share no answered question of these categories: nothing to compare.")
    clusters = [x["conversation"] for x, _ in pairs]
    names = [n for n in pairs[0][0]["arms"] if all(n in x["arms"] and n in y["arms"] for x, y in pairs)]
    out = []
    for name in names:
        fa = [x["arms"][name]["f1"] for x, _ in pairs]
        fb = [y["arms"][name]["f1"] for _, y in pairs]
        d = [q - p for p, q in zip(fa, fb)]
        ba, bb, bd = cluster_bootstrap(fa, clusters), cluster_bootstrap(fb, clusters), cluster_bootstrap(d, clusters)
        test = wilcoxon_d(d, what=f"F1 {name}: B - A")
        out.append(
            ArmComparison(
                name,
                (ba.estimate, ba.low, ba.high),
                (bb.estimate, bb.low, bb.high),
                (bd.estimate, bd.low, bd.high),
                int(np.sum(np.array(d) > 0)),
                int(np.sum(np.array(d) < 0)),
                test.p_value,
                len(d),
            )
        )
    return out


def comparison_table(rows: Sequence[ArmComparison], label_a: str, label_b: str, category: int | None) -> Table:
    """The markdown table of :func:`compare_runs`."""
    from eventkv.stats import format_p

    def ci(t: tuple[float, float, float], sign: str = "") -> str:
        return f"{t[0]:{sign}.3f} [{t[1]:{sign}.3f}, {t[2]:{sign}.3f}]"

    which = f"category {category} ({CATEGORIES[category]})" if category is not None else "categories 1-4"
    return Table(
        f"Token F1, {label_a} (A) vs {label_b} (B), paired questions of {which} (cluster bootstrap 95%)",
        ["arm", f"A: {label_a}", f"B: {label_b}", "B - A", "better:worse", "Wilcoxon p", "n"],
        [
            [
                r.arm,
                ci(r.f1_a),
                ci(r.f1_b),
                ci(r.diff, "+"),
                f"{r.better}:{r.worse}",
                "n/a" if r.wilcoxon_p != r.wilcoxon_p else format_p(r.wilcoxon_p),
                str(r.n),
            ]
            for r in rows
        ],
    )


def compare_folders(
    a: str | Path, b: str | Path, *, category: int | None = None, label_a: str = "", label_b: str = ""
) -> str:
    """:func:`comparison_table` of two run folders' records, as markdown (labels default to the folder names), and
    a line counting the questions paired and those only one run answered (left out).

    Raises:
        EventKVError: a folder without records; as :func:`compare_runs`.
    """
    from eventkv.probes.runner import load_records

    runs = []
    for folder in (a, b):
        if not (Path(folder) / "records.jsonl").is_file():
            raise EventKVError(f"{str(folder)!r} holds no records.jsonl: give a memory eval's run folder (its --out).")
        runs.append(load_records(folder))
    table = comparison_table(
        compare_runs(runs[0], runs[1], category), label_a or Path(a).name, label_b or Path(b).name, category
    )
    paired = len(pair_records(runs[0], runs[1]))
    alone = [sum("arms" in r for r in run) - paired for run in runs]
    return (
        f"{table.to_markdown()}\n\n{paired} questions answered in both runs (every category); answered in A only: "
        f"{alone[0]}, in B only: {alone[1]} (left out)."
    )
