"""Verifiable math rewards for TRL's `GRPOTrainer` (`f(completions, **kwargs) -> list[float | None]`).

Registry names: `boxed`, `format`, `format_think`, `format_partial`, `hybrid`; built from recipe options: `judge`
(a rubric LLM judge), `cost`, a configured `hybrid`, and reward models by folder or hub id (see `docs/rewards.md`).
"""

from trl_grpo_ext.task.rewards.accuracy import boxed_reward
from trl_grpo_ext.task.rewards.build import CONFIGURED_REWARDS, preflight_rewards, reward_functions
from trl_grpo_ext.task.rewards.cost import make_cost_reward
from trl_grpo_ext.task.rewards.format import format_checks, format_reward, make_format_reward
from trl_grpo_ext.task.rewards.hybrid import DEFAULT_HYBRID_COMPONENTS, hybrid_reward, make_hybrid_reward
from trl_grpo_ext.task.rewards.judge import JudgeReward, JudgeUnavailableError, make_judge_reward
from trl_grpo_ext.task.rewards.judge_config import JudgeConfig
from trl_grpo_ext.task.rewards.registry import (
    REWARD_REGISTRY,
    get_reward,
    get_reward_funcs,
    register_reward,
    reward_index,
    reward_names,
)
from trl_grpo_ext.task.rewards.reward_model import RewardModelOptions, RewardModelReward, trl_reward_inputs
from trl_grpo_ext.task.rewards.settings import RewardSettings, reward_settings_problems
from trl_grpo_ext.task.rewards.vetoes import DEFAULT_VETOES, VETOES, has_repetition_loop

__all__ = [
    "CONFIGURED_REWARDS",
    "JudgeConfig",
    "JudgeReward",
    "JudgeUnavailableError",
    "RewardModelOptions",
    "RewardModelReward",
    "RewardSettings",
    "make_cost_reward",
    "make_judge_reward",
    "preflight_rewards",
    "reward_settings_problems",
    "trl_reward_inputs",
    "DEFAULT_HYBRID_COMPONENTS",
    "DEFAULT_VETOES",
    "REWARD_REGISTRY",
    "VETOES",
    "boxed_reward",
    "format_checks",
    "format_reward",
    "get_reward",
    "get_reward_funcs",
    "has_repetition_loop",
    "hybrid_reward",
    "make_format_reward",
    "make_hybrid_reward",
    "register_reward",
    "reward_functions",
    "reward_index",
    "reward_names",
]
