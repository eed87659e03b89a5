"""Scoring one donor pair (Study 1, "Donor pair"): the pair's outcome from the two variants'
answers (:func:`outcome`), the continuous donor statistic from their candidate log-probabilities
(:func:`donor_d`), and per-variant correctness and candidate shares read off a record."""

from __future__ import annotations

import math

VARIANTS = ("A", "B")
#: pair outcomes (Study 1, "Donor pair"), in table order
OUTCOMES = ("follow", "anti", "constant", "other")
#: the leading columns of every outcome table: the arm, the readout, the number of pairs, each outcome's count
OUTCOME_COLUMNS = ("arm", "readout", "pairs", *OUTCOMES)


def outcome(answer_a: str | None, answer_b: str | None, a: str, b: str) -> str:
    """Pair outcome from the two variants' answers (variant A's source wrote ``a``, B's ``b``):
    ``follow`` (each answers its own source's value), ``anti`` (each answers the other's),
    ``constant`` (both give the same answer), ``other`` (anything else, e.g. no answer)."""
    if answer_a == a and answer_b == b:
        return "follow"
    if answer_a == b and answer_b == a:
        return "anti"
    if answer_a is not None and answer_a == answer_b:
        return "constant"
    return "other"


def log_odds(logprobs: dict[str, float], state: str) -> float:
    """log-odds of ``state`` among the candidates: ``lp(state) - logsumexp(lp(others))`` (nats)."""
    others = [v for k, v in logprobs.items() if k != state]
    m = max(others)
    return logprobs[state] - (m + math.log(sum(math.exp(v - m) for v in others)))


def donor_d(lp_a: dict[str, float], lp_b: dict[str, float], a: str, b: str) -> float:
    """The continuous donor statistic of one pair (Study 1, "Donor pair"), in nats:
    ``d = ½([lo(a|A) - lo(a|B)] + [lo(b|B) - lo(b|A)])`` where ``lo(v|X)`` is the log-odds of ``v``
    among the candidates in variant X (:func:`log_odds`); d > 0 leans toward each variant's own
    unserved value. ``lp_a``/``lp_b``: candidate log-probabilities per variant."""
    return 0.5 * ((log_odds(lp_a, a) - log_odds(lp_b, a)) + (log_odds(lp_b, b) - log_odds(lp_a, b)))


def correct(record: dict, arm: str, readout: str, value_key: str = "values") -> list[bool]:
    """Per variant (A, B): did ``arm`` answer that variant's own value under ``readout``?"""
    key = "answer" if readout == "generate" else "choice"
    gold = record[value_key] if readout == "generate" else record.get("gold_candidates", record[value_key])
    return [record["arms"][arm][v].get(key) == g for v, g in zip(VARIANTS, gold)]


def candidate_share(out: dict, candidate: str) -> float:
    """Probability share of ``candidate`` among the scored candidates (softmax of their log-probs)."""
    lps = out["logprobs"]
    m = max(lps.values())
    return math.exp(lps[candidate] - m) / sum(math.exp(v - m) for v in lps.values())
