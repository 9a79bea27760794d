"""Concurrent sample requests of the local server, decoded together (`DecodeBatch`) by one worker thread.

The async PyTRIO loop sends one ``sample`` request per prompt at once; served one at a time they would take as many
memory-bound decodes as there are prompts. Here a request waits in a queue (its HTTP request awaits the `Future`
that `submit` returns, holding no thread); the worker starts a batch with the oldest one and, between decode steps,
admits every queued request on the same adapter snapshot (up to `max_rows` rows), so concurrent requests share each
decode step. Nothing waits on a clock: a request that finds the worker idle starts at once.

What a request samples does not depend on its batch-mates: each has its own seeded generator and draws from its own
rows only (`RequestRows`); the batch changes only the float rounding of the shared forward (padding, batch size),
see docs/pytrio_server.md.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from trl_grpo_ext.pytrio_server.adapters import LoraSnapshot
from trl_grpo_ext.pytrio_server.decoding import DecodeBatch, SampleSpec
from trl_grpo_ext.pytrio_server.engine import ModelEngine
from trl_grpo_ext.pytrio_server.errors import EngineError
from trl_grpo_ext.pytrio_server.inprocess import server_thread
from trl_grpo_ext.pytrio_server.memory import MemoryGate

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    snapshot: LoraSnapshot | None
    spec: SampleSpec
    cost: int = 0  # working memory admitted while it decodes (`MemoryGate`)
    future: Future = field(default_factory=Future)


class SamplingBatcher:
    """Queue of sample requests and the worker that decodes them in shared batches."""

    def __init__(self, engine: ModelEngine, max_rows: int = 64, memory: MemoryGate | None = None):
        self.engine = engine
        self.memory = memory if memory is not None else MemoryGate(2**62)
        self.max_rows = max(1, int(max_rows))
        self._pending: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.batches = 0  # decode batches started (tests and logs)
        self.max_requests_in_batch = 0

    def submit(self, snapshot: LoraSnapshot | None, spec: SampleSpec, cost: int = 0) -> Future:
        """Queue `spec` on `snapshot` (None: the base model); the future's result is its `SampleResult` list.

        It decodes once `cost` bytes of working memory are admitted. Cancelling the future before its batch admits it
        withdraws the request (its client is gone).
        """
        job = _Job(snapshot, self.engine.check_sample(spec), cost)  # a bad request fails alone, before any batch
        with self._cv:
            if self._stopped:
                raise RuntimeError("the sampling worker is stopped")
            if self._thread is None:
                self._thread = server_thread(self._work, "pytrio-sampling")
                self._thread.start()
            self._pending.append(job)
            self._cv.notify()
        return job.future

    def stop(self) -> None:
        """Fail every queued request and the running batch's (at its next step); the worker thread then exits."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    def _take_joiners(self, batch: DecodeBatch) -> list[_Job]:
        """Queued jobs that can join `batch` now, oldest first, within `max_rows`."""
        taken, rows = [], batch.rows
        with self._cv:
            for job in list(self._pending):
                if job.future.cancelled():  # withdrawn, nothing to decode
                    self._pending.remove(job)
                    continue
                if batch.can_join(job.snapshot, job.spec) and rows + job.spec.num_samples <= self.max_rows:
                    if not self.memory.try_acquire(job.cost):  # waits in the queue until running work releases
                        break  # in order: a later, smaller request does not overtake it
                    self._pending.remove(job)
                    if job.future.set_running_or_notify_cancel():
                        self._release_when_done(job)
                        taken.append(job)
                        rows += job.spec.num_samples
                    else:
                        self.memory.release(job.cost)
        return taken

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    _fail(self._pending, RuntimeError("the local server stopped"))
                    self._pending.clear()
                    return
                first = self._pending.popleft()
            if first.future.cancelled():  # withdrawn, nothing to decode
                continue
            self.memory.acquire(first.cost)  # waits while running work (a training event, ...) holds the budget
            if first.future.set_running_or_notify_cancel():
                self._release_when_done(first)
                self._run_batch(first)
            else:
                self.memory.release(first.cost)

    def _release_when_done(self, job: _Job) -> None:
        job.future.add_done_callback(lambda _future: self.memory.release(job.cost))

    def _run_batch(self, first: _Job) -> None:
        batch = DecodeBatch(self.engine, first.snapshot)
        jobs: dict[int, _Job] = {}  # id(RequestRows) -> job
        self.batches += 1
        try:
            self._admit(batch, first, jobs)
            while batch.requests:
                if self._stopped:  # its clients wait for nothing now: fail them at once instead of decoding on
                    _fail(jobs.values(), RuntimeError("the local server stopped"))
                    return
                for job in self._take_joiners(batch):  # requests that arrived meanwhile join before the next step
                    self._admit(batch, job, jobs)
                self.max_requests_in_batch = max(self.max_requests_in_batch, len(batch.requests))
                for rows in batch.step():
                    job = jobs.pop(id(rows))
                    if rows.error is not None:  # drawing failed for this request only: it alone gets the error
                        _fail([job], _request_failed(rows.error))
                    else:
                        job.future.set_result(rows.results(self.engine.tokenizer))
        except Exception as error:  # noqa: BLE001 - a failed model call fails every request of the batch
            logger.exception("sampling batch failed")
            _fail([first, *jobs.values()], error)

    def _admit(self, batch: DecodeBatch, job: _Job, jobs: dict[int, _Job]) -> None:
        """`job` joins `batch`; if its prefill fails it alone gets the error and the batch goes on without it."""
        try:
            jobs[id(batch.admit(job.spec))] = job
        except Exception as error:  # noqa: BLE001 - the request's own failure, answered to it alone
            logger.warning("sample request failed to join its decode batch: %r", error)
            _fail([job], _request_failed(error))


def _request_failed(error: Exception) -> EngineError:
    """A request that failed inside a batch (its checks at admission missed something): a 400 for it alone."""
    if isinstance(error, EngineError):
        return error
    return EngineError("sampling_failed", f"this request failed while decoding: {type(error).__name__}: {error}")


def _fail(jobs, error: BaseException) -> None:
    """Give every job of `jobs` that is still waiting `error` (withdrawn and answered ones are left alone)."""
    for job in jobs:
        if not job.future.done() and (job.future.running() or job.future.set_running_or_notify_cancel()):
            job.future.set_exception(error)
