"""Side-by-side reports of finished runs: a markdown table and one plot per metric, one line per run.

Reads `<run_dir>/metrics.jsonl` (written the same way by the TRL and PyTRIO recipes, see
docs/ARCHITECTURE.md) and the run's saved config. Anything missing is reported and skipped.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl_grpo_ext.evaluation import read_results
from trl_grpo_ext.experiments.seed_comparison import group_by_seed, seed_section
from trl_grpo_ext.report.curves import normalized_auc, smooth
from trl_grpo_ext.report.plots import Curve, plot_curves, plot_panels
from trl_grpo_ext.report.tables import escape, markdown_table
from trl_grpo_ext.runs import (
    EVAL_AFTER_PROBLEMS_FILENAME,
    EVAL_BEFORE_AFTER_FILENAME,
    EVAL_BEFORE_PROBLEMS_FILENAME,
    METRICS_FILENAME,
    read_metrics_file,
)
from trl_grpo_ext.runs.folders import (
    CONFIG_CANDIDATES,
    is_number,
    read_heldout_accuracy,
    read_run_config,
    run_backend,
    run_folders,
)
from trl_grpo_ext.runs.sweep_files import read_eval_summary

# Config keys that differ between any two runs by construction and say nothing about the variant.
IGNORED_CONFIG_KEYS = {"output_dir", "run_name", "logging_dir", "resume_from_checkpoint", "hub_model_id"}
PLOTS = (
    ("reward", "reward"),
    ("frac_degenerate", "fraction of degenerate groups"),
    ("entropy", "entropy"),
    ("kl", "KL to reference"),
    ("completions/mean_length", "mean completion length (tokens)"),
)


@dataclass
class RunData:
    """One run as read from disk: metrics by step (deduplicated, sorted), config and what was missing."""

    label: str
    path: Path
    rows: list[dict]
    config: dict
    config_source: str | None = None
    backend: str | None = None
    wall_time: float | None = None
    eval_summary: dict | None = None
    notes: list[str] = field(default_factory=list)
    # The recipe's own greedy held-out accuracy at the start and end of training, when it ran one.
    heldout: dict = field(default_factory=dict)
    # Its per-problem results ({'before': [ProblemResult], 'after': [...]}), for paired comparisons.
    heldout_problems: dict = field(default_factory=dict)

    def series(self, metric: str) -> tuple[list[float], list[float]]:
        """(steps, values) of a metric, finite values only."""
        steps, values = [], []
        for row in self.rows:
            if is_number(row.get(metric)):
                steps.append(float(row["step"]))
                values.append(float(row[metric]))
        return steps, values


def metrics_by_step(path: Path) -> tuple[list[dict], list[str]]:
    """Rows of a metrics.jsonl merged by step (a resumed run logs some steps twice: the later row wins)."""
    notes: list[str] = []
    by_step: dict[int, dict] = {}
    rows, bad = read_metrics_file(path)
    no_step = 0
    for row in rows:
        step = row.get("step")
        if not is_number(step):
            no_step += 1
            continue
        by_step.setdefault(int(step), {}).update(row)
        by_step[int(step)]["step"] = int(step)
    if bad:
        notes.append(f"{bad} unreadable line(s) in {path.name} skipped")
    if no_step:
        notes.append(f"{no_step} line(s) without a 'step' in {path.name} skipped")
    return [by_step[s] for s in sorted(by_step)], notes


def load_run(path: Path, label: str | None = None) -> RunData:
    path = Path(path)
    notes: list[str] = []
    metrics = path / METRICS_FILENAME
    if metrics.is_file():
        rows, more = metrics_by_step(metrics)
        notes += more
        if not rows:
            notes.append(f"{METRICS_FILENAME} holds no step")
    else:
        rows = []
        notes.append(f"no {METRICS_FILENAME} in {path}")
    config, source, marker = read_run_config(path)
    if source is None:
        notes.append("no saved config found (looked for " + ", ".join(CONFIG_CANDIDATES) + ")")
    wall = (marker or {}).get("wall_time")
    if not is_number(wall):
        runtimes = [r["train_runtime"] for r in rows if is_number(r.get("train_runtime"))]
        times = [r["step_time"] for r in rows if is_number(r.get("step_time"))]
        wall = runtimes[-1] if runtimes else (sum(times) if times else None)
    try:
        eval_summary = read_eval_summary(path)
    except ValueError as err:
        eval_summary = None
        notes.append(str(err))
    heldout = read_heldout_accuracy(path, notes)
    backend = run_backend(path, config, marker)
    run = RunData(label or path.name, path, rows, config, source, backend, wall, eval_summary, notes, heldout)
    run.heldout_problems = read_heldout_problems(path, notes)
    return run


def read_heldout_problems(run_dir: Path, notes: list[str]) -> dict:
    """The recipe's per-problem before/after results (eval_before.jsonl / eval_after.jsonl) that exist."""
    out = {}
    for when, name in (("before", EVAL_BEFORE_PROBLEMS_FILENAME), ("after", EVAL_AFTER_PROBLEMS_FILENAME)):
        if (run_dir / name).is_file():
            try:
                out[when] = read_results(run_dir / name)
            except (OSError, ValueError) as err:
                notes.append(f"unreadable {name} ({err})")
    return out


