"""`GRPOTrainer`: TRL's GRPO trainer with two more loss types, degenerate-group handling and shared metrics.

- TRL's own loss types go to ``super()._compute_loss`` unchanged; the subclass only reads the log-probabilities
  TRL computed to log ``ratio_mean`` (and clip fractions for TRL's clipped losses).
- ``importance_sampling``, two-sided ``cispo`` and ``ppo`` (Tinker's name, dapo's per-token loss; see
  `trl_grpo_ext.grpo.losses`) are computed by
  `_compute_extension_loss`, which follows TRL 1.16's ``_compute_loss`` step by step (reference KL, old
  log-probabilities for ``num_iterations > 1``, ``importance_sampling_level``, ``top_entropy_quantile``,
  off-policy mask, vLLM importance-sampling correction, entropy bonus, MoE aux loss) and normalises like ``dapo``.
- After TRL has scored a generation batch, prompt groups whose rewards are flat within ``degenerate_tol``
  get exactly zero advantage (``zero_degenerate_advantages``) and ``frac_degenerate`` is logged.
- Rows that share prompt tokens are encoded once in the log-prob forward and in non-vLLM generation
  (``share_prompt_prefix``, `trl_grpo_ext.trl.prefix_mixin.PrefixSharingMixin`; docs/prefix_sharing.md).
- ``dynamic_sampling`` (DAPO's group filter) and the task ``curriculum`` are the mixins of
  `trl_grpo_ext.trl.sampling`; they read the degenerate mask this class computes for each generation batch.
"""

from __future__ import annotations

import functools

import torch
import trl
from trl.trainer.utils import get_config_model_id

from trl_grpo_ext.grpo.loss_table import loss_type_of_trl_name, ratio_bounds
from trl_grpo_ext.grpo.losses import degenerate_groups, policy_loss_from_log_ratio, ratio_metrics, token_level_mean
from trl_grpo_ext.grpo.reward_aggregation import weighted_rewards
from trl_grpo_ext.grpo.spec import raise_problems, reward_index, reward_option_problems
from trl_grpo_ext.task.rewards import reward_names
from trl_grpo_ext.trl.config import EXTRA_LOSS_TYPES, GRPOConfig, trl_loss_type
from trl_grpo_ext.trl.prefix_mixin import PrefixSharingMixin
from trl_grpo_ext.trl.sampler_precision import SamplerPrecisionMixin
from trl_grpo_ext.trl.sampling import CurriculumMixin, DynamicSamplingMixin

# Inputs that `_get_per_token_logps_and_entropies` takes for multimodal models, forwarded as TRL does.
_MODEL_INPUT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def given_reward_count(reward_funcs) -> int:
    """How many reward functions TRL 1.16 weighs with ``reward_weights``: the ``reward_funcs`` argument (one, a
    list, or none). A reward an environment owns comes after them, with weight 1 and no entry in ``reward_weights``."""
    if reward_funcs is None:
        return 0
    return len(reward_funcs) if isinstance(reward_funcs, list) else 1


@functools.cache
def _on_policy_ratio_metrics(clip_low, clip_high) -> dict[str, float]:
    """`ratio_metrics` of ratios that are all exactly 1, as plain floats."""
    return {name: value.item() for name, value in ratio_metrics(torch.ones(1), None, clip_low, clip_high).items()}


