"""The step phase: ``forward_backward`` with the service's built-in loss, or ``forward_backward_custom`` with the
local one (`trl_grpo_ext.pytrio.loss`), then ``optim_step(AdamParams(...))``; both waited for, their metrics
returned."""

from __future__ import annotations

import time

from trl_grpo_ext.pytrio.calls import call, wait
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.loss import builtin_loss_config, builtin_loss_metrics, make_custom_loss
from trl_grpo_ext.pytrio.types import StepTimes, TrainBatch


def adam_params(config: PyTrioGRPOConfig, learning_rate: float):
    """The optimizer settings of one step (``learning_rate``: the schedule's value at this step)."""
    import pytrio as trio

    c = config
    return trio.AdamParams(
        learning_rate=learning_rate,
        beta1=c.adam_beta1,
        beta2=c.adam_beta2,
        eps=c.adam_epsilon,
        weight_decay=c.weight_decay,
        grad_clip_norm=c.max_grad_norm,
    )


def optimizer_step(
    config: PyTrioGRPOConfig, training_client, batch: TrainBatch, learning_rate: float, times: StepTimes
) -> tuple[dict, dict]:
    """``forward_backward`` (built-in loss) or ``forward_backward_custom``, then ``optim_step``; returns
    ``(loss metrics, optim_step metrics)``."""
    c = config
    adam = adam_params(c, learning_rate)
    loss_record: dict = {}
    t0 = time.perf_counter()
    if c.uses_builtin_loss:
        fb_future = call(
            training_client.forward_backward,
            "forward_backward",
            batch.datums,
            c.loss_type,
            loss_fn_config=builtin_loss_config(c),
        )
    else:
        fb_future = call(
            training_client.forward_backward_custom,
            "forward_backward_custom",
            batch.datums,
            make_custom_loss(c, batch.token_rows, loss_record),
        )
    # async: optim_step is queued right behind forward_backward, so the trainer applies it as soon as the
    # gradients are in; sync: submitted once forward_backward has answered
    optim_future = call(training_client.optim_step, "optim_step", adam) if c.mode == "async" else None
    fb_out = wait(fb_future, "forward_backward", c.request_timeout_s)
    times.forward_backward = time.perf_counter() - t0
    t1 = time.perf_counter()
    if optim_future is None:
        optim_future = call(training_client.optim_step, "optim_step", adam)
    optim_out = wait(optim_future, "optim_step", c.request_timeout_s)
    times.optim_step = time.perf_counter() - t1
    if c.uses_builtin_loss:
        loss_record = builtin_loss_metrics(c, batch, fb_out)
    return loss_record, getattr(optim_out, "metrics", None) or {}
