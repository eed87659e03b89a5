"""The report of ``eventkv memory eval`` (:mod:`eventkv.studies.materialization.memory_eval`) from its records:
the statistics and tables of :func:`summarize_memory_eval` (``docs/memory.md``) and the figure drawn from
them (:func:`memory_eval_figure`)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from eventkv.probes.base import Summary, Table
from eventkv.studies.materialization.memory_eval.arms import ARM_KINDS, CONTROL_KINDS, arm_spec, budget_label, parse_arm
from eventkv.studies.materialization.memory_eval.history import CATEGORIES

#: the headline's budget (PROTOCOLS.md: "F1(rows at 10 %) / F1(full)")
HEADLINE_BUDGET = 0.1


class _Ordered(Protocol):
    """What the summary reads of its probe (:class:`~eventkv.studies.materialization.memory_eval.MemoryEval`): the
    order the text and ``/contiguous`` arms served their sets in (``"log"`` or ``"relevance"``)."""

    order: str


def _count(n: int, noun: str) -> str:
    """``"1 question"``, ``"3 questions"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _with_ci(b) -> str:
    """``mean [low, high]`` of a cluster bootstrap; with one cluster there is no interval to give."""
    return "n/a" if b is None else b.interval(single="one conversation")


#: the bins of "F1 against the number of served turns": (fewest, most) turns, None: no upper bound
TURN_BINS: tuple[tuple[int, int | None], ...] = ((1, 5), (6, 10), (11, 20), (21, 40), (41, 80), (81, None))


def _served_turns(ids: Sequence[str]) -> list[str]:
    """The turns among served event ids: every id but the session headers' (``session-N``, as
    :func:`history_events` names them)."""
    return [i for i in ids if not i.startswith("session-")]


def _bin_label(low: int, high: int | None) -> str:
    return f"{low}+" if high is None else f"{low}-{high}"


def _f1_by_turns(pairs: Sequence[tuple[int, float]]) -> dict[str, dict]:
    """Mean F1 and count of ``(served turns, F1)`` pairs per :data:`TURN_BINS` bin, by label
    (``"1-5"``, ..., ``"81+"``), in bin order; a bin no pair falls in is left out, as are pairs with no turn."""
    out = {}
    for low, high in TURN_BINS:
        xs = [f for n, f in pairs if n >= low and (high is None or n <= high)]
        if xs:
            out[_bin_label(low, high)] = {"f1": float(np.mean(xs)), "n": len(xs)}
    return out


def _percentiles(xs: Sequence[float]) -> tuple[float, float]:
    p50, p95 = (float(x) for x in np.percentile(xs, [50, 95]))
    return p50, p95


def _arm_order(names) -> list[str]:
    """Arm names in table order: by budget (full and gold last), then rows before the control kinds."""
    kinds = {k: i for i, k in enumerate(ARM_KINDS)}
    first: dict[str, int] = {}
    for i, n in enumerate(names):
        first.setdefault(n, i)

    def key(n: str):
        a = parse_arm(n)
        return (a.budget is None, a.budget or 0, kinds.get(a.kind, 9), first[n])

    return sorted(first, key=key)


