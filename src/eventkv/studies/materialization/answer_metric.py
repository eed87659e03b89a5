"""LoCoMo's answer metric: token F1 after LoCoMo's normalization, with its
per-category rules, and exact match after the same normalization.

Source: Maharana et al. 2024, "Evaluating Very Long-Term Conversational Memory of LLM Agents" (ACL 2024,
arXiv 2402.17753), which scores question answering by F1 after answer normalization, and its evaluation code,
github snap-research/locomo, branch ``code``, ``task_eval/evaluation.py`` (``normalize_answer``,
``f1_score``, ``f1``, ``exact_match_score``, ``eval_question_answering``). Written here from that
description, not copied. What the code does:

- **normalization** (:func:`normalize_answer`): delete commas; lowercase; delete every ASCII punctuation
  character (``string.punctuation``); delete the whole words ``a``, ``an``, ``the`` and ``and`` (``and``
  for every category, not only some); collapse whitespace.
- **token F1** (:func:`token_f1`): both texts normalized, split on whitespace, and every token stemmed
  with NLTK's Porter stemmer (``nltk.stem.PorterStemmer()``, default mode); F1 of the multiset overlap.
  No common token gives 0, also when both are empty (SQuAD would give 1 there; LoCoMo gives 0).
- **per category** (:func:`score_answer`): 1 (multi-hop): the prediction and the answer are each split on
  ``,`` and the score is the mean over answer parts of the best F1 against any prediction part
  (:func:`multi_answer_f1`); 2 (temporal) and 4 (single-hop): token F1; 3 (open-domain): token F1
  against the answer's part before the first ``;``; 5 (adversarial): 1 when the prediction contains
  ``"no information available"`` or ``"not mentioned"`` (case-insensitive), else 0 — the answer is not
  used.
- **exact match** (:func:`exact_match`): LoCoMo's ``exact_match_score`` compares the *sets* of normalized
  tokens (no stemming), so word order and repeats do not matter.

The stemmer needs the ``nltk`` package (pure Python, no data download for the Porter stemmer).
"""

from __future__ import annotations

import functools
import re
import string
from collections import Counter
from dataclasses import dataclass

from eventkv.errors import EventKVError, OptionError

_PUNCT = str.maketrans("", "", string.punctuation)
_DROPPED_WORDS = re.compile(r"\b(a|an|the|and)\b")
#: phrases LoCoMo accepts as the right response to an adversarial (category 5) question
ABSTENTIONS = ("no information available", "not mentioned")
CATEGORIES = (1, 2, 3, 4, 5)


def normalize_answer(text: str) -> str:
    """``text`` as LoCoMo normalizes it: commas deleted, lowercased, ASCII punctuation deleted, the words
    a/an/the/and deleted, whitespace collapsed (module docstring). E.g. ``"The cat, and a Dog!"`` ->
    ``"cat dog"``."""
    text = text.replace(",", "").lower().translate(_PUNCT)
    return " ".join(_DROPPED_WORDS.sub(" ", text).split())


@functools.cache
def _porter():
    try:
        from nltk.stem import PorterStemmer
    except ImportError:
        raise EventKVError(
            "LoCoMo's token F1 stems tokens with NLTK's Porter stemmer and the nltk package is not installed: "
            "pip install nltk (or pass stem=False, which is not LoCoMo's metric)."
        ) from None
    return PorterStemmer()


def answer_tokens(text: str, *, stem: bool = True) -> list[str]:
    """The tokens token F1 compares: :func:`normalize_answer` split on whitespace, each Porter-stemmed when
    ``stem``.

    Raises:
        EventKVError: ``stem`` and the nltk package is not installed.
    """
    words = normalize_answer(text).split()
    if not stem:
        return words
    porter = _porter()
    return [porter.stem(w) for w in words]


def token_f1(prediction: str, answer: str, *, stem: bool = True) -> float:
    """Token F1 in [0, 1] of ``prediction`` against ``answer`` (LoCoMo's ``f1_score``): precision and
    recall of the multiset overlap of :func:`answer_tokens`; 0 when they share no token. No category rule:
    to score a LoCoMo question use :func:`score_answer`.

    Raises:
        EventKVError: ``stem`` and the nltk package is not installed.
    """
    pred, gold = answer_tokens(prediction, stem=stem), answer_tokens(answer, stem=stem)
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def multi_answer_f1(prediction: str, answer: str, *, stem: bool = True) -> float:
    """LoCoMo's category-1 F1 (its ``f1``): both texts split on ``,``; the mean over the answer's parts of
    the best :func:`token_f1` against any part of the prediction. In [0, 1].

    Raises:
        EventKVError: ``stem`` and the nltk package is not installed.
    """
    preds = [p.strip() for p in prediction.split(",")]
    golds = [g.strip() for g in answer.split(",")]
    return sum(max(token_f1(p, g, stem=stem) for p in preds) for g in golds) / len(golds)


def exact_match(prediction: str, answer: str) -> bool:
    """LoCoMo's exact match: the sets of normalized tokens (:func:`normalize_answer`, no stemming) are
    equal."""
    return set(normalize_answer(prediction).split()) == set(normalize_answer(answer).split())


def abstains(prediction: str) -> bool:
    """Whether ``prediction`` says the conversation does not tell (LoCoMo's category-5 rule: it contains
    one of :data:`ABSTENTIONS`, case-insensitive)."""
    low = prediction.lower()
    return any(p in low for p in ABSTENTIONS)


@dataclass(frozen=True)
class AnswerScore:
    """One answer's scores: ``f1`` in [0, 1] (LoCoMo's per-category F1) and ``exact`` (exact match against
    the same reference; category 5: whether the prediction abstains)."""

    f1: float
    exact: bool


def score_answer(prediction: str, answer: str, category: int, *, stem: bool = True) -> AnswerScore:
    """Score a predicted answer as LoCoMo's ``eval_question_answering`` does for ``category`` (module
    docstring): 1 -> :func:`multi_answer_f1`; 2, 4 -> :func:`token_f1`; 3 -> :func:`token_f1` against the
    answer's part before the first ``;``; 5 -> 1.0 when the prediction :func:`abstains`, else 0.0.
    ``exact`` is :func:`exact_match` against the same reference (category 5: abstains).

    Raises:
        OptionError: ``category`` is not 1-5.
        EventKVError: ``stem`` and the nltk package is not installed.
    """
    if isinstance(category, bool) or category not in CATEGORIES:
        raise OptionError("category", category, "give a LoCoMo question category, 1-5.")
    if category == 5:
        ok = abstains(prediction)
        return AnswerScore(float(ok), ok)
    if category == 3:
        answer = answer.split(";")[0].strip()
    f1 = multi_answer_f1(prediction, answer, stem=stem) if category == 1 else token_f1(prediction, answer, stem=stem)
    return AnswerScore(f1, exact_match(prediction, answer))
