"""The score phase, a pure function of rows, rollouts and the reward setup (`score_rollouts`): rewards as the TRL
path computes them (`trl_grpo_ext.grpo.reward_aggregation`), group advantages (`trl_grpo_ext.grpo.losses`); and
what dynamic sampling keeps of several scored rounds (`kept_groups`), what the curriculum learns from one
(`curriculum_outcomes`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl_grpo_ext.grpo.curriculum import passed_values
from trl_grpo_ext.grpo.dynamic_sampling import GroupRef
from trl_grpo_ext.grpo.reward_aggregation import (
    RewardMetricLog,
    reward_func_name,
    reward_kwargs,
    reward_weight_tensor,
    score_completions,
    weighted_rewards,
)
from trl_grpo_ext.grpo.spec import curriculum_pass_reward
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.types import Rollout, ScoredBatch
from trl_grpo_ext.task.rewards import reward_functions


@dataclass(frozen=True)
class RewardSetup:
    """The reward functions, TRL's names and weights for them, and the tokenizer that decodes completions."""

    funcs: list
    names: list[str]
    weights: object  # torch (K,)
    tokenizer: object


def reward_setup(config: PyTrioGRPOConfig, tokenizer) -> RewardSetup:
    """Reward functions with the TRL recipe's context (`trl_grpo_ext.task.rewards.reward_functions`: the length
    limit and EOS let rewards that veto truncated completions recognise them), TRL's names and weights."""
    funcs = reward_functions(config.reward_funcs, config, tokenizer, settings=config)
    return RewardSetup(
        funcs,
        [reward_func_name(f) for f in funcs],
        reward_weight_tensor(config.reward_weights, len(funcs)),
        tokenizer,
    )


def advantages_for(config: PyTrioGRPOConfig, rewards, rewards_per_func) -> tuple[list[float], list[bool]]:
    """`trl_grpo_ext.grpo.losses.group_advantages` of the weighted totals (N,) with the config's options (and
    ``degenerate_reward``'s column of ``rewards_per_func`` (N, K)); returns (advantages, degenerate per group)."""
    import torch

    from trl_grpo_ext.grpo.losses import group_advantages  # torch: loaded by the first step, not by importing the loop

    rewards_per_func = torch.as_tensor(rewards_per_func, dtype=torch.float32)
    degenerate_rewards = None
    if config.degenerate_reward is not None:
        degenerate_rewards = rewards_per_func[:, config.reward_column(config.degenerate_reward)]
    advantages, degenerate = group_advantages(
        torch.as_tensor(rewards, dtype=torch.float32),
        config.num_generations,
        scale_rewards=config.scale_rewards,
        degenerate_tol=config.degenerate_tol,
        zero_degenerate=config.zero_degenerate_advantages,
        degenerate_rewards=degenerate_rewards,
    )
    return advantages.tolist(), degenerate.tolist()


def score_rollouts(
    config: PyTrioGRPOConfig, setup: RewardSetup, rows: list[dict], rollouts: list[Rollout]
) -> ScoredBatch:
    """Rewards as TRL computes them (`trl_grpo_ext.grpo.reward_aggregation`), then group advantages; ``rollouts``
    prompt-major, ``num_generations`` per row."""
    g = config.num_generations
    completion_ids = [list(r.completion_tokens) for r in rollouts]
    texts = setup.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    conversational = isinstance(rows[0]["prompt"], list)
    completions = [[{"role": "assistant", "content": t}] if conversational else t for t in texts]
    if rollouts and rollouts[0].messages is not None:  # multi-turn: the turns and tool results, as TRL has them
        completions = [list(r.messages) for r in rollouts]
    inputs = [row for row in rows for _ in range(g)]  # TRL's per-completion inputs
    log = RewardMetricLog()
    rewards_per_func = score_completions(
        setup.funcs,
        setup.names,
        [row["prompt"] for row in inputs],
        completions,
        completion_ids,
        {**reward_kwargs(inputs), "log_metric": log},
    )
    rewards = weighted_rewards(rewards_per_func, setup.weights)
    advantages, degenerate = advantages_for(config, rewards, rewards_per_func)
    return ScoredBatch(rows, rollouts, rewards_per_func, rewards, advantages, degenerate, log.metrics())


def kept_groups(batches: list[ScoredBatch], selection: list[GroupRef], num_generations: int) -> ScoredBatch:
    """The groups dynamic sampling keeps (`trl_grpo_ext.grpo.dynamic_sampling.GroupFilter.selection`) as one batch.
    Padding groups are left out (fewer datums: what the TRL path's masked-out padding amounts to), unless nothing
    else is left; then they stay with zero advantages, so the step runs and its gradient is zero."""
    import torch

    refs = [ref for ref in selection if not ref.padding] or selection
    g = num_generations
    spans = [(batches[ref.batch], slice(ref.group * g, (ref.group + 1) * g)) for ref in refs]
    return ScoredBatch(
        rows=[batches[ref.batch].rows[ref.group] for ref in refs],
        rollouts=[r for b, span in spans for r in b.rollouts[span]],
        rewards_per_func=torch.cat([b.rewards_per_func[span] for b, span in spans]),
        rewards=torch.cat([b.rewards[span] for b, span in spans]),
        advantages=[
            0.0 if ref.padding else a for ref, (b, s) in zip(refs, spans, strict=True) for a in b.advantages[s]
        ],
        degenerate=[batches[ref.batch].degenerate[ref.group] for ref in refs],
        staleness=None
        if all(b.staleness is None for b in batches)
        else [s for b, span in spans for s in (b.staleness or [0] * len(b.rollouts))[span]],
    )


def curriculum_outcomes(config: PyTrioGRPOConfig, scored: ScoredBatch) -> tuple[list, list]:
    """What the curriculum learns from a scored batch: each completion's task and whether it passed
    (``curriculum_reward``'s column, else the total, against ``curriculum_pass_threshold``)."""
    c = config
    name = curriculum_pass_reward(c)
    rewards = scored.rewards if name is None else scored.rewards_per_func[:, c.reward_column(name)]
    tasks = [row.get("task") for row in scored.rows for _ in range(c.num_generations)]
    return tasks, passed_values(rewards.tolist(), c.curriculum_pass_threshold)
