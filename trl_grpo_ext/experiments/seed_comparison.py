"""Configurations compared across seeds: groups of runs that differ only in seed, their means with 95% intervals,
mean curves with interval bands, and for each pair of configurations the difference with its interval and a
plain verdict (`A − B = +0.06 [−0.02, +0.14]: not significant at 95%`).

Used by `trl_grpo_ext.experiments.compare.build_report`. Intervals (see `trl_grpo_ext.report.stats`):

- final reward, reward AUC, held-out accuracy of a configuration: Student-t over its seeds;
- difference of two configurations' final reward / reward AUC: Welch's t over their seeds;
- difference of held-out accuracies: the per-problem results on the same eval problems, paired across the two
  configurations, with a bootstrap that resamples problems (paired) and each side's seeds, so the interval
  carries both the eval-set and the training-seed variation.

A configuration with one seed has a mean but no interval, and no verdict is drawn from it: nothing here
ranks configurations without their intervals.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl_grpo_ext.report.curves import smooth
from trl_grpo_ext.report.plots import Band, plot_bands
from trl_grpo_ext.report.stats import CONFIDENCE, Interval, hierarchical_diff_ci, mean_ci, welch_diff_ci
from trl_grpo_ext.report.tables import escape, markdown_table
from trl_grpo_ext.report.text import interval_text, verdict

# Config keys that pick the seed: runs differing only in these (and in output paths) are one configuration.
SEED_KEYS = ("seed", "data_seed")
# (summary key, title) of the per-run numbers compared across seeds.
SEED_METRICS = (
    ("final_reward", "final reward"),
    ("reward_auc", "reward AUC/step"),
    ("heldout_after_any_format", "held-out format-independent acc after"),
    ("heldout_after", "held-out boxed acc after"),
    ("heldout_gain_any_format", "held-out format-independent gain"),
)
# Held-out figures compared problem by problem: (summary key, ProblemResult field).
PAIRED_HELDOUT = (("heldout_after_any_format", "greedy_any_correct"), ("heldout_after", "greedy_correct"))
# Curves drawn as each configuration's mean over seeds with its 95% band (`<metric>_mean_ci.png`).
BAND_PLOTS = ("reward", "frac_degenerate")
# In the table only: configurations trained from one base model share its "before" eval, so a difference of
# gains is the difference of the after-accuracies, already tested problem by problem.
TABLE_ONLY = {"heldout_gain_any_format"}


@dataclass
class ConfigGroup:
    """Runs of one configuration (every config key equal except the seed)."""

    label: str
    runs: list  # of compare.RunData
    summaries: list[dict]
    seeds: list = field(default_factory=list)

    def values(self, key: str) -> list[float]:
        return [s[key] for s in self.summaries if isinstance(s.get(key), (int, float))]


def config_key(run, ignored: set[str]) -> str:
    """What identifies a run's configuration: its config without the seed and output paths (its path if no config)."""
    if not run.config:
        return f"path:{run.path}"
    kept = {k: v for k, v in run.config.items() if k not in ignored and k not in SEED_KEYS}
    return json.dumps(kept, sort_keys=True, default=str)


def group_by_seed(runs: list, summaries: list[dict], ignored: set[str]) -> list[ConfigGroup]:
    """Runs that differ only in seed, grouped, in the order their first run appears."""
    order: dict[str, list[int]] = {}
    for i, run in enumerate(runs):
        order.setdefault(config_key(run, ignored), []).append(i)
    members = list(order.values())
    labels = _group_labels([[runs[i] for i in idx] for idx in members], ignored)
    return [
        ConfigGroup(
            label, [runs[i] for i in idx], [summaries[i] for i in idx], [runs[i].config.get("seed") for i in idx]
        )
        for label, idx in zip(labels, members, strict=True)
    ]


