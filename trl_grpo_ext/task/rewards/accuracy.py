"""`boxed_reward`: is the last `\\boxed{}` answer mathematically equal to the ground truth?"""

from __future__ import annotations

from trl_grpo_ext.task.answers import answers_match, completion_text, extract_boxed, parse_ground_truth
from trl_grpo_ext.task.rewards._batch import as_list, column, safe_score, warn_once_per_call
from trl_grpo_ext.task.rewards.registry import register_reward


def _score(completion, truth) -> float:
    pred = extract_boxed(completion_text(completion))
    return 1.0 if pred is not None and answers_match(pred, truth) else 0.0


@register_reward("boxed")
def boxed_reward(completions, answer=None, solution=None, **kwargs) -> list[float | None]:
    """1.0 when the last `\\boxed{...}` (or `\\fbox{...}`) of a completion equals the ground truth, else 0.0.

    Ground truth comes from the `answer` column (GSM8K's solution text ending in `#### N`, or a bare value)
    or its alias `solution` (MATH style, may hold a `\\boxed{}`). A ground truth that cannot be parsed
    scores None, so TRL leaves that sample out, and the call emits one RuntimeWarning."""
    completions = as_list(completions)
    truths_raw = answer if answer is not None else solution
    if truths_raw is None:
        raise ValueError(
            "boxed_reward needs the ground truth: a dataset column `answer` (GSM8K) or `solution`; "
            f"got only {sorted(k for k in kwargs if k not in ('log_metric', 'log_extra', 'trainer_state'))}"
        )
    truths = column(truths_raw, len(completions), "answer" if answer is not None else "solution")
    rewards: list[float | None] = []
    bad = []
    for completion, raw in zip(completions, truths, strict=True):
        truth = parse_ground_truth(raw)
        if truth is None:
            bad.append(raw)
            rewards.append(None)
            continue
        rewards.append(safe_score(_score, completion, truth))
    if bad:
        warn_once_per_call(
            f"boxed_reward: {len(bad)} of {len(completions)} ground truths could not be parsed "
            f"(first: {str(bad[0])[:80]!r}); those samples score None"
        )
    return rewards
