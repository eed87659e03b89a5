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
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
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


def wilcoxon_d(d: Sequence[float], what: str = "d") -> TestResult:
    """Two-sided Wilcoxon signed-rank test of ``d`` against 0 (``scipy.stats.wilcoxon``, zero
    differences dropped — ``zero_method="wilcox"``). The statistic is scipy's (the smaller rank
    sum for two-sided). Needs at least one non-zero d; else the p-value is nan. ``what`` names the
    paired differences in the test's name and counts (default the donor statistic ``d``).

    Raises:
        EventKVError: a nan or infinite d (:func:`require_finite`).
    """
    name = f"Wilcoxon signed-rank test on {what}"
    d = require_finite(d, name)
    nz = [x for x in d if x != 0]
    counts = {"n": len(nz), f"{what}=0 dropped": len(d) - len(nz)}
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


# ---------------------------------------------------------------- cluster bootstrap
# Questions about one conversation (the memory eval on LoCoMo) are not independent (one history, one
# selection, one model state), so intervals resample whole conversations.
@dataclass(frozen=True)
class ClusterBootstrap:
    """A statistic of pooled per-item values with a percentile cluster-bootstrap interval.

    Attributes:
        estimate: the statistic of all items pooled (for the mean: the mean over items, so a cluster
            weighs by its number of items).
        low, high: the interval's ends (nan when there are no items).
        n_items, n_clusters: what it was computed from.
        confidence, n_resamples, seed: how.
    """

    estimate: float
    low: float
    high: float
    n_items: int
    n_clusters: int
    confidence: float = CONFIDENCE
    n_resamples: int = 10_000
    seed: int = 0

    def interval(self, digits: int = 3, signed: bool = False, single: str = "one cluster") -> str:
        """``"0.412 [0.351, 0.470]"`` (``signed``: ``"+0.412 [...]"``); with fewer than two clusters
        there is no interval: ``"0.412 [n/a: <single>]"``."""
        f = f"{{:+.{digits}f}}" if signed else f"{{:.{digits}f}}"
        if self.n_clusters < 2:
            return f"{f.format(self.estimate)} [n/a: {single}]"
        return f"{f.format(self.estimate)} [{f.format(self.low)}, {f.format(self.high)}]"

    def describe(self, digits: int = 3) -> str:
        """E.g. ``"0.412 [0.351, 0.470] (n=60 in 2 clusters)"``."""
        if self.n_items == 0:
            return "n/a (n=0)"
        f = f"{{:+.{digits}f}}" if self.low < 0 else f"{{:.{digits}f}}"
        return (
            f"{f.format(self.estimate)} [{f.format(self.low)}, {f.format(self.high)}] "
            f"(n={self.n_items} in {self.n_clusters} clusters)"
        )


