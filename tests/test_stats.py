"""eventkv.stats against scipy.stats and against values worked by hand."""

import math

import numpy as np
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
    assert r.p_value == pytest.approx(2 * 0.5**99, rel=1e-9)
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


# ---- nan / inf: every statistic on measured values refuses them with the same EventKVError

BAD = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}
CLEAN = [0.5, 1.2, -0.1, 0.0, 2.0, 0.3, -0.7, 0.9]


def _statistics():
    from eventkv.stats import mean_effect, tost

    return {
        "exact two-sided sign test on d": sign_test_d,
        "Wilcoxon signed-rank test on d": wilcoxon_d,
        "median of d": median,
        "mean effect (t-test vs 0)": mean_effect,
        "TOST equivalence test (margin +-0.075)": lambda x: tost(x, 0.075),
    }


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("statistic", list(_statistics()))
def test_every_statistic_refuses_nan_and_inf_the_same_way(statistic, bad):
    from eventkv.errors import EventKVError

    xs = CLEAN[:3] + [BAD[bad]] + CLEAN[3:]
    with pytest.raises(EventKVError) as e:
        _statistics()[statistic](xs)
    msg = str(e.value)
    assert msg.startswith(f"{statistic}: 1 of 9 values is not a finite number ({bad} at index 3).")
    assert "error in the readout" in msg and "not a tie" in msg and "fix the readout" in msg


def test_nan_is_never_counted_as_a_tie_or_ranked():
    # Before: the sign test counted nan as "d=0 dropped" (p from 5:2), Wilcoxon returned p = nan, and the
    # median sorted a nan into the middle. Now all three refuse; the message counts and names every bad entry.
    from eventkv.errors import EventKVError

    d = [math.nan, 0.5, -math.inf, 0.25, math.nan]
    for f in (sign_test_d, wilcoxon_d, median):
        with pytest.raises(
            EventKVError,
            match=r"3 of 5 values are not a finite number "
            r"\(nan at index 0, -inf at index 2, nan at index 4\)",
        ):
            f(d)
    with pytest.raises(EventKVError, match=r"'x' at index 1"):  # not a number at all
        median([1.0, "x"])


def test_require_finite_names_items_and_caps_the_list():
    from eventkv.errors import EventKVError
    from eventkv.stats import require_finite

    assert require_finite([1, 2.5, -3], "s") == [1.0, 2.5, -3.0]
    with pytest.raises(
        EventKVError,
        match=r"^donor statistic d of arm 'kv': 10 of 12 values are not a finite number "
        r"\(nan at item 2, .*nan at item 9, and 2 more\)",
    ):
        require_finite(
            [0.1] + [math.nan] * 10 + [0.2],
            "donor statistic d of arm 'kv'",
            labels=[f"item {i + 1}" for i in range(12)],
        )


def test_probe_summaries_name_the_arm_and_item_of_a_nan_d():
    from eventkv.errors import EventKVError
    from eventkv.studies.materialization.pairs import d_stats

    recs = [{"index": i, "d": {"kv": x}} for i, x in enumerate([0.5, 0.25, math.nan, -0.1])]
    with pytest.raises(
        EventKVError,
        match=r"^donor statistic d of arm 'kv': 1 of 4 values is not a finite number "
        r"\(nan at item 2\)",
    ):
        d_stats(recs, "kv")


def test_clean_inputs_still_match_scipy():
    from eventkv.stats import mean_effect, tost

    d = CLEAN + [1e300, -1e-300]  # large and tiny finite values pass
    nz = [x for x in d if x != 0]
    assert sign_test_d(d).p_value == pytest.approx(st.binomtest(6, 9).pvalue, rel=1e-12)
    w, ref = wilcoxon_d(d), st.wilcoxon(nz)
    assert (w.p_value, w.statistic) == pytest.approx((ref.pvalue, ref.statistic), rel=1e-12)
    assert median(CLEAN) == pytest.approx(float(np.median(CLEAN)))
    m = mean_effect(CLEAN)
    r = st.ttest_1samp(CLEAN, 0.0)
    ci = r.confidence_interval(0.95)
    assert (m.mean, m.low, m.high, m.p_zero) == pytest.approx((np.mean(CLEAN), ci.low, ci.high, r.pvalue), rel=1e-12)
    t = tost(CLEAN, 0.5)
    assert t.p_lower == pytest.approx(st.ttest_1samp(CLEAN, -0.5, alternative="greater").pvalue, rel=1e-12)
    assert t.p_upper == pytest.approx(st.ttest_1samp(CLEAN, 0.5, alternative="less").pvalue, rel=1e-12)
    for margin in (0, -1, math.nan, math.inf):
        with pytest.raises(ValueError, match="positive finite"):
            tost(CLEAN, margin)
