"""`ToolsMixin`: TRL's tools and environments on our trainer: their definitions checked before the model loads (one
line per problem), and the per-step tool metrics (`trl_grpo_ext.environments.tool_metrics`) of every multi-turn
generation batch. TRL runs the tool loop itself; its ``tool_mask`` keeps the tools' tokens out of every loss type."""

from __future__ import annotations

import sys

from trl_grpo_ext.environments import definition_problems, tool_metrics
from trl_grpo_ext.errors import raise_problems
from trl_grpo_ext.trl import internals


class ToolsMixin:
    """`trl.GRPOTrainer` hooks: ``__init__`` checks ``tools`` / ``environment_factory``; ``_generate`` logs
    ``tools/*`` when the batch is multi-turn (tools ran, or a ``rollout_func`` returned an ``env_mask``)."""

    def __init__(self, *args, **kwargs):
        raise_problems("tools", definition_problems(kwargs.get("tools"), kwargs.get("environment_factory")))
        super().__init__(*args, **kwargs)

    def _generate(self, prompts):
        output = super()._generate(prompts)
        completion_ids, tool_mask, completions = output[1], output[2], output[3]
        if tool_mask is not None or getattr(self, "tools", None):
            cap = getattr(self, "max_tool_calling_iterations", None)
            cap = None if cap is None or cap >= sys.maxsize else cap
            masks = tool_mask if tool_mask is not None else [[1] * len(ids) for ids in completion_ids]
            mode = "train" if self.model.training else "eval"
            for key, value in tool_metrics(completions, masks, cap).items():
                internals.log_metric(self, mode, key, value)
        return output
