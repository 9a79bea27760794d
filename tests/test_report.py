"""`trl_grpo_ext.report`: the statistics agree with closed forms and by-hand computations, the text and tables read
as specified, and the lower layers (runs, report) import nothing above them."""

import ast
import math
import random
import statistics
from pathlib import Path

import pytest

from trl_grpo_ext.report.curves import normalized_auc, smooth
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
from trl_grpo_ext.report.tables import escape, markdown_table
from trl_grpo_ext.report.text import format_interval, interval_text

ROOT = Path(__file__).resolve().parents[1]


def _samples():
    rng = random.Random(7)
    xs = [round(rng.random(), 6) for _ in range(40)]
    ys = [round(rng.random() * 0.8 + 0.1, 6) for _ in range(40)]
    a = [[float(rng.random() < 0.4) for _ in range(30)] for _ in range(3)]
    b = [[float(rng.random() < 0.3) for _ in range(30)] for _ in range(2)]
    return xs, ys, a, b


def _close(iv: Interval, estimate, low, high, tol):
    return iv.estimate == pytest.approx(estimate, abs=tol) and (iv.low, iv.high) == pytest.approx((low, high), abs=tol)


def _t_closed_form(p, df):
    """Student's t quantile where it has a closed form: df 1 (Cauchy) and df 2."""
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    assert df == 2
    return (2 * p - 1) / math.sqrt(2 * p * (1 - p))


@pytest.mark.parametrize("p", [0.6, 0.9, 0.95, 0.975, 0.995])
@pytest.mark.parametrize("df", [1, 2])
def test_t_quantiles_equal_the_closed_forms(p, df):
    assert t_quantile(p, df) == pytest.approx(_t_closed_form(p, df), rel=1e-12)
    assert t_quantile(1 - p, df) == pytest.approx(-t_quantile(p, df), rel=1e-12)  # symmetric


def test_t_quantiles_fall_towards_the_normal_ones_as_df_grows():
    normal = statistics.NormalDist().inv_cdf(0.975)
    values = [t_quantile(0.975, df) for df in (1, 2, 3.5, 30, 1000)]
    assert values == sorted(values, reverse=True) and values[-1] > normal
    # at df 1000: the normal quantile z plus the Cornish-Fisher terms in 1/df and 1/df^2
    z, df = normal, 1000
    assert values[-1] == pytest.approx(
        z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2), abs=1e-7
    )


def test_t_intervals_by_hand():
    xs = [0.31, 0.35, 0.29]
    mean, sd = statistics.mean(xs), statistics.stdev(xs)
    half = _t_closed_form(0.975, 2) * sd / math.sqrt(3)
    assert _close(mean_ci(xs), mean, mean - half, mean + half, 1e-12)
    # Welch: the difference of means, its standard error, the Welch-Satterthwaite degrees of freedom
    ys = [0.25, 0.27, 0.30, 0.22]
    va, vb = statistics.variance(xs) / 3, statistics.variance(ys) / 4
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    diff, half = mean - statistics.mean(ys), t_quantile(0.975, df) * math.sqrt(va + vb)
    assert _close(welch_diff_ci(xs, ys), diff, diff - half, diff + half, 1e-12)
    # one side constant: only the other side's spread counts, with its n - 1 degrees of freedom
    diff, half = 0.5 - statistics.mean(ys), t_quantile(0.975, 3) * math.sqrt(vb)
    assert _close(welch_diff_ci([0.5, 0.5, 0.5], ys), diff, diff - half, diff + half, 1e-12)
    assert welch_diff_ci([0.5, 0.5], [0.25, 0.25, 0.25]).as_dict() == {
        "estimate": 0.25, "low": 0.25, "high": 0.25, "n": 2, "method": "welch"
    }  # fmt: skip


