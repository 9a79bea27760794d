"""The `cost` reward: what a completion cost, for a hybrid term with a negative weight (``cost: -0.05``).

``per: tokens``: completion tokens over ``max_completion_length`` (in [0, 1], so a weight reads as "at most this
much for a completion that used the whole budget"); ``per: judge_calls``: requests the hybrid's judge sent for the
completion in this step (0 for a cache hit; retries count).
"""

from __future__ import annotations

from trl_grpo_ext.task.rewards._batch import as_list, column
from trl_grpo_ext.task.rewards.reward_model import mapping_option

COST_KINDS = ("tokens", "judge_calls")


def cost_options(value) -> dict:
    mapping = mapping_option("cost", value)
    unknown = sorted(set(mapping) - {"per"})
    if unknown:
        raise ValueError(f"cost: unknown key(s) {unknown}; valid: ['per']")
    per = mapping.get("per", "tokens")
    if per not in COST_KINDS:
        raise ValueError(f"cost.per={per!r} must be one of {', '.join(COST_KINDS)}")
    return {"per": per}


def make_cost_reward(value=None, max_completion_length: int | None = None):
    """The cost reward for the ``cost:`` mapping; ``per: tokens`` needs the run's ``max_completion_length``."""
    per = cost_options(value)["per"]
    if per == "tokens" and not max_completion_length:
        raise ValueError("cost per tokens needs max_completion_length (the denominator of the token fraction)")

    def cost_reward(completions, completion_ids=None, judge_requests=None, **kwargs) -> list[float]:
        n = len(as_list(completions))
        if per == "judge_calls":
            if judge_requests is None:
                raise ValueError("cost per judge_calls is a hybrid term beside a judge component")
            return [float(r) for r in column(judge_requests, n, "judge_requests")]
        ids = column(completion_ids, n, "completion_ids")
        return [len(i if i is not None else ()) / max_completion_length for i in ids]

    cost_reward.per = per
    cost_reward.needs_judge_requests = per == "judge_calls"
    return cost_reward
