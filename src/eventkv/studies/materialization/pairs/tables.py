"""Donor-pair statistics and tables over records (Study 1, "Donor pair"): per arm and readout the
outcome counts, follow rate and prevalence with Wilson intervals and the sign test follow vs anti
(:func:`pair_stats`, :func:`arm_table`), the graded donor shift d with its sign and Wilcoxon
tests (:func:`d_stats`, :func:`d_table`), and the two together (:func:`outcome_tables`)."""

from __future__ import annotations

from typing import Sequence

from eventkv.studies.materialization.pairs.arms import PairArm
from eventkv.studies.materialization.pairs.scoring import OUTCOME_COLUMNS, OUTCOMES


def pair_stats(records: Sequence[dict], arm: str, readout: str) -> dict:
    """Donor-pair statistics of one arm and readout over records (Study 1, "Donor pair"):
    outcome counts, the follow rate (pairs where both variants answered their own donor's value)
    with its Wilson 95% interval, prevalence (follow + anti), and the exact sign test follow vs anti."""
    from eventkv.stats import sign_test, wilson

    rs = [r for r in records if arm in r["outcomes"] and readout in r["outcomes"][arm]]
    c = {o: sum(1 for r in rs if r["outcomes"][arm][readout] == o) for o in OUTCOMES}
    n = len(rs)
    st = sign_test(c["follow"], c["anti"], ("follow", "anti"), name=f"{arm}/{readout}: exact sign test, follow vs anti")
    return {"n": n, **c, "rate": wilson(c["follow"], n), "prevalence": wilson(c["follow"] + c["anti"], n), "sign": st}


def primary_readout(readouts: Sequence[str]) -> str:
    """The readout contract figures are quoted on: candidate logits when run (Study 1: on older
    checkpoints free generation under-reports what the candidate probe finds), else generation."""
    return "logits" if "logits" in readouts else "generate"


def arm_table(
    records: Sequence[dict], arms: Sequence[PairArm], readouts: Sequence[str], caption: str, data: dict | None = None
):
    """One row per arm and readout: pairs, follow, anti, constant, other, the follow rate and the
    prevalence (follow + anti) with Wilson 95% intervals, and the exact sign test follow vs anti.
    Fills ``data[f"{arm}/{readout}"]`` when given."""
    from eventkv.probes.base import Table
    from eventkv.stats import format_p

    rows = []
    for a in arms:
        for ro in readouts:
            s = pair_stats(records, a.name, ro)
            if data is not None:
                data[f"{a.name}/{ro}"] = {
                    "n": s["n"],
                    "follow": s["follow"],
                    "anti": s["anti"],
                    "constant": s["constant"],
                    "other": s["other"],
                    "rate": s["rate"].__dict__,
                    "prevalence": s["prevalence"].__dict__,
                    "p": s["sign"].p_value,
                }
            rows.append(
                [
                    a.name,
                    ro,
                    str(s["n"]),
                    str(s["follow"]),
                    str(s["anti"]),
                    str(s["constant"]),
                    str(s["other"]),
                    s["rate"].describe(2),
                    s["prevalence"].describe(2),
                    format_p(s["sign"].p_value),
                ]
            )
    return Table(
        caption,
        [*OUTCOME_COLUMNS, "follow rate [Wilson 95%]", "sensitive [Wilson 95%]", "p (follow vs anti)"],
        rows,
    )


def d_stats(records: Sequence[dict], arm: str) -> dict | None:
    """Graded donor sensitivity of one arm (candidate readout): the donor statistic ``d`` of every
    pair (:func:`donor_d`, nats; d > 0 leans toward each variant's own
    unserved value), its median, the exact sign test d > 0 vs d < 0 (zeros dropped) and the
    two-sided Wilcoxon signed-rank test (``scipy.stats.wilcoxon``). ``None`` when no record has a
    ``d`` for ``arm`` (generation-only runs)."""
    from eventkv.stats import median, require_finite, sign_test_d, wilcoxon_d

    with_d = [(r.get("index", i), r["d"][arm]) for i, r in enumerate(records) if arm in r.get("d", {})]
    ds = require_finite(
        [x for _, x in with_d], f"donor statistic d of arm {arm!r}", labels=[f"item {i}" for i, _ in with_d]
    )
    if not ds:
        return None
    s, w = sign_test_d(ds), wilcoxon_d(ds)
    return {
        "n": len(ds),
        "median": median(ds),
        "pos": s.counts["d>0"],
        "neg": s.counts["d<0"],
        "zero": s.counts["d=0 dropped"],
        "sign_p": s.p_value,
        "wilcoxon_p": w.p_value,
    }


def describe_d(s: dict) -> str:
    """``d>0:d<0 = 27:5, median +0.125 nats`` for a :func:`d_stats` dict."""
    return f"d>0:d<0 = {s['pos']}:{s['neg']}, median {round(s['median'], 3) + 0.0:+.3f} nats"


def d_table(records: Sequence[dict], arms: Sequence[PairArm], caption: str, data: dict | None = None):
    """One row per arm with a candidate readout: pairs, median d, d>0, d<0, d=0, sign-test and
    Wilcoxon p (see :func:`d_stats`); fills ``data[f"d/{arm}"]``. ``None`` when no arm has d."""
    from eventkv.probes.base import Table
    from eventkv.stats import format_p

    rows = []
    for a in arms:
        s = d_stats(records, a.name)
        if s is None:
            continue
        if data is not None:
            data[f"d/{a.name}"] = s
        rows.append(
            [
                a.name,
                str(s["n"]),
                f"{round(s['median'], 3) + 0.0:+.3f}",
                str(s["pos"]),
                str(s["neg"]),
                str(s["zero"]),
                format_p(s["sign_p"]),
                format_p(s["wilcoxon_p"]),
            ]
        )
    if not rows:
        return None
    return Table(caption, ["arm", "pairs", "median d (nats)", "d>0", "d<0", "d=0", "p sign", "p Wilcoxon"], rows)


D_CAPTION = (
    "Graded donor shift d (candidate log-odds of each variant's own value, own minus other variant, nats; "
    "d > 0 leans toward the unserved source)"
)


def outcome_tables(
    records: Sequence[dict],
    arms: Sequence[PairArm],
    readouts: Sequence[str],
    caption: str,
    data: dict | None = None,
    d_caption: str = D_CAPTION,
) -> list:
    """A pair probe's outcome tables: :func:`arm_table` (``caption``), then :func:`d_table`
    (``d_caption``, default :data:`D_CAPTION`) when an arm has d. Fills ``data`` as both do."""
    tables = [arm_table(records, arms, readouts, caption, data)]
    dt = d_table(records, arms, d_caption, data)
    return tables + ([dt] if dt else [])
