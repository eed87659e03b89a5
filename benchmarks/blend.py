"""Selective recompute (serve mode ``blend``, CacheBlend) against its two ends, measured in one run.

For a packaged model (default smollm2-135m) and the first LoCoMo conversation truncated to ~T tokens
of turns (default 2000; one event per turn, ``Turn.event_text()``), each of the first Q questions
whose evidence lies in the kept turns is served a set of turns: its evidence turns plus a seeded
sample of the others (``--served`` of the turns in all). The same served set is served as

* ``compact`` — the stored rows (computed in the whole history's context), nothing recomputed;
* ``blend`` — the stored rows with ``--recompute`` of the served tokens re-prefilled (default 0.15);
* ``blend 1.0`` — every served token re-prefilled at its original positions (blend's upper end);
* ``text`` — header + served turns re-prefilled as plain text at contiguous positions.

Prints, per arm, the median serve time (building the served cache) and the time to the first
token's logits (serve + the question's forward), their ratios, and the KL divergence (nats) of
each arm's next-token distribution after the question from the text arm's and from blend 1.0's
(mean over the questions): where blend sits between the rows and a re-prefill.

    python benchmarks/blend.py [--model smollm2-135m] [--tokens 2000] [--questions 5] [--served 0.25]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time

import torch

from eventkv.kv.log import Event, EventLog, tokenize, tokenize_query
from eventkv.kv.model import model_forward
from eventkv.kv.prefill import prefill
from eventkv.kv.serve import ServedCache, serve
from eventkv.models import load
from eventkv.options import DIALOGUE_FORMATS
from eventkv.studies.materialization.dialogue import truncate

LOCOMO = "/work/shared/data/locomo/locomo10-dev.json"
ARMS = ("compact", "blend", "blend 1.0", "text")


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) in nats of two next-token distributions given as logits ``[vocab]`` (float64)."""
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


@torch.inference_mode()
def first_logits(model, served: ServedCache, query: list[int]) -> torch.Tensor:
    """The next-token logits ``[vocab]`` after ``query`` read from ``served`` (positions from its next one)."""
    pos = torch.arange(served.next_position, served.next_position + len(query)).unsqueeze(0)
    return model_forward(model, torch.tensor([query]), pos, served.to_cache(), logits_to_keep=1)[0, -1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default=LOCOMO)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--served", type=float, default=0.25, help="fraction of the turns served (evidence included)")
    ap.add_argument("--recompute", type=float, default=0.15)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    lm = load(args.model, dtype="float32")
    conv = truncate(DIALOGUE_FORMATS.get("locomo")(args.data)[0], lm.tokenizer, args.tokens)
    events = [Event(t.id, t.event_text()) for t in conv.turns]
    log = tokenize(EventLog(events, instruction="Answer from the conversation."), lm.tokenizer, lm.profile)
    t0 = time.perf_counter()
    ekv = prefill(lm.model, log)
    prefill_s = time.perf_counter() - t0
    cpu = platform.processor() or platform.machine()
    threads = f"{torch.get_num_threads()} torch threads, {os.cpu_count()} cores"
    print(f"model: {args.model} float32 on the CPU ({cpu}, {threads})", flush=True)
    print(
        f"history: {conv.id}, {len(events)} turns, {log.history_end} positions; global prefill {prefill_s:.2f} s; "
        f"{len(conv.questions)} questions with evidence inside",
        flush=True,
    )
    modes = {
        "compact": dict(mode="compact"),
        "blend": dict(mode="blend", recompute=args.recompute),
        "blend 1.0": dict(mode="blend", recompute=1.0),
        "text": dict(mode="text"),
    }
    rng = random.Random(0)
    serve_ms: dict[str, list[float]] = {a: [] for a in ARMS}
    ttft_ms: dict[str, list[float]] = {a: [] for a in ARMS}
    kl_text: dict[str, list[float]] = {a: [] for a in ARMS}
    kl_full: dict[str, list[float]] = {a: [] for a in ARMS}
    n_served_tokens = []
    for qa in conv.questions[: args.questions]:
        want = max(len(qa.evidence), round(args.served * len(events)))
        others = [e.id for e in events if e.id not in qa.evidence]
        served = set(qa.evidence) | set(rng.sample(others, want - len(qa.evidence)))
        ids = [e.id for e in events if e.id in served]
        n_served_tokens.append(int(ekv.rows_of(ids, include_header=False).shape[0]))
        query = tokenize_query(lm.tokenizer, lm.profile, qa.question)
        logits = {}
        for arm, kw in modes.items():
            times, totals = [], []
            for _ in range(args.repeats):
                t1 = time.perf_counter()
                sc = serve(ekv, ids, model=lm.model, **kw)  # type: ignore[arg-type]
                t2 = time.perf_counter()
                logits[arm] = first_logits(lm.model, sc, query)
                t3 = time.perf_counter()
                times.append(1e3 * (t2 - t1))
                totals.append(1e3 * (t3 - t1))
            serve_ms[arm].append(statistics.median(times))
            ttft_ms[arm].append(statistics.median(totals))
        for arm in ARMS:
            kl_text[arm].append(kl(logits["text"], logits[arm]))
            kl_full[arm].append(kl(logits["blend 1.0"], logits[arm]))
        print(
            f"  question {len(n_served_tokens)}: {len(ids)} turns, {n_served_tokens[-1]} tokens served; serve ms "
            + ", ".join(f"{arm} {serve_ms[arm][-1]:.0f}" for arm in ARMS),
            flush=True,
        )
    n_q = len(n_served_tokens)
    print(
        f"served: {n_q} questions, {args.served:.0%} of the turns each (evidence included), "
        f"{statistics.mean(n_served_tokens):.0f} served event tokens on average; blend recomputes {args.recompute:.0%}"
    )
    for arm in ARMS:
        serve_t, first_t = statistics.median(serve_ms[arm]), statistics.median(ttft_ms[arm])
        kt, kf = statistics.mean(kl_text[arm]), statistics.mean(kl_full[arm])
        print(
            f"{arm:>9}: serve {serve_t:8.1f} ms, first token {first_t:8.1f} ms; "
            f"KL from text {kt:.4f} nats, from blend 1.0 {kf:.4f} nats"
        )

    def ratio(a: str, b: str, table: dict[str, list[float]]) -> float:
        return statistics.median(table[a]) / statistics.median(table[b])

    print(
        f"serve time: text / blend {ratio('text', 'blend', serve_ms):.2f}x, blend 1.0 / blend "
        f"{ratio('blend 1.0', 'blend', serve_ms):.2f}x, blend / compact {ratio('blend', 'compact', serve_ms):.1f}x"
    )
    print(
        f"first token: text / blend {ratio('text', 'blend', ttft_ms):.2f}x, blend 1.0 / blend "
        f"{ratio('blend 1.0', 'blend', ttft_ms):.2f}x, blend / compact {ratio('blend', 'compact', ttft_ms):.2f}x"
    )
    closed = [
        1 - b / c if c > 0 else float("nan") for b, c in zip(kl_full["blend"], kl_full["compact"])
    ]  # share of the rows' distance to a full recompute that blend removes
    rows_text, blend_text = statistics.mean(kl_text["compact"]), statistics.mean(kl_text["blend"])
    print(
        f"KL to blend 1.0 closed by blend: {statistics.mean(closed):.0%} (mean over questions); "
        f"KL from text: compact {rows_text:.4f}, blend {blend_text:.4f} (blend closer: {blend_text < rows_text})"
    )


if __name__ == "__main__":
    main()
