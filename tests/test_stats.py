"""eventkv.stats against scipy.stats and against values worked by hand."""

import math

import pytest
from scipy import stats as st

from eventkv.stats import format_p, median, sign_test, sign_test_d, wilcoxon_d, wilson


def test_sign_test_matches_scipy_and_hand_values():
    r = sign_test(9, 1, ("follow", "anti"))
    assert r.p_value == pytest.approx(st.binomtest(9, 10, 0.5).pvalue, rel=1e-12)
    # exact: 2 * (C(10,0) + C(10,1)) / 2**10 = 22 / 1024
    assert r.p_value == pytest.approx(22 / 1024, rel=1e-12)
    assert r.counts == {"follow": 9, "anti": 1, "n": 10}
    assert "follow 9, anti 1, n 10" in r.describe()


def test_sign_test_study_headline():
    # Study 1: 99:0 on Qwen3-8B gives p = 3.2e-30 (two-sided: 2 * 0.5**99).
    r = sign_test(99, 0)
    assert r.p_value == pytest.approx(2 * 0.5 ** 99, rel=1e-9)
    assert format_p(r.p_value) == "3.16e-30"


def test_sign_test_empty_is_nan_not_invented():
    r = sign_test(0, 0)
    assert math.isnan(r.p_value)
    assert "not run" in r.describe()


def test_wilson_matches_scipy():
    p = wilson(7, 20)
    ci = st.binomtest(7, 20).proportion_ci(method="wilson")
    assert (p.low, p.high) == pytest.approx((ci.low, ci.high), rel=1e-12)
    assert p.rate == pytest.approx(0.35)
    # hand value of the Wilson interval for 7/20 at z = 1.959964
    z = st.norm.ppf(0.975)
    centre = (7 / 20 + z * z / 40) / (1 + z * z / 20)
    half = z / (1 + z * z / 20) * math.sqrt(0.35 * 0.65 / 20 + z * z / 1600)
    assert (p.low, p.high) == pytest.approx((centre - half, centre + half), rel=1e-9)
    assert wilson(0, 0).describe() == "n/a (0/0)"
    with pytest.raises(ValueError):
        wilson(3, 2)


def test_d_tests_match_scipy():
    d = [0.5, 1.2, -0.1, 0.0, 2.0, 0.3, -0.7, 0.9]
    s = sign_test_d(d)
    assert s.counts == {"d>0": 5, "d<0": 2, "n": 7, "d=0 dropped": 1}
    assert s.p_value == pytest.approx(st.binomtest(5, 7).pvalue, rel=1e-12)
    w = wilcoxon_d(d)
    ref = st.wilcoxon([x for x in d if x != 0])
    assert w.p_value == pytest.approx(ref.pvalue, rel=1e-12)
    assert w.statistic == pytest.approx(ref.statistic)
    assert w.counts == {"n": 7, "d=0 dropped": 1}
    assert math.isnan(wilcoxon_d([0.0, 0.0]).p_value)


def test_median():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 2, 3]) == 2.5
    assert math.isnan(median([]))
