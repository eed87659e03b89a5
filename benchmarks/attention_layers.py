"""Which layers and pooling the attention selector should score with: evidence-turn recall per layer.

On the LoCoMo development split (each conversation truncated to its first ``--tokens`` tokens of
turns by :func:`eventkv.studies.materialization.dialogue.truncate`; one event per turn, ``turn.event_text()``; the
questions whose evidence lies inside the kept turns), the history is prefilled once per conversation
and every question is scored by :mod:`eventkv.memory.attention` at every layer, for each pooling
(``mass``, ``max``, ``mean``), with the header in or out of the softmax, and with the question
forwarded alone or over the history (``attend``). Reported: recall@k of the evidence turns (the
share of a question's evidence turns among the top k, averaged over questions) per layer, for bands
of layers (the mean of the layers' scores, as ``AttentionSelector(layers=...)`` pools them), and for
BM25 on the same questions (reference).

    python benchmarks/attention_layers.py [--model smollm2-135m] [--tokens 3000] [--k 5 10]
        [--conversations N] [--questions-per-conversation N] [--poolings mass max mean]
        [--attend question history] [--header out in] [--out results.json] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from itertools import product

import numpy as np
import torch

from eventkv.kv.log import HEADER_ID, Event, EventLog, tokenize
from eventkv.kv.prefill import prefill
from eventkv.memory.attention import ATTENDS, POOLINGS, attention_modules, event_scores, question_queries
from eventkv.memory.select import best_first
from eventkv.memory.select import scores as bm25_scores
from eventkv.models import load
from eventkv.options import DIALOGUE_FORMATS
from eventkv.studies.materialization.dialogue import truncate

LOCOMO_DEV = "/work/shared/data/locomo/locomo10-dev.json"


@dataclass
class Setting:
    pooling: str
    header: bool
    attend: str

    @property
    def label(self) -> str:
        return f"{self.pooling}/{'header' if self.header else 'no-header'}/{self.attend}"


def recall(order: list[int], gold: set[int], k: int) -> float:
    return len(gold & set(order[:k])) / len(gold)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default=LOCOMO_DEV)
    ap.add_argument("--tokens", type=int, default=3000, help="turn tokens kept per conversation")
    ap.add_argument("--k", type=int, nargs="+", default=[5, 10])
    ap.add_argument("--conversations", type=int, default=None, help="the first N conversations (default all)")
    ap.add_argument("--questions-per-conversation", type=int, default=None)
    ap.add_argument("--poolings", nargs="+", default=list(POOLINGS), choices=POOLINGS)
    ap.add_argument("--attend", nargs="+", default=list(ATTENDS), choices=ATTENDS)
    ap.add_argument("--header", nargs="+", default=["out", "in"], choices=["out", "in"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the recalls as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    lm = load(args.model)
    n_layers = lm.profile.num_layers
    modules = attention_modules(lm.model)
    convs = DIALOGUE_FORMATS.get("locomo")(args.data)[: args.conversations]
    settings = [Setting(p, h == "in", a) for p, h, a in product(args.poolings, args.header, args.attend)]
    # per setting: per question, [layers, events] scores; with the gold indices
    per_q: dict[str, list[np.ndarray]] = {s.label: [] for s in settings}
    golds: list[set[int]] = []
    bm25: list[list[int]] = []
    n_events = []
    for conv in convs:
        conv = truncate(conv, lm.tokenizer, args.tokens)
        events = [Event(t.id, t.event_text()) for t in conv.turns]
        log = tokenize(EventLog(events), lm.tokenizer, lm.profile)
        ekv = prefill(lm.model, log, chunk_size=1024)
        spans = [log.span(e.id) for e in events]
        event_rows = [r for s in spans for r in range(s.row_start, s.row_end)]
        owner = torch.tensor([i for i, s in enumerate(spans) for _ in range(s.n_tokens)])
        head = log.span(HEADER_ID)
        header_rows = list(range(head.row_start, head.row_end))
        rows = {False: torch.tensor(event_rows), True: torch.tensor(header_rows + event_rows)}
        owners = {False: owner, True: torch.cat([torch.full((len(header_rows),), -1), owner])}
        keys = {h: [ekv.keys[layer].index_select(2, rows[h]) for layer in range(n_layers)] for h in rows}
        index = {e.id: i for i, e in enumerate(events)}
        questions = conv.questions[: args.questions_per_conversation]
        for qa in questions:
            golds.append({index[e] for e in qa.evidence})
            bm25.append(best_first(bm25_scores([e.text for e in events], qa.question)))
            n_events.append(len(events))
            queries = {
                a: question_queries(
                    lm, qa.question, log.history_end, range(n_layers), rows=ekv if a == "history" else None
                )
                for a in args.attend
            }
            for s in settings:
                layer_scores = [
                    event_scores(
                        queries[s.attend][layer],
                        keys[s.header][layer],
                        owners[s.header],
                        len(events),
                        scaling=float(modules[layer].scaling),
                        pooling=s.pooling,  # type: ignore[arg-type]
                    ).numpy()
                    for layer in range(n_layers)
                ]
                per_q[s.label].append(np.stack(layer_scores))
        print(
            f"{conv.id}: {len(events)} turns, {log.n_rows} rows, {len(questions)} questions "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )

    bands = {"all": range(n_layers)}
    for parts in (3, 4):
        for i in range(parts):
            a, b = round(i * n_layers / parts), round((i + 1) * n_layers / parts)
            bands[f"{i + 1}/{parts} (layers {a}-{b - 1})"] = range(a, b)
    result: dict = {
        "model": args.model,
        "data": args.data,
        "tokens": args.tokens,
        "questions": len(golds),
        "conversations": len(convs),
        "mean_events": float(np.mean(n_events)),
        "layers": n_layers,
        "bm25": {k: float(np.mean([recall(o, g, k) for o, g in zip(bm25, golds)])) for k in args.k},
        "per_layer": {},
        "bands": {},
    }
    for s in settings:
        mats = per_q[s.label]
        result["per_layer"][s.label] = {
            k: [
                float(np.mean([recall(best_first(m[layer]), g, k) for m, g in zip(mats, golds)]))
                for layer in range(n_layers)
            ]
            for k in args.k
        }
        result["bands"][s.label] = {
            name: {
                k: float(np.mean([recall(best_first(m[list(band)].mean(0)), g, k) for m, g in zip(mats, golds)]))
                for k in args.k
            }
            for name, band in bands.items()
        }
    k0 = args.k[0]
    print(
        f"\n{args.model}, {len(golds)} questions of {len(convs)} LoCoMo dev conversations (first {args.tokens} "
        f"tokens of turns, {np.mean(n_events):.0f} turns on average); recall@{args.k}"
    )
    print("BM25: " + ", ".join(f"@{k} {v:.3f}" for k, v in result["bm25"].items()))
    print(f"\nper layer, recall@{k0}:")
    print("| setting | " + " | ".join(str(i) for i in range(n_layers)) + " |")
    for s in settings:
        row = result["per_layer"][s.label][k0]
        print(f"| {s.label} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
    print("\nbands (mean of the layers' scores):")
    print("| setting | " + " | ".join(bands) + " |")
    for s in settings:
        print(
            f"| {s.label} | "
            + " | ".join("/".join(f"{result['bands'][s.label][name][k]:.3f}" for k in args.k) for name in bands)
            + " |"
        )
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
