"""The recipe options of the rewards that need settings: `judge`, reward models, `hybrid` and `cost`.

`RewardSettings` declares them once; both recipes' argument classes inherit it (`trl_grpo_ext.trl.script_args.
ScriptArguments`, `trl_grpo_ext.pytrio.config.PyTrioGRPOConfig`), and both paths build their rewards from it
(`trl_grpo_ext.task.rewards.build.reward_functions`). Each holds a mapping (YAML), or its JSON text (command line).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RewardSettings:
    """Options of the configured rewards (docs/rewards.md)."""

    judge: dict | str | None = field(
        default=None,
        metadata={
            "help": "The rubric LLM judge of reward 'judge': {base_url, model, rubric | rubric_file, score_range, "
            "score_format, max_concurrency, timeout_s, retries, cache, ...} (any OpenAI-compatible server)."
        },
    )
    reward_model: dict | str | None = field(
        default=None,
        metadata={
            "help": "Options of the reward models named in reward_funcs (a model folder or hub id, as in TRL): "
            "{batch_size, max_length, device, dtype}."
        },
    )
    hybrid: dict | str | None = field(
        default=None,
        metadata={
            "help": "Terms of reward 'hybrid': {components: {boxed: 0.7, judge: 0.3, cost: -0.05}, vetoes: [...], "
            "veto_value}; unset: boxed 1.0 + format 0.3 with every veto."
        },
    )
    cost: dict | str | None = field(
        default=None,
        metadata={
            "help": "The 'cost' reward: {per: tokens} (completion tokens / max_completion_length) or judge_calls."
        },
    )


def reward_settings_problems(settings) -> list[str]:
    """Every problem with the reward options of `settings` (no model, file or server is touched but rubric files)."""
    from trl_grpo_ext.task.rewards.build import settings_problems  # the builders: judge, hybrid, cost, reward models

    return settings_problems(settings)
