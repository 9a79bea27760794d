"""Before vs after on the same problems: per-problem flips, and each held-out figure's paired gain with its 95%
paired-bootstrap interval and exact McNemar p-value (`trl_grpo_ext.report.stats`)."""

from __future__ import annotations

from typing import Any, Sequence

from trl_grpo_ext.evaluation.scoring import HELDOUT_METRICS, ProblemResult
from trl_grpo_ext.report.stats import mcnemar_exact, paired_bootstrap_ci


def _check_same_problems(before: Sequence[ProblemResult], after: Sequence[ProblemResult]) -> None:
    if len(before) != len(after):
        raise ValueError(f"the two evaluations cover different numbers of problems ({len(before)} vs {len(after)})")
    for b, a in zip(before, after, strict=True):
        if (b.question, b.answer) != (a.question, a.answer):
            raise ValueError(
                f"the two evaluations differ at problem {b.index}: {b.question[:60]!r} vs {a.question[:60]!r}"
            )


def compare_results(before: Sequence[ProblemResult], after: Sequence[ProblemResult]) -> dict:
    """Per-problem flips of greedy (boxed) correctness between two evaluations of the same problems."""
    _check_same_problems(before, after)
    fixed = sum(1 for b, a in zip(before, after, strict=True) if not b.greedy_correct and a.greedy_correct)
    broken = sum(1 for b, a in zip(before, after, strict=True) if b.greedy_correct and not a.greedy_correct)
    return {"fixed": fixed, "broken": broken, "net": fixed - broken}


def paired_gain(before: Sequence[bool], after: Sequence[bool], seed: int = 0) -> dict:
    """Rates before/after on the same items, the paired gain with its 95% paired-bootstrap interval, and the exact
    McNemar p-value of the discordant pairs (`fixed`: wrong -> right, `broken`: right -> wrong)."""
    b = [float(bool(x)) for x in before]
    a = [float(bool(x)) for x in after]
    iv = paired_bootstrap_ci(b, a, seed=seed)
    fixed = sum(1 for x, y in zip(b, a, strict=True) if y > x)
    broken = sum(1 for x, y in zip(b, a, strict=True) if y < x)
    n = len(b)
    return {
        "n": n,
        "before": sum(b) / n,
        "after": sum(a) / n,
        "gain": iv.estimate,
        "ci_low": iv.low,
        "ci_high": iv.high,
        "mcnemar_p": mcnemar_exact(fixed, broken),
        "fixed": fixed,
        "broken": broken,
    }


def paired_comparison(before: Sequence[ProblemResult], after: Sequence[ProblemResult]) -> dict:
    """The paired before/after figures of every `HELDOUT_METRICS` entry, overall and per task (same problems)."""
    _check_same_problems(before, after)
    if not before:
        raise ValueError("no problems to compare")

    def block(pairs):
        return {
            name: paired_gain([getattr(b, attr) for b, _ in pairs], [getattr(a, attr) for _, a in pairs])
            for name, (attr, _) in HELDOUT_METRICS.items()
        }

    pairs = list(zip(before, after, strict=True))
    out: dict[str, Any] = {"n": len(pairs), "metrics": block(pairs)}
    tasks = sorted({b.task for b in before if b.task is not None})
    if tasks:
        out["per_task"] = {}
        for task in tasks:
            sub = [(b, a) for b, a in pairs if b.task == task]
            out["per_task"][task] = {"n": len(sub), "metrics": block(sub)}
    return out
