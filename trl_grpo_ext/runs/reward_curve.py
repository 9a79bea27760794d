"""A run's reward curve PNG from its files: `metrics.jsonl` rows, with the eval before/after accuracy in the title.

Drawn by `trl_grpo_ext.report.plots.plot_reward_curve` (mean reward per logged step and a moving average, the
per-reward-function means TRL logs, `frac_reward_zero_std` on a second panel); called after training by the TRL
recipe and by `recipes/plot_metrics.py` to redraw it.
"""

from __future__ import annotations

import json
from pathlib import Path

from trl_grpo_ext.report.plots import plot_reward_curve as draw_reward_curve
from trl_grpo_ext.runs.metrics import read_metrics_file
from trl_grpo_ext.runs.names import EVAL_BEFORE_AFTER_FILENAME, METRICS_FILENAME, REWARD_CURVE_FILENAME


def plot_run_reward_curve(run_dir, out=None, window=5) -> Path:
    """Write the reward curve PNG of `run_dir` (default `<run_dir>/reward_curve.png`) and return its path."""
    run_dir = Path(run_dir)
    rows, _ = read_metrics_file(run_dir / METRICS_FILENAME)
    rows = [r for r in rows if isinstance(r.get("step"), (int, float))]
    if not rows:
        raise ValueError(f"{run_dir / METRICS_FILENAME} has no rows")
    title = run_dir.name
    eval_path = run_dir / EVAL_BEFORE_AFTER_FILENAME
    if eval_path.exists():
        evals = json.loads(eval_path.read_text())
        if "before" in evals and "after" in evals:
            title += (
                f" - greedy eval accuracy {evals['before']['accuracy']:.2f} -> {evals['after']['accuracy']:.2f}"
                f" (n={evals['after']['n']})"
            )
    return draw_reward_curve(rows, title, Path(out) if out else run_dir / REWARD_CURVE_FILENAME, window)
