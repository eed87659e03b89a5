"""Equivalence and mean-effect tests for the contract probes (``scipy.stats``).

Study 1, "The memory contract" (Landing): the root-donor x mention-donor factorial asks whether
the downstream mention's donor has *no* effect, which a non-significant difference cannot show;
the two one-sided tests (TOST) against an equivalence margin can.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats as _st

from eventkv.stats import CONFIDENCE, format_p, require_finite


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
