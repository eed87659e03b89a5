"""One memory grown past the model's context, measured in one run: what a query costs and finds as
the history grows, and what storing its rows in fewer bits saves and costs.

A synthetic agent history (smollm2-135m by default, 8,192 positions) is grown to each size in
``--sizes`` (tokens of history; default 4,000, 16,000 and 32,000: the last two pass the model's
context, so their prefill is windowed and their rows are served at contiguous positions), in writes
of ``--batch-events`` events (default 20), each added and prefilled. Among the filler events,
``--needles`` facts are planted at known turns spread over the whole run ("The access code of
locker Heron is 4817."); at each size every needle planted so far is asked for ("What is the access
code of locker Heron?"). Each question is answered three ways, one readout each, with the same
greedy decode:

  rows   the selector's served set at a fixed budget (``--budget-rows`` rows, header excluded),
         stored rows served at contiguous positions (``positions="contiguous"``);
  text   the same events re-prefilled as text after the header (the RAG baseline);
  full   every stored row, where the history fits the model's context (original positions);
         past the context there is no full arm: the model cannot attend to the whole history.

Per size and arm: per-query latency (median ms, lazy prefill excluded), KV bytes served (rows x
2 x layers x kv heads x head dim x dtype bytes) and the answer hit rate (the code appears in the answer), the
arms on the first selector's served set. Per selector: the needle's recall (its turn is in the served set)
and the answer hit rate of the rows arm.

Row formats. ``--rows`` (default ``native``) lists the formats the memory's rows are stored in
(``EventMemory.create(..., rows=...)``: ``native``, ``int8``, ``int4``; docs/memory.md, "Row
formats"). Each format is its own memory, grown one after the other through the same sizes with
the same events (the same batches, replayed), so it holds the same history and is asked the same
questions; ``native`` is always measured, first, and the lines above are its own. The open memory
holds the rows its store holds (the quantized ones, dequantized), so a format changes the rows
arm's answers and, for the attention selector, what is selected; BM25, dense and hybrid select the
same sets in every format. The text arm does not read the stored rows, and the full arm's latency
and bytes do not depend on their format (the open memory holds them in the model's dtype): both are
measured once, on the native memory. For every other format, per size: the rows arm's latency (median ms,
on the first selector's served set), each selector's recall and hit rate, the store's bytes on
disk (every file of its directory: ``stats().bytes_on_disk``), the segment files' bytes (the rows
alone) and the time the growth from the previous size took (add + prefill, the quantization
included); the native memory's store line closes each of its blocks. With ``--rows native`` alone
none of these lines is printed.

Printed last, measured in this run: `rows latency, largest vs smallest history: N.NNx` (a memory's
cost per query should not grow with its history), `text vs rows latency at <size>: N.Nx`, `full vs
rows latency at <size>: N.Nx` and `full vs rows KV bytes at <size>: N.Nx` (at the largest size
that fits), and each selector's recall at each size. With formats other than ``native``, then,
per size: `disk bytes, native / <format> at <size>: N.NNx` and `segment bytes, native / <format>
at <size>: N.NNx` for each format, `hit rate at <size> (<selector>): native 0.83, int8 0.83, int4
0.75` and `recall at <size> (<selector>): ...` for each selector, `rows latency at <size>: native
N ms, ...` and `growth at <size>: native N.N s, ...`.

    python benchmarks/memory_scale.py [--model smollm2-135m] [--sizes 4000,16000,32000]
        [--budget-rows 256] [--needles 12] [--selectors bm25,dense,attention,hybrid]
        [--rows native,int8,int4] [--batch-events 20] [--new-tokens 16] [--threads N] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eventkv.files import directory_bytes
from eventkv.kv.quant import ROW_FORMATS
from eventkv.memory import EventMemory, MemoryEvent
from eventkv.memory.store import SEGMENTS
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


class History:
    """The run's events in batches of ``per_batch``, each made once (in turn order, from ``rng``) and replayed
    to every memory that asks for it: each row format holds the same history and is asked the same questions."""

    def __init__(self, rng: random.Random, needle_at: dict[int, str], codes: dict[str, str], per_batch: int):
        self.rng, self.needle_at, self.codes, self.per_batch = rng, needle_at, codes, per_batch
        self.batches: list[tuple[list[MemoryEvent], dict[str, str]]] = []

    def batch(self, n: int) -> tuple[list[MemoryEvent], dict[str, str]]:
        """The ``n``-th batch: its events and the needles planted in it (locker -> event id)."""
        while len(self.batches) <= n:
            events, planted = [], {}
            for i in range(len(self.batches) * self.per_batch, (len(self.batches) + 1) * self.per_batch):
                if i in self.needle_at:
                    locker = self.needle_at[i]
                    events.append(MemoryEvent(needle(i, locker, self.codes[locker]), id=f"t{i}"))
                    planted[locker] = f"t{i}"
                else:
                    events.append(MemoryEvent(filler(self.rng, i), id=f"t{i}"))
            self.batches.append((events, planted))
        return self.batches[n]


class Grown:
    """One memory, grown batch by batch through a :class:`History`; ``planted``: its needles so far (locker ->
    event id)."""

    def __init__(self, mem: EventMemory, history: History):
        self.mem, self.history, self.next = mem, history, 0
        self.planted: dict[str, str] = {}

    def grow(self, size: int) -> float:
        """Add (and prefill) the history's next batches until the memory holds ``size`` rows; the seconds it took."""
        t0 = time.perf_counter()
        while self.mem.stats().rows < size:
            events, planted = self.history.batch(self.next)
            self.mem.add(events, prefill=True)
            self.planted.update(planted)
            self.next += 1
        return time.perf_counter() - t0


