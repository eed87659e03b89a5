"""LoCoMo's answer metric (eventkv.studies.materialization.answer_metric): normalization, token F1 (Porter-stemmed), the
per-category rules and exact match, each against values computed by hand in the comments; and the
cluster bootstrap the memory eval reports its intervals with (eventkv.stats.cluster_bootstrap)."""

import importlib.util
import math

import numpy as np
import pytest
from scipy import stats as st

from eventkv.errors import EventKVError, OptionError
from eventkv.stats import cluster_bootstrap
from eventkv.studies.materialization.answer_metric import (
    AnswerScore,
    abstains,
    answer_tokens,
    exact_match,
    multi_answer_f1,
    normalize_answer,
    score_answer,
    token_f1,
)

#: LoCoMo's token F1 stems with NLTK's Porter stemmer
needs_nltk = pytest.mark.skipif(importlib.util.find_spec("nltk") is None, reason="nltk is not installed")


def test_normalize_answer():
    assert normalize_answer("The cat, and a Dog!") == "cat dog"
    assert normalize_answer("Caroline's  mom\t(Anne)") == "carolines mom anne"
    assert normalize_answer("7 May, 2023.") == "7 may 2023"
    assert normalize_answer("Andrew banded the band") == "andrew banded band"  # whole words only
    assert normalize_answer("a an the and") == ""


@needs_nltk
def test_answer_tokens_are_porter_stemmed():
    assert answer_tokens("Running dogs studied happily") == ["run", "dog", "studi", "happili"]
    assert answer_tokens("Running dogs", stem=False) == ["running", "dogs"]


@needs_nltk
def test_token_f1_hand_computed():
    # pred {run, dog, in, park}, gold {dog, run}: overlap 2, P = 2/4, R = 2/2, F1 = 2/3
    assert token_f1("running dogs in the park", "dog running") == pytest.approx(2 / 3)
    # unstemmed: overlap {running} = 1, P = 1/4, R = 1/2, F1 = 2 * (1/8) / (3/4) = 1/3
    assert token_f1("running dogs in the park", "dog running", stem=False) == pytest.approx(1 / 3)
    # multiset overlap: pred cat cat, gold cat: overlap 1, P = 1/2, R = 1, F1 = 2/3
    assert token_f1("cat cat", "cat") == pytest.approx(2 / 3)
    assert token_f1("A Cat.", "the cat") == 1.0
    assert token_f1("dog", "cat") == 0.0
    assert token_f1("", "") == 0.0 and token_f1("the", "a") == 0.0  # LoCoMo: no common token is 0


@needs_nltk
def test_multi_answer_f1_hand_computed():
    # gold parts painting (1), hiking (1), swimming (0): mean 2/3
    assert multi_answer_f1("hiking, painting", "painting, hiking, swimming") == pytest.approx(2 / 3)
    # gold pasta vs "cooking pasta": P = 1/2, R = 1, F1 = 2/3; skiing: 0; mean 1/3
    assert multi_answer_f1("cooking pasta", "pasta, skiing") == pytest.approx(1 / 3)


def test_exact_match_is_set_equality_of_normalized_tokens():
    assert exact_match("The blue and red", "red, blue")
    assert exact_match("red red", "red")
    assert not exact_match("running", "run")  # no stemming
    assert not exact_match("blue", "blue sky")


@needs_nltk
def test_score_answer_by_category():
    assert score_answer("cooking pasta", "pasta, skiing", 1) == AnswerScore(pytest.approx(1 / 3), False)
    assert score_answer("7 May 2023", "7 May, 2023", 2) == AnswerScore(1.0, True)
    # category 3: only the part before ';' is the reference
    assert score_answer("likely yes", "Likely yes; she likes dogs", 3) == AnswerScore(1.0, True)
    # category 4: the whole answer; stems pred {like, ye}, gold {like, ye, she, like, dog}: P = 1, R = 2/5, F1 = 4/7
    assert score_answer("likely yes", "Likely yes; she likes dogs", 4).f1 == pytest.approx(4 / 7)
    assert score_answer("2022", "2022", 4) == AnswerScore(1.0, True)
    # category 5: abstaining is right, whatever the answer
    assert score_answer("That is not mentioned in the conversation.", "", 5) == AnswerScore(1.0, True)
    assert score_answer("No information available", "grey", 5) == AnswerScore(1.0, True)
    assert score_answer("grey", "grey", 5) == AnswerScore(0.0, False)
    assert abstains("NOT MENTIONED") and not abstains("not sure")
    for bad in (0, 6, True):
        with pytest.raises(OptionError, match="^category"):
            score_answer("x", "x", bad)


