"""The asynchronous sampler of the TRL path: a thread that draws requested batches with the weights each names.

`RolloutWorker` takes `RolloutRequest`s in order (the trainer's look-ahead, `trl_grpo_ext.trl.async_sampling`), the
trainer's urgent ones (a batch it is waiting for now: dynamic sampling's extra rounds, a redraw) before those
requested ahead: for each it acquires the weights of the request's policy version
(`trl_grpo_ext.trl.weight_transfer`), draws the completions with a generator seeded by the request alone (so the
tokens do not depend on what any other thread draws meanwhile, nor on the order), says when it drew (``on_drawn``,
the look-ahead's busy time) and keeps the `RolloutResult` until the trainer takes it (`result`). On a CPU it runs on
its own cores with its own torch thread count (`trl_grpo_ext.cpu.threads.pin_this_thread`).

Failures: an exception in the sampler (its generate, the weight hand-over) is kept and raised in the trainer, with
its reason, when it next waits for a batch; a batch that does not come within ``timeout_s`` stops the run with a
line saying which step and version it was for; a wait longer than a tenth of that is logged as a stall while it
lasts. Nothing is trained from a request whose drawing failed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from trl_grpo_ext.cpu.threads import pin_this_thread
from trl_grpo_ext.trl.weight_transfer import WeightTransfer

logger = logging.getLogger(__name__)


class AsyncSamplerError(RuntimeError):
    """The asynchronous sampler failed, hung or fell too far behind; the message says which batch and why."""


@dataclass(frozen=True)
class RolloutRequest:
    seq: int  # the order of requests (one per generation batch)
    step: int | None  # the optimizer step the batch is meant for; None: drawn on demand (dynamic sampling, eval)
    version: int  # the policy version that must draw it
    prompt_ids: tuple[tuple[int, ...], ...]
    seed: int  # seeds the draws of this request alone
    urgent: bool = False  # the trainer waits for it now: drawn before the requests made ahead

    def what(self) -> str:
        target = "an on-demand batch" if self.step is None else f"the batch of step {self.step + 1}"
        return f"{target} (request {self.seq}, weights of version {self.version})"


@dataclass(frozen=True)
class RolloutResult:
    request: RolloutRequest
    completion_ids: list[list[int]]
    logprobs: list[list[float]]  # the sampler's log-prob of each completion token (the behaviour policy)
    started: float  # time.monotonic() when drawing began (after the weights were in)
    finished: float
    weight_wait_s: float  # seconds the sampler waited for the request's weights to be published
    weight_sync_s: float  # seconds it spent taking them


class RolloutWorker:
    """Draws requests in order in a daemon thread; ``generate(request) -> (completion_ids, logprobs)`` runs there."""

    def __init__(
        self,
        generate: Callable[[RolloutRequest], tuple[list[list[int]], list[list[float]]]],
        weights: WeightTransfer,
        timeout_s: float,
        cores: tuple[int, ...] | None = None,
        threads: int | None = None,
        on_drawn: Callable[[float, float], None] | None = None,
    ):
        self._generate = generate
        self._on_drawn = on_drawn
        self.weights = weights
        self.timeout_s = float(timeout_s)
        self._cores, self._threads = cores, threads
        # (0: urgent | 1: ahead | 2: stop, seq, request): urgent requests first, each kind in the order it came
        self._requests: queue.PriorityQueue = queue.PriorityQueue()
        self._results: dict[int, RolloutResult] = {}
        self._done = threading.Condition()
        self._error: BaseException | None = None
        self._failed_request: RolloutRequest | None = None
        self._pending: dict[int, RolloutRequest] = {}
        self._thread = threading.Thread(target=self._run, name="async-sampler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ trainer side
    def submit(self, request: RolloutRequest) -> None:
        self.raise_if_failed()
        with self._done:
            self._pending[request.seq] = request
        self.weights.expect(request.version)
        self._requests.put((0 if request.urgent else 1, request.seq, request))

    def pending(self) -> list[RolloutRequest]:
        """Requests submitted and not yet taken by `result`, in order."""
        with self._done:
            return [self._pending[seq] for seq in sorted(self._pending)]

    def result(self, seq: int) -> tuple[RolloutResult, float]:
        """The result of request `seq` and the seconds waited for it; raises `AsyncSamplerError` on a failure or
        after ``timeout_s`` without it (a wait over a tenth of that is logged as a stall, once per tenth)."""
        t0 = time.monotonic()
        stall = self.timeout_s / 10
        next_log = t0 + stall
        with self._done:
            request = self._pending.get(seq)
            if request is None:
                raise AsyncSamplerError(f"no pending sampler request {seq}")
            while seq not in self._results:
                if self._error is not None:
                    raise self._failure()
                now = time.monotonic()
                if now - t0 >= self.timeout_s:
                    raise AsyncSamplerError(
                        f"async sampling: no batch from the sampler in {self.timeout_s:g} s (async_timeout_s) while "
                        f"waiting for {request.what()}; it is hung or far too slow for this trainer"
                    )
                if now >= next_log:
                    logger.warning(
                        "async sampling: the trainer has waited %.0f s for %s (stall; async_timeout_s=%g)",
                        now - t0,
                        request.what(),
                        self.timeout_s,
                    )
                    next_log += stall
                self._done.wait(timeout=min(1.0, max(0.01, next_log - now)))
            del self._pending[seq]
            return self._results.pop(seq), time.monotonic() - t0

    def wait_idle(self) -> float:
        """Wait until every submitted request has been drawn (not necessarily taken); the seconds waited."""
        t0 = time.monotonic()
        with self._done:
            while any(seq not in self._results for seq in self._pending):
                if self._error is not None:
                    raise self._failure()
                if time.monotonic() - t0 >= self.timeout_s:
                    raise AsyncSamplerError(
                        f"async sampling: the sampler did not finish its batches in {self.timeout_s:g} s "
                        "(async_timeout_s); it is hung or far too slow for this trainer"
                    )
                self._done.wait(timeout=1.0)
        return time.monotonic() - t0

    def raise_if_failed(self) -> None:
        with self._done:
            if self._error is not None:
                raise self._failure()

    def _failure(self) -> AsyncSamplerError:
        what = self._failed_request.what() if self._failed_request is not None else "a batch"
        error = AsyncSamplerError(
            f"async sampling: the sampler failed while drawing {what}: {type(self._error).__name__}: {self._error}"
        )
        error.__cause__ = self._error
        return error

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread after the batch it is drawing; requests not drawn yet are dropped. A thread still drawing
        after `timeout_s` (a hung sampler) is left to end with the process (a daemon), said in the log."""
        self._requests.put((2, 0, None))
        self.weights.close()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            logger.warning("async sampling: the sampler thread is still drawing; left to end with the process")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ sampler side
    def _run(self) -> None:
        if self._cores is not None and self._threads is not None:
            pin_this_thread(self._cores, self._threads)
        while True:
            _, _, request = self._requests.get()
            if request is None:
                return
            try:
                weight_wait, weight_sync = self.weights.acquire(request.version, self.timeout_s)
                started = time.monotonic()
                completion_ids, logprobs = self._generate(request)
                if len(completion_ids) != len(request.prompt_ids) or len(logprobs) != len(completion_ids):
                    raise AsyncSamplerError(
                        f"{len(completion_ids)} completions and {len(logprobs)} log-prob rows for "
                        f"{len(request.prompt_ids)} prompts"
                    )
                finished = time.monotonic()
            except BaseException as error:  # noqa: BLE001 - kept and raised in the trainer's thread
                with self._done:
                    self._error, self._failed_request = error, request
                    self._done.notify_all()
                return
            if self._on_drawn is not None:
                self._on_drawn(started, finished)
            with self._done:
                self._results[request.seq] = RolloutResult(
                    request, completion_ids, logprobs, started, finished, weight_wait, weight_sync
                )
                self._done.notify_all()
