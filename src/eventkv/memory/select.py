"""BM25 selection of events for a question (``select`` ranks events with BM25 over
their texts before the served set is completed with patches, pins and the header).

Scoring is the ``bm25s`` library's (Lù 2024, "BM25S: Orders of magnitude faster lexical search via
eager sparse scoring", arXiv 2407.03618); nothing here re-implements BM25. The choices, fixed so a
ranking is reproducible:

- **variant** ``method="lucene"`` (bm25s's default), with ``k1 = 1.5`` and ``b = 0.75``: a document
  ``D`` scores ``sum over query tokens t of idf(t) * tf(t, D) / (tf(t, D) + k1 * (1 - b + b * |D| / avgdl))``
  with ``idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))`` (Kamphuis et al. 2020, "Which BM25 do you
  mean?"). A query token given twice counts twice; a token absent from every text scores nothing.
- **tokenization** ``bm25s.tokenize``: lowercased, split by the pattern ``(?u)\\b\\w\\w+\\b`` (words of two
  or more word characters; one-character tokens are dropped), bm25s's English stopword list (NLTK's)
  removed, no stemming (stemming would need the PyStemmer package, which eventkv does not depend on).
"""

from __future__ import annotations

from collections.abc import Sequence

import bm25s
import numpy as np

from eventkv.errors import EventKVError, OptionError

#: bm25s's scoring variant and parameters used by :func:`rank` (see the module docstring)
METHOD, K1, B = "lucene", 1.5, 0.75
#: bm25s's stopword list used for texts and questions
STOPWORDS = "en"


def tokens(texts: Sequence[str]) -> list[list[str]]:
    """The BM25 tokens of each text, as :func:`rank` sees them (lowercased words of >= 2 characters,
    English stopwords removed; see the module docstring)."""
    return bm25s.tokenize(list(texts), stopwords=STOPWORDS, return_ids=False, show_progress=False)


def scores(texts: Sequence[str], question: str) -> np.ndarray:
    """BM25 score of every text for ``question``: ``[len(texts)]`` float32, in text order; 0 for a text
    sharing no token with the question (and for every text when the question has no token left after
    stopword removal, or no text has any token).

    Raises:
        EventKVError: no texts, or a blank question (see :func:`rank`).
    """
    texts = list(texts)
    _check(texts, question)
    corpus = tokens(texts)
    query = tokens([question])[0]
    if not any(corpus) or not query:
        # why: bm25s cannot index an empty vocabulary, and get_scores refuses an empty query
        return np.zeros(len(texts), dtype=np.float32)
    retriever = bm25s.BM25(k1=K1, b=B, method=METHOD)
    retriever.index(corpus, show_progress=False)
    ids = retriever.get_tokens_ids(query)
    if not ids:
        return np.zeros(len(texts), dtype=np.float32)
    return np.asarray(retriever.get_scores_from_ids(ids), dtype=np.float32)


def rank(texts: list[str], question: str, k: int) -> list[int]:
    """Indices of the ``k`` texts that score highest for ``question`` under BM25 (bm25s, Lucene variant,
    k1 = 1.5, b = 0.75, English stopwords; module docstring), best first.

    Deterministic: equal scores are ordered by the lower index first, so texts sharing no token with the
    question come last in their original order. A ``k`` larger than ``len(texts)`` returns every index,
    ranked.

    Args:
        texts: the candidate texts (event texts), in history order.
        question: the query text.
        k: how many indices to return (>= 1).

    Raises:
        EventKVError: ``texts`` is empty or ``question`` is blank.
        OptionError: ``k`` is not a whole number >= 1.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise OptionError("k", k, "select at least 1 text (a whole number >= 1).")
    s = scores(texts, question)
    order = np.lexsort((np.arange(len(s)), -s.astype(np.float64)))  # last key first: score desc, then index
    return [int(i) for i in order[:k]]


def _check(texts: list[str], question: str) -> None:
    if not texts:
        raise EventKVError("BM25 selection got no texts to rank: give at least one event text.")
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise EventKVError(
            f"BM25 selection got a text that is not a string at index {bad[0]} "
            f"({type(texts[bad[0]]).__name__}): give every event's text as a string."
        )
    if not isinstance(question, str) or not question.strip():
        raise EventKVError(f"BM25 selection got the question {question!r}: give a non-empty question.")
