"""Built-in PyTRIO/Tinker loss names and their `loss_fn_config` mapped onto `trl_grpo_ext.grpo.losses`.

The server computes each loss as a plain sum of per-token terms over the counted tokens, as Tinker documents
(``loss = -objective.sum()``). A sum is also what `TrainingClient.forward_backward_custom` relies on: it sends
``-dL/dlogp`` as cross-entropy weights, and only an unnormalised sum turns those back into the custom gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trl_grpo_ext.grpo import losses
from trl_grpo_ext.grpo.loss_table import SERVER_LOSS_CONFIG_KEYS, WIRE_CLIP_HIGH, WIRE_CLIP_LOW

# Tinker's names for the knobs, from the loss table; the losses module takes ratio bounds and a DRO beta.
CONFIG_KEYS: dict[str, tuple[str, ...]] = SERVER_LOSS_CONFIG_KEYS
BUILTIN_LOSSES = tuple(CONFIG_KEYS)


class LossConfigError(ValueError):
    """A `loss_fn_config` the named loss cannot take (unknown key, non-numeric or out-of-range value)."""


@dataclass(frozen=True)
class LossSpec:
    name: str
    clip_low: float | None = None
    clip_high: float | None = None
    beta: float | None = None


def parse_loss(name: str, config: dict | None) -> LossSpec:
    """Validate a loss name and its config; raise `LossConfigError` with the accepted keys on bad input."""
    normalized = str(name).strip().lower()
    if normalized not in CONFIG_KEYS:
        raise LossConfigError(f"unsupported loss {name!r}; built-in losses: {', '.join(BUILTIN_LOSSES)}")
    # None means "use the default", as a loop that fills every key from optional settings sends it
    config = {k: v for k, v in (config or {}).items() if v is not None}
    allowed = CONFIG_KEYS[normalized]
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        accepted = ", ".join(allowed) if allowed else "none"
        raise LossConfigError(
            f"loss_fn_config keys {unknown} are not accepted by {normalized!r} (accepted: {accepted})"
        )
    values: dict[str, float] = {}
    for key, value in config.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise LossConfigError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        values[key] = float(value)
    low, high = values.get(WIRE_CLIP_LOW), values.get(WIRE_CLIP_HIGH)
    if low is not None and low < 0:
        raise LossConfigError(f"{WIRE_CLIP_LOW} must be >= 0, got {low}")
    if low is not None and high is not None and low > high:
        raise LossConfigError(f"{WIRE_CLIP_LOW} {low} exceeds {WIRE_CLIP_HIGH} {high}")
    beta = values.get("beta")
    if beta is not None and beta < 0:
        raise LossConfigError(f"beta must be >= 0, got {beta}")
    return LossSpec(normalized, clip_low=low, clip_high=high, beta=beta)


def per_token_loss(
    spec: LossSpec,
    logprobs: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Unmasked per-token loss of `spec` from `trl_grpo_ext.grpo.losses` (same shapes as ``logprobs``)."""
    if spec.name == "cross_entropy":
        return losses.policy_loss("cross_entropy", logprobs, None, weights)
    return losses.policy_loss(
        spec.name,
        logprobs,
        old_logprobs,
        advantages,
        clip_low=spec.clip_low,
        clip_high=spec.clip_high,
        beta=spec.beta,
    )
