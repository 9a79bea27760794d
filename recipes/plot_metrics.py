"""Reward curve of a run from its `metrics.jsonl`: python recipes/plot_metrics.py OUTPUT_DIR [--out PNG].

Plots the mean reward per logged step (and a moving average), the per-reward-function means TRL logs,
and `frac_reward_zero_std` on a second panel (`trl_grpo_ext.runs.reward_curve`); the eval before/after accuracy
goes into the title.
"""

import argparse
import sys

from trl_grpo_ext.runs.reward_curve import plot_run_reward_curve


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="output_dir of a run (holds metrics.jsonl)")
    parser.add_argument("--out", help="PNG path (default: <run_dir>/reward_curve.png)")
    parser.add_argument("--window", type=int, default=5, help="moving-average window in steps")
    args = parser.parse_args(argv)
    print(plot_run_reward_curve(args.run_dir, args.out, args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
