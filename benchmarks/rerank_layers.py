"""Which attention layers, pooling and candidate pool the ``rerank`` selector should use: evidence recall and
precision of the served set per layer, against the first stage alone.

On LoCoMo's development split, as ``eventkv memory eval`` builds it (each conversation cut to ``--max-tokens``
tokens of turns, one event per turn, session header events with ``--with-headers``, the same 15 questions per
conversation, categories 1-4), every question's first-stage ranking (``--first``, default hybrid) is computed
once; its candidates (the best events up to each ``--pools`` fraction of the rows) are scored by the model's
attention at every layer (one forward of the question, :mod:`eventkv.memory.attention`) for each pooling; each
(pool, layer, pooling) ranking is shaped into a served set at each ``--budgets`` fraction exactly as
``EventMemory.select`` does (:func:`eventkv.memory.select.shape_units`, with ``--neighbours`` and the session
headers), and scored: recall (share of the question's evidence turns served), precision (share of the served turns
that are evidence; headers not counted), mean over questions. Bands of layers (the mean of their scores, as
``AttentionSelector(layers=...)`` pools them) are scored too.

``--memories DIR`` reuses the prefilled memories of a memory-eval run folder (``DIR/c0``, ``DIR/c1``, ...; opened,
never changed); a conversation without one is prefilled into a temporary folder.

    python benchmarks/rerank_layers.py --memories docs/results/memory-eval-dev-grid/h1-n0/memories \\
        --conversations 3 --with-headers --out rerank.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eventkv.memory.attention import POOLINGS, attention_modules, event_scores, question_queries
from eventkv.memory.rerank import pool_of, rerank_scores
from eventkv.memory.select import HEADER_TAG, fraction_of, group_headers, selector_for, shape_units
from eventkv.models import load
from eventkv.studies.materialization.dialogue import load_locomo, truncate
from eventkv.studies.materialization.memory_eval import HEADED_INSTRUCTION, INSTRUCTION, history_events, open_history

LOCOMO_DEV = "/work/shared/data/locomo/locomo10-dev.json"


def served_of(order: list[int], rows: list[int], budget: float, neighbours: int, headers) -> list[int]:
    taken = shape_units(order, rows, budget=fraction_of(budget, sum(rows)), neighbours=neighbours, headers=headers)
    return sorted({j for _, members in taken for j in members})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--data", default=LOCOMO_DEV)
    ap.add_argument("--memories", default=None, help="a memory-eval run folder's memories/ to reuse")
    ap.add_argument("--conversations", type=int, default=7)
    ap.add_argument("--skip", type=int, default=0, help="start at this conversation (held-out checks)")
    ap.add_argument("--questions-per-conversation", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=16000)
    ap.add_argument("--with-headers", action="store_true")
    ap.add_argument("--neighbours", type=int, default=0)
    ap.add_argument("--first", default="hybrid")
    ap.add_argument("--pools", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.025, 0.05, 0.1])
    ap.add_argument("--poolings", nargs="+", default=["max", "mass"], choices=POOLINGS)
    ap.add_argument("--bands", nargs="+", default=[], help="layer bands as first:last (inclusive), e.g. 10:14")
    ap.add_argument(
        "--concentration",
        type=float,
        nargs="*",
        default=[],
        help="per-question budgets: serve the fewest re-ranked candidates holding this share of their summed scores",
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    lm = load(args.model, dtype=args.dtype)
    instruction = HEADED_INSTRUCTION if args.with_headers else INSTRUCTION
    convs = load_locomo(args.data)[: args.conversations]
    n_layers = len(attention_modules(lm.model))
    bands = [tuple(int(x) for x in b.split(":")) for b in args.bands]
    scorers = [(p, (lay,)) for p in args.poolings for lay in range(n_layers)]
    scorers += [(p, tuple(range(a, b + 1))) for p in args.poolings for a, b in bands]
    # (pool, pooling, layers, budget) -> [recall], [precision]; ("first", budget) the first stage alone
    recall: dict[tuple, list[float]] = {}
    precision: dict[tuple, list[float]] = {}
    used: dict[tuple, list[int]] = {}  # served rows, per-question budgets
    tmp = tempfile.TemporaryDirectory(prefix="rerank-layers-")
    t0 = time.perf_counter()
    n_questions = 0
    for c, conv in enumerate(convs):
        if c < args.skip:
            continue
        conv = truncate(conv, lm.tokenizer, args.max_tokens or sys.maxsize)
        sessions = history_events(conv, args.with_headers)
        root = Path(args.memories) if args.memories and (Path(args.memories) / f"c{c}").is_dir() else Path(tmp.name)
        mem = open_history(root / f"c{c}", lm, instruction, sessions)
        questions = list(conv.questions)
        random.Random(f"memory-eval:0:{c}").shuffle(questions)
        events = [cur for _, cur in mem.selection().table.units()]
        rows = [e.n_rows for e in events]
        headers = group_headers([HEADER_TAG in e.tags for e in events]) if args.with_headers else None
        is_turn = [HEADER_TAG not in e.tags for e in events]
        context = mem.selection().context()
        ekv = context.rows()
        modules = attention_modules(lm.model)
        first_sel = selector_for(args.first)
        for qa in questions[: args.questions_per_conversation]:
            evidence = set(qa.evidence)
            if not evidence:
                continue

            def score(served: list[int], key: tuple, evidence=evidence, events=events, is_turn=is_turn) -> None:
                got = [events[i].id for i in served if is_turn[i]]
                recall.setdefault(key, []).append(len(evidence & set(got)) / len(evidence))
                precision.setdefault(key, []).append(len(evidence & set(got)) / len(got) if got else 0.0)

            index = {e.id: i for i, e in enumerate(events)}
            first = [index[r.id] for r in first_sel.rank(qa.question, events, context=context)]
            for b in args.budgets:
                score(served_of(first, rows, b, args.neighbours, headers), ("first", b))
            queries = question_queries(lm, qa.question, context.history_end, list(range(n_layers)))
            for pool in args.pools:
                cand = pool_of(first, rows, pool)
                spans = [ekv.log.span(events[i].id) for i in cand]
                owner = torch.tensor([j for j, s in enumerate(spans) for _ in range(s.row_start, s.row_end)])
                idx = torch.tensor([r for s in spans for r in range(s.row_start, s.row_end)])
                per_layer = {}
                with torch.inference_mode():
                    for p in args.poolings:
                        for lay in range(n_layers):
                            a = modules[lay]
                            per_layer[(p, lay)] = event_scores(
                                queries[lay],
                                ekv.keys[lay].index_select(2, idx),
                                owner,
                                len(cand),
                                scaling=float(a.scaling),
                                pooling=p,
                                softcap=getattr(a, "attn_logit_softcapping", None),
                            ).numpy()
                for p, layers in scorers:
                    s = np.mean([per_layer[(p, lay)] for lay in layers], axis=0)
                    sc = rerank_scores(first, cand, s, len(events))
                    order = sorted(range(len(events)), key=lambda i: (-sc[i], i))
                    for b in args.budgets:
                        score(served_of(order, rows, b, args.neighbours, headers), (pool, p, layers, b))
                    share = np.cumsum(np.sort(s)[::-1]) / max(float(s.sum()), 1e-30)
                    for tau in args.concentration:
                        keep = order[: int(np.searchsorted(share, tau - 1e-12)) + 1]
                        for b in args.budgets:
                            served = served_of(keep, rows, b, args.neighbours, headers)
                            score(served, (pool, p, layers, b, tau))
                            used.setdefault((pool, p, layers, b, tau), []).append(sum(rows[i] for i in served))
            n_questions += 1
        mem.close()
        print(f"conversation {c}: {n_questions} questions so far, {time.perf_counter() - t0:.0f} s", flush=True)

    def mean(xs):
        return round(float(np.mean(xs)), 4)

    print(f"\n{n_questions} questions; first stage {args.first}; recall / precision of the served turns")
    for b in args.budgets:
        print(f"budget {b:g}: first stage alone {mean(recall[('first', b)])} / {mean(precision[('first', b)])}")
        for pool in args.pools:
            for p in args.poolings:
                best = sorted(
                    ((mean(recall[(pool, p, lay, b)]), lay) for q, lay in scorers if q == p),
                    reverse=True,
                )[:3]
                print(f"  pool {pool:g} {p}: best layers {[(lay, r) for r, lay in best]}")
    if args.out:
        out = {
            "options": vars(args),
            "questions": n_questions,
            "n_layers": n_layers,
            "recall": {json.dumps(k): mean(v) for k, v in recall.items()},
            "precision": {json.dumps(k): mean(v) for k, v in precision.items()},
            "served_rows": {json.dumps(k): mean(v) for k, v in used.items()},
            "per_question_recall": {json.dumps(k): v for k, v in recall.items() if k[0] == "first"},
        }
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
