"""The PyTRIO path's asynchronous sampling: the batches of the next steps in flight while a step trains.

With ``async_sampling: true`` and ``max_staleness: K >= 1`` (the rules both paths share:
`trl_grpo_ext.grpo.async_sampling`), each step starts as on-policy does, with a sampler made from the current
weights (``save_weights_and_get_sampling_client``: version ``v``, the optimizer steps done); then every step up to
``v + K`` whose batch was not requested yet takes its prompts from the stream and has them submitted to that sampler
(`SampleAhead.request`), so the service samples step ``v + 1``... while ``forward_backward`` / ``optim_step`` of step
``v`` run, as tinker-cookbook's off-policy streaming does. The step then trains the batch requested for it K steps
earlier (`SampleAhead.take`), drawn with the same seeds as on-policy but older weights; the loss's ratio is taken
against the log-probs of the sampler that drew it, as every PyTRIO loss already does.

Checkpoints keep the batches drawn ahead (prompt rows and completions, plain JSON in the loop state, `saved`), so a
resumed run trains what an uninterrupted one would; a batch older than the resumed run's bound is dropped, counted
and drawn again from the current sampler. The per-step metrics are the TRL path's (`AsyncStepStats`), measured from
the client: a batch's sampling time runs from its requests to their last answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from trl_grpo_ext.grpo.async_sampling import AsyncStepStats, asynchronous, close_step, steps_to_request, too_stale
from trl_grpo_ext.pytrio.calls import PyTrioLoopError
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.sampling import PendingSamples, collect_samples, submit_samples
from trl_grpo_ext.pytrio.types import Rollout


@dataclass
class DrawnBatch:
    """A step's first round of prompts, requested ahead from the sampler of ``version``; ``rollouts`` once
    collected (or restored from a checkpoint)."""

    step: int
    version: int
    rows: list[dict]
    pending: PendingSamples | None = None
    rollouts: list[Rollout] | None = None
    submitted: float = 0.0  # time.monotonic() of its requests
    answered: list[float] = field(default_factory=list)  # when each request was answered (the client's view)


class SampleAhead:
    """The steps' batches requested ahead, by step (module docstring). ``saved``: a resumed run's `saved` list."""

    def __init__(self, config: PyTrioGRPOConfig, prompts, tool_turns=None, start: int = 0, saved=()):
        self.config = config
        self.prompts = prompts  # row -> prompt tokens (`prompts.PromptTokens`)
        self.tool_turns = tool_turns
        self.batches: dict[int, DrawnBatch] = {}
        for data in saved:
            batch = _restored(data)
            self.batches[batch.step] = batch
        self.requested_through = max([start - 1, *self.batches])
        self.stats = AsyncStepStats()
        self._busy: list[tuple[float, float]] = []  # the sampler's (first request, last answer) per batch

    def request(self, sampler, version: int, stream, max_steps: int) -> None:
        """Submit the batches `version` may draw: every step up to ``version + max_staleness`` not requested yet."""
        for step in steps_to_request(version, self.config.max_staleness, self.requested_through, max_steps):
            rows = stream.take(self.config.prompts_per_step)
            self.batches[step] = self._submit(sampler, version, step, rows)
            self.requested_through = step

    def _submit(self, sampler, version: int, step: int, rows: list[dict]) -> DrawnBatch:
        tokens = [self.prompts(row) for row in rows]
        pending = submit_samples(self.config, sampler, rows, tokens, step, 0, in_flight=True)
        batch = DrawnBatch(step, version, rows, pending, submitted=time.monotonic())
        for future in pending.futures:  # the answer times, for the sampler's busy time (a pytrio APIFuture wraps a
            inner = getattr(future, "_future", None)  # concurrent.futures.Future: its done-callback is public)
            if inner is not None:
                inner.add_done_callback(lambda _f, answered=batch.answered: answered.append(time.monotonic()))
        return batch

    def take(self, step: int, sampler, version: int) -> DrawnBatch:
        """Step `step`'s batch with its rollouts (waiting for them: the trainer's wait). One older than
        ``max_staleness`` (a resumed run's, saved under a larger bound) is dropped, counted and drawn again from
        `sampler`, the current weights."""
        batch = self.batches.pop(step, None)
        if batch is None:
            raise PyTrioLoopError(f"async sampling: no batch was requested for step {step + 1}")
        # on-policy (a run resumed without async_sampling from an asynchronous checkpoint): every kept batch is too old
        bound = self.config.max_staleness if asynchronous(self.config) else 0
        if too_stale(batch.version, version, bound):
            self.stats.dropped += len(batch.rows) * self.config.num_generations
            batch = self._submit(sampler, version, step, batch.rows)
        t0 = time.monotonic()
        self._collect(batch)
        self.stats.trainer_wait_s += time.monotonic() - t0
        self.stats.trained(batch.version, version, len(batch.rollouts))
        return batch

    def _collect(self, batch: DrawnBatch) -> None:
        if batch.rollouts is None:
            batch.rollouts = collect_samples(self.config, batch.pending, self.tool_turns)
            done = max(batch.answered, default=time.monotonic())
            self._busy.append((batch.submitted, done))
            batch.pending = None

    def step_metrics(self, step_started: float, weight_sync_s: float) -> dict[str, float]:
        """The step's `AsyncStepStats` row; the stats start again for the next step."""
        now = time.monotonic()
        stats, self.stats = self.stats, AsyncStepStats()
        for batch in self.batches.values():  # batches in flight whose answers are in: their busy time is known
            if batch.pending is not None and batch.answered and len(batch.answered) == len(batch.pending.futures):
                self._busy.append((batch.submitted, max(batch.answered)))
                batch.submitted = max(batch.answered)  # counted once
        stats.sampler_busy_s, self._busy = close_step(self._busy, step_started, now)
        stats.weight_sync_s = weight_sync_s
        stats.sampler_wait_s = max(0.0, now - step_started - stats.sampler_busy_s)
        return stats.metrics(now - step_started)

    def saved(self) -> list[dict]:
        """Every batch requested ahead, collected (waited for) and as plain JSON, for the loop state."""
        out = []
        for step in sorted(self.batches):
            batch = self.batches[step]
            self._collect(batch)
            out.append(
                {
                    "step": batch.step,
                    "version": batch.version,
                    "rows": batch.rows,
                    "rollouts": [_rollout_json(r) for r in batch.rollouts],
                }
            )
        return out


def _rollout_json(rollout: Rollout) -> dict:
    return {
        "prompt_tokens": list(rollout.prompt_tokens),
        "completion_tokens": list(rollout.completion_tokens),
        "completion_logprobs": list(rollout.completion_logprobs),
        "stop_reason": rollout.stop_reason,
    }


def _restored(data: dict) -> DrawnBatch:
    """A saved batch, checked (a loop state is a file: its values are typed before anything trains on them)."""
    try:
        step, version, rows = data["step"], data["version"], data["rows"]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, version)):
            raise ValueError("step and version must be integers >= 0")
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError("rows must be a list of mappings")
        rollouts = [
            Rollout(
                prompt_tokens=tuple(int(t) for t in r["prompt_tokens"]),
                completion_tokens=tuple(int(t) for t in r["completion_tokens"]),
                completion_logprobs=tuple(float(x) for x in r["completion_logprobs"]),
                stop_reason=str(r["stop_reason"]),
            )
            for r in data["rollouts"]
        ]
        if any(len(r.completion_logprobs) != len(r.completion_tokens) for r in rollouts):
            raise ValueError("a completion needs one log-prob per token")
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"a batch drawn ahead in the loop state is malformed ({error}); remove 'ahead' to resume"
        ) from None
    return DrawnBatch(step, version, rows, rollouts=rollouts)
