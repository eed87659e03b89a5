"""How far the dates written in LoCoMo's evidence turns reach toward the temporal answers: for every category-2
question, the best token F1 (LoCoMo's metric, :func:`eventkv.studies.materialization.answer_metric.token_f1`) that
any date string of its evidence turns reaches against the gold answer -- the session dates alone, then with each
relative expression's resolved date (:func:`eventkv.memory.dates.relative_dates`) -- and how many questions have a
relative expression in an evidence turn. No model: an upper bound on what a reader could copy from the turns.

    python benchmarks/temporal_dates.py ../shared/data/locomo/locomo10-dev.json
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="a LoCoMo-format JSON file")
    args = parser.parse_args(argv)

    from eventkv.memory.dates import relative_dates
    from eventkv.options import DIALOGUE_FORMATS
    from eventkv.studies.materialization.answer_metric import token_f1

    n = with_relative = 0
    dates_only = resolved = 0.0
    for conv in DIALOGUE_FORMATS.get("locomo")(args.data):
        turns = {t.id: t for t in conv.turns}
        for qa in conv.questions:
            evidence = [turns[e] for e in qa.evidence if e in turns]
            if qa.category != 2 or not evidence:
                continue
            n += 1
            # the session's date as the turn carries it: "1:56 pm on 8 May, 2023" -> "8 May, 2023"
            dates = [t.date_time.split(" on ")[-1] for t in evidence if t.date_time]
            written = [h.rendered for t in evidence if t.date_time for h in relative_dates(t.text, t.date_time)]
            with_relative += bool(written)
            dates_only += max((token_f1(d, qa.answer) for d in dates), default=0.0)
            resolved += max((token_f1(d, qa.answer) for d in dates + written), default=0.0)
    if not n:
        print("no temporal question with evidence in this file", file=sys.stderr)
        return 1
    print(f"temporal questions with evidence: {n}")
    print(f"  with a relative expression in an evidence turn: {with_relative} ({with_relative / n:.0%})")
    print(
        f"  best F1 of a date string in the evidence turns: session dates {dates_only / n:.3f}, "
        f"with resolved dates {resolved / n:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
