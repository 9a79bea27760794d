"""The asynchronous look-ahead both execution paths share: batches drawn ahead of the step that trains them.

A path decides which generation batches to request when (`trl_grpo_ext.grpo.async_sampling.steps_to_request`) and
supplies a `BatchSampler`: how one batch is sent to its sampler and collected. `Lookahead` holds everything else:

- the batches, keyed by ``(step, slot)``: the optimizer step that first trains a batch and its place among that
  step's generation batches (the TRL path draws several per step when ``steps_per_generation`` is below
  ``gradient_accumulation_steps``; the PyTRIO path one);
- the staleness check when a batch is taken: one drawn by weights older than ``max_staleness`` (only possible where
  the bound changed under it: a run resumed with a smaller bound, or without asynchronous sampling) is dropped,
  counted and drawn again with the current weights (`take`);
- the checkpoint schema of the batches drawn ahead (`saved`, `restored`): plain JSON, the same on both paths, typed
  when read back, so a resumed run trains what an uninterrupted one would;
- the per-step metrics (`AsyncStepStats`): staleness of what trained, drops, the trainer's waits, and the sampler's
  busy time (`record_busy`, from whichever thread sees a batch finish).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from trl_grpo_ext.grpo.async_sampling import AsyncStepStats, close_step, too_stale

logger = logging.getLogger(__name__)

SAVED_FORMAT = 2  # the layout of `Lookahead.saved`


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its prompt, tokens, the sampler's log-prob of each token (the behaviour policy) and
    why it stopped (the PyTRIO service says; "" where the sampler does not)."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    stop_reason: str = ""


@dataclass
class DrawnBatch:
    """A generation batch requested from the sampler: drawn by weights of ``version`` with ``seed`` for ``step``
    (``slot`` among the step's batches). ``prompt_ids`` has one prompt per completion; ``rows`` holds the data rows
    (the PyTRIO path scores them; the TRL path reads its rows from its data loader). ``completions`` once collected
    (or restored from a checkpoint); ``handle`` what the sampler returned for it until then."""

    step: int
    slot: int
    version: int
    seed: int
    prompt_ids: tuple[tuple[int, ...], ...]
    rows: list[dict] | None = None
    completions: list[Completion] | None = None
    handle: object = None
    submitted: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> tuple[int, int]:
        return (self.step, self.slot)

    def what(self) -> str:
        return f"the batch of step {self.step + 1} (weights of version {self.version})"


class BatchSampler(Protocol):
    """What a path supplies: how a batch reaches its sampler, and how its completions come back."""

    def submit(self, batch: DrawnBatch, now: bool = False) -> object:
        """Send `batch` (its prompts, seed and version) to the sampler; returns the handle `collect` takes. `now`:
        the trainer is waiting for it (drawn before the batches requested ahead, where the sampler can choose)."""

    def collect(self, handle) -> list[Completion]:
        """The batch's completions (waiting for them); raises with one line if the sampler failed or hung."""


class Lookahead:
    """The batches requested ahead, by ``(step, slot)`` (module docstring). ``max_staleness``: the bound `take`
    checks (0 for a run that samples on-policy). ``saved``: a resumed run's batches (`saved`'s output)."""

    def __init__(self, sampler: BatchSampler, max_staleness: int, saved: Iterable[dict] = ()):
        self.sampler = sampler
        self.max_staleness = max_staleness
        self.batches: dict[tuple[int, int], DrawnBatch] = {}
        for data in saved:
            batch = restored(data)
            self.batches[batch.key] = batch
        self.stats = AsyncStepStats()
        self._busy: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ requests
    def request(
        self, step: int, slot: int, version: int, seed: int, prompt_ids, rows: list[dict] | None = None
    ) -> DrawnBatch:
        """Request the batch of ``(step, slot)`` from the weights of `version`, or keep the one a checkpoint saved
        for it when it holds the same prompts (a resumed run trains what the interrupted one drew)."""
        prompt_ids = tuple(tuple(int(t) for t in p) for p in prompt_ids)
        kept = self.batches.get((step, slot))
        if kept is not None and kept.completions is not None and kept.handle is None:
            if kept.prompt_ids == prompt_ids:
                return kept
            logger.warning(
                "async sampling: the batch saved for step %d has other prompts; sampling it again", step + 1
            )
        batch = DrawnBatch(step, slot, version, seed, prompt_ids, rows)
        batch.handle = self.sampler.submit(batch)
        self.batches[batch.key] = batch
        return batch

    def requested(self, step: int, slot: int = 0) -> bool:
        return (step, slot) in self.batches

    def draw_now(self, step: int, version: int, seed: int, prompt_ids, rows: list[dict] | None = None) -> DrawnBatch:
        """A batch drawn on demand with the current weights (dynamic sampling's extra rounds), waited for; not kept."""
        batch = DrawnBatch(step, -1, version, seed, tuple(tuple(int(t) for t in p) for p in prompt_ids), rows)
        batch.handle = self.sampler.submit(batch, now=True)
        self._collect(batch)
        return batch

    def take(self, step: int, version: int, slot: int = 0) -> DrawnBatch:
        """The batch of ``(step, slot)`` with its completions (waiting for them: the trainer's wait). One drawn by
        weights more than ``max_staleness`` older than `version` is dropped, counted and drawn again now."""
        batch = self.batches.pop((step, slot), None)
        if batch is None:
            raise KeyError(f"async sampling: no batch was requested for step {step + 1}")
        if too_stale(batch.version, version, self.max_staleness):
            self.stats.dropped += len(batch.prompt_ids)
            logger.warning(
                "async sampling: dropped %s, %d steps older than the policy (max_staleness %d); sampling it again",
                batch.what(),
                version - batch.version,
                self.max_staleness,
            )
            self._discard(batch)
            batch = DrawnBatch(step, slot, version, batch.seed, batch.prompt_ids, batch.rows)
            batch.handle = self.sampler.submit(batch, now=True)
        self._collect(batch)
        return batch

    def discard_before(self, step: int) -> None:
        """Let go of the batches of steps before `step`, which no step will take any more (a resumed run's saved
        batch whose generation window starts elsewhere now); one still being drawn is waited for first."""
        for key in [key for key in self.batches if key[0] < step]:
            batch = self.batches.pop(key)
            logger.warning("async sampling: %s was not trained (no step took it); let go", batch.what())
            self._discard(batch)

    def _collect(self, batch: DrawnBatch) -> None:
        if batch.completions is None:
            t0 = time.monotonic()
            batch.completions = self.sampler.collect(batch.handle)
            self.stats.trainer_wait_s += time.monotonic() - t0
            batch.handle = None
            if len(batch.completions) != len(batch.prompt_ids):
                raise ValueError(
                    f"async sampling: {len(batch.completions)} completions for {len(batch.prompt_ids)} prompts in "
                    f"{batch.what()}"
                )

    def _discard(self, batch: DrawnBatch) -> None:
        """A dropped batch still being drawn: its result is collected and thrown away (the sampler answers in
        order)."""
        if batch.handle is not None:
            self.sampler.collect(batch.handle)
            batch.handle = None

    # ------------------------------------------------------------------ metrics
    def trained(self, batch_version: int, trainer_version: int, samples: int) -> None:
        """`samples` completions drawn by `batch_version` trained the weights of `trainer_version`."""
        self.stats.trained(batch_version, trainer_version, samples)

    def record_busy(self, started: float, finished: float) -> None:
        """The sampler drew a batch between these ``time.monotonic()`` readings (any thread may say so)."""
        with self._lock:
            self._busy.append((started, finished))

    def step_metrics(self, step_started: float, weight_sync_s: float = 0.0, now: float | None = None) -> dict:
        """The step's `AsyncStepStats` row; the stats start again for the next step. The sampler waited whenever it
        was not drawing nor taking weights: the schedule requests a batch only once its weights exist."""
        now = time.monotonic() if now is None else now
        stats, self.stats = self.stats, AsyncStepStats()
        with self._lock:
            stats.sampler_busy_s, self._busy = close_step(self._busy, step_started, now)
        stats.weight_sync_s += weight_sync_s
        stats.sampler_wait_s = max(0.0, now - step_started - stats.sampler_busy_s - stats.weight_sync_s)
        return stats.metrics(now - step_started)

    # ------------------------------------------------------------------ checkpoints
    def saved(self) -> list[dict]:
        """Every batch requested ahead, collected (waited for) and as plain JSON, in step order."""
        out = []
        for key in sorted(self.batches):
            batch = self.batches[key]
            self._collect(batch)
            data = {
                "step": batch.step,
                "slot": batch.slot,
                "version": batch.version,
                "seed": batch.seed,
                "completions": [
                    {
                        "prompt_ids": list(c.prompt_ids),
                        "completion_ids": list(c.completion_ids),
                        "logprobs": [_json_float(x) for x in c.logprobs],
                        "stop_reason": c.stop_reason,
                    }
                    for c in batch.completions
                ],
            }
            if batch.rows is not None:
                data["rows"] = batch.rows
            out.append(data)
        return out


def _json_float(value: float | None):
    """A log-prob as JSON has it: NaN or None (a sampler may return either) as null."""
    return None if value is None or math.isnan(value) else value


def _int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0")
    return value


def restored(data: dict) -> DrawnBatch:
    """A saved batch (`Lookahead.saved`), typed before anything trains on it (a checkpoint is a file: nothing in it
    runs); a malformed one raises ValueError saying what is wrong."""
    if not isinstance(data, dict):
        raise ValueError("a saved batch must be a mapping")
    try:
        step, slot, version, seed = (_int(data[k], k) for k in ("step", "slot", "version", "seed"))
        rows = data.get("rows")
        if rows is not None and (not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows)):
            raise ValueError("rows must be a list of mappings")
        completions = []
        for c in data["completions"]:
            ids, logprobs = c["completion_ids"], c["logprobs"]
            if not (isinstance(ids, list) and isinstance(logprobs, list) and len(ids) == len(logprobs)):
                raise ValueError("each completion needs its token ids and one log-prob per token")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in [*ids, *c["prompt_ids"]]):
                raise ValueError("token ids must be integers")
            completions.append(
                Completion(
                    tuple(c["prompt_ids"]),
                    tuple(ids),
                    tuple(float("nan") if x is None else float(x) for x in logprobs),
                    str(c.get("stop_reason", "")),
                )
            )
    except (KeyError, TypeError) as error:
        raise ValueError(f"malformed saved batch ({type(error).__name__}: {error})") from None
    prompt_ids = tuple(c.prompt_ids for c in completions)
    return DrawnBatch(step, slot, version, seed, prompt_ids, rows, completions)
