"""The PyTRIO path's asynchronous sampling: the batches of the next steps in flight while a step trains.

With ``async_sampling: true`` and ``max_staleness: K >= 1`` (the rules both paths share:
`trl_grpo_ext.grpo.async_sampling`), each step starts as on-policy does, with a sampler made from the current
weights (``save_weights_and_get_sampling_client``: version ``v``, the optimizer steps done); then every step up to
``v + sample_ahead`` whose batch was not requested yet takes its prompts from the stream and has them submitted to
that sampler (`SampleAhead.request`), so the service samples step ``v + 1``... while ``forward_backward`` /
``optim_step`` of step ``v`` run, as tinker-cookbook's off-policy streaming does. The step then trains the batch
requested for it earlier (`SampleAhead.take`), drawn with the same seeds as on-policy but older weights.

The batches, their staleness check and drop-and-redraw, the checkpoint schema (``ahead`` in the loop state) and the
per-step metrics are the look-ahead both paths share (`trl_grpo_ext.grpo.lookahead.Lookahead`); this module supplies
how a batch is submitted to the service and collected (`ServiceBatches`), and measures the sampler's busy time from
the client: a batch's, from its requests to their last answer.
"""

from __future__ import annotations

import threading
import time

from trl_grpo_ext.grpo.async_sampling import asynchronous, steps_to_request
from trl_grpo_ext.grpo.lookahead import Completion, DrawnBatch, Lookahead
from trl_grpo_ext.pytrio.calls import PyTrioLoopError
from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.sampling import PendingSamples, collect_samples, submit_samples
from trl_grpo_ext.pytrio.types import Rollout


class ServiceBatches:
    """The look-ahead's `BatchSampler` on the PyTRIO service: a batch's rows are submitted to the current sampler
    (the weights of its version) as on-policy rounds are, and collected into `Completion`s."""

    def __init__(self, config: PyTrioGRPOConfig, prompts, lookahead: Lookahead | None = None):
        self.config = config
        self.prompts = prompts  # row -> prompt tokens (`prompts.PromptTokens`)
        self.sampler = None  # the sampler of the current weights (`SampleAhead.request` sets it each step)
        self.lookahead = lookahead
        self._lock = threading.Lock()

    def submit(self, batch: DrawnBatch, now: bool = False) -> PendingSamples:
        tokens = [self.prompts(row) for row in batch.rows]
        pending = submit_samples(self.config, self.sampler, batch.rows, tokens, batch.step, 0, in_flight=True)
        submitted, answered = time.monotonic(), []

        def answer(_future):  # a pytrio APIFuture wraps a concurrent.futures.Future: its done-callback is public
            with self._lock:
                answered.append(time.monotonic())
                last = len(answered) == len(pending.futures)
            if last and self.lookahead is not None:
                self.lookahead.record_busy(submitted, max(answered))

        for future in pending.futures:
            inner = getattr(future, "_future", None)
            if inner is not None:
                inner.add_done_callback(answer)
        return pending

    def collect(self, pending: PendingSamples) -> list[Completion]:
        rollouts = collect_samples(self.config, pending)
        return [
            Completion(r.prompt_tokens, r.completion_tokens, r.completion_logprobs, r.stop_reason) for r in rollouts
        ]


class SampleAhead:
    """The steps' batches requested ahead (module docstring). ``saved``: a resumed run's ``ahead`` list."""

    def __init__(self, config: PyTrioGRPOConfig, prompts, start: int = 0, saved=()):
        self.config = config
        self.batches = ServiceBatches(config, prompts)
        # on-policy (a run resumed without async_sampling from an asynchronous checkpoint): every kept batch is too old
        bound = config.max_staleness if asynchronous(config) else 0
        try:
            self.lookahead = Lookahead(self.batches, bound, saved)
        except ValueError as error:
            message = f"a batch drawn ahead in the loop state is malformed ({error}); remove 'ahead' to resume"
            raise ValueError(message) from None
        self.batches.lookahead = self.lookahead
        self.requested_through = max([start - 1, *(step for step, _ in self.lookahead.batches)])

    def request(self, sampler, version: int, stream, max_steps: int) -> None:
        """Submit the batches `version` may draw: every step up to ``version + sample_ahead`` not requested yet."""
        self.batches.sampler = sampler
        for step in steps_to_request(version, self.config.sample_ahead, self.requested_through, max_steps):
            rows = stream.take(self.config.prompts_per_step)
            prompt_ids = [self.batches.prompts(row) for row in rows for _ in range(self.config.num_generations)]
            self.lookahead.request(step, 0, version, self.config.seed, prompt_ids, rows)
            self.requested_through = step

    def has(self, step: int) -> bool:
        return self.lookahead.requested(step)

    def take(self, step: int, sampler, version: int) -> tuple[list[dict], list[Rollout], int]:
        """Step `step`'s rows, their rollouts and the version that drew them (waiting for them: the trainer's wait).
        One older than ``max_staleness`` (a resumed run's, saved under a larger bound) is drawn again from `sampler`,
        the current weights."""
        self.batches.sampler = sampler
        try:
            batch = self.lookahead.take(step, version)
        except KeyError as error:
            raise PyTrioLoopError(str(error.args[0])) from None
        rollouts = [Rollout(c.prompt_ids, c.completion_ids, c.logprobs, c.stop_reason) for c in batch.completions]
        return batch.rows, rollouts, batch.version

    def step_metrics(self, step_started: float, weight_sync_s: float) -> dict[str, float]:
        """The step's `AsyncStepStats` row; the stats start again for the next step."""
        return self.lookahead.step_metrics(step_started, weight_sync_s)

    def saved(self) -> list[dict]:
        """Every batch requested ahead, collected (waited for) and as plain JSON, for the loop state."""
        return self.lookahead.saved()