def summarize_memory_eval(records: Sequence[dict], probe: _Ordered | None = None) -> Summary:
    """Tables (``docs/memory.md``): the headline, F1 / EM per arm (categories 1-4, cluster-bootstrap
    95% intervals; per category; category 5 apart), paired differences per budget (rows - text, rows -
    isolated, rows - blend for the controls, rows - full for every selector; with both positions
    modes, contiguous - original), cost per arm (rows, served fraction, KV bytes, latency p50/p95,
    tokens), evidence recall and precision and served turns per selector and budget (precision: the
    evidence turns served over the turns served, session headers not counted; over the questions with a
    turn served), and the rows arms' F1 against the number of turns served (:data:`TURN_BINS`; every rows
    arm pooled, and per positions mode when both are present; ``gold`` for reference)."""
    from eventkv.stats import cluster_bootstrap, cluster_bootstrap_ratio, format_p, wilcoxon_d, wilson

    done = [r for r in records if "arms" in r]
    main = [r for r in done if r["category"] in (1, 2, 3, 4)]
    adversarial = [r for r in done if r["category"] == 5]
    arms = _arm_order([a for r in done for a in r["arms"]])
    arms = [a for a in arms if all(a in r["arms"] for r in done)]
    specs = {a: parse_arm(a) for a in arms}
    clusters = [r["conversation"] for r in main]
    data: dict = {
        "n_questions": len(main),
        "n_adversarial": len(adversarial),
        "n_skipped": len(records) - len(done),
        "n_conversations": len(set(clusters)),
        "f1": {},
        "em": {},
        "paired": {},
        "abstention": {},
        "cost": {},
        "latency_ms": {},
        "recall": {},
        "precision": {},
        "served_turns": {},
        "f1_by_turns": {},
        "headline": None,
        "reach_text": {},
        "n_empty": {},
    }

    def f1s(a: str) -> list[float]:
        return [r["arms"][a]["f1"] for r in main]

    rows = []
    for a in arms:
        f1 = f1s(a)
        em = [float(r["arms"][a]["em"]) for r in main]
        b = cluster_bootstrap(f1, clusters) if f1 else None
        data["f1"][a] = b.__dict__ if b else None
        data["em"][a] = float(np.mean(em)) if em else None
        data["n_empty"][a] = sum(bool(r["arms"][a].get("empty")) for r in done)
        by_cat = []
        for c in (1, 2, 3, 4):
            xs = [r["arms"][a]["f1"] for r in main if r["category"] == c]
            by_cat.append(f"{np.mean(xs):.3f} ({len(xs)})" if xs else "n/a")
        adv = [r["arms"][a]["f1"] for r in adversarial]
        chose = [r["arms"][a]["abstains"] for r in adversarial if "abstains" in r["arms"][a]]
        if chose:
            w = wilson(sum(chose), len(chose))
            data["abstention"][a] = {"k": w.k, "n": w.n, "rate": w.rate, "low": w.low, "high": w.high}
        rows.append(
            [
                a,
                _with_ci(b),
                f"{np.mean(em):.3f}" if em else "n/a",
                *by_cat,
                f"{np.mean(adv):.3f} ({len(adv)})" if adv else "n/a",
                wilson(sum(chose), len(chose)).describe(2) if chose else "n/a",
            ]
        )
    f1_table = Table(
        "Token F1 by arm (categories 1-4; cluster bootstrap 95%, clusters = conversations)",
        [
            "arm",
            "F1 [95%]",
            "EM",
            *[f"{c} {CATEGORIES[c]} (n)" for c in (1, 2, 3, 4)],
            "5: answer abstains (n)",
            "5: chooses 'not mentioned' [Wilson 95%]",
        ],
        rows,
    )

    # ---- paired differences, per budget
    pairs: list[tuple[str, str]] = []
    for a, s in specs.items():
        if s.kind != "rows":
            continue
        for kind in CONTROL_KINDS:
            other = arm_spec(kind, s.selector, s.budget, s.positions).name
            if other in specs:
                pairs.append((a, other))
        if "full" in specs:
            pairs.append((a, "full"))
        if s.positions == "contiguous" and arm_spec("rows", s.selector, s.budget).name in specs:
            pairs.append((a, arm_spec("rows", s.selector, s.budget).name))
    paired_rows = []
    for a, other in pairs if main else []:
        diff = [x - y for x, y in zip(f1s(a), f1s(other))]
        b = cluster_bootstrap(diff, clusters)
        test = wilcoxon_d(diff, what=f"F1 {a} - {other}")
        better, worse = sum(x > 0 for x in diff), sum(x < 0 for x in diff)
        data["paired"][f"{a} - {other}"] = {
            **b.__dict__,
            "wilcoxon_p": test.p_value,
            "n_nonzero": test.counts["n"],
            "better": better,
            "worse": worse,
        }
        budget = specs[a].budget
        paired_rows.append(
            [
                budget_label(budget) if budget is not None else "",
                f"{a} - {other}",
                f"{b.estimate:+.3f}",
                "n/a" if b.n_clusters < 2 else f"[{b.low:+.3f}, {b.high:+.3f}]",
                f"{better}:{worse}",
                "n/a" if test.p_value != test.p_value else format_p(test.p_value),
                str(len(diff)),
            ]
        )

    # ---- cost
    cost_rows = []
    timed = [r for r in done if "serve" in r.get("timing", {})]
    for a in arms:
        n = [r["arms"][a]["rows"] for r in done]
        frac = [r["arms"][a]["fraction"] for r in done]
        kv = [r["arms"][a]["kv_bytes"] for r in done]
        toks = [r["arms"][a]["n_tokens"] for r in done]
        data["cost"][a] = {
            "rows": float(np.mean(n)),
            "fraction": float(np.mean(frac)),
            "kv_bytes": float(np.mean(kv)),
            "n_tokens": float(np.mean(toks)),
        }
        serve = [r["timing"]["serve"][a] for r in timed if a in r["timing"]["serve"]]
        readout = [r["timing"]["readout"][a] for r in timed if a in r["timing"]["readout"]]
        lat = ["", "", "", ""]
        if serve:
            s50, s95 = _percentiles(serve)
            r50, r95 = _percentiles(readout)
            data["latency_ms"][a] = {"serve_p50": s50, "serve_p95": s95, "readout_p50": r50, "readout_p95": r95}
            lat = [f"{s50:.0f}", f"{s95:.0f}", f"{r50:.0f}", f"{r95:.0f}"]
        cost_rows.append(
            [
                a,
                f"{np.mean(n):.0f}",
                f"{100 * np.mean(frac):.1f}%",
                f"{np.mean(kv) / 2**20:.2f}",
                *lat,
                f"{np.mean(toks):.1f}",
                str(len(done)),
            ]
        )

    # ---- evidence recall and precision of each selector's served sets
    recall_rows = []
    keys = list(dict.fromkeys(k for r in main for k in r.get("selection", {})))
    for key in keys:
        got = [r for r in main if key in r["selection"]]
        rec = [r["selection"][key]["recall"] for r in got]
        b = cluster_bootstrap(rec, [r["conversation"] for r in got])
        frac = [r["selection"][key]["rows"] / r["history_rows"] for r in got]
        data["recall"][key] = {**b.__dict__, "fraction": float(np.mean(frac))}
        turns = [(r, _served_turns(r["selection"][key]["ids"])) for r in got]
        served = [(r, t) for r, t in turns if t]  # precision of a set without a turn is undefined: left out
        prec = [len(set(t) & set(r["evidence"])) / len(t) for r, t in served]
        bp = cluster_bootstrap(prec, [r["conversation"] for r, _ in served]) if prec else None
        data["precision"][key] = bp.__dict__ if bp else None
        data["served_turns"][key] = float(np.mean([len(t) for _, t in turns]))
        selector, _, label = key.rpartition("@")
        recall_rows.append(
            [
                selector,
                label,
                _with_ci(b),
                _with_ci(bp) + ("" if len(prec) == len(rec) else f" (n={len(prec)})"),
                f"{data['served_turns'][key]:.1f}",
                f"{100 * np.mean(frac):.1f}%",
                str(len(rec)),
            ]
        )

    # ---- F1 of the rows arms against the number of turns their served set held
    by_mode: dict[str, list[tuple[int, float]]] = {}  # positions mode -> (served turns, F1) per question and arm
    for a, s in specs.items():
        if s.kind != "rows":
            continue
        key = f"{s.selector}@{budget_label(s.budget or 0)}"
        for r in main:
            if key in r.get("selection", {}):
                n_turns = len(_served_turns(r["selection"][key]["ids"]))
                by_mode.setdefault(s.positions, []).append((n_turns, r["arms"][a]["f1"]))
    pooled = [p for ps in by_mode.values() for p in ps]
    n_empty = sum(n == 0 for n, _ in pooled)
    data["f1_by_turns"] = {
        "all": _f1_by_turns(pooled),
        "positions": {m: _f1_by_turns(ps) for m, ps in by_mode.items()},
        "n_empty": n_empty,
        "gold": None,
    }
    turns_rows = [[label, f"{v['f1']:.3f}", str(v["n"])] for label, v in data["f1_by_turns"]["all"].items()]
    if turns_rows and "gold" in specs:
        gold_turns = [len(set(r["evidence"])) for r in main]
        gold = {"f1": float(np.mean(f1s("gold"))), "served_turns": float(np.mean(gold_turns)), "n": len(main)}
        data["f1_by_turns"]["gold"] = gold
        turns_rows.append(
            [f"gold (evidence: {gold['served_turns']:.1f} turns, mean)", f"{gold['f1']:.3f}", str(len(main))]
        )
    modes = [m for m in ("original", "contiguous") if m in by_mode]
    mode_rows = []
    if len(modes) == 2:
        per_mode = data["f1_by_turns"]["positions"]
        for low, high in TURN_BINS:
            label = _bin_label(low, high)
            cells = [per_mode[m].get(label) for m in modes]
            if any(cells):
                mode_rows.append([label, *(f"{c['f1']:.3f} ({c['n']})" if c else "" for c in cells)])

    # ---- headline: the best selector's rows at the headline budget, over full; where rows reach text
    headline_rows = []
    budgets = sorted({s.budget for s in specs.values() if s.kind == "rows" and s.budget is not None})
    if main and budgets:
        at = min(budgets, key=lambda b: (abs(b - HEADLINE_BUDGET), b))
        candidates = [a for a, s in specs.items() if s.kind == "rows" and s.budget == at]
        best = max(candidates, key=lambda a: (float(np.mean(f1s(a))), -arms.index(a)))
        line = [f"best rows at {budget_label(at)}", best, f"{np.mean(f1s(best)):.3f}"]
        if "full" in specs:
            ratio = cluster_bootstrap_ratio(f1s(best), f1s("full"), clusters)
            data["headline"] = {"arm": best, "budget": at, "f1": float(np.mean(f1s(best))), **ratio.__dict__}
            data["headline"]["full_f1"] = float(np.mean(f1s("full")))
            line.append(f"{data['headline']['full_f1']:.3f}")
            full_zero = data["headline"]["full_f1"] == 0
            line.append("n/a (full F1 is 0)" if full_zero else ratio.interval(single="one conversation"))
        else:
            data["headline"] = {"arm": best, "budget": at, "f1": float(np.mean(f1s(best)))}
            line += ["n/a", "n/a"]
        headline_rows.append(line)
    reach_rows = []
    for sel in dict.fromkeys(s.selector for s in specs.values() if s.kind == "text" and main):
        reached = None
        for bud in budgets:
            t_name = arm_spec("text", sel, bud).name
            r_name = next(
                (
                    n
                    for n in (arm_spec("rows", sel, bud).name, arm_spec("rows", sel, bud, "contiguous").name)
                    if n in specs
                ),
                "",
            )
            rows_f1 = np.mean(f1s(r_name)) if r_name else 0.0
            if r_name and t_name in specs and rows_f1 > 0 and rows_f1 >= np.mean(f1s(t_name)):  # 0 = 0 is no reach
                reached = bud
                break
        data["reach_text"][sel] = reached
        reach_rows.append(
            [f"rows reach text ({sel})", budget_label(reached) if reached else "at no budget", "", "", ""]
        )

    tables = []
    if headline_rows or reach_rows:
        tables.append(
            Table(
                "Headline: F1 of the best selector's rows at the budget nearest 10% as a fraction of full "
                "(ratio of means, cluster bootstrap 95%); the smallest budget at which rows' mean F1 reaches text's",
                ["", "arm / budget", "F1", "full F1", "rows / full [95%]"],
                headline_rows + reach_rows,
            )
        )
    tables.append(f1_table)
    if paired_rows:
        tables.append(
            Table(
                "Paired F1 differences per budget (same questions)",
                [
                    "budget",
                    "difference",
                    "mean",
                    "95% CI (cluster bootstrap)",
                    "better:worse",
                    "Wilcoxon p (questions)",
                    "n",
                ],
                paired_rows,
            )
        )
    batched = bool(timed) and any(max(r["timing"].get("batch", {"": 1}).values()) > 1 for r in timed)
    tables.append(
        Table(
            "Cost per arm (rows and served fraction: header excluded; KV: the served cache, header included; "
            "latency in ms, wall clock, the one global prefill excluded"
            + ("; arms read out in one batch share the readout time)" if batched else ")"),
            [
                "arm",
                "rows (mean)",
                "served fraction",
                "KV MiB (mean)",
                "serve p50",
                "serve p95",
                "readout p50",
                "readout p95",
                "tokens generated (mean)",
                "n",
            ],
            cost_rows,
        )
    )
    if recall_rows:
        tables.append(
            Table(
                "Evidence recall and precision of each selector's served set (recall: the fraction of the question's "
                "evidence turns served; precision: the fraction of the served turns that are evidence, session headers "
                "not counted, over the questions with a turn served; categories 1-4, cluster bootstrap 95%)",
                [
                    "selector",
                    "budget",
                    "recall [95%]",
                    "precision [95%]",
                    "served turns (mean)",
                    "served fraction (mean)",
                    "n",
                ],
                recall_rows,
            )
        )
    if turns_rows:
        tables.append(
            Table(
                "F1 against the number of served turns (session headers not counted): every rows arm of every "
                "selector and budget"
                + (" and both positions modes" if len(modes) == 2 else "")
                + " pooled, one value per question and arm (categories 1-4)"
                + (
                    f"; {_count(n_empty, 'served set')} without a turn (empty, or session headers alone) left out"
                    if n_empty
                    else ""
                )
                + ("; gold: the evidence turns as text, for reference" if data["f1_by_turns"]["gold"] else ""),
                ["served turns", "F1 (mean)", "n"],
                turns_rows,
            )
        )
    if mode_rows:
        tables.append(
            Table(
                "F1 against the number of served turns, per positions mode (rows arms of every selector and budget "
                "pooled; F1 mean (n))",
                ["served turns", *modes],
                mode_rows,
            )
        )
    data["batched_readout"] = batched
    n_conv = data["n_conversations"]
    title = (
        f"memory-eval: {_count(len(main), 'question')} (categories 1-4) from {_count(n_conv, 'conversation')}"
        + (f", {len(adversarial)} adversarial" if adversarial else "")
        + (f", {data['n_skipped']} slots skipped" if data["n_skipped"] else "")
    )
    notes = [
        "rows:S@B: selector S's served set at budget B (a fraction of the history's rows, header excluded) served "
        "as its stored rows; text / isolated / blend: the same set re-prefilled as text / each event encoded alone / "
        "rows with a fraction recomputed; /contiguous: served at contiguous positions; full: every stored row; "
        "gold: the evidence turns as text.",
        "F1 and EM: LoCoMo's token F1 after its answer normalization "
        "(eventkv.studies.materialization.answer_metric), by the data's integer category.",
        "Category 5 (adversarial): 'answer abstains' scores the generated answer by LoCoMo's keyword rule; "
        "'chooses' is LoCoMo's forced choice between 'Not mentioned in the conversation' and the adversarial "
        "answer, by log-probability. Both apart from the F1 of categories 1-4.",
        "Wilcoxon p treats the questions as independent (zero differences dropped); the cluster bootstrap "
        f"resamples the {_count(n_conv, 'conversation')}. Neither corrects for the number of comparisons.",
    ]
    if probe is not None and probe.order == "relevance":
        notes.append(
            "Order relevance: the text and /contiguous arms serve their turns in increasing selector score (each "
            "turn with its neighbours one block; with session headers, each session's served turns one block after "
            "its header, at its best turn's rank; the best-ranked last before the question); full, gold and the "
            "arms at original positions in history order."
        )
    empty = {a: n for a, n in data["n_empty"].items() if n}
    if empty:
        notes.append(
            "Served sets left empty by their budget (scored F1 0, nothing read out): "
            + ", ".join(f"{a} {n}" for a, n in empty.items())
            + "."
        )
    if 1 < n_conv < 5:
        notes.append(
            f"With {n_conv} conversations the cluster bootstrap draws from only {n_conv**n_conv} ordered "
            "resamples of whole conversations: its intervals show the spread between these conversations, not a "
            "95% interval for the population of dialogues; evaluate more conversations for that."
        )
    return Summary(title, tables, notes=notes, data=data)


