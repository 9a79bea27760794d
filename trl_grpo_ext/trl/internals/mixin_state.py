"""Our state on the trainer: `MixinState`, what the trainer and its mixins hand each other, declared once."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MixinState:
    """What `trl_grpo_ext.trl.trainer.GRPOTrainer` and its mixins (`trl_grpo_ext.trl.sampling`) hand each other on
    one trainer, declared here once and created by the trainer right after TRL's constructor (``mixin_state``)."""

    # Reward columns named by the options (index into rewards_per_func; None: not set), resolved once.
    degenerate_column: int | None = None  # degenerate_reward
    curriculum_column: int | None = None  # curriculum_reward, else degenerate_reward (None: the weighted total)
    # The generation batch being scored: all processes' rewards (N, K) from TRL's `_calculate_rewards`, read right
    # after it by the trainer's degenerate-group check.
    rewards_per_func: torch.Tensor | None = None
    # (num_groups,) bool over the last scored generation batch (all processes): dynamic sampling filters on it.
    degenerate_groups: torch.Tensor | None = None
    # The rubric judges among the reward functions (hybrids' components included): the trainer stops every process
    # at once when one is down (`GRPOTrainer._stop_if_a_judge_is_down`).
    judges: list = field(default_factory=list)
