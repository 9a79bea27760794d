"""Reward curve of a run from its `metrics.jsonl`: python recipes/plot_metrics.py OUTPUT_DIR [--out PNG].

Plots the mean reward per logged step (and a moving average), the per-reward-function means TRL logs,
and `frac_reward_zero_std` on a second panel; the eval before/after accuracy goes into the title.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without an install

from trl_grpo_ext.runs import (  # noqa: E402
    EVAL_BEFORE_AFTER_FILENAME,
    METRICS_FILENAME,
    REWARD_CURVE_FILENAME,
    read_metrics_file,
)


def _series(rows, key):
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def _moving_average(values, window):
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot_reward_curve(run_dir, out=None, window=5) -> Path:
    """Write the reward curve PNG of `run_dir` (default `<run_dir>/reward_curve.png`) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows, _ = read_metrics_file(run_dir / METRICS_FILENAME)
    rows = [r for r in rows if isinstance(r.get("step"), (int, float))]
    if not rows:
        raise ValueError(f"{run_dir / METRICS_FILENAME} has no rows")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    steps, reward = _series(rows, "reward")
    top.plot(steps, reward, color="tab:blue", alpha=0.35, label="reward (per step)")
    top.plot(steps, _moving_average(reward, window), color="tab:blue", label=f"reward ({window}-step mean)")
    component_keys = sorted({k for r in rows for k in r if k.startswith("rewards/") and not k.endswith("/std")})
    for key in component_keys:
        if key.endswith("/mean") and len(component_keys) > 1 and "hybrid" in key:
            continue  # the hybrid's mean is the reward itself
        xs, ys = _series(rows, key)
        top.plot(xs, _moving_average(ys, window), linestyle="--", label=key.removeprefix("rewards/"))
    top.set_ylabel("reward")
    top.legend(fontsize=7, loc="upper left")
    top.grid(alpha=0.3)
    xs, ys = _series(rows, "frac_reward_zero_std")
    bottom.plot(xs, ys, color="tab:red", marker=".", linewidth=0.8)
    bottom.set_ylabel("frac zero std")
    bottom.set_ylim(-0.05, 1.05)
    bottom.set_xlabel("optimizer step")
    bottom.grid(alpha=0.3)
    title = run_dir.name
    eval_path = run_dir / EVAL_BEFORE_AFTER_FILENAME
    if eval_path.exists():
        evals = json.loads(eval_path.read_text())
        if "before" in evals and "after" in evals:
            title += (
                f" - greedy eval accuracy {evals['before']['accuracy']:.2f} -> {evals['after']['accuracy']:.2f}"
                f" (n={evals['after']['n']})"
            )
    top.set_title(title, fontsize=9)
    fig.tight_layout()
    out = Path(out) if out else run_dir / REWARD_CURVE_FILENAME
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


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
