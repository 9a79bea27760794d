"""The log phase's numbers: a sampled round's reward, completion and tool metrics (TRL's names, through the shared
`trl_grpo_ext.grpo.reward_aggregation` and `trl_grpo_ext.environments.tool_metrics`), the rounds of a step
averaged, and the step's row of ``metrics.jsonl`` (`step_metrics`)."""

from __future__ import annotations

from trl_grpo_ext.environments import tool_metrics
from trl_grpo_ext.grpo.reward_aggregation import frac_reward_zero_std, reward_metrics
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.types import Rollout, ScoredBatch, StepTimes, TrainBatch


def reward_step_metrics(config: PyTrioGRPOConfig, scored: ScoredBatch, reward_names) -> dict:
    """The TRL path's reward metrics of a step (`trl_grpo_ext.grpo.reward_aggregation`), plus ``frac_degenerate``."""
    metrics = reward_metrics(scored.rewards_per_func, scored.rewards, reward_names)
    metrics["frac_reward_zero_std"] = frac_reward_zero_std(
        scored.rewards, config.num_generations, config.scale_rewards
    )
    metrics["frac_degenerate"] = sum(bool(d) for d in scored.degenerate) / max(len(scored.degenerate), 1)
    metrics.update(scored.logged)
    return metrics


def completion_metrics(rollouts: list[Rollout]) -> dict:
    """TRL's ``completions/*`` length metrics; ``clipped_ratio``: the share stopped by ``max_tokens``."""
    lengths = [r.model_tokens for r in rollouts]
    return {
        "completions/mean_length": sum(lengths) / len(lengths),
        "completions/min_length": min(lengths),
        "completions/max_length": max(lengths),
        "completions/clipped_ratio": sum(r.stop_reason == "length" for r in rollouts) / len(rollouts),
    }


def round_metrics(config: PyTrioGRPOConfig, scored: ScoredBatch, reward_names) -> dict:
    """Reward and completion metrics of one sampled round; with tools, the ``tools/*`` metrics."""
    metrics = reward_step_metrics(config, scored, reward_names)
    metrics.update(completion_metrics(scored.rollouts))
    if config.environments:
        rollouts = scored.rollouts
        masks = [list(r.tool_mask or [1] * len(r.completion_tokens)) for r in rollouts]
        messages = [list(r.messages or []) for r in rollouts]
        metrics.update(tool_metrics(messages, masks, config.max_tool_calling_iterations))
    return metrics


def averaged(rounds: list[dict]) -> dict:
    """The rounds' metrics averaged, as TRL's logging averages each generation batch's."""
    return {key: sum(m[key] for m in rounds) / len(rounds) for key in rounds[0]}


def step_metrics(
    sampling_metrics: dict,
    loss_metrics: dict,
    batch: TrainBatch,
    learning_rate: float,
    optim_metrics: dict,
    step_time: float,
    times: StepTimes,
) -> dict:
    """A step's row: what sampling and scoring measured, the loss's metrics, then the optimizer step's."""
    metrics = dict(sampling_metrics)
    metrics.update(loss_metrics)
    metrics["train_tokens"] = batch.train_tokens
    metrics["learning_rate"] = learning_rate
    metrics["num_datums"] = len(batch.datums)
    if "grad_norm" in optim_metrics:
        metrics["grad_norm"] = float(optim_metrics["grad_norm"])
    metrics["step_time"] = step_time
    metrics.update(times.as_metrics())
    return metrics