def load_runs(paths: list[str | os.PathLike]) -> list[RunData]:
    dirs = run_folders(paths)
    return [load_run(d, label) for d, label in zip(dirs, unique_labels(dirs), strict=True)]


def unique_labels(dirs: list[Path]) -> list[str]:
    """Folder names, with as many parent folders as it takes to tell same-named runs apart."""
    parts = [d.resolve().parts for d in dirs]
    depth = [1] * len(dirs)
    while True:
        labels = ["/".join(p[-n:]) for p, n in zip(parts, depth, strict=True)]
        clashes = {i for i, lab in enumerate(labels) if labels.count(lab) > 1 and depth[i] < len(parts[i])}
        if not clashes:
            return labels
        for i in clashes:
            depth[i] += 1


# ------------------------------------------------------------------------------------------- numbers


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _last(values: list[float]) -> float | None:
    return values[-1] if values else None


def summarize(run: RunData, smooth_window: int = 1) -> dict:
    """The report's numbers for one run; None where the run did not log what a number needs."""
    steps, reward = run.series("reward")
    sm = smooth(reward, smooth_window)
    _, tokens = run.series("train_tokens")
    _, step_times = run.series("step_time")
    tok_s = None
    if tokens and step_times and len(tokens) == len(step_times) and sum(step_times) > 0:
        tok_s = sum(tokens) / sum(step_times)
    out = {
        "steps": run.rows[-1]["step"] if run.rows else None,
        "final_reward": sm[-1] if sm else None,
        "best_reward": max(sm) if sm else None,
        "reward_auc": normalized_auc(steps, reward),
        "frac_degenerate": _mean(run.series("frac_degenerate")[1]),
        "clip_low_frac": _mean(run.series("clip_low_frac")[1]),
        "clip_high_frac": _mean(run.series("clip_high_frac")[1]),
        "completion_length": _mean(run.series("completions/mean_length")[1]),
        # multi-turn runs with tools (`environments.tool_metrics`); None elsewhere, so the columns drop out
        "tool_calls": _mean(run.series("tools/calls_per_completion")[1]),
        "tool_errors": _mean(run.series("tools/errors")[1]),
        "tool_token_fraction": _mean(run.series("tools/token_fraction")[1]),
        # on-policy distillation runs (`grpo.distillation`): how far the student is from its teacher, per token
        "distill_reverse_kl": _mean(run.series("distill/reverse_kl")[1]),
        "distill_reverse_kl_last": _last(run.series("distill/reverse_kl")[1]),
        "tokens_per_s": tok_s,
        "wall_time": run.wall_time,
    }
    for key in ("before", "after", "before_any_format", "after_any_format"):
        if key in run.heldout:
            out[f"heldout_{key}"] = run.heldout[key]
    if "before_any_format" in run.heldout and "after_any_format" in run.heldout:
        out["heldout_gain_any_format"] = run.heldout["after_any_format"] - run.heldout["before_any_format"]
    if run.eval_summary:
        for key in ("pass@1", "maj@k", "pass@k"):
            if is_number(run.eval_summary.get(key)):
                out[f"eval_{key}"] = run.eval_summary[key]
    return out


# Equal gradients computed by different formulas agree to ~1e-5 in float32, not to the bit.
SAME_CURVE_RTOL = 1e-4