def ask(mem: EventMemory, question: str, select, new_tokens: int, **how):
    """``(ms, answer)``: one query's wall time, the lazy prefill excluded (nothing is pending here)."""
    t0 = time.perf_counter()
    ans = mem.query(question, select=select, max_new_tokens=new_tokens, **how)
    return 1e3 * (time.perf_counter() - t0) - ans.timings_ms["prefill"], ans


def measure(grown: Grown, codes: dict[str, str], selectors: list[str], args, fits: bool, controls: bool):
    """Every planted needle asked of ``grown``'s memory: per selector the rows arm; on the first selector's
    served set the rows arm's latency and, with ``controls``, the text arm's and (where the history ``fits``)
    the full arm's, each arm's answer read out. Returns ``(latency ms, rows served, recall, hits, arm hits)``: per
    arm, per arm, per selector, per selector, per arm (on the first selector's served set), one entry per needle."""
    mem = grown.mem
    lat: dict[str, list[float]] = {"rows": [], "text": [], "full": []}
    served_rows: dict[str, list[int]] = {"rows": [], "text": [], "full": []}
    recall: dict[str, list[bool]] = {s: [] for s in selectors}
    hits: dict[str, list[bool]] = {s: [] for s in selectors}
    arm_hits: dict[str, list[bool]] = {"rows": [], "text": [], "full": []}
    for locker, eid in grown.planted.items():
        q = f"What is the access code of locker {locker}?"
        for s in selectors:
            ids = mem.select(q, k=None, budget_rows=args.budget_rows, selector=s)
            recall[s].append(eid in ids)
            ms, ans = ask(mem, q, ids, args.new_tokens, positions="contiguous")
            hits[s].append(codes[locker] in ans.text)
            if s == selectors[0]:  # the latency arms are measured on the first selector's served set
                lat["rows"].append(ms)
                served_rows["rows"].append(ans.n_rows_served)
                arm_hits["rows"].append(codes[locker] in ans.text)
                if not controls:
                    continue
                ms, ans = ask(mem, q, ids, args.new_tokens, mode="text")
                lat["text"].append(ms)
                served_rows["text"].append(ans.n_rows_served)
                arm_hits["text"].append(codes[locker] in ans.text)
                if fits:
                    ms, ans = ask(mem, q, "all", args.new_tokens)
                    lat["full"].append(ms)
                    served_rows["full"].append(ans.n_rows_served)
                    arm_hits["full"].append(codes[locker] in ans.text)
    return lat, served_rows, recall, hits, arm_hits


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
    ap.add_argument(
        "--rows",
        default="native",
        help=f"row formats to store the memory in, one memory each ({', '.join(ROW_FORMATS)})",
    )
    ap.add_argument("--batch-events", type=int, default=20, help="events per add (one write, prefilled)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    formats = list(dict.fromkeys(["native", *(f.strip() for f in args.rows.split(","))]))
    if unknown := [f for f in formats if f not in ROW_FORMATS]:
        ap.error(f"--rows: unknown row format {', '.join(unknown)}; give some of {', '.join(ROW_FORMATS)}")
    if args.batch_events < 1:
        ap.error("--batch-events: give at least 1")
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
    if len(formats) > 1:
        print(f"row formats {', '.join(formats)}: one memory each, grown with the same events; native's blocks first")

    # the needles' turns, spread over the whole run (turn numbers estimated from a filler's length)
    per_event = statistics.mean(len(lm.tokenizer(filler(random.Random(i), i))["input_ids"]) for i in range(50))
    n_turns = int(sizes[-1] / per_event)
    n_needles = min(args.needles, len(LOCKERS))
    needle_at = dict(zip(sorted(rng.sample(range(2, n_turns - 2), n_needles)), LOCKERS))
    codes = {locker: f"{rng.randrange(1000, 9999)}" for locker in LOCKERS}
    history = History(rng, needle_at, codes, args.batch_events)

    results: dict[str, dict[int, dict]] = {}  # row format -> size -> what was measured there
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in formats:
            native = fmt == "native"
            mem = EventMemory.create(
                Path(tmp) / f"mem-{fmt}", lm, namespace="bench", instruction="You are an assistant.", rows=fmt
            )
            grown = Grown(mem, history)
            results[fmt] = {}
            for size in sizes:
                grow_s = grown.grow(size)
                stats = mem.stats()
                rows = stats.rows
                fits = ctx is None or rows + 64 + args.new_tokens <= ctx
                lat, served_rows, recall, hits, arm_hits = measure(grown, codes, selectors, args, fits, controls=native)
                results[fmt][size] = r = {
                    "rows": rows,
                    "fits": fits,
                    "grow_s": grow_s,
                    "lat": {a: statistics.median(v) for a, v in lat.items() if v},
                    "bytes": {a: statistics.median(v) * per_row for a, v in served_rows.items() if v},
                    "recall": {s: sum(v) / len(v) for s, v in recall.items() if v},
                    "hits": {s: sum(v) / len(v) for s, v in hits.items() if v},
                    "arm_hits": {a: sum(v) / len(v) for a, v in arm_hits.items() if v},
                    "n": len(grown.planted),
                    "disk": stats.bytes_on_disk,
                    "segments": directory_bytes(mem.directory / SEGMENTS),
                }
                store = f"  store  {fmt} rows: {r['disk']:,} bytes on disk, segment files {r['segments']:,} bytes"
                if native:
                    print(
                        f"\nhistory {rows} rows ({'fits' if fits else 'past'} the context; grown in "
                        f"{r['grow_s']:.0f} s), {r['n']} needles asked, budget {args.budget_rows} rows "
                        f"({args.budget_rows / rows:.1%} of the rows)"
                    )
                    for a in ("rows", "text", "full"):
                        if a in r["lat"]:
                            print(
                                f"  {a:5s} median {r['lat'][a]:8.0f} ms per query, "
                                f"KV bytes served {r['bytes'][a]:>14,.0f}, answer has the code {r['arm_hits'][a]:.2f}"
                            )
                        else:
                            print(f"  {a:5s} n/a (the history passes the model's context)")
                    for s in selectors:
                        print(f"  {s:10s} needle recall {r['recall'][s]:.2f}, answer has the code {r['hits'][s]:.2f}")
                    if len(formats) > 1:
                        print(store)
                else:
                    print(
                        f"\nhistory {rows} rows, rows {fmt} (grown in {r['grow_s']:.1f} s), {r['n']} needles asked, "
                        f"budget {args.budget_rows} rows"
                    )
                    print(f"  rows  median {r['lat']['rows']:8.0f} ms per query")
                    print(store)
                    for s in selectors:
                        print(f"  {s:10s} needle recall {r['recall'][s]:.2f}, answer has the code {r['hits'][s]:.2f}")
            mem.close()
            shutil.rmtree(mem.directory)  # one format's store at a time on disk

    base = results["native"]
    small, large = sizes[0], sizes[-1]
    print()
    growth = base[large]["lat"]["rows"] / base[small]["lat"]["rows"]
    print(f"rows latency, largest vs smallest history: {growth:.2f}x ({large} vs {small} tokens)")
    for size in sizes:
        print(f"text vs rows latency at {size}: {base[size]['lat']['text'] / base[size]['lat']['rows']:.1f}x")
    fitting = [s for s in sizes if base[s]["fits"]]
    if fitting:
        f = fitting[-1]
        r = base[f]
        print(f"full vs rows latency at {f}: {r['lat']['full'] / r['lat']['rows']:.1f}x")
        print(f"full vs rows KV bytes at {f}: {r['bytes']['full'] / r['bytes']['rows']:.1f}x")
    for s in selectors:
        print(f"recall {s}: " + ", ".join(f"{size}: {base[size]['recall'][s]:.2f}" for size in sizes))
    if len(formats) == 1:
        return
    for size in sizes:
        for fmt in formats[1:]:
            r = results[fmt][size]
            print(f"disk bytes, native / {fmt} at {size}: {base[size]['disk'] / r['disk']:.2f}x")
            print(f"segment bytes, native / {fmt} at {size}: {base[size]['segments'] / r['segments']:.2f}x")
        for s in selectors:
            for name, key in (("hit rate", "hits"), ("recall", "recall")):
                each = ", ".join(f"{fmt} {results[fmt][size][key][s]:.2f}" for fmt in formats)
                print(f"{name} at {size} ({s}): {each}")
        print(
            f"rows latency at {size}: "
            + ", ".join(f"{fmt} {results[fmt][size]['lat']['rows']:.0f} ms" for fmt in formats)
        )
        print(f"growth at {size}: " + ", ".join(f"{fmt} {results[fmt][size]['grow_s']:.1f} s" for fmt in formats))


if __name__ == "__main__":
    main()
