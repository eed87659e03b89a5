"""LoCoMo's answer metric (eventkv.memory.metrics): normalization, token F1 (Porter-stemmed), the
per-category rules and exact match, each against values computed by hand in the comments."""

import pytest

from eventkv.errors import OptionError
from eventkv.memory.metrics import (
    AnswerScore,
    abstains,
    answer_tokens,
    exact_match,
    multi_answer_f1,
    normalize_answer,
    score_answer,
    token_f1,
)

pytest.importorskip("nltk")  # LoCoMo stems with NLTK's Porter stemmer


def test_normalize_answer():
    assert normalize_answer("The cat, and a Dog!") == "cat dog"
    assert normalize_answer("Caroline's  mom\t(Anne)") == "carolines mom anne"
    assert normalize_answer("7 May, 2023.") == "7 may 2023"
    assert normalize_answer("Andrew banded the band") == "andrew banded band"  # whole words only
    assert normalize_answer("a an the and") == ""


def test_answer_tokens_are_porter_stemmed():
    assert answer_tokens("Running dogs studied happily") == ["run", "dog", "studi", "happili"]
    assert answer_tokens("Running dogs", stem=False) == ["running", "dogs"]


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
