"""Interval and test math of `trl_grpo_ext.report.stats` against known answers."""

import math
import random

import pytest

from trl_grpo_ext.report.stats import (
    Interval,
    bootstrap_ci,
    hierarchical_diff_ci,
    mcnemar_exact,
    mean_ci,
    paired_bootstrap_ci,
    t_quantile,
    welch_diff_ci,
)
from trl_grpo_ext.report.text import format_p, verdict


@pytest.mark.parametrize("df, expected", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423)])
def test_t_quantile_matches_tables(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=1e-4)
    assert t_quantile(0.975, 1e6) == pytest.approx(1.95996, abs=1e-4)


def test_mean_ci_is_the_t_interval():
    iv = mean_ci([1.0, 2.0, 3.0])  # sd 1, n 3: 2 +- 4.3027 / sqrt(3)
    assert iv.estimate == 2.0
    assert iv.low == pytest.approx(2 - 4.3027 / math.sqrt(3), abs=1e-3)
    assert iv.high == pytest.approx(2 + 4.3027 / math.sqrt(3), abs=1e-3)
    one = mean_ci([0.4])
    assert one.estimate == 0.4 and not one.has_interval
    with pytest.raises(ValueError):
        mean_ci([])


def test_mcnemar_exact_known_values():
    assert mcnemar_exact(10, 0) == pytest.approx(2 / 1024)
    assert mcnemar_exact(7, 1) == pytest.approx(2 * 9 / 256)  # P(X <= 1), X ~ Bin(8, 1/2), two-sided
    assert mcnemar_exact(5, 5) == 1.0 and mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(3, 12) == mcnemar_exact(12, 3)
    assert 0 < mcnemar_exact(0, 2000) < 1e-300 or mcnemar_exact(0, 2000) == 0.0  # no overflow on large counts


def test_verdict_strings():
    assert verdict("A", "B", Interval(0.06, -0.02, 0.14, 3)) == "A − B = +0.06 [−0.02, +0.14]: not significant at 95%"
    assert verdict("ppo", "cispo", Interval(-0.1, -0.15, -0.05, 3)) == (
        "ppo − cispo = −0.10 [−0.15, −0.05]: significant at 95%"
    )
    assert "no verdict" in verdict("A", "B", Interval(0.1, None, None, 1))
    assert format_p(1.2e-5) == "1e-5" and format_p(0.5) == "0.50" and format_p(0.031) == "0.031"


def test_identical_distributions_are_not_significant_separated_ones_are():
    same_a, same_b = [0.30, 0.32, 0.31], [0.31, 0.30, 0.32]
    assert not welch_diff_ci(same_a, same_b).significant
    assert welch_diff_ci(same_a, same_b).estimate == pytest.approx(0.0)
    apart = welch_diff_ci([0.50, 0.52, 0.51], [0.30, 0.31, 0.29])
    assert apart.significant and apart.low > 0
    assert "significant at 95%" in verdict("A", "B", apart) and "not" not in verdict("A", "B", apart)
    # Welch's df: equal variances and sizes give 2n - 2
    iv = welch_diff_ci([1.0, 2.0, 3.0], [2.0, 3.0, 4.0])
    assert iv.high - iv.estimate == pytest.approx(t_quantile(0.975, 4) * math.sqrt(2 / 3), abs=1e-9)
    assert not welch_diff_ci([0.5], [0.4]).has_interval  # one seed: no interval


def test_bootstrap_is_deterministic_and_covers_the_mean():
    rng = random.Random(1)
    xs = [rng.random() for _ in range(50)]
    a, b = bootstrap_ci(xs), bootstrap_ci(xs)
    assert a == b
    assert a.low < sum(xs) / len(xs) < a.high
    assert a.high - a.low == pytest.approx(2 * 1.96 * (1 / math.sqrt(12)) / math.sqrt(50), rel=0.25)


def test_paired_bootstrap_of_binary_outcomes():
    before = [0] * 200
    after = [1 if i % 2 else 0 for i in range(200)]
    gain = paired_bootstrap_ci(before, after)
    assert gain.estimate == 0.5 and gain.significant and 0.42 < gain.low < 0.5 < gain.high < 0.58
    same = paired_bootstrap_ci(after, after)
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0) and not same.significant
    with pytest.raises(ValueError, match="equal lengths"):
        paired_bootstrap_ci([1, 0], [1])


def test_hierarchical_difference_on_synthetic_runs():
    rng = random.Random(0)

    def runs(p, seeds=3, n=300):
        return [[float(rng.random() < p) for _ in range(n)] for _ in range(seeds)]

    same = hierarchical_diff_ci(runs(0.3), runs(0.3), n_resamples=2000)
    assert not same.significant and same.low < 0 < same.high
    apart = hierarchical_diff_ci(runs(0.6), runs(0.3), n_resamples=2000)
    assert apart.significant and apart.low > 0.15
    assert hierarchical_diff_ci([[1, 0, 1]], [[0, 0, 1]]) == hierarchical_diff_ci([[1, 0, 1]], [[0, 0, 1]])
    with pytest.raises(ValueError, match="same problems"):
        hierarchical_diff_ci([[1, 0]], [[1, 0, 1]])
