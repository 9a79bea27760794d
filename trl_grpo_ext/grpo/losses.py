"""Per-token policy losses, their metrics, token-level aggregation, group advantages and the degenerate-group rule.

Shared by the TRL trainer subclass (`trl_grpo_ext.trl.trainer`) and the PyTRIO path (loop and local server), so
both execution paths compute the same numbers. Depends on torch only: the PyTRIO loop imports it without TRL.

Formulas (ratio ``r = exp(logp - logp_old)``, ``sg`` = stop-gradient, per token, before aggregation):

=====================  ===============================================  ==============================
loss_type              per-token loss                                   source
=====================  ===============================================  ==============================
``importance_sampling``  ``-r * A``                                     Tinker ``importance_sampling``
``ppo``                ``-min(r * A, clip(r, low, high) * A)``          Tinker ``ppo`` (0.8 / 1.2)
``cispo``              ``-sg(clip(r, low, high)) * A * logp``           Tinker ``cispo`` (0.0 / 4.0),
                                                                        MiniMax-M1 (arXiv 2506.13585)
``cross_entropy``      ``-logp * w`` (``w`` passed as ``advantages``)   Tinker ``cross_entropy``
``dro``                ``-(logp * A - beta / 2 * (logp - logp_old)^2)``  Tinker ``dro`` (beta 0.05)
=====================  ===============================================  ==============================

Tinker's pages (tinker-docs.thinkingmachines.ai/tinker/losses/{ppo,cispo,dro}) sum these per-token terms;
here they stay per token and `token_level_mean` aggregates them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

# (clip_low, clip_high) as ratio bounds, not epsilons, and dro's beta: the loss table's defaults (Tinker's).
from trl_grpo_ext.grpo.async_sampling import IS_RATIO_BY_STALENESS, SAMPLER_CORRECTION_MODES
from trl_grpo_ext.grpo.loss_table import DEFAULT_CLIP, DEFAULT_DRO_BETA, LOCAL_LOSS_TYPES

# Floor of the reward std in `scale_rewards`, as in TRL 1.16 (`advantages / (std + 1e-4)`).
TRL_STD_EPS = 1e-4


def _mask_weights(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    if mask is None:
        return None
    if x.shape != mask.shape:  # sequence-level values (B, 1): one per sequence that has a token
        return (mask.sum(-1, keepdim=True) > 0).to(x.dtype)
    return mask.to(x.dtype)


def ratio_metrics(
    ratio: torch.Tensor,
    mask: torch.Tensor | None = None,
    clip_low: float | None = None,
    clip_high: float | None = None,
) -> dict[str, torch.Tensor]:
    """Masked-mean ratio diagnostics as 0-d tensors (no gradient).

    ``clip_low_frac`` / ``clip_high_frac`` count tokens whose ratio lies below / above the bounds (whatever the
    advantage sign), ``clipped_ratio_mean`` is the mean of ``clip(r, low, high)``. Bounds of ``None`` are open,
    and with both open only ``ratio_mean`` is returned. A (B, 1) ratio with a (B, T) mask is averaged per sequence.
    """
    ratio = ratio.detach().float()
    names = ["ratio_mean"]
    rows = [ratio]
    if clip_low is not None or clip_high is not None:
        names += ["clip_low_frac", "clip_high_frac", "clipped_ratio_mean"]
        no = torch.zeros_like(ratio)
        rows += [
            (ratio < clip_low).float() if clip_low is not None else no,
            (ratio > clip_high).float() if clip_high is not None else no,
            torch.clamp(ratio, min=clip_low, max=clip_high),
        ]
    stacked = torch.stack(rows)  # one fused masked mean for all metrics: they are logged every micro-batch
    weights = _mask_weights(ratio, mask)
    if weights is None:
        means = stacked.flatten(1).mean(1)
    else:
        means = (stacked * weights).flatten(1).sum(1) / weights.sum().clamp(min=1.0)
    return dict(zip(names, means.unbind(0), strict=True))


def _bounds(loss_type: str, clip_low: float | None, clip_high: float | None) -> tuple[float, float]:
    default_low, default_high = DEFAULT_CLIP[loss_type]
    low = default_low if clip_low is None else float(clip_low)
    high = default_high if clip_high is None else float(clip_high)
    if low < 0 or high < 0 or low > high:
        raise ValueError(
            f"{loss_type}: ratio bounds must satisfy 0 <= clip_low <= clip_high, got clip_low={low}, clip_high={high}"
        )
    return low, high


def _as_token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    advantages = torch.as_tensor(advantages, dtype=like.dtype, device=like.device)
    if advantages.dim() == 1 and like.dim() == 2:
        advantages = advantages.unsqueeze(1)
    return advantages


def _importance_sampling(log_ratio, logprobs, advantages, mask, clip_low, clip_high, beta):
    ratio = torch.exp(log_ratio)
    return -ratio * advantages, ratio_metrics(ratio, mask)


def _ppo(log_ratio, logprobs, advantages, mask, clip_low, clip_high, beta):
    low, high = _bounds("ppo", clip_low, clip_high)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, low, high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    return loss, ratio_metrics(ratio, mask, low, high)


def _cispo(log_ratio, logprobs, advantages, mask, clip_low, clip_high, beta):
    low, high = _bounds("cispo", clip_low, clip_high)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, low, high).detach()
    return -weight * advantages * logprobs, ratio_metrics(ratio, mask, low, high)


def _cross_entropy(log_ratio, logprobs, advantages, mask, clip_low, clip_high, beta):
    return -logprobs * advantages, ratio_metrics(torch.exp(log_ratio), mask)


def _dro(log_ratio, logprobs, advantages, mask, clip_low, clip_high, beta):
    beta = DEFAULT_DRO_BETA if beta is None else float(beta)
    loss = -(logprobs * advantages - 0.5 * beta * log_ratio.square())
    return loss, ratio_metrics(torch.exp(log_ratio), mask)


# Per-token math keyed by loss type: f(log_ratio, logprobs, advantages, mask, clip_low, clip_high, beta). The names
# are the loss table's local losses (`trl_grpo_ext.grpo.loss_table`); a name added there without math here fails at import.
_PER_TOKEN = {
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "cross_entropy": _cross_entropy,
    "dro": _dro,
}
if set(_PER_TOKEN) != set(LOCAL_LOSS_TYPES):
    raise RuntimeError(f"losses.py computes {sorted(_PER_TOKEN)}, the loss table lists {sorted(LOCAL_LOSS_TYPES)}")


def policy_loss_from_log_ratio(
    loss_type: str,
    log_ratio: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    clip_low: float | None = None,
    clip_high: float | None = None,
    *,
    beta: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`policy_loss` with the log importance weight given directly.

    ``log_ratio`` is ``logp - logp_old`` per token (B, T) or one value per sequence (B, 1), as TRL's
    ``importance_sampling_level="sequence"`` builds it; it must carry the gradient where the loss needs it.
    The per-token loss is broadcast to the shape of ``logprobs``.
    """
    if loss_type not in _PER_TOKEN:
        raise ValueError(f"Unknown loss_type {loss_type!r}; valid values: {sorted(_PER_TOKEN)}")
    advantages = _as_token_advantages(advantages, logprobs)
    loss, metrics = _PER_TOKEN[loss_type](log_ratio, logprobs, advantages, mask, clip_low, clip_high, beta)
    if loss.shape != logprobs.shape:
        loss = loss.expand(logprobs.shape)
    return loss, metrics


