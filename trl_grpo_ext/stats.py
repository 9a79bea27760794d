"""Intervals and tests for comparisons: across seeds, across problems, before vs after.

Everything here is deterministic: bootstrap resamples come from a seeded numpy generator, so the same inputs
give the same interval on any machine, under any load.

- `mean_ci`: mean and 95% Student-t interval over a few values (seeds). The t quantile, not the normal one,
  because with 3 seeds the sample standard deviation is itself very uncertain (t(2) = 4.30 vs z = 1.96).
- `welch_diff_ci`: difference of two such means (Welch's t, unequal variances, Welch-Satterthwaite df).
- `bootstrap_ci` / `paired_bootstrap_ci`: percentile bootstrap of a mean / of a mean paired difference.
- `mcnemar_exact`: exact two-sided McNemar test on the discordant pairs of a paired binary outcome.
- `hierarchical_diff_ci`: difference of two configurations' accuracies on the same problems, resampling
  problems (paired across configurations) and seeds (within each configuration).
- `verdict`: the one-line reading, e.g. `A − B = +0.06 [−0.02, +0.14]: not significant at 95%`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

CONFIDENCE = 0.95
N_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
MINUS = "\u2212"  # typographic minus, as in the verdict strings
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


# ------------------------------------------------------------------------------------------ Student t


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Inverse of `t_cdf` (bisection to 1e-12: exact enough, and the same bits everywhere)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2.0


# --------------------------------------------------------------------------------------- intervals


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
    """mean(a) - mean(b) with Welch's t interval; no interval unless both sides have >= 2 values."""
    xa, xb = _finite(a), _finite(b)
    if not xa or not xb:
        raise ValueError("welch_diff_ci needs values on both sides")
    ma, mb = sum(xa) / len(xa), sum(xb) / len(xb)
    diff = ma - mb
    n = min(len(xa), len(xb))
    if len(xa) < 2 or len(xb) < 2:
        return Interval(diff, None, None, n, "welch")
    va = sum((x - ma) ** 2 for x in xa) / (len(xa) - 1) / len(xa)
    vb = sum((x - mb) ** 2 for x in xb) / (len(xb) - 1) / len(xb)
    se = math.sqrt(va + vb)
    if se == 0.0:  # every seed gave the same value on both sides: the difference is exact
        return Interval(diff, diff, diff, n, "welch")
    df = (va + vb) ** 2 / ((va**2 / (len(xa) - 1) if va else 0.0) + (vb**2 / (len(xb) - 1) if vb else 0.0))
    half = t_quantile(0.5 + confidence / 2.0, df) * se
    return Interval(diff, diff - half, diff + half, n, "welch")


def _percentiles(stats: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(stats, [alpha, 1.0 - alpha])
    return float(low), float(high)


def bootstrap_ci(
    values: Sequence[float], confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> Interval:
    """Mean and percentile-bootstrap interval (resampling the values with replacement)."""
    xs = np.asarray(_finite(values), dtype=np.float64)
    n = len(xs)
    if not n:
        raise ValueError("bootstrap_ci needs at least one value")
    mean = float(xs.mean())
    if n < 2:
        return Interval(mean, None, None, n, "bootstrap")
    rng = np.random.default_rng(seed)
    stats = np.empty(n_resamples)
    for start in range(0, n_resamples, _CHUNK):
        size = min(_CHUNK, n_resamples - start)
        stats[start : start + size] = xs[rng.integers(0, n, size=(size, n))].mean(axis=1)
    return Interval(mean, *_percentiles(stats, confidence), n, "bootstrap")


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

    Under no change each discordant pair is a fair coin: p = P(|X - m/2| >= |fixed - m/2|), X ~ Bin(m, 1/2).
    """
    if fixed < 0 or broken < 0:
        raise ValueError("counts must be >= 0")
    m = fixed + broken
    if m == 0:
        return 1.0
    k = min(fixed, broken)
    tail = sum(math.comb(m, i) for i in range(k + 1))
    return min(1.0, 2 * tail / 2**m)


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
    stats = np.empty(n_resamples)
    # Chunks of a fixed size, drawn in a fixed order (A's seeds, B's seeds, problems): the same draws on every
    # machine, memory bounded by _CHUNK * seeds * problems values.
    chunk = max(1, _CHUNK // max(len(ma), len(mb)))
    for start in range(0, n_resamples, chunk):
        size = min(chunk, n_resamples - start)
        pa = ma[rng.integers(0, len(ma), size=(size, len(ma)))].mean(axis=1)  # (size, n): per-problem means
        pb = mb[rng.integers(0, len(mb), size=(size, len(mb)))].mean(axis=1)
        problems = rng.integers(0, n, size=(size, n))
        stats[start : start + size] = np.take_along_axis(pa - pb, problems, axis=1).mean(axis=1)
    return Interval(diff, *_percentiles(stats, confidence), n, "hierarchical bootstrap")


# ----------------------------------------------------------------------------------------- reading


def signed(x: float, digits: int = 2) -> str:
    """`+0.06`, `−0.02` (typographic minus), `+0.00`."""
    text = f"{abs(x):.{digits}f}"
    return ("+" if x >= 0 or float(text) == 0 else MINUS) + text


def format_p(p: float) -> str:
    """McNemar / test p-values: `0.031`, `1e-5` (no padded exponent), `<1e-300`."""
    if p >= 0.001:
        return f"{p:.2g}" if p < 0.1 else f"{p:.2f}"
    if p <= 0:
        return "<1e-300"
    mantissa, exponent = f"{p:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def format_interval(iv: Interval, digits: int = 2) -> str:
    """`+0.06 [−0.02, +0.14]`, or `+0.06 (no interval)` when the data give none."""
    if not iv.has_interval:
        return f"{signed(iv.estimate, digits)} (no interval)"
    return f"{signed(iv.estimate, digits)} [{signed(iv.low, digits)}, {signed(iv.high, digits)}]"


def verdict(a: str, b: str, iv: Interval, confidence: float = CONFIDENCE, digits: int = 2) -> str:
    """`A − B = +0.06 [−0.02, +0.14]: not significant at 95%` (significant: the interval excludes 0)."""
    level = f"{confidence * 100:g}%"
    head = f"{a} {MINUS} {b} = {format_interval(iv, digits)}"
    if not iv.has_interval:
        return f"{head}: no verdict (needs at least 2 seeds per configuration)"
    return f"{head}: {'significant' if iv.significant else 'not significant'} at {level}"
