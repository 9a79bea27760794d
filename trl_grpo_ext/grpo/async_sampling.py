"""Asynchronous sampling, the part both execution paths share: which policy version draws each batch, the staleness
bound, the objective's settings and the per-step metrics.

Vocabulary (TRL 1.16's experimental ``AsyncGRPOTrainer``'s): a policy *version* counts the optimizer steps the
weights have taken (version 0: the model as loaded; step ``s`` trains version ``s`` into ``s + 1``). A batch drawn by
version ``v`` and trained at step ``s`` has *staleness* ``s - v``.

Two settings: ``sample_ahead`` (N) says how far ahead the sampler draws, ``max_staleness`` (K) bounds the staleness
of every sample at every step that trains it. When version ``v`` becomes current, the batches of the steps up to
``v + N`` are requested (`steps_to_request`), each drawn with version ``v``: step ``s``'s batch is drawn by version
``s - N`` while step ``s - N`` trains. A batch trained over several optimizer steps (``num_iterations > 1``, or
``steps_per_generation`` above the accumulation steps) grows one step staler at each, so ``N + steps - 1 <= K``
(`staleness_span_problems`). The schedule is a function of the step, never of timing: a slow sampler makes the
trainer wait (logged), a slow trainer makes the sampler wait for weights (logged); neither changes which weights draw
which batch, so a seeded run samples, scores and trains the same whatever the speed of either side. A batch older
than K (`too_stale`) arises only where the bound changed under it (a run resumed with a smaller ``max_staleness``);
it is dropped, counted and sampled again with the current weights (`trl_grpo_ext.grpo.lookahead`).

The objective (``async_objective``): ``decoupled`` (default) takes each loss's ratio and clip against the proximal
policy (the weights at the start of the step) and weighs the tokens by the behaviour ratio proximal/sampler, truncated
or masked by the ``vllm_importance_sampling_*`` settings (`trl_grpo_ext.grpo.losses.sampler_correction`);
``coupled`` takes the loss's ratio against the sampler's log-probs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

# Per-step metrics of an asynchronous run (both paths; TRL's async trainer's names where it has one).
STALENESS_MEAN = "sample/staleness_mean"  # mean staleness of the step's samples
STALENESS_MAX = "sample/staleness_max"
DROPPED_STALE = "sample/dropped_stale_total"  # samples dropped as older than max_staleness
TRAINER_WAIT = "perf/rollout_wait_s"  # seconds the trainer waited for samples
# seconds the sampler waited for the weights its next batch needs (had nothing it may draw yet)
SAMPLER_WAIT = "rollout/weight_wait_s"
WEIGHT_SYNC = "perf/weight_sync_s"  # seconds spent handing weights to the sampler
OVERLAP = "perf/overlap_frac"  # share of the step's wall time the sampler sampled while the trainer trained
ASYNC_METRIC_KEYS = (STALENESS_MEAN, STALENESS_MAX, DROPPED_STALE, TRAINER_WAIT, SAMPLER_WAIT, WEIGHT_SYNC, OVERLAP)
# The importance ratio exp(trainer - sampler) of the step's tokens, by the staleness of their batch (`losses`)
IS_RATIO_BY_STALENESS = "sample/is_ratio/staleness_{}"


ASYNC_OBJECTIVES = ("decoupled", "coupled")
# TRL 1.16's importance-sampling modes for a sampler whose log-probs are not the trainer's (vLLM there; the bf16
# sampler, and the behaviour weight of the decoupled objective, here): `token_*` weigh each token, `sequence_*` a
# whole completion; `*_truncate` caps the ratio, `*_mask` zeroes weights outside [clip_min, clip_max].
SAMPLER_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def last_step_to_request(version: int, sample_ahead: int, max_steps: int | None) -> int:
    """The last step whose batch `version` may draw: ``version + sample_ahead``, below `max_steps` (None: no end)."""
    last = version + sample_ahead
    return last if max_steps is None else min(last, max_steps - 1)


def steps_to_request(version: int, sample_ahead: int, requested_through: int, max_steps: int | None) -> range:
    """The steps whose batches may be requested once `version` is current and the batches of steps up to
    `requested_through` (-1: none) have been (`last_step_to_request`)."""
    return range(requested_through + 1, last_step_to_request(version, sample_ahead, max_steps) + 1)


def too_stale(batch_version: int, trainer_version: int, max_staleness: int) -> bool:
    """Whether a batch drawn by `batch_version` may not train the weights of `trainer_version`."""
    return trainer_version - batch_version > max_staleness


def busy_within(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of the (start, end) `intervals` that fall inside [start, end]."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)


def close_step(intervals: list[tuple[float, float]], start: float, end: float) -> tuple[float, list]:
    """A step's end on either path: (`busy_within` the step, the intervals still running at `end`, which later steps
    may still overlap; the rest are forgotten)."""
    return busy_within(intervals, start, end), [(a, b) for a, b in intervals if b > end]


@dataclass
class AsyncStepStats:
    """One optimizer step's asynchronous bookkeeping; `metrics` turns it into the `ASYNC_METRIC_KEYS` row."""

    staleness: list[int] = field(default_factory=list)  # one entry per trained sample
    dropped: int = 0
    trainer_wait_s: float = 0.0
    sampler_wait_s: float = 0.0
    weight_sync_s: float = 0.0
    sampler_busy_s: float = 0.0  # the sampler's sampling time inside the step's wall-clock window

    def trained(self, batch_version: int, trainer_version: int, samples: int) -> None:
        self.staleness += [trainer_version - batch_version] * samples

    def metrics(self, step_wall_s: float) -> dict[str, float]:
        """The row: staleness mean and max, drops, waits, hand-over time and the overlap fraction
        (``(sampler busy - trainer wait) / step wall time``, in [0, 1]: while the trainer waits for the sampler
        nothing overlaps)."""
        overlap = 0.0
        if step_wall_s > 0 and math.isfinite(step_wall_s):
            overlap = min(1.0, max(0.0, self.sampler_busy_s - self.trainer_wait_s) / step_wall_s)
        staleness = self.staleness or [0]
        return {
            STALENESS_MEAN: sum(staleness) / len(staleness),
            STALENESS_MAX: float(max(staleness)),
            DROPPED_STALE: float(self.dropped),
            TRAINER_WAIT: self.trainer_wait_s,
            SAMPLER_WAIT: self.sampler_wait_s,
            WEIGHT_SYNC: self.weight_sync_s,
            OVERLAP: overlap,
        }


