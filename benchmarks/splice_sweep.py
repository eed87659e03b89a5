"""Splice sweep vs the naive loop (Study 2 probe).

Naive: every (item, arm, cutoff, step) cell runs from scratch — clean prefill + clean decode up to
the splice step, the donor prefill, the splice and its decode (``eventkv.studies.splice.engine.splice_generate``).
Sweep: per item one clean run and one donor prefill, then every cell as a batched splice over the
shared rows (``clean_run`` + ``donor_rows`` + ``splice_sweep``), with and without the early exit the
probe uses (for ``--match word``, the default, or ``exact``). Prints wall times, the speed-ups, and
how many cells give the same tokens (and scores) as the naive path.

    python benchmarks/splice_sweep.py [--model smollm2-135m] [--items 2] [--cutoff-every 6]
"""

from __future__ import annotations

import argparse
import time

import torch

from eventkv.studies.splice.engine import (
    Splice,
    SplicePrompt,
    clean_run,
    donor_rows,
    filler_ids,
    splice_generate,
    splice_sweep,
)
from eventkv.studies.splice.tasks import builtin_items, outcome_decided, score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="packaged alias / HF dir, or 'tiny' (random tiny Llama)")
    ap.add_argument("--task", default="lookup")
    ap.add_argument("--items", type=int, default=2)
    ap.add_argument("--cutoff-every", type=int, default=6)
    ap.add_argument("--arms", default="scaffold,zero-kv,mask")
    ap.add_argument("--steps", default="0,1")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--match", default="word", help="matcher of the early exit and the score check: word | exact")
    args = ap.parse_args()

    if args.model == "tiny":
        from eventkv.testing import tiny_lm

        lm = tiny_lm("llama")
    else:
        from eventkv.models import load

        lm = load(args.model)
    model, tok, prof = lm.model, lm.tokenizer, lm.profile
    n_layers = model.config.get_text_config().num_hidden_layers
    cutoffs = sorted(set(range(0, n_layers, args.cutoff_every)) | {n_layers})
    steps = [int(s) for s in args.steps.split(",")]
    arms = args.arms.split(",")
    cells = [Splice(a, tuple(range(c, n_layers)), step=t) for a in arms for c in cutoffs for t in steps]
    items = builtin_items(args.task, 0, range(args.items))
    stops = list(prof.stop_token_ids)
    kw = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
    print(
        f"model {args.model} ({n_layers} layers), {args.items} items x {len(cells)} cells "
        f"({len(arms)} arms x {len(cutoffs)} cutoffs x {len(steps)} steps), max {args.max_new_tokens} new tokens, "
        f"torch threads {torch.get_num_threads()}"
    )

    prompts = [SplicePrompt.from_text(tok, prof, it["prompt"]) for it in items]
    fills = [filler_ids(tok, len(p.span_ids)) for p in prompts]

    t0 = time.perf_counter()
    naive = []
    for p, f in zip(prompts, fills):
        naive.append([splice_generate(model, p, c, donor_ids=f, **kw).tokens for c in cells])
    t_naive = time.perf_counter() - t0

    def sweep(early: bool):
        out = []
        for it, p, f in zip(items, prompts, fills):
            dec = (
                (lambda toks, it=it: outcome_decided(tok.decode(toks, skip_special_tokens=True), it, args.match))
                if early
                else None
            )
            run = clean_run(model, p, decided=dec, **kw)
            donors = {"scaffold": donor_rows(model, run, f)}
            out.append(
                [
                    r.tokens
                    for r in splice_sweep(
                        model, run, cells, donors=donors, batch_size=args.batch_size, decided=dec, **kw
                    )
                ]
            )
        return out

    t0 = time.perf_counter()
    fast = sweep(False)
    t_fast = time.perf_counter() - t0
    t0 = time.perf_counter()
    early = sweep(True)
    t_early = time.perf_counter() - t0

    n = len(cells) * len(items)
    same = sum(a == b for xs, ys in zip(naive, fast) for a, b in zip(xs, ys))
    same_score = sum(
        score(tok.decode(a, skip_special_tokens=True), it, args.match)[0]
        == score(tok.decode(b, skip_special_tokens=True), it, args.match)[0]
        for it, xs, ys in zip(items, naive, early)
        for a, b in zip(xs, ys)
    )
    print(f"naive loop (prefills + decode per cell):        {t_naive:8.1f} s")
    print(
        f"sweep (shared prefills, batched splices):       {t_fast:8.1f} s   speed-up x{t_naive / t_fast:.1f}   "
        f"same tokens as naive: {same}/{n}"
    )
    print(
        f"sweep + {args.match}-matcher early exit:          {t_early:8.1f} s   speed-up x{t_naive / t_early:.1f}   "
        f"same score as naive: {same_score}/{n}"
    )


if __name__ == "__main__":
    main()
