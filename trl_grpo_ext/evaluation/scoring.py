"""Scoring an eval's completions: each answer parsed exactly as the `boxed` reward parses it (`trl_grpo_ext.task.answers`),
so an eval number and a training reward mean the same thing, and again format-independently (that box if there is
one, else the last number), so a gain splits into "learned the format" and "solves more problems"; then the
accuracies over problems, overall and per task."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from trl_grpo_ext.evaluation.problems import Problem
from trl_grpo_ext.task.answers import answers_match, completion_text, extract_boxed, extract_last_number, same_answer


def extract_prediction(completion: Any) -> str | None:
    """The answer a completion gives, as the boxed reward reads it (last `\\boxed{}`), or None."""
    return extract_boxed(completion_text(completion))


def extract_any_prediction(completion: Any) -> str | None:
    """The answer regardless of format: the last `\\boxed{}` if there is one, else the last number, or None."""
    text = completion_text(completion)
    boxed = extract_prediction(text)
    return boxed if boxed is not None else extract_last_number(text)


def is_correct(pred: str | None, truth: str) -> bool:
    return pred is not None and bool(answers_match(pred, truth))


def majority_vote(preds: Sequence[str | None]) -> tuple[str | None, int]:
    """Most frequent answer among `preds` (equivalent answers such as "18" and "18.0" vote together).

    Unanswered samples (None) do not vote; a tie goes to the answer seen first. Returns (answer, votes).
    """
    clusters: list[list[str]] = []
    for p in preds:
        if p is None:
            continue
        for cluster in clusters:
            if p == cluster[0] or same_answer(p, cluster[0]):
                cluster.append(p)
                break
        else:
            clusters.append([p])
    if not clusters:
        return None, 0
    best = max(clusters, key=len)  # max keeps the first of equal lengths
    return best[0], len(best)


@dataclass
class ProblemResult:
    index: int
    id: str | int | None
    question: str
    answer: str
    task: str | None = None
    greedy_completion: str | None = None
    greedy_pred: str | None = None  # the last boxed answer (what the reward reads)
    greedy_correct: bool | None = None
    greedy_boxed: bool | None = None
    greedy_any_pred: str | None = None  # format-independent: the boxed answer, else the last number
    greedy_any_correct: bool | None = None
    greedy_tokens: int | None = None
    samples: list[str] = field(default_factory=list)
    sample_preds: list[str | None] = field(default_factory=list)
    sample_correct: list[bool] = field(default_factory=list)
    maj_pred: str | None = None
    maj_correct: bool | None = None
    pass_at_k: bool | None = None

    @classmethod
    def from_dict(cls, row: dict) -> ProblemResult:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in names})


def score_problem(
    index: int, problem: Problem, greedy: str | None, samples: Sequence[str], greedy_tokens: int | None = None
) -> ProblemResult:
    r = ProblemResult(index, problem.id, problem.question, problem.answer, problem.task)
    if greedy is not None:
        r.greedy_completion = greedy
        r.greedy_pred = extract_prediction(greedy)
        r.greedy_correct = is_correct(r.greedy_pred, problem.answer)
        r.greedy_boxed = r.greedy_pred is not None
        r.greedy_any_pred = extract_any_prediction(greedy)
        r.greedy_any_correct = is_correct(r.greedy_any_pred, problem.answer)
        r.greedy_tokens = greedy_tokens
    if samples:
        r.samples = list(samples)
        r.sample_preds = [extract_prediction(s) for s in samples]
        r.sample_correct = [is_correct(p, problem.answer) for p in r.sample_preds]
        r.maj_pred, _ = majority_vote(r.sample_preds)
        r.maj_correct = is_correct(r.maj_pred, problem.answer)
        r.pass_at_k = any(r.sample_correct)
    return r


# Greedy held-out figures: name -> (ProblemResult field, how the summary says it). Format-independent first:
# it is the one that says whether the model solves more problems.
HELDOUT_METRICS: dict[str, tuple[str, str]] = {
    "accuracy_any_format": ("greedy_any_correct", "format-independent accuracy"),
    "accuracy": ("greedy_correct", "boxed accuracy"),
    "boxed_rate": ("greedy_boxed", "boxed rate"),
}


def _rates(results: Sequence[ProblemResult]) -> dict:
    n = len(results)
    out: dict[str, Any] = {"n": n}
    for name, (attr, _) in HELDOUT_METRICS.items():
        out[name] = sum(bool(getattr(r, attr)) for r in results) / n if n else None
    return out


def greedy_summary(results: Sequence[ProblemResult]) -> dict:
    """Boxed accuracy, format-independent accuracy, boxed rate and mean length of greedy results, overall and per task."""
    greedy = [r for r in results if r.greedy_correct is not None]
    out = _rates(greedy)
    tokens = [r.greedy_tokens for r in greedy if r.greedy_tokens is not None]
    out["mean_length"] = sum(tokens) / len(tokens) if tokens and len(tokens) == len(greedy) else None
    tasks = sorted({r.task for r in greedy if r.task is not None})
    if tasks:
        out["per_task"] = {task: _rates([r for r in greedy if r.task == task]) for task in tasks}
    return out


def summarize(results: Sequence[ProblemResult], k: int) -> dict:
    """Accuracies over problems. pass@1: greedy (boxed, as `accuracy`); maj@k / pass@k: over k samples; mean@k:
    mean sample accuracy. Greedy results add `accuracy_any_format`, `boxed_rate` and `per_task`."""
    n = len(results)
    out: dict[str, Any] = {"n": n, "k": k}
    if not n:
        return out
    if any(r.greedy_correct is not None for r in results):
        greedy = greedy_summary(results)
        out["pass@1"] = greedy["accuracy"]
        out.update({key: value for key, value in greedy.items() if key != "n"})
    sampled = [r for r in results if r.sample_correct]
    if sampled:
        out["maj@k"] = sum(bool(r.maj_correct) for r in sampled) / len(sampled)
        out["pass@k"] = sum(bool(r.pass_at_k) for r in sampled) / len(sampled)
        out["mean@k"] = sum(sum(r.sample_correct) / len(r.sample_correct) for r in sampled) / len(sampled)
    return out