def asynchronous(config) -> bool:
    """Whether `config` (either path's) samples asynchronously: ``async_sampling`` with ``max_staleness`` >= 1 (0 is
    on-policy)."""
    return bool(getattr(config, "async_sampling", False)) and getattr(config, "max_staleness", 0) > 0


def decoupled(config) -> bool:
    """Asynchronous sampling with the decoupled objective (module docstring), on either path."""
    return asynchronous(config) and getattr(config, "async_objective", "decoupled") == "decoupled"


def sampling_mode(config) -> str:
    """``on-policy`` or ``asynchronous, sample_ahead N, max_staleness K, <objective>``: what both paths say at start
    and run_summary.json keeps."""
    if not asynchronous(config):
        return "on-policy"
    return (
        f"asynchronous, sample_ahead {config.sample_ahead}, max_staleness {config.max_staleness}, "
        f"{config.async_objective} objective"
    )


def staleness_span_problems(config, steps_per_batch: int) -> list[str]:
    """A batch trained over `steps_per_batch` optimizer steps is ``sample_ahead + steps_per_batch - 1`` steps stale
    at its last: more than ``max_staleness`` is refused (one line, naming what to change)."""
    if not asynchronous(config) or steps_per_batch <= 1:
        return []
    worst = config.sample_ahead + steps_per_batch - 1
    if worst <= config.max_staleness:
        return []
    return [
        f"max_staleness={config.max_staleness}: each generation batch trains {steps_per_batch} optimizer steps "
        f"(num_iterations x steps_per_generation / gradient_accumulation_steps), so drawn sample_ahead="
        f"{config.sample_ahead} steps ahead its last step trains it {worst} steps stale; set max_staleness >= {worst}"
    ]


def async_problems(config) -> list[str]:
    """Problems with the asynchronous-sampling settings of `config` (both paths), each starting with its key."""
    problems = []
    enabled = getattr(config, "async_sampling", False)
    if not isinstance(enabled, bool):
        problems.append(f"async_sampling={enabled!r} must be true or false")
    k = getattr(config, "max_staleness", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        problems.append(
            f"max_staleness={k!r} must be an integer >= 0 (optimizer steps a sample may lag the trained policy; "
            "0: on-policy)"
        )
    ahead = getattr(config, "sample_ahead", 1)
    if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1:
        problems.append(f"sample_ahead={ahead!r} must be an integer >= 1 (optimizer steps the sampler draws ahead)")
    elif enabled is True and isinstance(k, int) and 0 < k < ahead:
        problems.append(
            f"sample_ahead={ahead} exceeds max_staleness={k}: a batch drawn {ahead} steps ahead trains {ahead} steps "
            "stale; lower sample_ahead or raise max_staleness"
        )
    objective = getattr(config, "async_objective", "decoupled")
    if objective not in ASYNC_OBJECTIVES:
        problems.append(f"async_objective={objective!r} must be one of {', '.join(ASYNC_OBJECTIVES)}")
    timeout = getattr(config, "async_timeout_s", 600.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        problems.append(f"async_timeout_s={timeout!r} must be a number of seconds > 0")
    return problems


def sampler_correction_problems(config) -> list[str]:
    """Problems with the ``vllm_importance_sampling_*`` settings of `config` (TRL's rules, for both paths)."""
    problems = []
    mode = getattr(config, "vllm_importance_sampling_mode", "sequence_mask")
    if mode not in SAMPLER_CORRECTION_MODES:
        problems.append(f"vllm_importance_sampling_mode={mode!r} must be one of {', '.join(SAMPLER_CORRECTION_MODES)}")
    if not isinstance(getattr(config, "vllm_importance_sampling_correction", True), bool):
        problems.append("vllm_importance_sampling_correction must be true or false")
    low = getattr(config, "vllm_importance_sampling_clip_min", None)
    high = getattr(config, "vllm_importance_sampling_clip_max", 3.0)
    for name, value in (("clip_min", low), ("clip_max", high)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0):
            problems.append(f"vllm_importance_sampling_{name}={value!r} must be a number >= 0 or null")
            return problems
    if low is not None and high is not None and low >= high:
        problems.append(
            f"vllm_importance_sampling_clip_min ({low}) must be less than vllm_importance_sampling_clip_max ({high})"
        )
    if str(mode).endswith("truncate") and low is None and high is None:
        problems.append(f"vllm_importance_sampling_mode={mode}: set vllm_importance_sampling_clip_min or _clip_max")
    return problems
