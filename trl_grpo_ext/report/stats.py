"""Intervals and tests for comparisons: across seeds, across problems, before vs after, on `scipy.stats`.

Everything here is deterministic: bootstrap resamples come from a seeded numpy generator, so the same inputs
give the same interval on any machine, under any load.

- `mean_ci`: mean and 95% Student-t interval over a few values (seeds). The t quantile, not the normal one,
  because with 3 seeds the sample standard deviation is itself very uncertain (t(2) = 4.30 vs z = 1.96).
- `welch_diff_ci`: difference of two such means (Welch's t, unequal variances, Welch-Satterthwaite df).
- `bootstrap_ci` / `paired_bootstrap_ci`: percentile bootstrap of a mean / of a mean paired difference.
- `mcnemar_exact`: exact two-sided McNemar test on the discordant pairs of a paired binary outcome.
- `hierarchical_diff_ci`: difference of two configurations' accuracies on the same problems, resampling
  problems (paired across configurations) and seeds (within each configuration). scipy has no such resampling
  of two levels at once; it is written here on numpy's generator.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np


def _scipy_stats():
    """`scipy.stats`, imported on first use: it takes seconds to import, and most users of this module (the
    recipes, `trl-grpo-ext sweep`) reach a statistic only at the end of a run, if at all."""
    from scipy import stats

    return stats


CONFIDENCE = 0.95
N_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
# Resamples drawn per numpy call: bounds memory to ~_CHUNK * n values whatever N_RESAMPLES is.
_CHUNK = 1_000


@dataclass(frozen=True)
class Interval:
    """An estimate with its confidence interval (`low`/`high` None when the data cannot give one)."""

    estimate: float
    low: float | None
    high: float | None
    n: int
    method: str = ""

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    @property
    def significant(self) -> bool:
        """True when the interval excludes 0."""
        return self.has_interval and (self.low > 0 or self.high < 0)

    def as_dict(self) -> dict:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "n": self.n, "method": self.method}


def t_quantile(p: float, df: float) -> float:
    """The `p` quantile of Student's t with `df` degrees of freedom."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    return float(_scipy_stats().t.ppf(p, df))


