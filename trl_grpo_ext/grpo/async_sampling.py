"""Asynchronous sampling, the part both execution paths share: which policy version draws each batch, the staleness
bound, and the per-step metrics.

Vocabulary (TRL 1.16's experimental ``AsyncGRPOTrainer``'s): a policy *version* counts the optimizer steps the
weights have taken (version 0: the model as loaded; step ``s`` trains version ``s`` into ``s + 1``). A batch drawn by
version ``v`` and trained at step ``s`` has *staleness* ``s - v``. ``max_staleness`` (K) bounds it: 0 is on-policy
(the synchronous path itself), K >= 1 lets the sampler draw step ``s + K``'s batch with version ``s`` while step
``s`` trains, and the loss corrects the gap with the sampler's own log-probs as the behaviour policy.

The schedule is a function of the step, never of timing (`steps_to_request`): when version ``v`` becomes current,
the batches of the steps up to ``v + K`` are requested, each drawn with the version current at its request. A slow
sampler makes the trainer wait (logged), a slow trainer makes the sampler wait for weights (logged); neither changes
which weights draw which batch, so a seeded run samples, scores and trains the same whatever the speed of either
side. TRL's ``AsyncGRPOTrainer`` lets the clock decide and drops what it made too stale; here a batch older than K
(`too_stale`) is dropped and counted only where the schedule changed under it (a run resumed with a smaller
``max_staleness``), and its step samples again on-policy.
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


def last_step_to_request(version: int, max_staleness: int, max_steps: int | None) -> int:
    """The last step whose batch `version` may draw: ``version + max_staleness``, below `max_steps` (None: no end)."""
    last = version + max_staleness
    return last if max_steps is None else min(last, max_steps - 1)


def steps_to_request(version: int, max_staleness: int, requested_through: int, max_steps: int | None) -> range:
    """The steps whose batches may be requested once `version` is current and the batches of steps up to
    `requested_through` (-1: none) have been (`last_step_to_request`)."""
    return range(requested_through + 1, last_step_to_request(version, max_staleness, max_steps) + 1)


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


def sampling_mode(config) -> str:
    """``on-policy`` or ``asynchronous, max_staleness K``: what both paths say at start and run_summary.json keeps."""
    return f"asynchronous, max_staleness {config.max_staleness}" if asynchronous(config) else "on-policy"


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
    timeout = getattr(config, "async_timeout_s", 600.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        problems.append(f"async_timeout_s={timeout!r} must be a number of seconds > 0")
    return problems
