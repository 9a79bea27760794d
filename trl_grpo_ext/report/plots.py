"""The reports' PNGs: one metric's curves (a line per run), all metrics at a glance, each configuration's mean over
seeds with its band, and a run's reward curve. matplotlib is imported on first use (headless: Agg)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from trl_grpo_ext.report.curves import smooth

# Runs whose curves coincide (same seed, a setting that did not change training) stay visible as
# dashes or dots over the solid line.
LINE_STYLES = ("-", "--", ":", "-.")


@dataclass
class Curve:
    """One line: a metric of one run (or one configuration) over optimizer steps. `position` is the run's place in
    the report, not the line's in this plot: it picks the colour and dash, so a run looks alike in every plot."""

    label: str
    steps: list[float]
    values: list[float]
    position: int = 0


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_style(position: int) -> tuple[str, str]:
    return f"C{position % 10}", LINE_STYLES[position % len(LINE_STYLES)]


def _one_plot():
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    return plt, fig, ax


def _finish(plt, fig, ax, metric: str, title: str, fontsize: int, path: Path) -> None:
    """Labels, grid and legend of a one-metric plot over optimizer steps; saved to `path` and closed."""
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=fontsize)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_curves(curves: list[Curve], metric: str, title: str, path: Path, smooth_window: int = 1) -> bool:
    """One PNG with a line per curve that has values; False (no file) when none has."""
    curves = [c for c in curves if c.values]
    if not curves:
        return False
    plt, fig, ax = _one_plot()
    for curve in curves:
        color, style = line_style(curve.position)
        if smooth_window > 1:
            ax.plot(curve.steps, curve.values, color=color, alpha=0.25, linewidth=1, linestyle=style)
            smoothed = smooth(curve.values, smooth_window)
            ax.plot(curve.steps, smoothed, color=color, linewidth=2, linestyle=style, label=curve.label)
        else:
            marker = "." if len(curve.steps) < 40 else None
            ax.plot(
                curve.steps,
                curve.values,
                color=color,
                linewidth=1.8,
                linestyle=style,
                label=curve.label,
                marker=marker,
            )
    suffix = f" (moving average over {smooth_window} steps)" if smooth_window > 1 else ""
    _finish(plt, fig, ax, metric, title + suffix, 10, path)
    return True


def plot_panels(panels: dict[str, list[Curve]], path: Path, smooth_window: int = 1) -> bool:
    """All metrics in one figure (a grid of small panels, one legend), for a quick look; False when there are none."""
    if not panels:
        return False
    plt = _pyplot()
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows + 0.6), dpi=100, squeeze=False)
    for ax, (metric, curves) in zip(axes.flat, panels.items(), strict=False):
        for curve in curves:
            if curve.values:
                color, style = line_style(curve.position)
                smoothed = smooth(curve.values, smooth_window)
                ax.plot(curve.steps, smoothed, color=color, linestyle=style, linewidth=1.6, label=curve.label)
        ax.set_title(metric, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=False):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.03 * math.ceil(len(labels) / 3), 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return True


@dataclass
class Band:
    """A configuration's mean curve over its `runs` seeds, with the interval's `low` / `high` at each step."""

    label: str
    steps: list[float]
    mean: list[float]
    low: list[float]
    high: list[float]
    runs: int
    position: int = 0


def plot_bands(bands: list[Band], metric: str, title: str, path: Path) -> bool:
    """One PNG: each band's mean curve, shaded between low and high when it has several runs; False when empty."""
    bands = [b for b in bands if b.steps]
    if not bands:
        return False
    plt, fig, ax = _one_plot()
    for band in bands:
        color = f"C{band.position % 10}"
        ax.plot(band.steps, band.mean, color=color, linewidth=1.8, label=f"{band.label} (n={band.runs})")
        if band.runs > 1:
            ax.fill_between(band.steps, band.low, band.high, color=color, alpha=0.2, linewidth=0)
    _finish(plt, fig, ax, metric, title, 9, path)
    return True


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def plot_reward_curve(rows: list[dict], title: str, path: Path, window: int = 5) -> Path:
    """A run's reward per logged step with its moving average, the per-reward-function means TRL logs, and
    `frac_reward_zero_std` on a second panel, from its metrics.jsonl rows."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    steps, reward = _series(rows, "reward")
    top.plot(steps, reward, color="tab:blue", alpha=0.35, label="reward (per step)")
    top.plot(steps, smooth(reward, window), color="tab:blue", label=f"reward ({window}-step mean)")
    component_keys = sorted({k for r in rows for k in r if k.startswith("rewards/") and not k.endswith("/std")})
    for key in component_keys:
        if key.endswith("/mean") and len(component_keys) > 1 and "hybrid" in key:
            continue  # the hybrid's mean is the reward itself
        xs, ys = _series(rows, key)
        top.plot(xs, smooth(ys, window), linestyle="--", label=key.removeprefix("rewards/"))
    top.set_ylabel("reward")
    top.legend(fontsize=7, loc="upper left")
    top.grid(alpha=0.3)
    xs, ys = _series(rows, "frac_reward_zero_std")
    bottom.plot(xs, ys, color="tab:red", marker=".", linewidth=0.8)
    bottom.set_ylabel("frac zero std")
    bottom.set_ylim(-0.05, 1.05)
    bottom.set_xlabel("optimizer step")
    bottom.grid(alpha=0.3)
    top.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
