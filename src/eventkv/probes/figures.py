"""Figures of probe records (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from eventkv.stats import wilson

OUTCOME_COLORS = {"follow": "#2b8cbe", "anti": "#e34a33", "constant": "#999999", "other": "#dddddd"}


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> Path:
    """Lay out ``fig``, write it to ``path`` (PNG, 110 dpi), close it and return the path."""
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


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
