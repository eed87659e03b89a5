"""Figures of the first study's probe records (matplotlib, Agg backend: no display needed):
donor-pair outcome rates and d; the contract probes' write-through vs comprehension over the 16
trigger constructions, access recovery vs chance by cardinality, patch vs re-prefill time against L,
and per-arm follow-rate bars (Study 1, "The memory contract", "Updates")."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from eventkv.probes.figures import pyplot, save_figure
from eventkv.stats import wilson

OUTCOME_COLORS = {"follow": "#2b8cbe", "anti": "#e34a33", "constant": "#999999", "other": "#dddddd"}


def donor_pair_figure(records: Sequence[dict], path: str | Path) -> Path:
    """Two panels: (left) per arm and readout, the rate of each outcome with its Wilson 95%
    interval; (right) the distribution of d per arm (strip + box), when candidate scores exist."""
    plt = pyplot()

    n = len(records)
    cells = list(records[0]["outcomes"].items())
    labels = [f"{arm}\n{ro}" for arm, ros in cells for ro in ros]
    keys = [(arm, ro) for arm, ros in cells for ro in ros]
    has_d = bool(records[0].get("d"))
    fig, axes = plt.subplots(1, 2 if has_d else 1, figsize=(12 if has_d else 7, 4.2), squeeze=False)
    ax = axes[0, 0]
    width = 0.8 / 4
    for j, o in enumerate(("follow", "anti", "constant", "other")):
        xs, ys, lo, hi = [], [], [], []
        for x, (arm, ro) in enumerate(keys):
            k = sum(1 for r in records if r["outcomes"][arm][ro] == o)
            p = wilson(k, n)
            xs.append(x + (j - 1.5) * width)
            ys.append(p.rate)
            lo.append(p.rate - p.low)
            hi.append(p.high - p.rate)
        ax.bar(
            xs, ys, width, yerr=[lo, hi], capsize=2, label=o, color=OUTCOME_COLORS[o], edgecolor="black", linewidth=0.4
        )
    ax.set_xticks(range(len(keys)), labels, fontsize=8)
    ax.set_ylim(0, 1.2)
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_ylabel(f"fraction of pairs (n={n}), Wilson 95%")
    ax.set_title("donor-pair outcomes")
    ax.legend(fontsize=8, ncol=4, loc="upper center")
    if has_d:
        ax = axes[0, 1]
        arms = list(records[0]["d"])
        data = [[r["d"][a] for r in records] for a in arms]
        ax.boxplot(data, showfliers=False)
        for i, ds in enumerate(data, start=1):
            jitter = [(((k * 7919) % 100) / 100 - 0.5) * 0.3 for k in range(len(ds))]
            ax.scatter([i + j for j in jitter], ds, s=10, alpha=0.6, color="#2b8cbe")
        ax.set_xticks(range(1, len(arms) + 1), arms)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_ylabel("d (nats): log-odds toward the omitted source")
        ax.set_title("distribution of d")
    return save_figure(fig, path)


def trigger_scatter(data: dict, path) -> Path:
    """Left: write-through (y) vs comprehension (x) per construction (primary readout), Wilson 95%
    bars; mirror family circles, flag family squares; the diagonal is 'writes what it
    comprehends'. Constructions at the same point share one stacked label. Right (when the
    candidate readout was run): the graded write-through, median kv donor shift d per
    construction (nats), starred where the sign test on d gives p < .05."""
    plt = pyplot()
    ro = data["primary"]
    graded = {k: v["logits"] for k, v in data["constructions"].items() if "median_d" in v.get("logits", {})}
    fig, axes = plt.subplots(1, 2 if graded else 1, figsize=(12.4 if graded else 8.4, 5.6), squeeze=False)
    ax = axes[0][0]
    at: dict = {}
    for fam, marker in (("mirror", "o"), ("flag", "s")):
        xs: list[float] = []
        ys: list[float] = []
        xe: list[list[float]] = [[], []]
        ye: list[list[float]] = [[], []]
        for phrase, per in data["constructions"].items():
            row = per.get(ro)
            if not row or row["family"] != fam or "comprehension" not in row:
                continue
            c, w = row["comprehension"], row["write_through"]
            xs.append(c["rate"])
            ys.append(w["rate"])
            xe[0].append(c["rate"] - c["low"])
            xe[1].append(c["high"] - c["rate"])
            ye[0].append(w["rate"] - w["low"])
            ye[1].append(w["high"] - w["rate"])
            at.setdefault((round(c["rate"], 6), round(w["rate"], 6)), []).append(phrase)
        if xs:
            ax.errorbar(xs, ys, xerr=xe, yerr=ye, fmt=marker, capsize=2, alpha=0.8, label=f"{fam} family")
    number = {k: i + 1 for i, k in enumerate(data["constructions"])}  # short labels; the key is in the title/ticks
    for (x, y), names in at.items():
        low = y < 0.5  # labels of low points go above them, of high points below
        ax.annotate(
            ",".join(str(number[n]) for n in names),
            (x, y),
            fontsize=7,
            xytext=(3, 4 if low else -4),
            textcoords="offset points",
            va="bottom" if low else "top",
            ha="right" if x > 0.7 else "left",
        )
    if not graded:
        ax.text(
            1.02, 0.5, "\n".join(f"{i} {k}" for k, i in number.items()), transform=ax.transAxes, fontsize=6, va="center"
        )
    ax.plot([0, 1], [0, 1], color="grey", linewidth=0.7, linestyle="--")
    ax.set_xlim(-0.05, 1.05), ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("comprehension rate (text arm)")
    ax.set_ylabel("write-through rate (kv, served {decoy, carrier})")
    ax.set_title(f"trigger bank ({ro} readout, Wilson 95%; numbers: constructions)")
    ax.legend(fontsize=8, loc="upper left")
    if graded:
        ax = axes[0][1]
        names = list(graded)
        med = [graded[k]["median_d"] for k in names]
        colors = ["tab:blue" if graded[k]["family"] == "mirror" else "tab:orange" for k in names]
        ax.barh(range(len(names)), med, color=colors, alpha=0.85)
        for i, k in enumerate(names):
            if graded[k]["p_d"] < 0.05:
                ax.annotate("*", (med[i], i), xytext=(3 if med[i] >= 0 else -9, -4), textcoords="offset points")
        ax.axvline(0, color="black", linewidth=0.7)
        ax.set_yticks(range(len(names)), [f"{number[k]} {k}" for k in names], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("median kv donor shift d (nats; > 0 leans to the unserved source)")
        ax.set_title("graded write-through (* sign test on d, p < .05)")
    return save_figure(fig, path)


def access_figure(data: dict, path) -> Path:
    """Recovery (kv and text, primary readout) per payload cardinality with Wilson 95% bars, and
    the chance rate of each as a short black line."""
    plt = pyplot()
    ro = data["primary"]
    rec = data["recovery"]
    cards = [c for c in ("binary", "compass", "phonetic", "number") if f"{c}/kv/{ro}" in rec]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for j, arm in enumerate(("kv", "text")):
        xs, ys, lo, hi = [], [], [], []
        for i, c in enumerate(cards):
            r = rec[f"{c}/{arm}/{ro}"]["rate"]
            xs.append(i + (j - 0.5) * 0.35)
            ys.append(r["rate"])
            lo.append(r["rate"] - r["low"])
            hi.append(r["high"] - r["rate"])
        ax.bar(xs, ys, 0.35, yerr=[lo, hi], capsize=3, label=arm, edgecolor="black", linewidth=0.4)
    for i, c in enumerate(cards):
        ch = rec[f"{c}/kv/{ro}"]["chance"]
        ax.hlines(ch, i - 0.4, i + 0.4, color="black", linewidth=1.5, label="chance" if i == 0 else None)
    names = {
        "binary": "binary (2)",
        "compass": "compass (4)",
        "phonetic": "phonetic (8)",
        "number": "3-digit\n(first digit)" if ro == "logits" else "3-digit\n(exact)",
    }
    ax.set_xticks(range(len(cards)), [names[c] for c in cards])
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("recovery per answer (Wilson 95%)")
    ax.set_title(f"access: recovery vs chance by cardinality ({ro} readout)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def patch_figure(data: dict, path) -> Path:
    """Patch vs re-prefill time (ms) against L (tokens), log-log axes, with slope-1 and slope-2
    guides through the first re-prefill point."""
    plt = pyplot()
    pts = [v for k, v in data["timing"].items() if not k.startswith("slope/")]
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    if pts:
        L = [p["L_tokens"] for p in pts]
        ax.loglog(L, [p["rewrite_ms"] for p in pts], "o-", label="re-prefill rewritten history (attention O(L^2))")
        ax.loglog(L, [p["patch_ms"] for p in pts], "s-", label="append patch event (attention O(pL + p^2))")
        x0, y0 = L[0], pts[0]["rewrite_ms"]
        for k, style in ((1, ":"), (2, "--")):
            ax.loglog([x0, L[-1]], [y0, y0 * (L[-1] / x0) ** k], style, color="grey", linewidth=0.8, label=f"slope {k}")
    ax.set_xlabel("history length L (tokens)")
    ax.set_ylabel("wall time (ms)")
    ax.set_title("updates: patch vs recompute")
    if pts:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no timings recorded (run with --timing)", ha="center", va="center", transform=ax.transAxes)
    return save_figure(fig, path)


def arm_bars(records: Sequence[dict], arms: Sequence[str], readout: str, title: str, path) -> Path:
    """Follow rate and anti rate per arm (one readout), Wilson 95% bars."""
    from eventkv.stats import wilson

    plt = pyplot()
    n = len(records)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(arms) + 2), 4.2))
    for j, o in enumerate(("follow", "anti")):
        xs, ys, lo, hi = [], [], [], []
        for i, a in enumerate(arms):
            p = wilson(sum(1 for r in records if r["outcomes"][a][readout] == o), n)
            xs.append(i + (j - 0.5) * 0.35)
            ys.append(p.rate)
            lo.append(p.rate - p.low)
            hi.append(p.high - p.rate)
        ax.bar(xs, ys, 0.35, yerr=[lo, hi], capsize=2, label=o, edgecolor="black", linewidth=0.4)
    ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel(f"fraction of pairs (n={n}), Wilson 95%")
    ax.set_title(f"{title} ({readout} readout)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)
