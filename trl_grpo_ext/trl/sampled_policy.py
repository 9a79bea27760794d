"""`SampledPolicyMixin`: the policy the trainer scores is the distribution its sampler draws from.

`trl_grpo_ext.grpo.sampling_distribution` defines that distribution once for every sampler: the logits divided by the
temperature, truncated by ``top_k`` / ``top_p`` / ``min_p`` and renormalised over the tokens kept. This mixin reads
the trainer's settings (`sampling_settings`: what its transformers generation config applies, or what TRL hands
vLLM) and, where they truncate, re-patches TRL's fused LM head on every model the trainer scores (the policy, the
reference model, a distillation teacher) to score the truncated distribution
(`trl_grpo_ext.trl.internals.add_truncated_lm_head`): the sampler's recorded log-probs and the trainer's then agree to
float rounding at staleness 0, whatever the settings. Without truncation TRL's own head (the tempered softmax) stays.
"""

from __future__ import annotations

import logging

from accelerate.utils import is_peft_model

from trl_grpo_ext.errors import raise_problems
from trl_grpo_ext.grpo.sampling_distribution import SamplingSettings
from trl_grpo_ext.trl import internals

logger = logging.getLogger(__name__)


class SampledPolicyMixin:
    """`trl.GRPOTrainer` mixin: ``sampling_settings`` and, with truncation, the truncated head (module docstring).
    Left of `DistillationMixin` in the trainer's bases, so its teacher exists when this runs."""

    sampling_settings = SamplingSettings()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        generation_config = None if self.use_vllm else getattr(self, "generation_config", None)
        self.sampling_settings = SamplingSettings.of(generation_config if generation_config is not None else self)
        if not self.sampling_settings.truncates:
            return
        models = [self.model, self.ref_model, getattr(self, "teacher_model", None)]
        models = [self.accelerator.unwrap_model(m) for m in models if m is not None]
        raise_problems("GRPOTrainer", internals.truncation_problems(models[0]))
        for model in models:
            base = model.get_base_model() if is_peft_model(model) else model
            internals.add_truncated_lm_head(
                base, self.temperature, self.sampling_settings, self.args.cast_lm_head_to_fp32
            )
        logger.info(
            "sampling with %s: the trained policy is that truncated distribution (renormalised over the kept tokens)",
            self.sampling_settings.describe(),
        )