def policy_loss(
    loss_type: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    clip_low: float | None = None,
    clip_high: float | None = None,
    *,
    beta: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss of ``loss_type`` and its metrics.

    Args:
        logprobs: log-probabilities of the sampled tokens under the policy being trained, (B, T) or (N,).
        old_logprobs: the same under the sampling policy (no gradient). ``None`` means on-policy (ratio 1).
        advantages: (B,), (B, 1) or (B, T); for ``cross_entropy`` the per-token weights.
        mask: 1 for tokens that count; only used for the metrics (the loss is returned unmasked).
        clip_low, clip_high: ratio bounds for ``ppo`` and ``cispo``; ``None`` takes `DEFAULT_CLIP`.
        beta: quadratic penalty of ``dro`` (default `DEFAULT_DRO_BETA`).

    Returns:
        ``(per_token_loss, metrics)``: the loss has the shape of ``logprobs``; metrics are 0-d tensors:
        ``ratio_mean`` and, for ``ppo``/``cispo``, ``clip_low_frac``, ``clip_high_frac``, ``clipped_ratio_mean``.
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs.to(logprobs.dtype)
    return policy_loss_from_log_ratio(
        loss_type, logprobs - old, logprobs, advantages, mask, clip_low, clip_high, beta=beta
    )


# `policy_loss` with the loss type bound: LOSS_FUNCTIONS[name](logprobs, old_logprobs, advantages, mask, ...).
LOSS_FUNCTIONS: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {
    name: partial(policy_loss, name) for name in _PER_TOKEN
}


def token_level_mean(
    per_token_loss: torch.Tensor, mask: torch.Tensor, normalizer: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Sum of the masked per-token loss divided by the token count: TRL's ``dapo`` aggregation.

    ``normalizer`` replaces the local token count, e.g. TRL's ``num_items_in_batch`` (active tokens of the whole
    generation batch across processes) rescaled to one accumulation window.
    """
    mask = mask.to(per_token_loss.dtype)
    total = (per_token_loss * mask).sum()
    if normalizer is None:
        normalizer = mask.sum()
    return total / torch.as_tensor(normalizer, dtype=total.dtype, device=total.device).clamp(min=1.0)


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected std that ignores NaN, as TRL 1.16's `trl.trainer.utils.nanstd` (NaN with fewer than two
    values); checked against TRL's source with the other copies (`trl_grpo_ext.trl.internals.MIRRORED_ELSEWHERE`)."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim)
    count = (~torch.isnan(x)).sum(dim=dim)
    var = var * torch.where(count > 1, count / (count - 1).clamp(min=1), torch.full_like(var, float("nan")))
    return torch.sqrt(var)


def degenerate_groups(values: torch.Tensor, group_size: int, tol: float = 1e-6) -> torch.Tensor:
    """Bool mask (num_groups,): groups whose values are all equal within ``tol`` (``max - min <= tol``).

    ``values`` is (N,) or (N, K) (K reward functions: every column must be flat). NaN entries (unscorable
    completions) are ignored; a group with fewer than two scored entries carries no signal and counts as degenerate.
    """
    if group_size < 1 or values.shape[0] % group_size:
        raise ValueError(f"{values.shape[0]} values do not split into groups of {group_size}")
    grouped = values.reshape(-1, group_size, *values.shape[1:]).float()
    nan = torch.isnan(grouped)
    spread = grouped.masked_fill(nan, float("-inf")).amax(1) - grouped.masked_fill(nan, float("inf")).amin(1)
    scored = (~nan).sum(1)
    flat = (spread <= tol) | (scored < 2)
    return flat if flat.dim() == 1 else flat.all(-1)


def degenerate_group_mask(
    rewards: torch.Tensor, group_size: int, tol: float = 1e-6, named_reward: torch.Tensor | None = None
) -> torch.Tensor:
    """The degenerate-group rule of both paths, bool (num_groups,): a group is degenerate when its ``rewards`` are flat
    within ``tol`` (`degenerate_groups`: the weighted totals (N,), or every reward function's column (N, K)), or when
    ``named_reward`` (N,), the column ``degenerate_reward`` names, is flat.

    The TRL trainer applies it to the generation batch TRL scored, `group_advantages` (the PyTRIO loop) to its own."""
    degenerate = degenerate_groups(rewards, group_size, tol)
    if named_reward is not None:
        degenerate = degenerate | degenerate_groups(named_reward, group_size, tol)
    return degenerate


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale_rewards: str | bool = "group",
    degenerate_tol: float = 1e-6,
    zero_degenerate: bool = True,
    eps: float = TRL_STD_EPS,
    *,
    degenerate_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages of TRL 1.16 (``multi_objective_aggregation="sum_then_normalize"``) plus a tolerance rule.

    ``rewards`` (N,) are the weighted total rewards, consecutive ``group_size`` entries per prompt; NaN marks an
    unscorable completion (excluded from the group baseline, advantage 0), as in TRL. Advantages are
    ``r - group_mean``, divided by ``group_std + eps`` (``"group"``), the batch std + eps (``"batch"``) or nothing
    (``"none"``); ``True``/``False`` mean ``"group"``/``"none"`` as in TRL.

    Tolerance rule: a group whose rewards are equal within ``degenerate_tol`` is degenerate; TRL's exact-zero test
    misses float noise (std 1.3e-7 for eight rewards of 1.3) and ``"group"`` scaling blows it up to ±1e-3.
    ``degenerate_rewards`` (N,), e.g. one reward function's values, marks groups where it is flat as degenerate too.
    With ``zero_degenerate`` the advantages of degenerate groups are set to exactly 0.

    Returns ``(advantages (N,), degenerate (N // group_size,) bool)``; ``frac_degenerate = degenerate.float().mean()``.
    """
    scale_rewards = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    advantages = rewards - mean
    if scale_rewards == "group":
        std = nanstd(grouped, dim=1).repeat_interleave(group_size) if group_size > 1 else torch.zeros_like(rewards)
        advantages = advantages / (std + eps)
    elif scale_rewards == "batch":
        std = nanstd(rewards) if rewards.numel() > 1 else torch.zeros(())
        advantages = advantages / (std + eps)
    advantages = torch.nan_to_num(advantages, nan=0.0)

    named = None if degenerate_rewards is None else torch.as_tensor(degenerate_rewards, dtype=torch.float32)
    degenerate = degenerate_group_mask(rewards, group_size, degenerate_tol, named)
    if zero_degenerate:
        advantages = advantages.masked_fill(degenerate.repeat_interleave(group_size), 0.0)
    return advantages, degenerate


# --------------------------------------------------------------------------- sampler / trainer mismatch
# The mismatch metrics both paths log, one row per step (`sampler_correction`)
SAMPLER_MISMATCH_KEYS = (
    "sampling/sampler_kl",
    "sampling/is_ratio_raw/mean",
    "sampling/is_ratio_raw/min",
    "sampling/is_ratio_raw/max",
    "sampling/is_ratio_truncated_frac",
)


def sampler_correction(
    trainer_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_truncate",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights correcting for a sampler whose token log-probs differ from the trainer's, and the mismatch.

    The weights are TRL 1.16's vLLM importance-sampling ratio (`GRPOTrainer._generate_and_score_completions`):
    ``exp(trainer - sampler)`` per token (``token_*``) or per completion (``sequence_*``: the summed difference),
    clamped to [clip_min, clip_max] (``*_truncate``) or zeroed outside it (``*_mask``); padding and NaN sampler
    log-probs count as no difference. Shape (B, T) or (B, 1), detached; a loss multiplies its per-token terms by them.

    Metrics (0-dim tensors, local to the rows given), keys `SAMPLER_MISMATCH_KEYS`: ``sampler_kl``, the k3 estimate
    of KL(sampler || trainer) per token, ``mean(r - 1 - log r)`` with ``r = exp(trainer - sampler)`` (>= 0, unbiased
    under the sampler's tokens); the raw ratio's mean/min/max before truncation (per token or per completion, as the
    mode weighs); the fraction of them outside the bounds (truncated or masked).
    """
    if mode not in SAMPLER_CORRECTION_MODES:
        raise ValueError(f"unknown importance sampling mode {mode!r}; valid: {', '.join(SAMPLER_CORRECTION_MODES)}")
    trainer_logps, sampler_logps = trainer_logps.detach().float(), sampler_logps.detach().float()
    valid = mask.bool() & ~torch.isnan(sampler_logps)
    diff = torch.where(valid, trainer_logps - torch.nan_to_num(sampler_logps), torch.zeros_like(trainer_logps))
    sequence = mode.startswith("sequence")
    log_ratio = diff.sum(-1, keepdim=True) if sequence else diff
    raw = torch.exp(log_ratio)
    low = -float("inf") if clip_min is None else float(clip_min)
    high = float("inf") if clip_max is None else float(clip_max)
    outside = (raw < low) | (raw > high)
    if mode.endswith("truncate"):
        weights = raw.clamp(min=clip_min, max=clip_max)
    else:
        weights = raw.masked_fill(outside, 0.0)
    counted = valid.any(-1, keepdim=True) if sequence else valid
    ratios = raw[counted]
    zero = raw.new_zeros(())
    k3 = torch.expm1(diff) - diff  # r - 1 - log r per token, 0 where not counted
    metrics = {
        "sampling/sampler_kl": k3[valid].mean() if valid.any() else zero,
        "sampling/is_ratio_raw/mean": ratios.mean() if ratios.numel() else zero,
        "sampling/is_ratio_raw/min": ratios.min() if ratios.numel() else zero,
        "sampling/is_ratio_raw/max": ratios.max() if ratios.numel() else zero,
        "sampling/is_ratio_truncated_frac": outside[counted].float().mean() if ratios.numel() else zero,
    }
    return weights, metrics


def ratio_by_staleness(log_ratio: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor) -> dict[str, float]:
    """The mean importance ratio ``exp(trainer - sampler)`` of the masked tokens of the rows of each staleness in
    `staleness` (B,), as ``sample/is_ratio/staleness_<s>`` (`trl_grpo_ext.grpo.async_sampling`): how far the
    trained policy has moved from the weights that drew a batch, by how many steps older they are."""
    ratio = torch.exp(torch.nan_to_num(log_ratio.detach().float()))
    weights = mask.detach().float()
    metrics = {}
    for value in sorted(set(staleness.tolist())):
        rows = staleness == value
        count = weights[rows].sum()
        if count > 0:
            metrics[IS_RATIO_BY_STALENESS.format(value)] = float((ratio[rows] * weights[rows]).sum() / count)
    return metrics
