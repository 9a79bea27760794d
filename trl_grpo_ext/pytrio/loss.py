"""The loss, computed here or by the service: the local loss ``forward_backward_custom`` runs
(`make_custom_loss`: `trl_grpo_ext.grpo.losses.policy_loss`, the TRL path's loss math), the service's built-in
losses' ``loss_fn_config`` (`builtin_loss_config`), and a built-in loss's metrics recomputed locally from the
log-probs it returned (`builtin_loss_metrics`), so both report the same numbers.

The old log-probs are the sampler's (the service's semantics: the loss's ratio against the weights that drew the
batch), except under asynchronous sampling's decoupled objective (`trl_grpo_ext.grpo.async_sampling`): there the
loss runs here, its ratio and clip against the proximal policy (the forward's own log-probs, the weights at the
step's start) and the advantages weighed by the behaviour ratio proximal/sampler, truncated or masked as the
``vllm_importance_sampling_*`` settings say (`trl_grpo_ext.grpo.losses.sampler_correction`): the TRL path's
objective."""

from __future__ import annotations

from trl_grpo_ext.grpo.async_sampling import asynchronous, decoupled
from trl_grpo_ext.grpo.loss_table import wire_loss_config
from trl_grpo_ext.pytrio.calls import PyTrioLoopError
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.types import TokenRows, TrainBatch


def make_custom_loss(config: PyTrioGRPOConfig, rows: TokenRows, record: dict):
    """The local loss for ``forward_backward_custom``: `trl_grpo_ext.grpo.losses.policy_loss`, aggregated over the
    completion tokens of the whole batch as ``loss_aggregation`` says. Metrics also land in ``record``."""
    import torch

    from trl_grpo_ext.grpo.losses import (  # torch: first step
        policy_loss,
        ratio_by_staleness,
        sampler_correction,
        token_level_mean,
    )

    clip_low, clip_high = config.clip_bounds
    decoupled_loss = decoupled(config)

    def loss_fn(data, logprobs_list):
        if len(logprobs_list) != len(rows.masks):
            raise PyTrioLoopError(f"custom loss got {len(logprobs_list)} logprob rows for {len(rows.masks)} datums")
        width = max(int(lp.numel()) for lp in logprobs_list)
        padded = {"new": [], "old": [], "adv": [], "mask": []}
        for lp, old, adv, mask in zip(logprobs_list, rows.old_logprobs, rows.advantages, rows.masks, strict=True):
            lp = lp.reshape(-1)
            if lp.numel() != len(mask):
                raise PyTrioLoopError(f"service returned {lp.numel()} logprobs for a datum of {len(mask)} positions")
            pad = (0, width - lp.numel())
            padded["new"].append(torch.nn.functional.pad(lp, pad))
            for key, values in (("old", old), ("adv", adv), ("mask", mask)):
                padded[key].append(torch.nn.functional.pad(torch.tensor(values, dtype=torch.float32), pad))
        new, old, adv, mask = (torch.stack(padded[k]) for k in ("new", "old", "adv", "mask"))
        # Prompt positions hold logprob 0 in the datum; make their ratio exactly 1 (they are masked anyway).
        old = torch.where(mask > 0, old, new.detach())
        proximal = new.detach()  # the weights at the step's start: this forward's
        # the behaviour ratio proximal/sampler by the staleness of each datum's batch (asynchronous runs)
        staleness = torch.tensor(rows.staleness, dtype=torch.long)
        extra = ratio_by_staleness(proximal - old, mask, staleness) if asynchronous(config) else {}
        if decoupled_loss:
            weights, mismatch = sampler_correction(
                proximal,
                old,
                mask,
                config.vllm_importance_sampling_mode,
                config.vllm_importance_sampling_clip_min,
                config.vllm_importance_sampling_clip_max,
            )
            if config.vllm_importance_sampling_correction:
                adv = adv * weights
            old = proximal
        else:
            # The sampler/trainer mismatch, as the TRL path logs it with a bf16 sampler. No weight is added: the
            # loss's ratio is already taken against the sampler's log-probs (the service's semantics).
            _, mismatch = sampler_correction(proximal, old, mask)
        per_token, loss_metrics = policy_loss(config.loss_type, new, old, adv, mask, clip_low, clip_high)
        if config.loss_aggregation == "sum":
            loss = (per_token * mask).sum()
        else:
            loss = token_level_mean(per_token, mask)
        metrics = {k: float(v) for k, v in loss_metrics.items()}
        metrics["loss"] = float(loss.detach())
        metrics.update({k: float(v) for k, v in mismatch.items()})
        metrics.update(extra)
        record.update(metrics)
        return loss, metrics

    return loss_fn


def builtin_loss_config(config: PyTrioGRPOConfig) -> dict | None:
    """``loss_fn_config`` for the service's built-in losses (Tinker's key names for the ratio bounds)."""
    return wire_loss_config(config.loss_type, *config.clip_bounds)


def local_loss_metrics(config: PyTrioGRPOConfig, rows: TokenRows, new_logprobs) -> dict:
    """Loss and ratio metrics recomputed with `trl_grpo_ext.grpo.losses` from the logprobs the trainer returned, so a
    built-in loss reports the same numbers a custom one does."""
    import torch

    record: dict = {}
    fn = make_custom_loss(config, rows, record)
    with torch.no_grad():
        fn(None, [torch.tensor(lp, dtype=torch.float32) for lp in new_logprobs])
    return record


def builtin_loss_metrics(config: PyTrioGRPOConfig, batch: TrainBatch, fb_out) -> dict:
    """Loss metrics of a built-in loss: recomputed locally from the logprobs ``forward_backward`` returned (so
    they match a custom loss's), else the service's ``loss_mean``, else none."""
    record: dict = {}
    outputs = getattr(fb_out, "loss_fn_outputs", None) or []
    if len(outputs) == len(batch.datums) and all("logprobs" in o for o in outputs):
        new_logprobs = [list(o["logprobs"].data) for o in outputs]
        if all(len(lp) == len(m) for lp, m in zip(new_logprobs, batch.token_rows.masks, strict=True)):
            record = local_loss_metrics(config, batch.token_rows, new_logprobs)
    if "loss" not in record:
        server_loss = (getattr(fb_out, "metrics", None) or {}).get("loss_mean")
        if server_loss is not None:
            record["loss"] = float(server_loss)
    return record
