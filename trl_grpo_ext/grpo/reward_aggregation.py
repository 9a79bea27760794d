"""Reward aggregation of TRL 1.16's GRPO, in one place for both execution paths.

The TRL path lets `trl.GRPOTrainer._calculate_rewards` call the reward functions and
``_generate_and_score_completions`` log the reward metrics; `trl_grpo_ext.trl.trainer` needs only the weighted total
(`weighted_rewards`, for the degenerate-group rule). The PyTRIO loop has no trainer to do any of this, so it calls
the functions here (with TRL's columns and ``log_metric``; TRL's ``trainer_state`` / ``log_extra`` / environments
have no counterpart there), which mirror those two TRL 1.16 methods line by line (``multi_objective_aggregation=
"sum_then_normalize"``, TRL's default): both paths' ``reward``, ``reward_std``, ``rewards/<name>/mean|std`` and
``frac_reward_zero_std`` are the same numbers for the same rewards (tests/test_reward_aggregation.py checks them
against a real `trl.GRPOTrainer`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading

import torch

from trl_grpo_ext.grpo.losses import nanstd

# Keys of a training row that TRL 1.16's `_calculate_rewards` does not forward as reward keyword arguments.
NOT_REWARD_KWARGS = ("prompt", "completion", "completion_ids")


class RewardFunctionError(ValueError):
    """A reward function failed or returned something that is not one reward per completion."""


# Copies of three small `trl.trainer.utils` helpers of TRL 1.16.0 (`get_callable_name`, `is_async_callable`,
# `start_event_loop_in_daemon`), so that this core does not import TRL (the PyTRIO path runs without it); checked
# against TRL's source with the other copies (`trl_grpo_ext.trl.internals.MIRRORED_ELSEWHERE`).
def reward_func_name(func) -> str:
    """The name TRL 1.16's `GRPOTrainer.__init__` gives a reward callable (`trl.trainer.utils.get_callable_name`):
    the ``<name>`` of the ``rewards/<name>/mean`` metrics: a `functools.partial` is unwrapped to its function, a
    callable instance falls back to its class name."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def is_async_callable(func) -> bool:
    """Whether calling `func` returns a coroutine (`trl.trainer.utils.is_async_callable`): a coroutine function, a
    `functools.partial` of one, or an instance whose ``__call__`` is one."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(func.__call__)


def start_event_loop_in_daemon(name: str | None = None):
    """A new event loop running in a daemon thread (`trl.trainer.utils.start_event_loop_in_daemon`):
    ``(thread, loop, ready)``, `ready` set once the loop runs in the thread."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run_loop():
        asyncio.set_event_loop(loop)
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run_loop, name=name, daemon=True)
    thread.start()
    return thread, loop, ready


def reward_weight_tensor(weights, num_funcs: int) -> torch.Tensor:
    """TRL 1.16's ``self.reward_weights``: float32 ``reward_weights``, all ones when None."""
    if weights is None:
        return torch.ones(num_funcs, dtype=torch.float32)
    if len(weights) != num_funcs:
        raise ValueError(f"{len(weights)} reward weights for {num_funcs} reward functions")
    return torch.tensor(weights, dtype=torch.float32)


class RewardMetricLog:
    """TRL 1.16's ``log_metric`` reward keyword argument for a path without a trainer: a reward function calls
    ``log_metric(name, value)`` (`hybrid` logs its components and vetoes); `metrics` gives each name's mean over
    the batch as ``_generate_and_score_completions`` flushes ``_pending_metrics`` (float32 sum and count)."""

    def __init__(self):
        self._values: dict[str, list[float]] = {}

    def __call__(self, name: str, value: float) -> None:
        self._values.setdefault(name, []).append(value)

    def metrics(self) -> dict[str, float]:
        out = {}
        for name in sorted(self._values):
            values = self._values[name]
            total, count = torch.tensor([sum(values), len(values)], dtype=torch.float32).tolist()
            out[name] = total / count
        return out


def reward_kwargs(inputs: list[dict]) -> dict[str, list]:
    """The dataset columns as reward keyword arguments, as TRL 1.16's `_calculate_rewards` builds them from its
    per-completion ``inputs``: every key of the first row except ``prompt`` / ``completion`` / ``completion_ids``."""
    keys = [key for key in inputs[0] if key not in NOT_REWARD_KWARGS]
    return {key: [example.get(key) for example in inputs] for key in keys}