class GRPOTrainer(DynamicSamplingMixin, CurriculumMixin, SamplerPrecisionMixin, PrefixSharingMixin, trl.GRPOTrainer):
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
        weighted = given_reward_count(reward_funcs)  # counted first: TRL appends to a list it is given
        super().__init__(model, reward_funcs, args, *pos_args, **kwargs)

        self.ext_loss_type = args.loss_type if extended and args.loss_type in EXTRA_LOSS_TYPES else None
        if extended and self.ext_loss_type is None:
            self.loss_type = trl_loss_type(args.loss_type)  # trl_cispo -> TRL's "cispo"
        # Ratio bounds of the loss (its clipping, and the bounds of the clip metrics); TRL's names keep TRL's meaning.
        self._ratio_bounds = ratio_bounds(args, args.loss_type if extended else loss_type_of_trl_name(args.loss_type))
        defaults = GRPOConfig.__dataclass_fields__
        self.degenerate_tol = getattr(args, "degenerate_tol", defaults["degenerate_tol"].default)
        self.zero_degenerate_advantages = getattr(
            args, "zero_degenerate_advantages", defaults["zero_degenerate_advantages"].default
        )
        self.degenerate_reward = getattr(args, "degenerate_reward", None)
        # Every reward column TRL scores (the reward_funcs given, then the rewards environments own) may be named;
        # reward_weights covers the given ones, as TRL counts them. One check, curriculum_reward included.
        names = reward_names(func_names=self.reward_func_names)
        raise_problems("GRPOTrainer", reward_option_problems(args, names, weighted))
        self._degenerate_column = (
            None if self.degenerate_reward is None else reward_index(self.degenerate_reward, names)
        )

        self._capture_logps = False
        self._captured_logps = None
        self._last_rewards_per_func = None
        self._train_tokens_window = None

    # ------------------------------------------------------------------ rewards and advantages
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards_per_func  # all processes' rewards, read right after TRL scored them
        return rewards_per_func

    def _degenerate_group_mask(self, rewards_per_func: torch.Tensor, num_generations: int) -> torch.Tensor:
        """(num_groups,) bool over the whole (all-process) generation batch."""
        if self.multi_objective_aggregation == "normalize_then_sum":
            # Each reward function is normalised on its own, so each one's float noise is amplified on its own.
            degenerate = degenerate_groups(rewards_per_func, num_generations, self.degenerate_tol)
        else:
            rewards = weighted_rewards(rewards_per_func, self.reward_weights)
            degenerate = degenerate_groups(rewards, num_generations, self.degenerate_tol)
        if self._degenerate_column is not None:
            column = rewards_per_func[:, self._degenerate_column]
            degenerate = degenerate | degenerate_groups(column, num_generations, self.degenerate_tol)
        return degenerate

    def _generate_and_score_completions(self, inputs):
        self._last_rewards_per_func = None
        output = super()._generate_and_score_completions(inputs)
        rewards_per_func, self._last_rewards_per_func = self._last_rewards_per_func, None
        if rewards_per_func is None:
            return output
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        degenerate = self._degenerate_group_mask(rewards_per_func, num_generations)
        self._metrics[mode]["frac_degenerate"].append(degenerate.float().mean().item())
        self._last_degenerate_groups = degenerate  # dynamic sampling (`trl_grpo_ext.trl.sampling`) filters on it
        if self.zero_degenerate_advantages and bool(degenerate.any()):
            zero = degenerate.repeat_interleave(num_generations).to(output["advantages"].device)
            num_local = output["advantages"].shape[0]
            start = self.accelerator.process_index * num_local
            local_zero = zero[start : start + num_local]
            if output["advantages"].dim() == 2:
                local_zero = local_zero.unsqueeze(1)
            output["advantages"] = output["advantages"].masked_fill(local_zero, 0.0)
            logged = self._logs["advantages"]  # the completions table should show what is trained on
            k = min(len(logged), zero.numel())
            recent = [0.0 if z else a for a, z in zip(list(logged)[-k:], zero[-k:].tolist(), strict=True)]
            for _ in range(k):
                logged.pop()
            logged.extend(recent)
        return output

    # ------------------------------------------------------------------ loss
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._capture_logps:
            self._captured_logps = result[0].detach()
        return result

    def _compute_loss(self, model, inputs):
        inputs = self._with_sampler_correction(inputs)  # bf16 sampler: advantages weighed (trl.sampler_precision)
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

    def _loss_mask(self, inputs):
        mask = inputs["completion_mask"]
        return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]

    def _log_importance_weights(self, log_ratio, mask):
        if self.importance_sampling_level == "token":
            return log_ratio
        if self.importance_sampling_level == "sequence":
            return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        raise ValueError(
            f"Unknown importance sampling level: {self.importance_sampling_level}. Possible values are 'token' and "
            "'sequence'."
        )

    def _compute_extension_loss(self, model, inputs):
        """TRL 1.16 ``_compute_loss`` with the policy term from `trl_grpo_ext.grpo.losses` and ``dapo`` normalisation."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = self._loss_mask(inputs)
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _MODEL_INPUT_KEYS},
        )
        entropy_mask = (
            self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            if self.top_entropy_quantile < 1.0
            else None
        )
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        # Without old log-probabilities TRL is on-policy (one update per generation): ratio exactly 1.
        old_per_token_logps = inputs.get("old_per_token_logps")
        if old_per_token_logps is None:
            old_per_token_logps = per_token_logps.detach()

        log_importance_weights = self._log_importance_weights(per_token_logps - old_per_token_logps, mask)
        if self.beta != 0.0:
            ref_per_token_logps = inputs["ref_per_token_logps"]
            per_token_kl = (
                torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
            )
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * torch.exp(log_importance_weights)

        clip_low, clip_high = self._ratio_bounds
        per_token_loss, ratio_stats = policy_loss_from_log_ratio(
            self.ext_loss_type, log_importance_weights, per_token_logps, advantages, mask, clip_low, clip_high
        )
        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_per_token_logps),
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask
        if self.use_vllm and self.vllm_importance_sampling_correction:
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
        if self.beta != 0.0:
            per_token_loss = per_token_loss + self.beta * per_token_kl

        mode = "train" if self.model.training else "eval"
        # TRL's dapo normaliser: active tokens of the generation batch (all processes), per process and per
        # accumulation window, so the accumulated gradient is a token mean over the whole window.
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        loss = token_level_mean(per_token_loss, mask, normalizer)
        policy_loss = loss.detach()

        if self._entropy_bonus_enabled:
            loss = self._add_entropy_bonus(loss, policy_loss, entropies, mask, entropy_mask, mode)
        if self.aux_loss_enabled:
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        token_means = {"entropy": entropies}
        if self.beta != 0.0:
            token_means["kl"] = per_token_kl
        self._log_global_means(mode, self._masked_stats(token_means, mask))
        self._log_ratio_stats(mode, ratio_stats, log_importance_weights, mask)
        return loss

    def _add_entropy_bonus(self, loss, policy_loss, entropies, mask, entropy_mask, mode):
        """TRL 1.16's entropy bonus (static or adaptive coefficient), unchanged."""
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
        if self.use_adaptive_entropy:
            apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        else:
            apply_coef = self.entropy_coef
        loss = loss - apply_coef * entropy_loss
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            self._entropy_window_stats = (
                stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
            )
            if self.accelerator.sync_gradients:
                window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(
                        self.entropy_coef + self.args.entropy_coef_delta, self.args.entropy_coef_max
                    )
                else:
                    self.entropy_coef = max(
                        self.entropy_coef - self.args.entropy_coef_delta, self.args.entropy_coef_min
                    )
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return loss

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
            self._metrics[mode][name].append(totals[i] / max(totals[len(names) + i], 1.0))

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
                self._metrics[mode][name].append(value)
            return
        mask = self._loss_mask(inputs)
        log_iw = self._log_importance_weights(logps - old, mask)
        self._log_ratio_stats(mode, ratio_metrics(torch.exp(log_iw), mask, *bounds), log_iw, mask)

    def _log_train_tokens(self, inputs):
        """``train_tokens``: completion tokens with non-zero advantage, summed over an optimizer step."""
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        local = (self._loss_mask(inputs) * (advantages != 0)).sum().float().detach()
        mode = "train" if self.model.training else "eval"
        if mode == "eval":
            self._metrics[mode]["train_tokens"].append(self._sum_over_processes(local).item())
            return
        self._train_tokens_window = local if self._train_tokens_window is None else self._train_tokens_window + local
        if self.accelerator.sync_gradients:
            total = self._sum_over_processes(self._train_tokens_window).item()
            self._metrics[mode]["train_tokens"].append(total)
            self._train_tokens_window = None
