"""Figures of splice records (matplotlib, Agg backend): accuracy vs layer cutoff per arm with
Wilson 95% bands and the clean line, and a cutoff x decoding-step heatmap of the scaffold arm."""

from __future__ import annotations

from pathlib import Path

from eventkv.probes.figures import pyplot, save_figure

ARM_COLORS = {
    "scaffold": "#2b8cbe",
    "zero-kv": "#e34a33",
    "zero-k": "#fdae6b",
    "zero-v": "#a63603",
    "mask": "#31a354",
    "mean": "#756bb1",
}


def accuracy_figure(table: dict, path: str | Path) -> Path:
    """One panel per decoding step: accuracy vs cutoff for each arm (line + Wilson band), clean as a
    horizontal line with its band. ``table`` is the probe's cell table
    (:func:`eventkv.studies.splice.probe.cell_table` of the records)."""
    from eventkv.stats import wilson

    plt = pyplot()
    keys = [k for k in table if len(k) == 3]
    arms = list(dict.fromkeys(k[0] for k in keys))
    steps = sorted({k[2] for k in keys})
    cutoffs = sorted({k[1] for k in keys})
    clean = wilson(table[("clean",)]["k"], table[("clean",)]["n"])
    fig, axes = plt.subplots(1, len(steps), figsize=(6.5 * len(steps), 4.2), squeeze=False)
    for ax, t in zip(axes[0], steps):
        ax.axhspan(clean.low, clean.high, color="#999999", alpha=0.2)
        ax.axhline(clean.rate, color="black", linestyle="--", linewidth=1, label=f"clean {clean.rate:.2f}")
        for a in arms:
            ps = [wilson(table[(a, c, t)]["k"], table[(a, c, t)]["n"]) for c in cutoffs]
            color = ARM_COLORS.get(a)
            ax.plot(cutoffs, [p.rate for p in ps], marker="o", markersize=3, label=a, color=color)
            ax.fill_between(cutoffs, [p.low for p in ps], [p.high for p in ps], alpha=0.15, color=color)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("layer cutoff (span spliced in layers >= cutoff)")
        ax.set_ylabel(f"accuracy (n={clean.n}), Wilson 95%")
        ax.set_title(f"splice from decoding step {t}")
        ax.legend(fontsize=8, loc="lower right")
    return save_figure(fig, path)


def heatmap_figure(table: dict, path: str | Path, arm: str = "scaffold") -> Path | None:
    """Accuracy of ``arm`` over cutoff (x) x decoding step (y), from the probe's cell table; None (no
    file) when the arm was not run."""
    keys = [k for k in table if len(k) == 3 and k[0] == arm]
    if not keys:
        return None
    plt = pyplot()
    steps = sorted({k[2] for k in keys})
    cutoffs = sorted({k[1] for k in keys})
    grid = [[table[(arm, c, t)]["k"] / table[(arm, c, t)]["n"] for c in cutoffs] for t in steps]
    clean = table[("clean",)]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * len(cutoffs) + 2), max(2.2, 0.5 * len(steps) + 1.5)))
    im = ax.imshow(grid, aspect="auto", origin="lower", vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(len(cutoffs)), [str(c) for c in cutoffs], fontsize=7)
    ax.set_yticks(range(len(steps)), [str(t) for t in steps])
    ax.set_xlabel("layer cutoff")
    ax.set_ylabel("decoding step")
    ax.set_title(f"{arm}: accuracy (clean {clean['k']}/{clean['n']})")
    fig.colorbar(im, ax=ax)
    return save_figure(fig, path)
