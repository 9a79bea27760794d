"""Reward curve of a run from its `metrics.jsonl`: python recipes/plot_metrics.py OUTPUT_DIR [--out PNG].

Plots the mean reward per logged step (and a moving average), the per-reward-function means TRL logs,
and `frac_reward_zero_std` on a second panel (`trl_grpo_ext.report.plots.plot_reward_curve`); the eval
before/after accuracy goes into the title.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without an install

from trl_grpo_ext.report.plots import plot_reward_curve as draw_reward_curve  # noqa: E402
from trl_grpo_ext.runs import (  # noqa: E402
    EVAL_BEFORE_AFTER_FILENAME,
    METRICS_FILENAME,
    REWARD_CURVE_FILENAME,
    read_metrics_file,
)


def plot_reward_curve(run_dir, out=None, window=5) -> Path:
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="output_dir of a run (holds metrics.jsonl)")
    parser.add_argument("--out", help="PNG path (default: <run_dir>/reward_curve.png)")
    parser.add_argument("--window", type=int, default=5, help="moving-average window in steps")
    args = parser.parse_args(argv)
    print(plot_reward_curve(args.run_dir, args.out, args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
