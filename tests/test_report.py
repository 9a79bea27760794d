"""`trl_grpo_ext.report`: the statistics on scipy give today's numbers, the text and tables read as before, and the
lower layers (runs, report) import nothing above them."""

import ast
import random
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

# What the hand-written implementation (bisection t quantile, integer McNemar tail, numpy bootstrap in chunks of
# 1,000) returned on these inputs, before the move to scipy.stats.
OLD_T = {
    (0.975, 1): 12.70620473617464,
    (0.975, 2): 4.302652729749298,
    (0.975, 3.5): 2.940088637983081,
    (0.975, 30): 2.042272456300907,
    (0.95, 7): 1.8945786050903735,
    (0.995, 1000): 2.5807546980663574,
    (0.6, 2): 0.2886751345945413,
}
OLD_MCNEMAR = {
    (10, 0): 0.001953125,
    (7, 1): 0.0703125,
    (5, 5): 1.0,
    (3, 12): 0.03515625,
    (40, 25): 0.08168153394154005,
    (0, 0): 1.0,
    (1, 0): 1.0,
    (100, 130): 0.055613577781392386,
    (0, 60): 1.734723475976807e-18,
}


def _samples():
    rng = random.Random(7)
    xs = [round(rng.random(), 6) for _ in range(40)]
    ys = [round(rng.random() * 0.8 + 0.1, 6) for _ in range(40)]
    a = [[float(rng.random() < 0.4) for _ in range(30)] for _ in range(3)]
    b = [[float(rng.random() < 0.3) for _ in range(30)] for _ in range(2)]
    return xs, ys, a, b


def _close(iv: Interval, estimate, low, high, tol):
    return iv.estimate == pytest.approx(estimate, abs=tol) and (iv.low, iv.high) == pytest.approx((low, high), abs=tol)


@pytest.mark.parametrize("p, df", sorted(OLD_T))
def test_t_quantiles_agree_with_the_old_bisection(p, df):
    assert t_quantile(p, df) == pytest.approx(OLD_T[(p, df)], abs=1e-11)  # the bisection stopped at 1e-12 wide


def test_t_intervals_agree_with_the_old_ones():
    assert _close(mean_ci([0.31, 0.35, 0.29]), 0.31666666666666665, 0.24077500599473436, 0.39255832733859897, 1e-12)
    welch = welch_diff_ci([0.31, 0.35, 0.29], [0.25, 0.27, 0.30, 0.22])
    assert _close(welch, 0.05666666666666664, -0.007221726152480026, 0.12055505948581331, 1e-12)
    one_side_constant = welch_diff_ci([0.5, 0.5, 0.5], [0.25, 0.27, 0.30, 0.22])
    assert _close(one_side_constant, 0.24, 0.18643144637285392, 0.29356855362714607, 1e-12)
    assert welch_diff_ci([0.5, 0.5], [0.25, 0.25, 0.25]).as_dict() == {
        "estimate": 0.25, "low": 0.25, "high": 0.25, "n": 2, "method": "welch"
    }  # fmt: skip


def test_bootstraps_draw_exactly_what_they_drew_before():
    xs, ys, a, b = _samples()
    assert bootstrap_ci(xs).as_dict() == {
        "estimate": 0.39147765, "low": 0.309146290625, "high": 0.47813663687499997, "n": 40, "method": "bootstrap"
    }  # fmt: skip
    paired = paired_bootstrap_ci(xs, ys)
    assert _close(paired, 0.14707307500000003, 0.048873778750000006, 0.24475142937499997, 1e-15)
    hier = hierarchical_diff_ci(a, b, n_resamples=2000)
    assert _close(hier, 0.26111111111111107, 0.08888888888888886, 0.45, 1e-15)


@pytest.mark.parametrize("fixed, broken", sorted(OLD_MCNEMAR))
def test_exact_mcnemar_agrees_with_the_integer_tail(fixed, broken):
    assert mcnemar_exact(fixed, broken) == pytest.approx(OLD_MCNEMAR[(fixed, broken)], rel=1e-12)
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
