"""Are a memory's rows as readable as their text? Per question of a ``memory eval`` run, the question's evidence
served from the memory's stored rows (compact, each row re-rotated to contiguous positions) against the same
events re-prefilled as text, with and without their session headers (``--original``: the rows also read at the
positions they were computed at); then, with ``--window N``, the same
history prefilled again in windows of N positions (each row computed with only the header and the rows just
before it in view, :class:`eventkv.kv.windowed.PrefillWindow`) and the evidence and the run's own served set
(its first selector and budget, in the run's order) served from those rows.

    python benchmarks/evidence_rows.py RUN --conversation 0 --window 2048

``RUN`` is a run folder of ``eventkv memory eval`` that keeps its memories (``RUN/memories/cK``) and its records'
questions and gold answers (not a redacted copy: LoCoMo's text stays outside the repository). The model and
dtype are the run's. Prints one line per question (token F1 of each way, LoCoMo's metric), then each way's mean
and the paired differences rows - text with their Wilcoxon signed-rank p (scipy). A way that reproduces the run's
own rows arm (``served set (run)``) is printed too, as a check that the reopened memory serves what the run
served.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path


def _evidence_sets(events, evidence: list[str]) -> dict[str, list[str]]:
    """The evidence ids in the memory's (history) order, alone and each after its session's header event: the
    header events (tag ``"header"``) the run's gold arm serves with them, none where the run has no headers."""
    want, header, alone, headed = set(evidence), None, [], []
    for e in events:
        if "header" in e.tags:
            header = e.id
        elif e.id in want:
            alone.append(e.id)
            headed += [header, e.id] if header is not None and header not in headed else [e.id]
    return {"evidence": alone, "header + evidence": headed} if headed != alone else {"evidence": alone}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.replace("``", "`"),
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=32),
    )
    parser.add_argument("run", help="a memory eval run folder with its memories and unredacted records")
    parser.add_argument(
        "--conversation", type=int, default=0, help="the conversation's index in the run (cK; default 0)"
    )
    parser.add_argument("--window", type=int, default=None, help="also prefill the history in windows of N positions")
    parser.add_argument(
        "--original", action="store_true", help="also serve the evidence's rows at their original positions"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own count)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="greedy answer length limit (default 24)")
    args = parser.parse_args(argv)

    import scipy.stats
    import torch

    from eventkv.errors import EventKVError
    from eventkv.kv.windowed import PrefillWindow
    from eventkv.memory import EventMemory, MemoryEvent
    from eventkv.models import load
    from eventkv.studies.materialization.answer_metric import score_answer
    from eventkv.studies.materialization.memory_eval import first_line, question_prompt

    if args.threads:
        torch.set_num_threads(args.threads)
    run = Path(args.run)
    try:
        if not (run / "manifest.json").is_file():
            raise EventKVError(
                f"{str(run)!r} is not a memory eval run folder (no manifest.json): give the --out of an eventkv "
                "memory eval run."
            )
        manifest = json.loads((run / "manifest.json").read_text())
        ident = manifest["identity"]
        opts = ident["options"]
        store = run / "memories" / f"c{args.conversation}"
        if not store.is_dir():
            raise EventKVError(f"{str(store)!r} does not exist: give a run folder that keeps its memories.")
        records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines() if line.strip()]
        lm = load(ident["model"], dtype=ident["dtype"])
        mems = {"": EventMemory.open(store, lm)}
        ids = [r["conversation"] for r in records if "arms" in r]
        conv_id = list(dict.fromkeys(ids))[args.conversation] if len(set(ids)) > args.conversation else None
        records = [r for r in records if "arms" in r and r["conversation"] == conv_id and "question" in r]
        if not records:
            raise EventKVError(f"{str(run)!r} has no unredacted question of conversation {args.conversation}.")
        tmp = None
        if args.window:
            tmp = Path(tempfile.mkdtemp(prefix="evidence-rows-"))
            header = json.loads((store / "manifest.json").read_text()).get("instruction")
            win = PrefillWindow.for_context(lm.profile.max_context, size=args.window)
            mem = EventMemory.create(tmp / "m", lm, namespace="eval", instruction=header, window=win)
            mem.add([MemoryEvent(e.text, id=e.id, tags=tuple(e.tags)) for e in mems[""].list()], prefill=True)
            mems[f" (window {args.window})"] = mem
    except (EventKVError, OSError, KeyError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    selector, budget = opts["selectors"][0], opts["budgets"][0]
    order = opts.get("order", "log")
    f1s: dict[str, list[float]] = {}
    print(f"{ident['model']} ({ident['dtype']}), conversation {conv_id}, {len(records)} questions")
    ways = [("compact", "contiguous", "rows"), ("text", "contiguous", "text")]
    if args.original:
        ways.append(("compact", "original", "rows at original positions"))
    events = mems[""].list()
    for r in records:
        prompt = question_prompt(r["question"], r["category"])
        for suffix, mem in mems.items():
            for name, ids in _evidence_sets(events, r["evidence"]).items():
                for mode, positions, label in ways:
                    if suffix and label != "rows":
                        continue  # text does not depend on how the rows were prefilled
                    ans = mem.query(
                        prompt, select=ids, mode=mode, positions=positions, max_new_tokens=args.max_new_tokens
                    )
                    f1s.setdefault(f"{name}: {label}{suffix}", []).append(
                        score_answer(first_line(ans.text), r["gold"], r["category"]).f1
                    )
            ans = mem.query(
                r["question"] if order == "relevance" else prompt,
                selector=selector,
                budget=budget,
                order=order,
                with_headers=opts.get("with_headers", False),
                neighbours=opts.get("neighbours", 0),
                positions="contiguous",
                messages=[{"role": "user", "content": prompt}] if order == "relevance" else None,
                max_new_tokens=args.max_new_tokens,
            )
            f1s.setdefault(f"served set (run): rows{suffix}", []).append(
                score_answer(first_line(ans.text), r["gold"], r["category"]).f1
            )
        line = [f"{k} {v[-1]:.2f}" for k, v in f1s.items()]
        print(f"  {r['index']:>4} category {r['category']}: " + "; ".join(line), flush=True)
    for mem in mems.values():
        mem.close()
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    print("way                                        mean F1     n")
    for k, v in f1s.items():
        print(f"{k:<42} {sum(v) / len(v):>8.3f} {len(v):>5}")
    for k, v in f1s.items():
        base = k.split(": ")[0] + ": text"
        if ": rows" not in k or base not in f1s:
            continue
        d = [a - b for a, b in zip(v, f1s[base])]
        nz = [x for x in d if x]
        p = scipy.stats.wilcoxon(nz).pvalue if len(nz) >= 1 else float("nan")
        better, worse = sum(x > 0 for x in d), sum(x < 0 for x in d)
        print(f"{k} - text: {sum(d) / len(d):+.3f} ({better}:{worse}, Wilcoxon p {p:.3g}, n {len(d)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
