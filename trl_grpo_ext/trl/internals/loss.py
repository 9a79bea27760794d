"""TRL 1.16's loss step (``GRPOTrainer._compute_loss``), copied step by step with the policy term as a parameter,
and the loss mask and log importance weights the TRL path's mixins share with it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trl_grpo_ext.grpo.losses import token_level_mean
from trl_grpo_ext.trl.internals.mirroring import TRL_GRPO, mirrors
from trl_grpo_ext.trl.internals.private_state import log_metric

# Inputs that `_get_per_token_logps_and_entropies` takes for multimodal models, forwarded as `_compute_loss` does.
MODEL_INPUT_KEYS = (
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


def loss_mask(inputs: dict) -> torch.Tensor:
    """The tokens TRL's loss counts: ``completion_mask``, times ``tool_mask`` when tools ran (`_compute_loss`)."""
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]


@mirrors(f"{TRL_GRPO}._compute_loss", {"1.16.0": "786b6ecc70228b78"}, part="importance_sampling_level")
def log_importance_weights(trainer, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL 1.16 ``_compute_loss``'s log importance weights: per token, or one per sequence (B, 1)."""
    if trainer.importance_sampling_level == "token":
        return log_ratio
    if trainer.importance_sampling_level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(
        f"Unknown importance sampling level: {trainer.importance_sampling_level}. Possible values are 'token' and "
        "'sequence'."
    )


@dataclass
class LossTerms:
    """What `compute_loss` computed besides the loss, for the caller's metrics."""

    mask: torch.Tensor
    log_importance_weights: torch.Tensor
    ratio_stats: dict[str, torch.Tensor]  # the policy term's ratio metrics (local masked means)
    token_means: dict[str, torch.Tensor]  # per-token values logged as global masked means: entropy, kl (beta > 0)


# policy_term(inputs, log_importance_weights, per_token_logps, advantages, mask) -> (per-token loss, ratio metrics)
PolicyTerm = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@mirrors(f"{TRL_GRPO}._compute_loss", {"1.16.0": "786b6ecc70228b78"})
def compute_loss(trainer, model, inputs: dict, policy_term: PolicyTerm) -> tuple[torch.Tensor, LossTerms]:
    """TRL 1.16 ``_compute_loss`` step by step with `policy_term` in place of TRL's per-loss-type branch and TRL's
    ``dapo`` normalisation: reference KL, old log-probabilities (``num_iterations > 1``), ``importance_sampling_level``,
    ``top_entropy_quantile``, off-policy mask, vLLM importance-sampling correction, entropy bonus, MoE aux loss.

    TRL's own metrics (entropy bonus, aux loss) are logged here; the caller logs `LossTerms`'."""
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    mask = loss_mask(inputs)
    per_token_logps, entropies, aux_loss = trainer._get_per_token_logps_and_entropies(
        model,
        input_ids,
        attention_mask,
        completion_ids.size(1),
        compute_entropy=True,
        compute_aux_loss=trainer.aux_loss_enabled,
        **{key: inputs.get(key) for key in MODEL_INPUT_KEYS},
    )
    entropy_mask = (
        trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
        if trainer.top_entropy_quantile < 1.0
        else None
    )
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    # Without old log-probabilities TRL is on-policy (one update per generation): ratio exactly 1.
    old_per_token_logps = inputs.get("old_per_token_logps")
    if old_per_token_logps is None:
        old_per_token_logps = per_token_logps.detach()

    log_iw = log_importance_weights(trainer, per_token_logps - old_per_token_logps, mask)
    if trainer.beta != 0.0:
        ref_per_token_logps = inputs["ref_per_token_logps"]
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        if trainer.args.use_bias_correction_kl:
            per_token_kl = per_token_kl * torch.exp(log_iw)

    per_token_loss, ratio_stats = policy_term(inputs, log_iw, per_token_logps, advantages, mask)
    if trainer.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * trainer.get_off_policy_mask(
            advantages=advantages,
            per_token_logps=per_token_logps,
            sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_per_token_logps),
            mask=mask,
            off_policy_threshold=trainer.off_policy_mask_threshold,
        )
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
    if trainer.beta != 0.0:
        per_token_loss = per_token_loss + trainer.beta * per_token_kl

    mode = "train" if trainer.model.training else "eval"
    # TRL's dapo normaliser: active tokens of the generation batch (all processes), per process and per
    # accumulation window, so the accumulated gradient is a token mean over the whole window.
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
    if mode == "train":
        normalizer = normalizer * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    loss = token_level_mean(per_token_loss, mask, normalizer)
    policy_loss = loss.detach()

    if trainer._entropy_bonus_enabled:
        loss = entropy_bonus(trainer, loss, policy_loss, entropies, mask, entropy_mask, mode)
    if trainer.aux_loss_enabled:
        accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss + trainer.router_aux_loss_coef * aux_loss / accumulation
        log_metric(trainer, mode, "aux_loss", trainer.accelerator.gather_for_metrics(aux_loss).mean().item())

    token_means = {"entropy": entropies}
    if trainer.beta != 0.0:
        token_means["kl"] = per_token_kl
    return loss, LossTerms(mask, log_iw, ratio_stats, token_means)


@mirrors(f"{TRL_GRPO}._compute_loss", {"1.16.0": "786b6ecc70228b78"}, part="entropy bonus")
def entropy_bonus(trainer, loss, policy_loss, entropies, mask, entropy_mask, mode: str) -> torch.Tensor:
    """TRL 1.16's entropy bonus (static or adaptive coefficient, TRL's controller state), unchanged."""
    effective_mask = mask if entropy_mask is None else mask * entropy_mask
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
    if trainer.use_adaptive_entropy:
        apply_coef = trainer.entropy_coef if trainer._last_world_entropy <= trainer.args.entropy_target else 0.0
    else:
        apply_coef = trainer.entropy_coef
    loss = loss - apply_coef * entropy_loss
    log_metric(trainer, mode, "policy_loss", trainer.accelerator.gather(policy_loss).nanmean().item())
    if trainer.use_adaptive_entropy and mode == "train":
        stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
        window = trainer._entropy_window_stats
        trainer._entropy_window_stats = stats if window is None else window + stats
        if trainer.accelerator.sync_gradients:
            totals = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
            world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
            args = trainer.args
            if world_entropy <= args.entropy_target:
                trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
            trainer._last_world_entropy = world_entropy
            trainer._entropy_window_stats = None
    if mode == "train" and trainer.accelerator.sync_gradients:
        log_metric(trainer, mode, "entropy_coef", trainer.entropy_coef)
    return loss
