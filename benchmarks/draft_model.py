"""A draft model against prompt lookup for the donor pair's long greedy answers: which verifies them in less time.

    python benchmarks/draft_model.py --model qwen2.5-coder-1.5b --dtype float32 \
        --draft qwen2.5-coder-0.5b --draft-dtype bfloat16 --threads 2 --pairs 6

eventkv's greedy readout drafts from the text its served events hold (prompt lookup,
:class:`eventkv.kv.decoding.PromptLookup`); speculative decoding with a smaller model of the same tokenizer
(Leviathan et al. 2023, arXiv 2211.17192, Sec. 2) is the other way to verify several tokens in one forward.
This benchmark runs ``eventkv run donor-pair`` with all four arms on the first ``--pairs`` + 1 pairs (seed 0,
the throughput benchmark's items) and keeps every greedy answer of more than ``--min-tokens`` tokens with
the token ids its drafts come from (its arm's served events and the question). For each such answer it
counts, exactly and without timing, the forwards of the model a greedy decode takes:

* plain: one a token (and one for the stop token);
* prompt lookup: eventkv's drafts (:data:`~eventkv.kv.decoding.DRAFT_TOKENS` tokens, n-grams of
  :data:`~eventkv.kv.decoding.DRAFT_NGRAM`), each forward keeping the draft's tokens the model agrees with
  and one token of its own;
* draft model: the draft model, its cache prefilled with the same source tokens, proposes
  ``--draft-tokens`` tokens greedily before each forward of the model; it costs that many forwards of
  the draft a round and one prefill of the source an answer.

The first token of every way comes from the question's forward, counted once in each. Then, in one process
and at the same threads, it times a forward of the model of 1 to ``--draft-tokens`` + 1 tokens over a cache of
the source's length, a decode step of the draft and the draft's prefill of each source (median of ``--repeats``),
and prints per answer and in total the seconds each way takes by those timings — the ratio of prompt lookup's
to the draft model's says which pays on this machine.

Both models come from eventkv's loader (aliases, hub ids or directories); they must share a tokenizer
(checked on the sources' token ids). Raises EventKVError when no answer is longer than ``--min-tokens``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Sequence
from unittest import mock

import torch
from transformers import DynamicCache

import eventkv.studies.materialization.pairs.engine as pair_engine
from eventkv.errors import EventKVError
from eventkv.kv.decoding import PromptLookup
from eventkv.models import load
from eventkv.probes import Runtime
from eventkv.studies.materialization.donor_pair import DonorPair

ALL_ARMS = ("kv", "isolated", "text-all", "kv-all")
#: the donor pair's answer budget (``eventkv run donor-pair --max-new-tokens``' default)
MAX_NEW_TOKENS = 64


def long_answers(rt: Runtime, pairs: int, min_tokens: int) -> list[dict]:
    """The greedy answers of more than ``min_tokens`` tokens of the first ``pairs`` donor pairs (all arms,
    seed 0): per answer its token ids with the stop token appended when one ended it (``tokens``), and the
    token ids its prompt-lookup drafts come from (``source``)."""
    found: list[dict] = []
    real = pair_engine.read_out

    def watching(model: Any, caches: Any, queries: Any, **kw: Any) -> Any:
        res = real(model, caches, queries, **kw)
        sources = kw.get("lookup") or [None] * len(res)
        for src, r in zip(sources, res):
            g = r.generation
            if g is not None and src and len(g.tokens) > min_tokens:
                stop = [min(rt.stop_token_ids)] if g.stopped else []
                found.append({"source": [int(t) for t in src], "tokens": list(g.tokens) + stop, "text": g.text})
        return res

    probe = DonorPair(max_new_tokens=MAX_NEW_TOKENS, arm_names=ALL_ARMS)
    with mock.patch.object(pair_engine, "read_out", watching):
        for item in probe.items(0, range(pairs)):
            probe.run_item(rt, item)
    return found


def lookup_rounds(source: Sequence[int], answer: Sequence[int], stops: set[int], room: int) -> list[int]:
    """The tokens fed in each forward of a greedy decode of ``answer`` (stop token included) drafted by prompt
    lookup as the readout drafts (``room``: the answer's token budget): the question's forward first
    (reported as 1), then one token and its draft a forward."""
    pl = PromptLookup(source, stops)
    rounds, i = [1], 1
    while i < len(answer):
        d = pl.draft(answer[:i], room - i)
        m = next((j for j, t in enumerate(d) if i + j >= len(answer) or t != answer[i + j]), len(d))
        rounds.append(1 + len(d))
        i += m + 1
    return rounds


@torch.inference_mode()
def draft_rounds(
    draft: Any, source: Sequence[int], answer: Sequence[int], k: int, stops: set[int], room: int
) -> tuple[list[int], int]:
    """As :func:`lookup_rounds`, drafted by ``draft``'s greedy continuation of ``source`` + the answer so far,
    ``k`` tokens a round (fewer when a stop token comes first or ``room``, the answer's token budget, ends),
    its cache prefilled with ``source`` and cropped to what the answer kept. Also returns the draft's own
    forwards after that prefill (one a proposed token, plus the catch-up after a round whose whole draft
    was kept)."""
    cache = DynamicCache()
    draft(torch.tensor([list(source)]), cache=cache, use_cache=True)
    base = len(source)
    rounds, i, steps = [1], 1, 0
    while i < len(answer):
        have, want = cache.get_seq_length(), base + i - 1  # the cache should hold source + answer[: i - 1]
        if have > want:
            cache.crop(want - have)
        elif have < want:
            draft(torch.tensor([list(answer[have - base : i - 1])]), cache=cache, use_cache=True)
            steps += 1
        feed, proposed = answer[i - 1], []
        for _ in range(min(k, room - i)):
            out = draft(torch.tensor([[feed]]), cache=cache, use_cache=True)
            steps += 1
            feed = int(out.logits[0, -1].argmax())
            if feed in stops:
                break
            proposed.append(feed)
        m = next((j for j, t in enumerate(proposed) if i + j >= len(answer) or t != answer[i + j]), len(proposed))
        rounds.append(1 + len(proposed))
        i += m + 1
    return rounds, steps


@torch.inference_mode()
def forward_seconds(model: Any, ids: Sequence[int], widths: Sequence[int], repeats: int) -> dict[int, float]:
    """Median seconds of one forward of ``w`` tokens (each of ``widths``; the first ``w`` of ``ids``) after a
    cache of ``ids``."""
    cache = DynamicCache()
    model(torch.tensor([list(ids)]), cache=cache, use_cache=True)
    out: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(repeats):
        for w in widths:
            t = time.perf_counter()
            model(torch.tensor([list(ids[:w])]), cache=cache, use_cache=True)
            out[w].append(time.perf_counter() - t)
            cache.crop(-w)
    return {w: statistics.median(v) for w, v in out.items()}


@torch.inference_mode()
def prefill_seconds(model: Any, ids: Sequence[int], repeats: int) -> float:
    """Median seconds of a prefill of ``ids`` (one forward)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model(torch.tensor([list(ids)]), cache=DynamicCache(), use_cache=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model (the same tokenizer)")
    ap.add_argument("--draft-dtype", default="bfloat16", help="its dtype (its numerics never reach an answer)")
    ap.add_argument("--draft-tokens", type=int, default=4, help="tokens the draft model proposes a round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=6, help="donor pairs run (their first is the warm-up of the timings)")
    ap.add_argument("--min-tokens", type=int, default=3, help="answers longer than this are counted")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.draft_tokens < 1:
        raise EventKVError(f"--draft-tokens {args.draft_tokens}: give a whole number >= 1.")
    torch.set_num_threads(args.threads)
    lm = load(args.model, dtype=args.dtype)
    dm = load(args.draft, dtype=args.draft_dtype)
    rt = Runtime(lm.model, lm.tokenizer, lm.profile)
    cpu = torch.backends.cpu.get_cpu_capability()
    print(
        f"model {args.model} ({lm.profile.dtype}), draft {args.draft} ({dm.profile.dtype}); "
        f"{args.threads} threads, {cpu}"
    )
    answers = long_answers(rt, args.pairs + 1, args.min_tokens)
    if not answers:
        raise EventKVError(
            f"no greedy answer longer than {args.min_tokens} tokens in {args.pairs + 1} pairs: give more --pairs."
        )
    for a in answers:
        text = dm.tokenizer.decode(a["source"][:64])
        if lm.tokenizer.decode(a["source"][:64]) != text:
            raise EventKVError(
                f"{args.draft!r} does not share {args.model!r}'s tokenizer: give a draft model of its family."
            )
    stops = set(rt.stop_token_ids)
    k = args.draft_tokens
    longest = max((a["source"] for a in answers), key=len)
    fwd = forward_seconds(lm.model, longest, range(1, max(k, 2) + 2), args.repeats)
    step = forward_seconds(dm.model, longest, [1], args.repeats)[1]
    print(
        f"model forward over {len(longest)} cached tokens: "
        + ", ".join(f"{w} tok {s * 1000:.0f} ms" for w, s in fwd.items())
    )
    print(f"draft decode step {step * 1000:.0f} ms ({step / fwd[1]:.2f} of the model's)")
    tot = {"plain": 0.0, "lookup": 0.0, "draft": 0.0}
    for a in answers:
        src, ans = a["source"], a["tokens"]
        pl = lookup_rounds(src, ans, stops, MAX_NEW_TOKENS)
        dr, steps = draft_rounds(dm.model, src, ans, k, stops, MAX_NEW_TOKENS)
        pre = prefill_seconds(dm.model, src, args.repeats)
        secs = {
            "plain": len(ans) * fwd[1],
            "lookup": sum(fwd[w] for w in pl),
            "draft": sum(fwd[w] for w in dr) + steps * step + pre,
        }
        for name, s in secs.items():
            tot[name] += s
        print(
            f"{len(ans)} tokens ({a['text'][:40]!r}...), source {len(src)}: forwards plain {len(ans)}, "
            f"lookup {len(pl)}, "
            f"draft {len(dr)} (+{steps} draft steps, prefill {pre:.2f} s); seconds plain {secs['plain']:.2f}, "
            f"lookup {secs['lookup']:.2f}, draft {secs['draft']:.2f}"
        )
    print(
        f"total over {len(answers)} answers: plain {tot['plain']:.2f} s, prompt lookup {tot['lookup']:.2f} s, "
        f"draft model {tot['draft']:.2f} s; draft model / prompt lookup {tot['draft'] / tot['lookup']:.2f}x the time"
    )


if __name__ == "__main__":
    main()
