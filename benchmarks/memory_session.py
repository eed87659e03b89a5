"""An agent-style session on EventMemory, measured in one run.

A synthetic session (default ~6,000 tokens of history on smollm2-135m, inside its context):
events are added one at a time with eager prefill, 20 of them are updated by served patches, and
100 queries are interleaved. Each query is answered three ways, with the same greedy decode:

  served  EventMemory: BM25 selects k events, their stored rows are served (compact), decode;
  text    the same selected events re-prefilled as text after the header, then decode;
  full    the whole history re-prefilled (what a memory without stored rows pays), then decode.

Also: the time of each eager ``add`` against the history length (log-log slope: the per-event
prefill attends over the stored rows, so about linear in L), and the bytes of the store's KV
segment files per token against the physical K/V size (2 x layers x kv_heads x head_dim x bytes).

Printed last, measured in this run: `served vs full re-prefill: N.Nx`, `served vs text
re-prefill: N.Nx`, `bytes on disk / physical KV: N.NNNx`.

    python benchmarks/memory_session.py [--model smollm2-135m] [--tokens 6000] [--queries 100]
        [--updates 20] [--k 8] [--new-tokens 8] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from scipy import stats as st

from eventkv.memory import EventMemory, MemoryEvent
from eventkv.models import load

PEOPLE = ("Dana", "Ravi", "Mei", "Tomas", "Aiko", "Lena", "Omar", "Priya", "Jon", "Sofia")
PLACES = ("Lisbon", "Oslo", "Kyoto", "Austin", "Nairobi", "Porto", "Quito", "Tallinn", "Hanoi", "Perth")
THINGS = ("the quarterly report", "the grant proposal", "the team offsite", "the server migration", "the demo")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")


def session_text(rng: random.Random, i: int) -> str:
    """One synthetic agent event (~60 tokens): who did what, where and when."""
    p, q = rng.sample(PEOPLE, 2)
    return (
        f"[turn {i}] {p} told the assistant that {q} will handle {rng.choice(THINGS)} from {rng.choice(PLACES)}; "
        f"the review is on {rng.choice(DAYS)} at {rng.randrange(8, 18)}:{rng.choice(('00', '15', '30', '45'))}, "
        f"ticket {rng.randrange(1000, 9999)}, budget {rng.randrange(2, 90)}k."
    )


def question(rng: random.Random) -> str:
    p = rng.choice(PEOPLE)
    return f"When is the review of what {p} said, and who handles it?"


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1000, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=6000, help="history length to reach (tokens)")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--k", type=int, default=8, help="events selected per query (EventMemory.select's default)")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    lm = load(args.model, dtype=args.dtype)
    print(f"{args.model} {lm.profile.dtype}, torch threads {torch.get_num_threads()}, context {lm.profile.max_context}")

    served_ms, text_ms, full_ms, add_ms, add_len = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        mem = EventMemory.create(Path(tmp) / "mem", lm, namespace="bench", instruction="You are an assistant.")
        ids: list[str] = []
        # a schedule of adds, updates and queries, interleaved over the last three quarters of the session
        probe_rng = random.Random(args.seed + 1)
        per_event = statistics.mean(len(lm.tokenizer(session_text(probe_rng, i))["input_ids"]) + 1 for i in range(50))
        n_est = max(8, int((args.tokens - 200) / per_event))
        queries_at = sorted(rng.choices(range(n_est // 4, n_est), k=args.queries))
        update_at = set(rng.sample(range(n_est // 4, n_est), min(args.updates, n_est - n_est // 4)))

        def ask() -> None:
            q = question(rng)
            sel = mem.select(q, k=args.k)
            t_served, _ = timed(lambda: mem.query(q, select=sel, max_new_tokens=args.new_tokens))
            t_text, _ = timed(lambda: mem.query(q, select=sel, mode="text", max_new_tokens=args.new_tokens))
            t_full, _ = timed(lambda: mem.query(q, select="view", mode="text", max_new_tokens=args.new_tokens))
            served_ms.append(t_served)
            text_ms.append(t_text)
            full_ms.append(t_full)

        i = 0
        while mem.stats().rows < args.tokens - 200:
            ms, added = timed(lambda i=i: mem.add([MemoryEvent(session_text(rng, i), id=f"t{i}")], prefill=True))
            add_ms.append(ms)
            add_len.append(mem.stats().rows)
            ids.append(added[0].id)
            if i in update_at:
                mem.update(rng.choice(ids), session_text(rng, i) + " (updated)", prefill=True)
            while queries_at and queries_at[0] <= i:
                queries_at.pop(0)
                ask()
            i += 1
        for _ in queries_at:  # the session ended before these slots: ask at its end
            ask()
        s = mem.stats()
        seg_bytes = sum(f.stat().st_size for f in (Path(tmp) / "mem" / "segments").glob("*.safetensors"))
        cfg = lm.model.config.get_text_config()
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_token = (
            2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.empty(0, dtype=lm.model.dtype).element_size()
        )
        physical = s.rows * per_token
        mem.close()

    slope = st.linregress(np.log(add_len[len(add_len) // 4 :]), np.log(add_ms[len(add_ms) // 4 :])).slope
    med = statistics.median
    print(f"history: {s.events} events, {s.rows} rows; {len(served_ms)} queries, {args.updates} updates, k = {args.k}")
    print(
        f"per query (median ms): served {med(served_ms):.0f}, text re-prefill {med(text_ms):.0f}, "
        f"full re-prefill {med(full_ms):.0f}"
    )
    print(f"add (eager prefill of one event): median {med(add_ms):.0f} ms; log-log slope vs history length {slope:.2f}")
    print(
        f"KV segment bytes: {seg_bytes:,} for {s.rows} rows = {seg_bytes / s.rows:,.0f} bytes/token; "
        f"physical {per_token:,}"
    )
    print(f"served vs full re-prefill: {med(full_ms) / med(served_ms):.1f}x")
    print(f"served vs text re-prefill: {med(text_ms) / med(served_ms):.1f}x")
    print(f"bytes on disk / physical KV: {seg_bytes / physical:.3f}x")
    if not math.isfinite(slope):
        raise SystemExit("slope is not finite")


if __name__ == "__main__":
    main()
