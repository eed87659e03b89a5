"""One memory grown past the model's context, measured in one run: what a query costs and finds as
the history grows.

A synthetic agent history (smollm2-135m by default, 8,192 positions) is grown to each size in
``--sizes`` (tokens of history; default 4,000, 16,000 and 32,000: the last two pass the model's
context, so their prefill is windowed and their rows are served at contiguous positions). Among the
filler events, ``--needles`` facts are planted at known turns spread over the whole run ("The
access code of locker Heron is 4817."); at each size every needle planted so far is asked for
("What is the access code of locker Heron?"). Each question is answered three ways, one readout
each, with the same greedy decode:

  rows   the selector's served set at a fixed budget (``--budget-rows`` rows, header excluded),
         stored rows served at contiguous positions (``positions="contiguous"``);
  text   the same events re-prefilled as text after the header (the RAG baseline);
  full   every stored row, where the history fits the model's context (original positions);
         past the context there is no full arm: the model cannot attend to the whole history.

Per size and arm: per-query latency (median ms, lazy prefill excluded) and KV bytes served (rows x
2 x layers x kv heads x head dim x dtype bytes). Per selector: the needle's recall (its turn is in
the served set) and the answer hit rate (the code appears in the answer) of the rows arm.

Printed last, measured in this run: `rows latency, largest vs smallest history: N.NNx` (a memory's
cost per query should not grow with its history), `text vs rows latency at <size>: N.Nx`, `full vs
rows latency at <size>: N.Nx` and `full vs rows KV bytes at <size>: N.Nx` (at the largest size
that fits), and each selector's recall at each size.

    python benchmarks/memory_scale.py [--model smollm2-135m] [--sizes 4000,16000,32000]
        [--budget-rows 256] [--needles 12] [--selectors bm25,dense,attention,hybrid]
        [--new-tokens 16] [--threads N] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eventkv.memory import EventMemory, MemoryEvent
from eventkv.models import load
from eventkv.options import SELECTORS

PEOPLE = ("Dana", "Ravi", "Mei", "Tomas", "Aiko", "Lena", "Omar", "Priya", "Jon", "Sofia")
PLACES = ("Lisbon", "Oslo", "Kyoto", "Austin", "Nairobi", "Porto", "Quito", "Tallinn", "Hanoi", "Perth")
THINGS = ("the quarterly report", "the grant proposal", "the team offsite", "the server migration", "the demo")
LOCKERS = (
    "Heron", "Maple", "Cobalt", "Juniper", "Falcon", "Saffron", "Granite", "Willow",
    "Orchid", "Quartz", "Badger", "Cedar", "Lynx", "Marigold", "Onyx", "Tundra",
)  # fmt: skip


def filler(rng: random.Random, i: int) -> str:
    """One synthetic agent event (~55 tokens) that mentions no locker."""
    p, q = rng.sample(PEOPLE, 2)
    return (
        f"[turn {i}] {p} told the assistant that {q} will handle {rng.choice(THINGS)} from "
        f"{rng.choice(PLACES)}; ticket {rng.randrange(1000, 9999)}, budget {rng.randrange(2, 90)}k."
    )


def needle(i: int, locker: str, code: str) -> str:
    return f"[turn {i}] The access code of locker {locker} is {code}. Keep it safe."


def ask(mem: EventMemory, question: str, select, new_tokens: int, **how):
    """``(ms, answer)``: one query's wall time, the lazy prefill excluded (nothing is pending here)."""
    t0 = time.perf_counter()
    ans = mem.query(question, select=select, max_new_tokens=new_tokens, **how)
    return 1e3 * (time.perf_counter() - t0) - ans.timings_ms["prefill"], ans