_ASYNC_LOOP = None  # (thread, loop): the daemon event loop of async rewards, started on first use as TRL starts its


def _async_loop():
    """The event loop async reward functions run on: one daemon loop per process, started as TRL 1.16's trainer
    starts its own (`trl.trainer.utils.start_event_loop_in_daemon`), so clients bound to a loop (the judge's) live
    across steps."""
    global _ASYNC_LOOP
    if _ASYNC_LOOP is None:
        thread, loop, ready = start_event_loop_in_daemon(name="trl_grpo_ext-async-rewards")
        ready.wait()
        _ASYNC_LOOP = (thread, loop)
    return _ASYNC_LOOP[1]


def _checked_output(output, name: str, n: int) -> list:
    output = [torch.nan if reward is None else reward for reward in (output if output is not None else [])]
    if len(output) != n:
        raise RewardFunctionError(f"reward function {name!r} returned {len(output)} rewards for {n} completions")
    return output


def _column(rewards_per_func, i: int, output, name: str) -> None:
    try:
        rewards_per_func[:, i] = torch.tensor(output, dtype=torch.float32)
    except (TypeError, ValueError):
        raise RewardFunctionError(f"reward function {name!r} returned a non-number among {output[:4]!r}") from None


def _failure(name: str, error: Exception) -> RewardFunctionError:
    return RewardFunctionError(f"reward function {name!r} failed: {type(error).__name__}: {error}")


def score_completions(reward_funcs, names, prompts, completions, completion_ids, kwargs) -> torch.Tensor:
    """``rewards_per_func`` (N, K) float32 as TRL 1.16's `_calculate_rewards` computes it: synchronous functions in
    order, then the async ones (an LLM judge) concurrently on one event loop (``asyncio.gather``); ``None`` -> NaN.
    A function that raises or returns the wrong number of values raises `RewardFunctionError`."""
    n = len(prompts)
    rewards_per_func = torch.zeros(n, len(reward_funcs))
    call = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    pending = []
    for i, (func, name) in enumerate(zip(reward_funcs, names, strict=True)):
        if is_async_callable(func):
            pending.append((i, func, name))
            continue
        try:
            output = func(**call)
        except Exception as error:  # noqa: BLE001 - name the function, keep the message
            raise _failure(name, error) from None
        _column(rewards_per_func, i, _checked_output(output, name, n), name)
    if pending:

        async def run_all():
            return await asyncio.gather(*(func(**call) for _, func, _ in pending), return_exceptions=True)

        outputs = asyncio.run_coroutine_threadsafe(run_all(), _async_loop()).result()
        for (i, _, name), output in zip(pending, outputs, strict=True):
            if isinstance(output, BaseException):
                raise _failure(name, output) from None
            _column(rewards_per_func, i, _checked_output(output, name, n), name)
    return rewards_per_func


def weighted_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Total reward per completion (N,): TRL 1.16 ``_generate_and_score_completions``' weighted NaN-sum; a row
    that every function left unscored (all NaN) is NaN, not 0, so it stays out of baselines and statistics."""
    rewards = (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards


def frac_reward_zero_std(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> float:
    """TRL 1.16's ``frac_reward_zero_std``: the share of completions whose reward std (the group's for ``group`` /
    ``none``, the batch's for ``batch``) is close to 0. A NaN std (fewer than two scored rewards) is not zero."""
    if scale_rewards in ("group", "none"):
        if num_generations > 1:
            std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
        else:
            std = torch.zeros_like(rewards)
    elif scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    return torch.isclose(std, torch.zeros_like(std)).float().mean().item()


def reward_metrics(rewards_per_func: torch.Tensor, rewards: torch.Tensor, names) -> dict[str, float]:
    """TRL 1.16's logged reward statistics: ``rewards/<name>/mean`` and ``/std`` per function over its scored
    completions, ``reward`` / ``reward_std`` over the scorable totals (`weighted_rewards`)."""
    metrics = {}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        metrics[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
    metrics["reward"] = torch.nanmean(rewards).item()
    metrics["reward_std"] = nanstd(rewards).item()
    return metrics