def memory_eval_figure(data: dict, path: str | Path) -> Path:
    """Token F1 (categories 1-4) against the served fraction of the history's rows (log scale), one line per
    arm kind and selector (and ``/contiguous``), ``full`` and ``gold`` as horizontal references, from the
    ``data`` of :func:`summarize_memory_eval`; written to ``path`` (PNG) and returned."""
    from eventkv.probes.figures import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    lines: dict[str, list[tuple[float, float]]] = {}
    for name, b in data["f1"].items():
        a = parse_arm(name)
        if b is None or a.budget is None:
            continue
        line = f"{a.kind}:{a.selector}" + ("/contiguous" if a.positions == "contiguous" else "")
        lines.setdefault(line, []).append((100 * a.budget, b["estimate"]))
    for line, pts in lines.items():
        pts.sort()
        style = "-" if line.startswith("rows") else "--"
        ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", label=line)
    for ref, colour in (("full", "black"), ("gold", "#d95f02")):
        if data["f1"].get(ref):
            ax.axhline(data["f1"][ref]["estimate"], color=colour, linestyle=":", label=ref)
    ax.set_xscale("log")
    budgets = sorted({x for pts in lines.values() for x, _ in pts})
    if budgets:  # the budgets as plain percentages, not matplotlib's log-scale 5x10^0
        ax.set_xticks(budgets, [f"{x:g}%" for x in budgets])
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel("served fraction of the history's rows (%, header excluded)")
    ax.set_ylabel("token F1 (categories 1-4)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(
        f"memory eval: {_count(data['n_questions'], 'question')}, {_count(data['n_conversations'], 'conversation')}"
    )
    return save_figure(fig, path)
