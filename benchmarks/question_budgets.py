"""Per-question budgets from a selector's own scores: does serving "the events that score near the best one"
find the evidence with fewer rows than a fixed share of the history?

A fixed budget serves the same share of the history's rows to every question. When a question's evidence
stands out (one or two turns score far above the rest) a smaller set would hold it; when the scores are flat,
a larger one. This measures that on LoCoMo's development split, as ``eventkv memory eval`` builds it (each
conversation cut to ``--max-tokens`` tokens of turns, one event per turn, dated turns or session headers with
``--with-headers``, the same 15 seeded questions per conversation, categories 1-4), with no model forward:
only the selectors' scores and each event's rows (its token count under the model's tokenizer).

Rules, each capped at ``--cap`` of the history's rows and shaped as ``EventMemory.select`` shapes a ranking
(:func:`eventkv.memory.select.shape_units`, ``--neighbours``, session headers):

* ``fixed B``: the selector's best events within B of the rows (what the memory serves today);
* ``bm25 >= a x best``: the events whose BM25 score is at least ``a`` times the question's best score;
* ``dense >= best - d``: the events whose cosine to the question is within ``d`` of the best cosine.

For each rule: evidence recall (share of the question's evidence turns served), precision (share of the served
turns that are evidence; headers not counted), served rows, mean over questions; and against the fixed budget
of the same selector whose mean rows are nearest, the paired recall difference per question with a cluster
bootstrap 95% interval over conversations (:func:`eventkv.stats.cluster_bootstrap`). An adaptive rule is worth
building only where it holds more evidence than a fixed budget of the same mean cost.

    python benchmarks/question_budgets.py --model qwen2.5-coder-1.5b --max-tokens 16000 --out budgets.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from eventkv.kv.log import Event
from eventkv.memory.dense import DenseSelector
from eventkv.memory.select import HEADER_TAG, BM25Selector, fraction_of, group_headers, shape_units
from eventkv.models.cache_dir import model_dir
from eventkv.models.encoding import encode
from eventkv.stats import cluster_bootstrap
from eventkv.studies.materialization.dialogue import load_locomo, truncate
from eventkv.studies.materialization.memory_eval import history_events

#: where the workplace keeps LoCoMo's development split, relative to the repository root (read there, never copied)
LOCOMO_DEV = "../shared/data/locomo/locomo10-dev.json"
FIXED = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.1)


def tokenizer_of(model: str):
    """The tokenizer of a packaged alias (its cached directory) or of a local directory / hub id."""
    from transformers import AutoTokenizer

    path = model_dir(model)
    return AutoTokenizer.from_pretrained(str(path) if path.is_dir() else model)


def served(order, rows, cap_rows, neighbours, headers) -> list[int]:
    taken = shape_units(order, rows, budget=cap_rows, neighbours=neighbours, headers=headers)
    return sorted({j for _, members in taken for j in members})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="whose tokenizer counts an event's rows")
    ap.add_argument("--data", default=LOCOMO_DEV, help=f"a LoCoMo-format JSON file (default: {LOCOMO_DEV})")
    ap.add_argument("--conversations", type=int, default=7)
    ap.add_argument("--questions-per-conversation", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=16000, help="history tokens per conversation; 0: all")
    ap.add_argument("--with-headers", action="store_true")
    ap.add_argument("--neighbours", type=int, default=0)
    ap.add_argument("--cap", type=float, default=0.1, help="the adaptive rules' largest share of the rows")
    ap.add_argument("--bm25-ratios", type=float, nargs="+", default=[0.3, 0.5, 0.6, 0.7, 0.8, 0.9])
    ap.add_argument("--dense-margins", type=float, nargs="+", default=[0.05, 0.1, 0.15, 0.2, 0.25])
    ap.add_argument("--out", default=None, help="write every per-question value as JSON")
    args = ap.parse_args()
    if not Path(args.data).is_file():
        ap.error(f"--data {args.data!r}: no such file: give the path of a LoCoMo-format JSON file.")

    tok = tokenizer_of(args.model)
    bm25, dense = BM25Selector(), DenseSelector()
    rules = [("bm25", ("fixed", b)) for b in FIXED] + [("dense", ("fixed", b)) for b in FIXED]
    rules += [("bm25", ("ratio", a)) for a in args.bm25_ratios] + [("dense", ("margin", d)) for d in args.dense_margins]
    recall: dict = {r: [] for r in rules}
    precision: dict = {r: [] for r in rules}
    used: dict = {r: [] for r in rules}
    clusters: list[int] = []
    t0 = time.perf_counter()
    for c, conv in enumerate(load_locomo(args.data)[: args.conversations]):
        conv = truncate(conv, tok, args.max_tokens or sys.maxsize)
        events = [e for _, evs in history_events(conv, args.with_headers) for e in evs]
        rows = [len(encode(tok, Event(e.id, e.text).render())) for e in events]
        is_turn = [HEADER_TAG not in e.tags for e in events]
        headers = group_headers([not t for t in is_turn]) if args.with_headers else None
        total = sum(rows)
        cap = fraction_of(args.cap, total)
        texts = [SimpleNamespace(text=e.text) for e in events]
        vectors = dense.embed([e.text for e in events])
        questions = list(conv.questions)
        random.Random(f"memory-eval:0:{c}").shuffle(questions)
        for qa in questions[: args.questions_per_conversation]:
            if qa.category not in (1, 2, 3, 4) or not qa.evidence:
                continue
            evidence = set(qa.evidence)
            score = {"bm25": bm25.scores(qa.question, texts), "dense": vectors @ dense.embed([qa.question])[0]}
            order = {s: sorted(range(len(events)), key=lambda i, v=v: (-v[i], i)) for s, v in score.items()}
            for sel, (kind, x) in rules:
                v, ranked = score[sel], order[sel]
                if kind == "fixed":
                    got = served(ranked, rows, fraction_of(x, total), args.neighbours, headers)
                else:
                    best = float(v[ranked[0]])
                    keep = [i for i in ranked if (v[i] >= x * best if kind == "ratio" else v[i] >= best - x)]
                    got = served(keep or ranked[:1], rows, cap, args.neighbours, headers)
                ids = [events[i].id for i in got if is_turn[i]]
                hit = len(evidence & set(ids))
                recall[(sel, (kind, x))].append(hit / len(evidence))
                precision[(sel, (kind, x))].append(hit / len(ids) if ids else 0.0)
                used[(sel, (kind, x))].append(sum(rows[i] for i in got))
            clusters.append(c)
        print(f"conversation {c}: {len(clusters)} questions so far, {time.perf_counter() - t0:.0f} s", flush=True)

    def name(sel, rule):
        kind, x = rule
        if kind == "fixed":
            return f"{sel} fixed {100 * x:g}%"
        return f"bm25 >= {x:g} x best" if kind == "ratio" else f"dense >= best - {x:g}"

    print(f"\n{len(clusters)} questions of categories 1-4 from {len(set(clusters))} conversations; cap {args.cap:g}")
    if len(set(clusters)) < 3:
        print(
            f"(with {len(set(clusters))} conversation(s) the cluster bootstrap has almost nothing to resample: the "
            "intervals show the spread between these conversations, not a 95% interval; use more conversations)"
        )
    print(
        "| rule | served rows (mean) | recall | precision | nearest fixed budget: rows, recall | recall - fixed [95%] |"
    )
    print("|---|---|---|---|---|---|")
    table = []
    for sel, rule in rules:
        m_rows = float(np.mean(used[(sel, rule)]))
        line = {
            "rule": name(sel, rule),
            "rows": round(m_rows, 1),
            "recall": round(float(np.mean(recall[(sel, rule)])), 4),
            "precision": round(float(np.mean(precision[(sel, rule)])), 4),
        }
        extra = "| | |"
        if rule[0] != "fixed":
            near = min(FIXED, key=lambda b: abs(np.mean(used[(sel, ("fixed", b))]) - m_rows))
            diff = [a - b for a, b in zip(recall[(sel, rule)], recall[(sel, ("fixed", near))])]
            boot = cluster_bootstrap(diff, clusters)
            line["nearest_fixed"] = near
            line["recall_minus_fixed"] = [round(boot.estimate, 4), round(boot.low, 4), round(boot.high, 4)]
            near_rows, near_recall = np.mean(used[(sel, ("fixed", near))]), np.mean(recall[(sel, ("fixed", near))])
            extra = (
                f"| {100 * near:g}%: {near_rows:.0f}, {near_recall:.3f} "
                f"| {boot.estimate:+.3f} [{boot.low:+.3f}, {boot.high:+.3f}] |"
            )
        table.append(line)
        print(f"| {line['rule']} | {m_rows:.0f} | {line['recall']:.3f} | {line['precision']:.3f} {extra}")
    if args.out:
        per_question = {name(s, r): {"recall": recall[(s, r)], "rows": used[(s, r)]} for s, r in rules}
        Path(args.out).write_text(
            json.dumps({"options": vars(args), "table": table, "clusters": clusters, "per_question": per_question})
        )


if __name__ == "__main__":
    main()
