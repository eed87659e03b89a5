"""BM25 selection (eventkv.memory.select): rankings on hand-made texts, bm25s's scores against the
Lucene BM25 formula written out here, ties, k and errors."""

import math

import numpy as np
import pytest

from eventkv.errors import EventKVError, OptionError
from eventkv.memory.select import K1, METHOD, B, rank, scores, tokens

TEXTS = [
    "Caroline went hiking in the mountains last weekend.",
    "Melanie painted a sunrise over the lake.",
    "The bakery on Elm street sells sourdough bread.",
    "Caroline adopted a puppy named Biscuit from the shelter.",
]


def test_obvious_rankings():
    assert rank(TEXTS, "What is the name of Caroline's puppy?", 1) == [3]
    assert rank(TEXTS, "Where does the bakery sell sourdough?", 2)[0] == 2
    assert rank(TEXTS, "What did Melanie paint?", 1) == [1]
    # both Caroline texts outrank the others; the one also matching "hiking" first
    assert rank(TEXTS, "Caroline hiking", 4)[:2] == [0, 3]


def test_k_larger_than_texts_returns_all_ranked():
    r = rank(TEXTS, "sourdough bread", 10)
    assert sorted(r) == [0, 1, 2, 3] and r[0] == 2


def test_ties_broken_by_lower_index():
    texts = ["apple pie", "banana bread", "apple pie", "cherry tart", "apple pie"]
    assert rank(texts, "apple", 5) == [0, 2, 4, 1, 3]
    # nothing matches (or only stopwords): history order
    assert rank(texts, "zebra", 3) == [0, 1, 2]
    assert rank(texts, "the of and", 2) == [0, 1]
    assert rank(["the", "a"], "the cat", 2) == [0, 1]  # no text has any token


def test_tokenization_is_bm25s_english_stopwords_no_stemming():
    assert tokens(["The cats ARE sleeping, a b c!"]) == [["cats", "sleeping"]]


def test_scores_match_lucene_bm25_formula():
    assert (METHOD, K1, B) == ("lucene", 1.5, 0.75)
    texts = ["red apple red", "green apple", "blue sky blue sky blue", "red car"]
    question = "red apple"
    docs = [t.split() for t in texts]  # no stopwords, all words >= 2 chars: bm25s tokens == split
    assert tokens(texts) == docs
    n, avgdl = len(docs), sum(map(len, docs)) / len(docs)

    def idf(t):
        df = sum(t in d for d in docs)
        return math.log(1 + (n - df + 0.5) / (df + 0.5))

    def bm25(d):
        return sum(
            idf(t) * d.count(t) / (d.count(t) + K1 * (1 - B + B * len(d) / avgdl)) for t in question.split() if t in d
        )

    expected = [bm25(d) for d in docs]
    assert np.allclose(scores(texts, question), expected, rtol=1e-6, atol=1e-6)  # bm25s keeps float32
    assert rank(texts, question, 4) == [0, 1, 3, 2]


def test_errors():
    with pytest.raises(EventKVError, match="no texts"):
        rank([], "cat", 1)
    with pytest.raises(EventKVError, match="non-empty question"):
        rank(TEXTS, "  ", 1)
    with pytest.raises(EventKVError, match="not a string at index 1"):
        rank(["a cat", None], "cat", 1)
    for k in (0, -1, 1.5, True):
        with pytest.raises(OptionError, match="^k "):
            rank(TEXTS, "cat", k)