def _group_labels(groups: list[list], ignored: set[str]) -> list[str]:
    """`k=v,...` of the config keys that differ between groups; a run's folder name where nothing tells them apart."""
    keys: list[str] = []
    for group in groups:
        for k in group[0].config:
            if k not in keys and k not in ignored and k not in SEED_KEYS:
                keys.append(k)
    differing = [
        k
        for k in keys
        if len({json.dumps(g[0].config.get(k), sort_keys=True, default=str) for g in groups if k in g[0].config}) > 1
    ]
    labels = []
    for group in groups:
        parts = [f"{k}={_short(group[0].config[k])}" for k in differing if k in group[0].config]
        labels.append(",".join(parts) if parts and len(groups) > 1 else _strip_seed(group[0].label))
    if len(set(labels)) < len(labels):  # still ambiguous: fall back to folder names
        labels = [
            _strip_seed(g[0].label) if len(g) == 1 else f"{_strip_seed(g[0].label)} (+{len(g) - 1})" for g in groups
        ]
    return labels


def _short(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _strip_seed(label: str) -> str:
    parts = [p for p in label.split(",") if not p.startswith("seed=")]
    return ",".join(parts) or label


# ------------------------------------------------------------------------------------------ numbers


def group_interval(group: ConfigGroup, key: str) -> Interval | None:
    values = group.values(key)
    return mean_ci(values) if values else None


def _problem_matrix(group: ConfigGroup, attr: str, questions: list[str]) -> list[list[float]] | None:
    rows = []
    for run in group.runs:
        after = run.heldout_problems.get("after")
        if not after:
            return None
        by_question = {(r.question, r.answer): r for r in after}
        row = [by_question.get(q) for q in questions]
        if any(r is None or getattr(r, attr) is None for r in row):
            return None
        rows.append([float(bool(getattr(r, attr))) for r in row])
    return rows


def common_problems(groups: list[ConfigGroup]) -> list:
    """The (question, answer) pairs of the eval set every run of `groups` was evaluated on after training, in the
    first run's order; [] unless all runs have per-problem results on the same set (a partial overlap, e.g. eval
    sets drawn with each run's seed, would pair a biased subset: easy problems repeat more often)."""
    sets = []
    for group in groups:
        for run in group.runs:
            after = run.heldout_problems.get("after")
            if not after:
                return []
            sets.append({(r.question, r.answer) for r in after})
    if any(s != sets[0] for s in sets):
        return []
    return [(r.question, r.answer) for r in groups[0].runs[0].heldout_problems["after"]]


def pair_difference(a: ConfigGroup, b: ConfigGroup, key: str) -> tuple[Interval | None, str]:
    """(difference of `a` and `b` on `key` with its interval, how it was computed)."""
    attr = dict(PAIRED_HELDOUT).get(key)
    if attr is not None:
        problems = common_problems([a, b])
        if problems:
            ma, mb = _problem_matrix(a, attr, problems), _problem_matrix(b, attr, problems)
            if ma is not None and mb is not None:
                iv = hierarchical_diff_ci(ma, mb)
                if min(len(ma), len(mb)) < 2:
                    # honest about what the interval can carry: these runs' eval noise, not seed-to-seed variation
                    return iv, f"paired over {len(problems)} problems; one seed on a side, so no seed variation"
                return iv, f"paired over {len(problems)} problems, seeds resampled"
    va, vb = a.values(key), b.values(key)
    if not va or not vb:
        return None, "not logged by both"
    if attr is not None:
        return welch_diff_ci(va, vb), "Welch t over seeds: no per-problem results on one common eval set"
    return welch_diff_ci(va, vb), "Welch t over seeds"


# ------------------------------------------------------------------------------------------ report


def _cell(iv: Interval | None) -> str:
    return "–" if iv is None else interval_text(iv.estimate, iv.low, iv.high, 3, sign=False, missing=" (1 seed)")


def groups_table(groups: list[ConfigGroup]) -> tuple[str, list[str]]:
    """Markdown table of each configuration's mean and 95% interval per metric (rows in the runs' order)."""
    metrics = [(k, t) for k, t in SEED_METRICS if any(g.values(k) for g in groups)]
    header = ["configuration", "seeds"] + [f"{t} (mean [95% CI])" for _, t in metrics]
    rows = []
    for g in groups:
        seeds = ",".join(str(s) for s in g.seeds if s is not None) or "–"
        rows.append([escape(g.label), f"{len(g.runs)} ({seeds})"] + [_cell(group_interval(g, k)) for k, _ in metrics])
    return markdown_table(header, rows), [k for k, _ in metrics]


def pairwise_verdicts(groups: list[ConfigGroup], keys: list[str]) -> list[dict]:
    """For each pair of configurations and each metric: the difference, its interval and the verdict line."""
    titles = dict(SEED_METRICS)
    out = []
    for a, b in itertools.combinations(groups, 2):
        for key in [k for k in keys if k not in TABLE_ONLY]:
            iv, method = pair_difference(a, b, key)
            if iv is None:
                continue
            line = f"{titles[key]}: {verdict(a.label, b.label, iv)} ({method})"
            out.append({"a": a.label, "b": b.label, "metric": key, **iv.as_dict(), "how": method, "verdict": line})
    return out


def mean_curve(group: ConfigGroup, metric: str, smooth_window: int = 1):
    """(steps, mean, low, high) of a metric over the group's seeds, at the steps every seed logged."""
    curves = []
    for run in group.runs:
        steps, values = run.series(metric)
        if values:
            curves.append(dict(zip(steps, smooth(values, smooth_window), strict=True)))
    if not curves:
        return [], [], [], []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    mean, low, high = [], [], []
    for s in steps:
        iv = mean_ci([c[s] for c in curves])
        mean.append(iv.estimate)
        low.append(iv.low if iv.has_interval else iv.estimate)
        high.append(iv.high if iv.has_interval else iv.estimate)
    return steps, mean, low, high


def plot_mean_curves(groups: list[ConfigGroup], metric: str, path: Path, smooth_window: int = 1) -> bool:
    """One PNG: each configuration's mean curve over seeds with its 95% band; False when nothing was logged."""
    bands = [Band(g.label, *mean_curve(g, metric, smooth_window), len(g.runs), i) for i, g in enumerate(groups)]
    suffix = f", moving average over {smooth_window} steps" if smooth_window > 1 else ""
    title = f"{metric}: mean over seeds with {CONFIDENCE:.0%} t-interval band{suffix}"
    return plot_bands(bands, metric, title, path)


def seed_section(groups: list[ConfigGroup], out: Path, smooth_window: int = 1) -> tuple[list[str], dict, dict]:
    """(markdown lines, plots, JSON payload) of the across-seeds comparison."""
    table, keys = groups_table(groups)
    pairs = pairwise_verdicts(groups, keys)
    md = ["## Configurations across seeds", ""]
    md += [
        f"{len(groups)} configuration(s); runs that differ only in `seed` are one configuration. Each cell: mean "
        "over seeds [95% Student-t interval]; one seed gives no interval. Rows keep the runs' order: this is not "
        "a ranking.",
        "",
        table,
        "",
    ]
    if pairs:
        md += ["### Differences between configurations", ""]
        md += [
            "Final reward and reward AUC: Welch's t over seeds. Held-out accuracy: the per-problem results on the "
            "same eval problems, paired, bootstrap over problems and seeds (10,000 resamples). Significant: the "
            "95% interval excludes 0.",
            "",
        ]
        md += [f"- {p['verdict']}" for p in pairs] + [""]
    elif len(groups) < 2:
        md += ["(one configuration: no differences to test)", ""]
    plots = {}
    if any(len(g.runs) > 1 for g in groups):
        for metric in BAND_PLOTS:
            path = out / f"{metric}_mean_ci.png"
            if plot_mean_curves(groups, metric, path, smooth_window):
                plots[f"{metric} (mean over seeds, 95% band)"] = path
    payload = {
        "groups": [
            {
                "label": g.label,
                "runs": [r.label for r in g.runs],
                "seeds": g.seeds,
                **{k: (group_interval(g, k).as_dict() if group_interval(g, k) else None) for k in keys},
            }
            for g in groups
        ],
        "differences": pairs,
    }
    return md, plots, payload