def row_bytes(lm) -> int:
    """Bytes of one K/V row over every layer: 2 x layers x kv heads x head dim x dtype bytes."""
    cfg = lm.model.config.get_text_config()
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.empty(0, dtype=lm.model.dtype).element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sizes", default="4000,16000,32000", help="history sizes to measure at (tokens)")
    ap.add_argument("--budget-rows", type=int, default=256, help="rows served per query (header excluded)")
    ap.add_argument("--needles", type=int, default=12, help="facts planted over the run (at most 16)")
    ap.add_argument("--selectors", default="bm25,dense,attention,hybrid", help="registered names; others skipped")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    selectors = [s for s in args.selectors.split(",") if s in SELECTORS.names()]
    skipped = [s for s in args.selectors.split(",") if s not in selectors]
    rng = random.Random(args.seed)
    lm = load(args.model, dtype=args.dtype)
    ctx = lm.profile.max_context
    per_row = row_bytes(lm)
    print(
        f"{args.model} {lm.profile.dtype}, torch threads {torch.get_num_threads()}, context {ctx}; "
        f"selectors {', '.join(selectors)}" + (f" (not registered, skipped: {', '.join(skipped)})" if skipped else "")
    )

    # the needles' turns, spread over the whole run (turn numbers estimated from a filler's length)
    per_event = statistics.mean(len(lm.tokenizer(filler(random.Random(i), i))["input_ids"]) for i in range(50))
    n_turns = int(sizes[-1] / per_event)
    n_needles = min(args.needles, len(LOCKERS))
    needle_at = dict(zip(sorted(rng.sample(range(2, n_turns - 2), n_needles)), LOCKERS))
    codes = {locker: f"{rng.randrange(1000, 9999)}" for locker in LOCKERS}

    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        mem = EventMemory.create(Path(tmp) / "mem", lm, namespace="bench", instruction="You are an assistant.")
        planted: dict[str, str] = {}  # locker -> event id
        i = 0
        for size in sizes:
            t0 = time.perf_counter()
            while mem.stats().rows < size:
                batch = []
                for _ in range(20):
                    if i in needle_at:
                        locker = needle_at[i]
                        batch.append(MemoryEvent(needle(i, locker, codes[locker]), id=f"t{i}"))
                        planted[locker] = f"t{i}"
                    else:
                        batch.append(MemoryEvent(filler(rng, i), id=f"t{i}"))
                    i += 1
                mem.add(batch, prefill=True)
            grow_ms = 1e3 * (time.perf_counter() - t0)
            rows = mem.stats().rows
            fits = ctx is None or rows + 64 + args.new_tokens <= ctx
            lat: dict[str, list[float]] = {"rows": [], "text": [], "full": []}
            served_rows: dict[str, list[int]] = {"rows": [], "text": [], "full": []}
            recall = {s: [] for s in selectors}
            hits = {s: [] for s in selectors}
            for locker, eid in planted.items():
                q = f"What is the access code of locker {locker}?"
                for s in selectors:
                    ids = mem.select(q, k=None, budget_rows=args.budget_rows, selector=s)
                    recall[s].append(eid in ids)
                    ms, ans = ask(mem, q, ids, args.new_tokens, positions="contiguous")
                    hits[s].append(codes[locker] in ans.text)
                    if s == selectors[0]:  # the latency arms are measured on the first selector's served set
                        lat["rows"].append(ms)
                        served_rows["rows"].append(ans.n_rows_served)
                        ms, ans = ask(mem, q, ids, args.new_tokens, mode="text")
                        lat["text"].append(ms)
                        served_rows["text"].append(ans.n_rows_served)
                        if fits:
                            ms, ans = ask(mem, q, "all", args.new_tokens)
                            lat["full"].append(ms)
                            served_rows["full"].append(ans.n_rows_served)
            results[size] = {
                "rows": rows,
                "fits": fits,
                "grow_s": grow_ms / 1e3,
                "lat": {a: statistics.median(v) for a, v in lat.items() if v},
                "bytes": {a: statistics.median(v) * per_row for a, v in served_rows.items() if v},
                "recall": {s: sum(v) / len(v) for s, v in recall.items() if v},
                "hits": {s: sum(v) / len(v) for s, v in hits.items() if v},
                "n": len(planted),
            }
            r = results[size]
            print(
                f"\nhistory {rows} rows ({'fits' if fits else 'past'} the context; grown in {r['grow_s']:.0f} s), "
                f"{r['n']} needles asked, budget {args.budget_rows} rows ({args.budget_rows / rows:.1%} of the rows)"
            )
            for a in ("rows", "text", "full"):
                if a in r["lat"]:
                    print(f"  {a:5s} median {r['lat'][a]:8.0f} ms per query, KV bytes served {r['bytes'][a]:>14,.0f}")
                else:
                    print(f"  {a:5s} n/a (the history passes the model's context)")
            for s in selectors:
                print(f"  {s:10s} needle recall {r['recall'][s]:.2f}, answer has the code {r['hits'][s]:.2f}")
        mem.close()

    small, large = sizes[0], sizes[-1]
    print()
    growth = results[large]["lat"]["rows"] / results[small]["lat"]["rows"]
    print(f"rows latency, largest vs smallest history: {growth:.2f}x ({large} vs {small} tokens)")
    for size in sizes:
        print(f"text vs rows latency at {size}: {results[size]['lat']['text'] / results[size]['lat']['rows']:.1f}x")
    fitting = [s for s in sizes if results[s]["fits"]]
    if fitting:
        f = fitting[-1]
        r = results[f]
        print(f"full vs rows latency at {f}: {r['lat']['full'] / r['lat']['rows']:.1f}x")
        print(f"full vs rows KV bytes at {f}: {r['bytes']['full'] / r['bytes']['rows']:.1f}x")
    for s in selectors:
        print(f"recall {s}: " + ", ".join(f"{size}: {results[size]['recall'][s]:.2f}" for size in sizes))


if __name__ == "__main__":
    main()