def identical_curves(runs: list[RunData], metrics: tuple[str, ...] = ("reward", "grad_norm")) -> list[str]:
    """Notes for pairs of runs whose `metrics` curves are equal: same steps, values within `SAME_CURVE_RTOL`.

    Two variants with equal reward and gradient-norm curves trained the same way: the setting that tells
    them apart had no effect in this run (for example CISPO's weight cap never reached, which leaves its
    gradient equal to plain importance sampling; the loss values differ by construction, so they don't count).
    """
    notes = []
    curves = [{metric: run.series(metric) for metric in metrics} for run in runs]
    for (a, curves_a), (b, curves_b) in itertools.combinations(zip(runs, curves, strict=True), 2):
        compared, equal = [], True
        for metric in metrics:
            sa, sb = curves_a[metric], curves_b[metric]
            if len(sa[1]) < 2 or len(sb[1]) < 2:
                continue
            compared.append(metric)
            equal = (
                equal
                and sa[0] == sb[0]
                and all(
                    math.isclose(x, y, rel_tol=SAME_CURVE_RTOL, abs_tol=1e-9)
                    for x, y in zip(sa[1], sb[1], strict=True)
                )
            )
        if compared and equal:
            same = " and ".join(compared)
            notes.append(
                f"{a.label} and {b.label} logged the same {same} at every step (to {SAME_CURVE_RTOL:g}"
                " relative): the settings that differ between them did not change training here"
            )
    return notes


def config_differences(runs: list[RunData]) -> list[str]:
    """Config keys that take different values in runs that set them.

    A key only some runs have (the two backends' recipes do not share every key) differs only if those
    runs disagree on it; otherwise TRL vs PyTRIO comparisons would list every backend-specific option.
    """
    keys: list[str] = []
    for run in runs:
        for k in run.config:
            if k not in keys and k not in IGNORED_CONFIG_KEYS:
                keys.append(k)
    diff = []
    for k in keys:
        values = {json.dumps(run.config[k], sort_keys=True, default=str) for run in runs if k in run.config}
        if len(values) > 1:
            diff.append(k)
    return diff


# -------------------------------------------------------------------------------------------- report

COLUMNS = (
    ("backend", "backend"),
    ("steps", "steps"),
    ("final_reward", "final reward"),
    ("best_reward", "best reward"),
    ("reward_auc", "reward AUC/step"),
    ("frac_degenerate", "frac degenerate"),
    ("clip_low_frac", "clip low"),
    ("clip_high_frac", "clip high"),
    ("completion_length", "completion len"),
    ("tool_calls", "tool calls/completion"),
    ("tool_errors", "tool errors/step"),
    ("tool_token_fraction", "tool token frac"),
    ("distill_reverse_kl", "reverse KL to teacher"),
    ("distill_reverse_kl_last", "reverse KL to teacher, last step"),
    ("tokens_per_s", "train tok/s"),
    ("wall_time", "wall time"),
    ("heldout_before", "held-out acc before"),
    ("heldout_after", "held-out acc after"),
    ("heldout_before_any_format", "held-out any-format acc before"),
    ("heldout_after_any_format", "held-out any-format acc after"),
)
EVAL_COLUMNS = (("eval_pass@1", "eval pass@1"), ("eval_maj@k", "eval maj@k"), ("eval_pass@k", "eval pass@k"))


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "–"
    if key == "wall_time":
        value = float(value)
        return f"{value:.0f}s" if value < 120 else f"{value / 60:.1f}min"
    if key in ("steps", "backend"):
        return str(value)
    if key in ("completion_length", "tokens_per_s"):
        return f"{value:.1f}"
    if isinstance(value, float):
        return f"{value:.3f}"
    return escape(str(value))


def results_table(runs: list[RunData], summaries: list[dict]) -> str:
    cols = list(COLUMNS) + [c for c in EVAL_COLUMNS if any(c[0] in s for s in summaries)]
    # A column no run can fill (e.g. clip fractions for importance_sampling only) is left out.
    cols = [c for c in cols if c[0] == "backend" or any(s.get(c[0]) is not None for s in summaries)]
    rows = []
    for run, s in zip(runs, summaries, strict=False):
        values = {**s, "backend": run.backend}
        rows.append([escape(run.label)] + [_fmt(key, values.get(key)) for key, _ in cols])
    return markdown_table(["run"] + [title for _, title in cols], rows)


def diff_table(runs: list[RunData], keys: list[str]) -> str:
    rows = [
        [escape(r.label)] + [escape(json.dumps(r.config[k]) if k in r.config else "–") for k in keys] for r in runs
    ]
    return markdown_table(["run"] + keys, rows)


def _curves(runs: list[RunData], metric: str) -> list[Curve]:
    return [Curve(run.label, *run.series(metric), position=i) for i, run in enumerate(runs)]