def _finite(values: Sequence[float]) -> list[float]:
    out = [float(v) for v in values]
    if any(not math.isfinite(v) for v in out):
        raise ValueError("values must be finite numbers")
    return out


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean and Student-t interval (df = n - 1). One value: the mean, no interval."""
    xs = _finite(values)
    n = len(xs)
    if not n:
        raise ValueError("mean_ci needs at least one value")
    mean = sum(xs) / n
    if n < 2:
        return Interval(mean, None, None, n, "t")
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, "t")


def welch_diff_ci(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """mean(a) - mean(b) with Welch's t interval (`scipy.stats.ttest_ind(equal_var=False)`); no interval unless
    both sides have >= 2 values."""
    xa, xb = _finite(a), _finite(b)
    if not xa or not xb:
        raise ValueError("welch_diff_ci needs values on both sides")
    diff = sum(xa) / len(xa) - sum(xb) / len(xb)
    n = min(len(xa), len(xb))
    if len(xa) < 2 or len(xb) < 2:
        return Interval(diff, None, None, n, "welch")
    if (
        np.var(xa) == 0.0 and np.var(xb) == 0.0
    ):  # every seed gave the same value on both sides: the difference is exact
        return Interval(diff, diff, diff, n, "welch")
    with warnings.catch_warnings():
        # scipy warns of precision loss when one side's values are all equal; its variance is then exactly 0.
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = _scipy_stats().ttest_ind(xa, xb, equal_var=False).confidence_interval(confidence)
    return Interval(diff, float(ci.low), float(ci.high), n, "welch")


def bootstrap_ci(
    values: Sequence[float], confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> Interval:
    """Mean and percentile-bootstrap interval (`scipy.stats.bootstrap`, resampling the values with replacement)."""
    xs = np.asarray(_finite(values), dtype=np.float64)
    n = len(xs)
    if not n:
        raise ValueError("bootstrap_ci needs at least one value")
    mean = float(xs.mean())
    if n < 2:
        return Interval(mean, None, None, n, "bootstrap")
    stats = _scipy_stats()
    with warnings.catch_warnings():
        # all resampled means equal (identical values): the interval is that value, no warning needed
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        result = stats.bootstrap(
            (xs,),
            np.mean,
            n_resamples=n_resamples,
            batch=_CHUNK,
            confidence_level=confidence,
            method="percentile",
            rng=np.random.default_rng(seed),
        )
    ci = result.confidence_interval
    return Interval(mean, float(ci.low), float(ci.high), n, "bootstrap")


def paired_bootstrap_ci(
    before: Sequence[float],
    after: Sequence[float],
    confidence: float = CONFIDENCE,
    n_resamples: int = N_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """mean(after - before) over paired items, with the percentile bootstrap of the pairs."""
    if len(before) != len(after):
        raise ValueError(f"paired values need equal lengths, got {len(before)} and {len(after)}")
    diffs = [float(a) - float(b) for b, a in zip(before, after, strict=True)]
    out = bootstrap_ci(diffs, confidence, n_resamples, seed)
    return Interval(out.estimate, out.low, out.high, out.n, "paired bootstrap")


def mcnemar_exact(fixed: int, broken: int) -> float:
    """Exact two-sided McNemar p-value: `fixed` pairs went wrong -> right, `broken` right -> wrong.

    Under no change each discordant pair is a fair coin: the exact binomial test of `fixed` out of the
    discordant pairs at p = 1/2 (`scipy.stats.binomtest`).
    """
    if fixed < 0 or broken < 0:
        raise ValueError("counts must be >= 0")
    if fixed + broken == 0:
        return 1.0
    # the smaller count, so that swapping the two (a symmetric test) gives the same bits
    return float(_scipy_stats().binomtest(min(fixed, broken), fixed + broken, 0.5).pvalue)


def _percentiles(values: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(values, [alpha, 1.0 - alpha])
    return float(low), float(high)


def hierarchical_diff_ci(
    a: Sequence[Sequence[float]],
    b: Sequence[Sequence[float]],
    confidence: float = CONFIDENCE,
    n_resamples: int = N_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """Mean over (seeds x problems) of `a` minus that of `b`, problems paired across the two.

    `a[s][i]`: outcome of seed run `s` of configuration A on problem `i` (the same problem `i` for B). Each
    resample draws the problems once (shared by A and B: the pairing) and, independently, each side's seed
    runs, so the interval carries both the eval-set and the training-seed variation. With one seed per side
    it is the paired bootstrap over problems.
    """
    ma, mb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if ma.ndim != 2 or mb.ndim != 2 or ma.shape[1] != mb.shape[1] or not ma.size or not mb.size:
        raise ValueError("a and b must be non-empty (seeds x problems) arrays over the same problems")
    n = ma.shape[1]
    diff = float(ma.mean() - mb.mean())
    if n < 2 and (len(ma) < 2 or len(mb) < 2):
        return Interval(diff, None, None, n, "hierarchical bootstrap")
    rng = np.random.default_rng(seed)
    resampled = np.empty(n_resamples)
    # Chunks of a fixed size, drawn in a fixed order (A's seeds, B's seeds, problems): the same draws on every
    # machine, memory bounded by _CHUNK * seeds * problems values.
    chunk = max(1, _CHUNK // max(len(ma), len(mb)))
    for start in range(0, n_resamples, chunk):
        size = min(chunk, n_resamples - start)
        pa = ma[rng.integers(0, len(ma), size=(size, len(ma)))].mean(axis=1)  # (size, n): per-problem means
        pb = mb[rng.integers(0, len(mb), size=(size, len(mb)))].mean(axis=1)
        problems = rng.integers(0, n, size=(size, n))
        resampled[start : start + size] = np.take_along_axis(pa - pb, problems, axis=1).mean(axis=1)
    return Interval(diff, *_percentiles(resampled, confidence), n, "hierarchical bootstrap")