def cluster_bootstrap(
    values: Sequence[float],
    clusters: Sequence[Hashable],
    statistic: Callable[[np.ndarray], float] = np.mean,
    n_resamples: int = 10_000,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> ClusterBootstrap:
    """Percentile bootstrap interval of ``statistic`` over per-item ``values`` that resamples whole
    clusters (e.g. the conversations the questions belong to) with replacement: each resample draws
    ``n_clusters`` cluster labels uniformly with replacement (``numpy.random.default_rng(seed)``), pools
    the items of the drawn clusters (a cluster drawn twice counts twice) and computes ``statistic`` on them;
    the interval is the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` percentiles of the
    ``n_resamples`` statistics (``numpy.percentile``, linear interpolation). Resampling the top-level units of
    hierarchical data: Davison & Hinkley 1997, "Bootstrap Methods and their Application", chapter 3.

    For a paired difference (arm A minus arm B on the same items) pass the per-item differences.
    With one cluster every resample is the data itself: a zero-width interval. Deterministic for a
    fixed ``seed``.

    Args:
        values: one value per item (e.g. an answer's F1).
        clusters: one label per item (e.g. the conversation id), any hashable.
        statistic: maps a 1-D array of pooled values to a number; ``numpy.mean`` (the default) takes a
            vectorized path (per-cluster sums and counts), any other callable is called per resample.

    Raises:
        EventKVError: a nan or infinite value (:func:`require_finite`).
        ValueError: ``values`` and ``clusters`` differ in length, ``n_resamples < 1``, or ``confidence``
            not in (0, 1).
    """
    xs = np.asarray(require_finite(values, "cluster bootstrap", "value"), dtype=np.float64)
    labels = list(clusters)
    if len(labels) != len(xs):
        raise ValueError(f"cluster_bootstrap needs one cluster label per value, got {len(labels)} for {len(xs)}")
    if not (isinstance(n_resamples, int) and n_resamples >= 1):
        raise ValueError(f"n_resamples must be a whole number >= 1, got {n_resamples!r}")
    if not (0 < confidence < 1):
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if len(xs) == 0:
        return ClusterBootstrap(math.nan, math.nan, math.nan, 0, 0, confidence, n_resamples, seed)
    index: dict[Hashable, int] = {}
    codes = np.array([index.setdefault(c, len(index)) for c in labels])
    n_clusters = len(index)
    estimate = float(statistic(xs))
    # why not scipy.stats.bootstrap: it resamples observations (jointly with paired=True), never groups of
    # them; clusters would need a statistic that is handed cluster ids and expands them in Python for every
    # resample. Drawing the cluster ids here with numpy's Generator is direct, and for the mean vectorized.
    draws = np.random.default_rng(seed).integers(0, n_clusters, size=(n_resamples, n_clusters))
    if statistic is np.mean:
        sums = np.bincount(codes, weights=xs, minlength=n_clusters)
        counts = np.bincount(codes, minlength=n_clusters)
        dist = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    else:
        members = [xs[codes == g] for g in range(n_clusters)]
        dist = np.array([float(statistic(np.concatenate([members[g] for g in row]))) for row in draws])
    alpha = (1 - confidence) / 2
    low, high = np.percentile(dist, [100 * alpha, 100 * (1 - alpha)])
    return ClusterBootstrap(estimate, float(low), float(high), len(xs), n_clusters, confidence, n_resamples, seed)


def cluster_bootstrap_ratio(
    numerator: Sequence[float],
    denominator: Sequence[float],
    clusters: Sequence[Hashable],
    n_resamples: int = 10_000,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> ClusterBootstrap:
    """The ratio of means ``mean(numerator) / mean(denominator)`` over paired per-item values (e.g. one
    arm's F1 over the full history's F1 on the same questions), with the percentile interval of
    :func:`cluster_bootstrap`: each resample draws whole clusters and takes the ratio of the pooled
    means, so the pairing of the two values of an item is kept. A resample whose denominator mean is 0
    gives an infinite or nan ratio; the estimate is nan when the pooled denominator mean is 0.

    Raises:
        EventKVError: a nan or infinite value.
        ValueError: the sequences differ in length (or as :func:`cluster_bootstrap`).
    """
    num = np.asarray(require_finite(numerator, "ratio bootstrap", "numerator"), dtype=np.float64)
    den = np.asarray(require_finite(denominator, "ratio bootstrap", "denominator"), dtype=np.float64)
    if len(num) != len(den):
        raise ValueError(f"cluster_bootstrap_ratio needs paired values, got {len(num)} and {len(den)}")

    def ratio(items: np.ndarray) -> float:
        i = items.astype(np.int64)
        d = float(den[i].mean())
        return float(num[i].mean()) / d if d else math.nan

    # the resampled "values" are item indices, so the statistic sees both members of each pair
    with np.errstate(divide="ignore", invalid="ignore"):
        return cluster_bootstrap([float(i) for i in range(len(num))], clusters, ratio, n_resamples, confidence, seed)
