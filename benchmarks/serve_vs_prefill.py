"""Serve-from-stored-EventKV vs re-prefill, measured in one run.

For a packaged model (default smollm2-135m) and an event log of ~L tokens (default ~4k):
  A. answer a query from the EventKV stored on disk, serving 5% of the events
     (load from disk + compact serving + query forward + greedy tokens);
  B. answer the same query by re-prefilling the whole history (+ query, same greedy tokens).
Prints `speed-up: N.Nx` (= time B / time A, medians over repeats) and the stored EventKV bytes
per token against the physical size 2 x layers x kv_heads x head_dim x bytes.

    python benchmarks/serve_vs_prefill.py [--model smollm2-135m] [--tokens 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import DynamicCache

from eventkv.kv.log import Event, EventLog, TokenizedLog, tokenize, tokenize_query
from eventkv.kv.model import model_forward
from eventkv.kv.prefill import prefill
from eventkv.kv.readout import generate
from eventkv.kv.rows import EventKV
from eventkv.kv.serve import serve
from eventkv.models import load


def make_log(tokenizer, profile, target_tokens: int, seed: int = 0) -> EventLog:
    """A seeded log of register steps (``e0``, ``e1`` ...), just long enough that the chat head and
    the events reach ``target_tokens`` tokens (at most one event over)."""
    rng = random.Random(seed)
    events, n, i = [], len(tokenizer(profile.chat_head)["input_ids"]), 0
    while n < target_tokens:
        text = (
            f"<step {i}> action: refresh register R{rng.randrange(100)} "
            f"observation: register R{rng.randrange(100)} refreshed to {rng.randrange(1000):03d}"
        )
        events.append(Event(f"e{i}", text))
        n += len(tokenizer(text + "\n", add_special_tokens=False)["input_ids"])
        i += 1
    return EventLog(events, instruction="You track registers. Answer with the value only.")


def served_and_query(log: EventLog, tokenizer, profile, fraction: float, seed: int = 1) -> tuple[list[str], list[int]]:
    """A seeded served set (``fraction`` of the log's events, at least one, in log order) and the
    token ids of a question about one register (question + chat tail)."""
    rng = random.Random(seed)
    served = sorted(rng.sample(log.ids, max(1, round(fraction * len(log.ids)))), key=log.ids.index)
    query = tokenize_query(tokenizer, profile, f"What was register R{rng.randrange(100)} last refreshed to?")
    return served, query


def timed(fn: Callable[[], object], repeats: int, sync: Callable[[], object] | None = None) -> tuple[float, object]:
    """Median wall seconds over ``repeats`` calls of ``fn``, and the last call's result.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each clock read, so work an accelerator
    still has queued is counted in the call that queued it.
    """
    times, out = [], None
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        out = fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


@torch.inference_mode()
def reprefill_answer(model, tlog: TokenizedLog, query: list[int], new_tokens: int) -> list[int]:
    """Answer ``query`` with no stored rows: one forward over the history's ids and the query's at
    the log's positions (``[1, n_rows + len(query)]``, the query right after ``history_end``), then
    ``new_tokens`` greedy steps at batch 1 (no stop tokens: always ``new_tokens`` ids). Runs on the
    model's device. Returns the generated token ids."""
    dev = next(model.parameters()).device
    ids = tlog.input_ids + query
    pos = tlog.position_ids + list(range(tlog.history_end, tlog.history_end + len(query)))
    cache = DynamicCache()
    logits = model_forward(
        model, torch.tensor([ids], device=dev), torch.tensor([pos], device=dev), cache, logits_to_keep=1
    )[0, -1]
    toks, p = [], pos[-1] + 1
    for _ in range(new_tokens):
        tok = int(logits.argmax())
        toks.append(tok)
        if len(toks) == new_tokens:
            break
        step = model_forward(
            model, torch.tensor([[tok]], device=dev), torch.tensor([[p]], device=dev), cache, logits_to_keep=1
        )
        logits = step[0, -1]
        p += 1
    return toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--served-fraction", type=float, default=0.05)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)

    lm = load(args.model, dtype=args.dtype)
    log = make_log(lm.tokenizer, lm.profile, args.tokens)
    tlog = tokenize(log, lm.tokenizer, lm.profile)
    served, query = served_and_query(log, lm.tokenizer, lm.profile, args.served_fraction)
    print(
        f"model {args.model} ({lm.profile.dtype}), history {tlog.n_rows} tokens in {len(log.ids)} events, "
        f"served {len(served)} events ({args.served_fraction:.0%}), query {len(query)} tokens, "
        f"{args.new_tokens} new tokens"
    )

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ekv = prefill(lm.model, tlog, weights_digest=lm.profile.weights_digest)
        t_prefill = time.perf_counter() - t0
        store = ekv.save(Path(tmp) / "kv")
        stored_bytes = (store / "kv.safetensors").stat().st_size

        def from_store():
            kv = EventKV.load(store, verify=False)
            sc = serve(kv, served, "compact")
            return generate(lm.model, sc, query, max_new_tokens=args.new_tokens)

        def reprefill():
            return reprefill_answer(lm.model, tlog, query, args.new_tokens)

        from_store()  # warm-up (allocator, kernels)
        t_serve, _ = timed(from_store, args.repeats)
        t_full, _ = timed(reprefill, args.repeats)

    prof = lm.profile
    elem = torch.empty(0, dtype=ekv.keys[0].dtype).element_size()
    physical = 2 * prof.num_layers * prof.num_kv_heads * prof.head_dim * elem
    per_token = stored_bytes / tlog.n_rows
    print(f"one-time global prefill: {t_prefill:.2f} s")
    print(f"answer from stored EventKV (load + serve + query + {args.new_tokens} tokens): {t_serve * 1000:.1f} ms")
    print(f"answer by re-prefilling the history: {t_full * 1000:.1f} ms")
    print(f"speed-up: {t_full / t_serve:.1f}x")
    print(
        f"stored EventKV: {stored_bytes} bytes for {tlog.n_rows} tokens = {per_token:.1f} bytes/token; "
        f"physical 2 x {prof.num_layers} x {prof.num_kv_heads} x {prof.head_dim} x {elem} = {physical} bytes/token"
    )
    print(f"bytes-per-token ratio: {per_token / physical:.3f}x")


if __name__ == "__main__":
    main()
