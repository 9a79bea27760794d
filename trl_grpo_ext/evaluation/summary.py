"""How eval results read: a paired gain as one line, the per-task gains, and `trl-grpo-ext eval`'s summary table
(estimates, intervals and tables from `trl_grpo_ext.report`)."""

from __future__ import annotations

from trl_grpo_ext.evaluation.scoring import HELDOUT_METRICS
from trl_grpo_ext.report.tables import escape, markdown_table
from trl_grpo_ext.report.text import format_p, interval_text


def format_gain(label: str, g: dict) -> str:
    """`format-independent accuracy 0.220 -> 0.330, paired gain +0.110 [+0.070, +0.150] (n=400, McNemar p=1e-5)`."""
    gain = interval_text(g["gain"], g.get("ci_low"), g.get("ci_high"), 3)
    return (
        f"{label} {g['before']:.3f} -> {g['after']:.3f}, paired gain {gain} "
        f"(n={g['n']}, McNemar p={format_p(g['mcnemar_p'])})"
    )


def format_paired(paired: dict, indent: str = "") -> list[str]:
    """Printed lines of a `paired_comparison`: each metric overall, then each task's format-independent and boxed gains."""
    lines = [indent + format_gain(HELDOUT_METRICS[name][1], g) for name, g in paired["metrics"].items()]
    for task, entry in paired.get("per_task", {}).items():
        parts = [
            _short_gain(short, entry["metrics"][name])
            for name, short in (("accuracy_any_format", "format-independent"), ("accuracy", "boxed"))
        ]
        lines.append(f"{indent}  {task} (n={entry['n']}): " + "; ".join(parts))
    return lines


def _short_gain(label: str, g: dict) -> str:
    """`boxed 0.02 -> 0.30, gain +0.280 [+0.200, +0.360] (p=1e-9)`: a per-task part of `format_paired`."""
    gain = interval_text(g["gain"], g.get("ci_low"), g.get("ci_high"), 3, missing="")
    return f"{label} {g['before']:.2f} -> {g['after']:.2f}, gain {gain} (p={format_p(g['mcnemar_p'])})"


def format_summary(payload: dict) -> str:
    """A short markdown table of the summary (and of the comparison when there is one)."""
    keys = [
        k
        for k in ("pass@1", "accuracy_any_format", "maj@k", "pass@k", "mean@k", "boxed_rate")
        if k in payload["summary"]
    ]
    k = payload["summary"].get("k", 1)
    names = [{"accuracy_any_format": "pass@1 any format"}.get(n, n.replace("@k", f"@{k}")) for n in keys]
    settings = payload.get("settings", {})
    rows = []
    if "compare_summary" in payload:
        cs = payload["compare_summary"]
        rows.append([escape(f"{settings.get('compare_model')} (before)")] + [f"{cs.get(x, 0):.3f}" for x in keys])
    model = settings.get("model") + (f" + {settings['adapter']}" if settings.get("adapter") else "")
    rows.append([escape(model)] + [f"{payload['summary'][x]:.3f}" for x in keys])
    if "delta" in payload:
        rows.append(["delta"] + [f"{payload['delta'].get(x, 0):+.3f}" for x in keys])
    lines = [f"{payload['summary']['n']} problems from '{settings.get('data')}'", ""]
    lines.append(markdown_table(["model", *names], rows))
    if "delta" in payload:
        f = payload["flips"]
        lines += ["", f"greedy answers fixed: {f['fixed']}, broken: {f['broken']} (net {f['net']:+d})"]
    if "paired" in payload:
        lines += ["", "paired (same problems, 95% paired-bootstrap interval, exact McNemar test):"]
        lines += format_paired(payload["paired"], indent="  ")
    return "\n".join(lines)


def heldout_line(entry: dict) -> str:
    """One greedy held-out eval of a recipe run, as `[eval before]` / `[eval after]` print it."""
    return (
        f"step {entry['step']}: format-independent accuracy {entry['accuracy_any_format']:.3f}, boxed accuracy "
        f"{entry['accuracy']:.3f}, boxed rate {entry['boxed_rate']:.3f} on {entry['n']} held-out problems"
    )


def heldout_lines(evals: dict) -> list[str]:
    """The held-out lines of a recipe's run summary (its eval_before_after.json): each eval's figures, then the
    paired gains with their intervals."""
    lines = []
    for label in ("before", "after"):
        if isinstance(evals.get(label), dict) and "accuracy" in evals[label]:
            r = evals[label]
            any_format = r.get("accuracy_any_format")
            lines.append(
                f"  held-out {label} (n={r.get('n')}): boxed accuracy {r['accuracy']:.3f}"
                + (f", format-independent accuracy {any_format:.3f}" if any_format is not None else "")
                + f", boxed rate {r['boxed_rate']:.3f}"
            )
    if "paired" in evals:
        lines.append("  held-out paired gains (95% paired-bootstrap interval, exact McNemar p):")
        lines += format_paired(evals["paired"], indent="    ")
    return lines
