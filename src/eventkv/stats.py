"""Statistics for probes, all computed with ``scipy.stats`` (Study 1, "Donor pair": the exact
sign test of follow vs anti, prevalence with a Wilson interval, and tests on the continuous
donor statistic d).

Every result keeps the counts it was computed from, so a printed table always says what a
p-value was run on. A test with nothing to run on (no sensitive pairs, all d equal to zero)
returns ``p_value = nan`` and says so in ``note``; it never invents a value.

Every statistic on measured values (the sign and Wilcoxon tests on d, the median, and the t and
TOST tests below) refuses a nan or infinite value with the same
:class:`~eventkv.errors.EventKVError` (:func:`require_finite`): such a value is an error in the
readout, neither a tie to drop nor a number to rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from scipy import stats as _st

from eventkv.errors import EventKVError

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Proportion:
    """``k`` successes out of ``n`` with a Wilson score interval at ``confidence``.
    ``rate``, ``low`` and ``high`` are nan when ``n == 0``."""

    k: int
    n: int
    rate: float
    low: float
    high: float
    confidence: float = CONFIDENCE

    def describe(self, digits: int = 3) -> str:
        """E.g. ``"0.625 [0.386, 0.815] (10/16)"``."""
        if self.n == 0:
            return "n/a (0/0)"
        f = f"{{:.{digits}f}}"
        return f"{f.format(self.rate)} [{f.format(self.low)}, {f.format(self.high)}] ({self.k}/{self.n})"


@dataclass(frozen=True)
class TestResult:
    """One hypothesis test: its name, statistic, two-sided p-value, and the counts it ran on."""

    name: str
    p_value: float
    statistic: float = math.nan
    counts: dict = field(default_factory=dict)
    note: str = ""

    def describe(self) -> str:
        """E.g. ``"exact two-sided sign test, follow 9 vs anti 1 (n=10): p = 0.0215"``."""
        c = ", ".join(f"{k} {v}" for k, v in self.counts.items())
        p = "not run" if math.isnan(self.p_value) else f"p = {format_p(self.p_value)}"
        extra = f" ({self.note})" if self.note else ""
        return f"{self.name}, {c}: {p}{extra}"


def format_p(p: float) -> str:
    """A p-value for tables: 4 significant digits, scientific below 1e-3, ``n/a`` for nan."""
    if math.isnan(p):
        return "n/a"
    return f"{p:.2e}" if p < 1e-3 else f"{p:.4f}"


def require_finite(
    xs: Sequence[float], statistic: str, what: str = "d", labels: Sequence[str] | None = None
) -> list[float]:
    """``xs`` as floats, after checking that every one is a finite number.

    Args:
        statistic: the statistic about to be computed, for the message (``"median of d"``).
        what: the name of the values, for the message (``"d"``).
        labels: one name per value (``"item 7"``) for the message; default ``"index i"``.

    Raises:
        EventKVError: some values are nan, +-inf or not numbers. The message names the
            statistic, how many values and which (up to 8), and the fix. Every statistic here
            raises this same error rather than dropping such a value (as a tie) or ranking it.
    """
    vals, bad = [], []
    for i, x in enumerate(xs):
        try:
            v = float(x)
        except (TypeError, ValueError):
            v = math.nan
            bad.append((i, repr(x)))
        else:
            if not math.isfinite(v):
                bad.append((i, "nan" if math.isnan(v) else f"{v:+}"))
        vals.append(v)
    if bad:
        names = list(labels) if labels is not None else [f"index {i}" for i in range(len(vals))]
        shown = ", ".join(f"{b} at {names[i]}" for i, b in bad[:8]) + (
            f", and {len(bad) - 8} more" if len(bad) > 8 else ""
        )
        raise EventKVError(
            f"{statistic}: {len(bad)} of {len(vals)} values {'is' if len(bad) == 1 else 'are'} not a finite number "
            f"({shown}). A nan or infinite {what} is an error in the readout that produced it (e.g. a candidate "
            f"log-probability of nan or -inf), not a tie or a missing pair: fix the readout (float32 log-probs, "
            "every candidate scored) and compute the statistic again, or remove those items explicitly and "
            "report them."
        )
    return vals


def wilson(k: int, n: int, confidence: float = CONFIDENCE) -> Proportion:
    """The proportion ``k/n`` with its Wilson score interval (``scipy.stats.binomtest(...)
    .proportion_ci(method="wilson")``).

    Raises:
        ValueError: ``k < 0``, ``n < 0`` or ``k > n``.
    """
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"a proportion needs 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return Proportion(0, 0, math.nan, math.nan, math.nan, confidence)
    ci = _st.binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
    return Proportion(k, n, k / n, float(ci.low), float(ci.high), confidence)


def sign_test(
    positive: int,
    negative: int,
    labels: tuple[str, str] = ("positive", "negative"),
    name: str = "exact two-sided sign test",
) -> TestResult:
    """Exact two-sided sign test of ``positive`` vs ``negative`` (ties already excluded):
    ``scipy.stats.binomtest(positive, positive + negative, 0.5)``. The statistic is ``positive``.
    With no observations the p-value is nan."""
    n = positive + negative
    counts = {labels[0]: positive, labels[1]: negative, "n": n}
    if n == 0:
        return TestResult(name, math.nan, math.nan, counts, "no observations")
    p = _st.binomtest(positive, n, 0.5, alternative="two-sided").pvalue
    return TestResult(name, float(p), float(positive), counts)


def sign_test_d(d: Sequence[float]) -> TestResult:
    """Sign test on the continuous donor statistic: count of ``d > 0`` against ``d < 0`` among the
    pairs with ``d != 0`` (zeros are ties and dropped; their count is reported).

    Raises:
        EventKVError: a nan or infinite d (:func:`require_finite`).
    """
    d = require_finite(d, "exact two-sided sign test on d")
    pos = sum(1 for x in d if x > 0)
    neg = sum(1 for x in d if x < 0)
    r = sign_test(pos, neg, ("d>0", "d<0"), name="exact two-sided sign test on d")
    zeros = len(d) - pos - neg
    return TestResult(r.name, r.p_value, r.statistic, {**r.counts, "d=0 dropped": zeros}, r.note)


def wilcoxon_d(d: Sequence[float]) -> TestResult:
    """Two-sided Wilcoxon signed-rank test of ``d`` against 0 (``scipy.stats.wilcoxon``, zero
    differences dropped — ``zero_method="wilcox"``). The statistic is scipy's (the smaller rank
    sum for two-sided). Needs at least one non-zero d; else the p-value is nan.

    Raises:
        EventKVError: a nan or infinite d (:func:`require_finite`).
    """
    d = require_finite(d, "Wilcoxon signed-rank test on d")
    nz = [x for x in d if x != 0]
    counts = {"n": len(nz), "d=0 dropped": len(d) - len(nz)}
    name = "Wilcoxon signed-rank test on d"
    if not nz:
        return TestResult(name, math.nan, math.nan, counts, "no non-zero d")
    res = _st.wilcoxon(nz, zero_method="wilcox", alternative="two-sided")
    return TestResult(name, float(res.pvalue), float(res.statistic), counts)


def median(xs: Sequence[float], what: str = "d") -> float:
    """Median of ``xs`` (nan when empty).

    Raises:
        EventKVError: a nan or infinite value (:func:`require_finite`; ``what`` names the values).
    """
    s = sorted(require_finite(xs, f"median of {what}", what))
    if not s:
        return math.nan
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


def mcnemar_exact(clean_only: int, arm_only: int) -> TestResult:
    """McNemar's exact test on paired binary outcomes: among the discordant items, ``clean_only``
    (clean correct, arm wrong) vs ``arm_only`` (arm correct, clean wrong), two-sided
    ``scipy.stats.binomtest(clean_only, clean_only + arm_only, 0.5)``. No discordant items: p = nan."""
    n = clean_only + arm_only
    counts = {"clean only": clean_only, "arm only": arm_only, "discordant": n}
    name = "McNemar exact test vs clean"
    if n == 0:
        return TestResult(name, math.nan, math.nan, counts, "no discordant items")
    p = _st.binomtest(clean_only, n, 0.5, alternative="two-sided").pvalue
    return TestResult(name, float(p), float(clean_only), counts)


# ---------------------------------------------------------------- equivalence and mean effects
# Study 1, "The memory contract" (Landing): the root-donor x mention-donor factorial asks whether the
# downstream mention's donor has *no* effect, which a non-significant difference cannot show; the two
# one-sided tests (TOST) against an equivalence margin can.
@dataclass(frozen=True)
class MeanEffect:
    """Mean of per-pair effects with a two-sided t interval and the t-test against 0."""

    n: int
    mean: float
    low: float
    high: float
    p_zero: float

    def describe(self) -> str:
        if self.n < 2:
            return f"n/a (n={self.n})"
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}] (n={self.n}, p vs 0 = {format_p(self.p_zero)})"


def mean_effect(x: Sequence[float], confidence: float = CONFIDENCE) -> MeanEffect:
    """Mean of ``x`` with its t confidence interval and the two-sided one-sample t-test against 0
    (``scipy.stats.ttest_1samp``). All-equal data get a zero-width interval and p = 1 (mean 0) or 0.

    Raises:
        EventKVError: a nan or infinite value (:func:`eventkv.stats.require_finite`).
    """
    xs = require_finite(x, "mean effect (t-test vs 0)", "effect")
    n = len(xs)
    if n < 2:
        return MeanEffect(n, xs[0] if xs else math.nan, math.nan, math.nan, math.nan)
    m = sum(xs) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in xs) / (n - 1))
    if sd == 0:
        return MeanEffect(n, m, m, m, 1.0 if m == 0 else 0.0)
    res = _st.ttest_1samp(xs, 0.0)
    ci = res.confidence_interval(confidence)
    return MeanEffect(n, m, float(ci.low), float(ci.high), float(res.pvalue))


@dataclass(frozen=True)
class Tost:
    """Two one-sided t-tests of ``-margin < mean < margin``: ``p`` = max of the two p-values;
    equivalence is shown at level alpha when ``p < alpha``."""

    n: int
    mean: float
    margin: float
    p_lower: float
    p_upper: float

    @property
    def p(self) -> float:
        return max(self.p_lower, self.p_upper)

    def describe(self) -> str:
        if math.isnan(self.p):
            return f"TOST not run (n={self.n})"
        return (
            f"TOST, margin +-{self.margin}: mean {self.mean:+.3f}, p(lower) = {format_p(self.p_lower)}, "
            f"p(upper) = {format_p(self.p_upper)}, p = {format_p(self.p)} (n={self.n})"
        )


def tost(x: Sequence[float], margin: float) -> Tost:
    """TOST equivalence test of the mean of ``x`` within ``(-margin, +margin)``:
    ``ttest_1samp(x, -margin, alternative="greater")`` and ``ttest_1samp(x, +margin, alternative="less")``.
    With n < 2 the p-values are nan; with zero spread they are 0 inside the band and 1 outside.

    Raises:
        ValueError: a margin that is not a positive finite number.
        EventKVError: a nan or infinite value (:func:`eventkv.stats.require_finite`).
    """
    if not (0 < margin < math.inf):
        raise ValueError(f"the equivalence margin must be a positive finite number, got {margin}")
    xs = require_finite(x, f"TOST equivalence test (margin +-{margin})", "effect")
    n = len(xs)
    if n < 2:
        return Tost(n, xs[0] if xs else math.nan, margin, math.nan, math.nan)
    m = sum(xs) / n
    if all(v == xs[0] for v in xs):
        return Tost(n, m, margin, 0.0 if m > -margin else 1.0, 0.0 if m < margin else 1.0)
    lo = _st.ttest_1samp(xs, -margin, alternative="greater").pvalue
    hi = _st.ttest_1samp(xs, margin, alternative="less").pvalue
    return Tost(n, m, margin, float(lo), float(hi))