# ---------------------------------------------------------------- eventkv.stats.cluster_bootstrap
# (the memory eval's intervals: questions clustered by conversation)
def test_cluster_bootstrap_one_item_per_cluster_matches_scipy_percentile():
    rng = np.random.default_rng(7)
    x = rng.normal(0.3, 1.0, size=200)
    ours = cluster_bootstrap(x, range(len(x)), n_resamples=10_000, seed=0)
    ref = st.bootstrap((x,), np.mean, n_resamples=10_000, method="percentile", rng=np.random.default_rng(1))
    # Monte Carlo error of each end with 10,000 resamples is ~0.002 here (standard error of the mean 0.07);
    # the two runs use different draws, so allow 0.01 (about 4 sd of the difference of two ends)
    assert ours.estimate == pytest.approx(x.mean())
    assert ours.low == pytest.approx(ref.confidence_interval.low, abs=0.01)
    assert ours.high == pytest.approx(ref.confidence_interval.high, abs=0.01)
    assert (ours.n_items, ours.n_clusters) == (200, 200)


def test_cluster_bootstrap_resamples_clusters():
    # 12 conversations of 5 questions each, the same value within a conversation: the cluster bootstrap is
    # a bootstrap of the 12 conversation values (scipy, tolerance as above for its wider spread), and much
    # wider than an item-level bootstrap that treats the 60 values as independent
    conv_values = np.random.default_rng(3).uniform(0, 1, size=12)
    values = np.repeat(conv_values, 5)
    clusters = np.repeat([f"conv-{i}" for i in range(12)], 5)
    ours = cluster_bootstrap(values, clusters, seed=0)
    ref = st.bootstrap((conv_values,), np.mean, method="percentile", rng=np.random.default_rng(1))
    assert ours.low == pytest.approx(ref.confidence_interval.low, abs=0.015)
    assert ours.high == pytest.approx(ref.confidence_interval.high, abs=0.015)
    naive = cluster_bootstrap(values, range(60), seed=0)
    assert (ours.high - ours.low) > 1.8 * (naive.high - naive.low)  # sqrt(5) in expectation
    assert ours.n_clusters == 12 and ours.n_items == 60


def test_cluster_bootstrap_paired_difference_and_general_statistic():
    rng = np.random.default_rng(5)
    a, b = rng.uniform(size=40), rng.uniform(size=40)
    clusters = [i // 10 for i in range(40)]
    diff = cluster_bootstrap(a - b, clusters, n_resamples=2000, seed=4)
    assert diff.estimate == pytest.approx(float(np.mean(a - b)))
    # the vectorized mean and the per-resample path draw the same clusters for the same seed
    slow = cluster_bootstrap(a - b, clusters, statistic=lambda v: float(np.mean(v)), n_resamples=2000, seed=4)
    assert (slow.low, slow.high) == pytest.approx((diff.low, diff.high), abs=1e-12)
    med = cluster_bootstrap(a, clusters, statistic=np.median, n_resamples=500)
    assert med.estimate == pytest.approx(float(np.median(a))) and med.low <= med.estimate <= med.high


def test_cluster_bootstrap_deterministic_and_edge_cases():
    v, c = [0.1, 0.5, 0.9, 0.4, 0.7, 0.2], ["a", "a", "b", "b", "c", "c"]
    assert cluster_bootstrap(v, c, seed=11) == cluster_bootstrap(v, c, seed=11)
    assert cluster_bootstrap(v, c, seed=11) != cluster_bootstrap(v, c, seed=12)
    one = cluster_bootstrap([0.2, 0.4], ["x", "x"])
    assert (one.low, one.estimate, one.high) == pytest.approx((0.3, 0.3, 0.3))  # one cluster: zero width
    empty = cluster_bootstrap([], [])
    assert empty.n_items == 0 and math.isnan(empty.estimate) and empty.describe() == "n/a (n=0)"
    assert cluster_bootstrap(v, c).describe().endswith("(n=6 in 3 clusters)")
    with pytest.raises(EventKVError, match="cluster bootstrap: 1 of 6 values is not a finite number"):
        cluster_bootstrap([0.1, math.nan, 0.9, 0.4, 0.7, 0.2], c)
    with pytest.raises(ValueError, match="one cluster label per value"):
        cluster_bootstrap(v, c[:-1])
    with pytest.raises(ValueError, match="confidence"):
        cluster_bootstrap(v, c, confidence=1.0)
    with pytest.raises(ValueError, match="n_resamples"):
        cluster_bootstrap(v, c, n_resamples=0)