def test_bootstraps_estimate_the_mean_with_an_interval_of_the_right_width_and_draw_the_same_every_time():
    xs, ys, a, b = _samples()
    boot = bootstrap_ci(xs)
    mean, se = statistics.mean(xs), statistics.stdev(xs) / math.sqrt(len(xs))
    assert boot.estimate == pytest.approx(mean, abs=1e-15) and boot.low < mean < boot.high
    # the percentile interval of the mean is close to the normal one, mean +- 1.96 standard errors
    assert (boot.high - boot.low) == pytest.approx(2 * 1.96 * se, rel=0.15)
    assert bootstrap_ci(xs) == boot and bootstrap_ci(xs, seed=1) != boot  # its draws follow the seed only
    paired = paired_bootstrap_ci(xs, ys)
    diffs = [y - x for x, y in zip(xs, ys, strict=True)]
    assert paired.estimate == pytest.approx(statistics.mean(diffs), abs=1e-15)
    assert (paired.low, paired.high) == (bootstrap_ci(diffs).low, bootstrap_ci(diffs).high)
    hier = hierarchical_diff_ci(a, b, n_resamples=2000)
    by_hand = statistics.mean(v for row in a for v in row) - statistics.mean(v for row in b for v in row)
    assert hier.estimate == pytest.approx(by_hand, abs=1e-15) and hier.low < by_hand < hier.high
    assert hierarchical_diff_ci(a, b, n_resamples=2000) == hier
    # problems and seeds both resampled: wider than the paired bootstrap over problems of the seed means alone
    seed_means = paired_bootstrap_ci(
        [statistics.mean(col) for col in zip(*b, strict=True)], [statistics.mean(col) for col in zip(*a, strict=True)]
    )
    assert hier.high - hier.low > seed_means.high - seed_means.low


@pytest.mark.parametrize(
    "fixed, broken", [(10, 0), (7, 1), (5, 5), (3, 12), (40, 25), (0, 0), (1, 0), (100, 130), (0, 60)]
)
def test_exact_mcnemar_is_the_two_sided_binomial_tail(fixed, broken):
    n, k = fixed + broken, min(fixed, broken)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n if n else 0.5
    assert mcnemar_exact(fixed, broken) == pytest.approx(min(1.0, 2 * tail), rel=1e-12)
    assert mcnemar_exact(broken, fixed) == mcnemar_exact(fixed, broken)


def test_interval_text_in_its_three_forms():
    assert format_interval(Interval(0.06, -0.02, 0.14, 3)) == "+0.06 [\u22120.02, +0.14]"
    assert format_interval(Interval(0.06, None, None, 1)) == "+0.06 (no interval)"
    assert interval_text(0.11, 0.07, 0.15, 3) == "+0.110 [+0.070, +0.150]"
    assert interval_text(0.3, -0.05, 0.35, 3, sign=False, missing=" (1 seed)") == "0.300 [-0.050, 0.350]"
    assert interval_text(0.3, None, None, 3, sign=False, missing=" (1 seed)") == "0.300 (1 seed)"
    assert interval_text(0.28, None, None, 3, missing="") == "+0.280"


def test_markdown_table_keeps_cells_as_written():
    table = markdown_table(["run", "steps"], [[escape("a|b\nc"), "2"], ["loss_type=cispo", "10"]])
    lines = table.splitlines()
    assert lines[0] == "| run | steps |" and set(lines[1]) <= {"|", "-"}
    assert lines[2:] == ["| a\\|b c | 2 |", "| loss_type=cispo | 10 |"]


def test_curve_numbers():
    assert smooth([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5] and smooth([1, 2], 1) == [1, 2]
    assert normalized_auc([1, 2, 3], [0.0, 1.0, 1.0]) == pytest.approx(0.75) and normalized_auc([], []) is None


# ------------------------------------------------------------------------------------------ layering

HIGHER = ("trl", "cli", "experiments", "evaluation", "pytrio")


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("layer", ["runs", "report"])
def test_lower_layers_import_nothing_above_them(layer):
    higher = tuple(f"trl_grpo_ext.{name}" for name in HIGHER)
    for path in sorted((ROOT / "trl_grpo_ext" / layer).glob("*.py")):
        bad = [m for m in _imported_modules(path) if m.startswith(higher)]
        assert bad == [], path


def test_seed_comparison_does_not_import_compare():
    """compare uses seed_comparison; the reverse import (once hidden in a function) made them a cycle."""
    assert not any(
        m.startswith("trl_grpo_ext.experiments.compare")
        for m in _imported_modules(ROOT / "trl_grpo_ext" / "experiments" / "seed_comparison.py")
    )


def test_the_recipe_reward_curve_from_a_run_folder(tmp_path):
    import json

    from trl_grpo_ext.runs.reward_curve import plot_run_reward_curve

    rows = [
        {"step": s, "reward": s / 10, "rewards/boxed/mean": s / 10, "frac_reward_zero_std": 0.5} for s in range(1, 8)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval_before_after.json").write_text(
        json.dumps({"before": {"accuracy": 0.1, "n": 4}, "after": {"accuracy": 0.5, "n": 4}})
    )
    path = plot_run_reward_curve(tmp_path, window=3)
    assert path == tmp_path / "reward_curve.png" and path.stat().st_size > 1000
    with pytest.raises(ValueError, match="has no rows"):
        plot_run_reward_curve(tmp_path / "missing")