def plot_filename(metric: str) -> str:
    return {"completions/mean_length": "completion_length"}.get(metric, metric.replace("/", "_")) + ".png"


@dataclass
class Report:
    markdown: str
    table: str
    summaries: list[dict]
    plots: dict[str, Path]
    notes: list[str]
    out_dir: Path
    verdicts: list[str] = field(default_factory=list)  # across-seeds differences between configurations


def build_report(run_paths: list[str | os.PathLike], out_dir: str | os.PathLike, smooth_window: int = 1) -> Report:
    """Read the runs, write `report.md`, `summary.json` and one PNG per metric to `out_dir`."""
    if smooth_window < 1:
        raise ValueError("--smooth must be >= 1")
    runs = load_runs(run_paths)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r, smooth_window) for r in runs]
    table = results_table(runs, summaries)
    diff_keys = config_differences(runs)
    notes = [f"{r.label}: {n}" for r in runs for n in r.notes] + identical_curves(runs)

    plots: dict[str, Path] = {}
    for metric, title in PLOTS:
        path = out / plot_filename(metric)
        if plot_curves(_curves(runs, metric), metric, title, path, smooth_window):
            plots[metric] = path
        else:
            notes.append(f"no run logged '{metric}'; no plot")

    if plot_panels({metric: _curves(runs, metric) for metric in plots}, out / "overview.png", smooth_window):
        plots["overview"] = out / "overview.png"

    md = ["# Run comparison", ""]
    md += [f"{len(runs)} runs: " + ", ".join(f"`{r.path}`" for r in runs), ""]
    md += [table, ""]
    md += [
        "final/best reward: last and highest value of the reward curve"
        + (f" after a {smooth_window}-step moving average" if smooth_window > 1 else "")
        + "; reward AUC/step: area under the raw reward curve divided by the step span (mean level over"
        " training); frac degenerate, clip fractions and completion length: means over logged steps;"
        " train tok/s: tokens with non-zero advantage per second of step time.",
        "",
    ]
    if any(s.get("tool_calls") is not None for s in summaries):
        md += [
            "tool calls/completion, tool errors/step, tool token frac: means over logged steps of"
            " `tools/calls_per_completion`, `tools/errors` and `tools/token_fraction` (runs with tools).",
            "",
        ]
    if any(s.get("distill_reverse_kl") is not None for s in summaries):
        md += [
            "reverse KL to teacher: mean over logged steps of `distill/reverse_kl` (the student's sampled tokens,"
            " log p_student - log p_teacher; runs with a `distillation:` teacher), and its last logged value.",
            "",
        ]
    sizes = sorted({r.heldout["n"] for r in runs if "n" in r.heldout})
    if sizes:
        md += [
            "held-out acc before/after: the recipe's greedy accuracy on "
            + "/".join(map(str, sizes))
            + f" held-out problems at the first and last step ({EVAL_BEFORE_AFTER_FILENAME}): boxed (the answer in"
            " `\\boxed{}`, as the reward reads it) and any-format (the boxed answer, else the last number).",
            "",
        ]
    md += ["## Config differences", ""]
    if len(runs) < 2:
        md += ["(one run: nothing to compare)", ""]
    elif diff_keys:
        md += [diff_table(runs, diff_keys), ""]
    else:
        md += ["(saved configs are identical apart from output paths)", ""]
    if len(runs) > 1 and diff_keys:
        md += ["A key that only some runs' configs hold is compared among those runs.", ""]
    verdicts: list[str] = []
    if len(runs) > 1:
        groups = group_by_seed(runs, summaries, IGNORED_CONFIG_KEYS)
        section, seed_plots, seed_payload = seed_section(groups, out, smooth_window)
        md += section
        plots.update(seed_plots)
        verdicts = [p["verdict"] for p in seed_payload["differences"]]
        (out / "groups.json").write_text(json.dumps(seed_payload, indent=2, default=str))
    md += ["## Curves", ""]
    for metric, path in plots.items():
        md += [f"### {metric}", "", f"![{metric}]({path.name})", ""]
    if notes:
        md += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    markdown = "\n".join(md)
    (out / "report.md").write_text(markdown)
    payload = [
        {
            "run": r.label,
            "path": str(r.path),
            "backend": r.backend,
            **s,
            "config": {k: r.config.get(k) for k in diff_keys},
        }
        for r, s in zip(runs, summaries, strict=False)
    ]
    (out / "summary.json").write_text(json.dumps(payload, indent=2, default=str))
    return Report(markdown, table, summaries, plots, notes, out, verdicts)
