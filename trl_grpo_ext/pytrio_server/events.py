"""Ordered execution of actor events: one worker thread per training run, long-poll status reads.

Events of one run execute in submission order (the client submits them in ``metadata.index`` order under its
sequence lock), so gradient accumulation, optimizer steps and saves interleave exactly as the loop asked.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from trl_grpo_ext.pytrio_server.errors import EventFailure, describe
from trl_grpo_ext.pytrio_server.inprocess import server_thread

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
# Events kept per run for status reads; older finished ones are forgotten (the client polls promptly, and
# a forward result holds per-token arrays).
MAX_EVENTS_PER_RUN = 512


def started_future() -> Future:
    """A `Future` already marked running: a waiter that gives up (an HTTP request cancelled at shutdown) cannot
    cancel it, so whoever completes it always can."""
    future: Future = Future()
    future.set_running_or_notify_cancel()
    return future


@dataclass
class EventRecord:
    event_id: str
    type: str
    run: str
    payload: dict
    status: str = "accepted"
    result: dict | None = None
    error: dict | None = None
    usage: dict = field(default_factory=lambda: {"input_tokens": 0, "output_tokens": 0, "train_tokens": 0})
    finished: Future = field(default_factory=started_future)  # result None once succeeded or failed

    async def wait(self, timeout: float, *also: asyncio.Future) -> None:
        """Until the event finished, one of `also` is done, or `timeout` seconds passed; holds no thread."""
        if not self.finished.done():
            waiters = {asyncio.wrap_future(self.finished), *also}
            await asyncio.wait(waiters, timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED)

    def wire(self) -> dict:
        """The msgpack map the client's `parse_event_response` expects."""
        body = {"version": PROTOCOL_VERSION, "event_id": self.event_id, "type": self.type, "status": self.status}
        if self.status == "succeeded":
            body["result"] = self.result or {}
            body["usage"] = self.usage
        elif self.status == "failed":
            body["error"] = self.error
            body["usage"] = self.usage
        return body


Handler = Callable[[EventRecord], dict]


class RunEventQueue:
    """FIFO executor for one training run's events."""

    def __init__(self, run: str, handler: Handler):
        self.run = run
        self._handler = handler
        self._queue: queue.Queue[EventRecord | None] = queue.Queue()
        self.events: dict[str, EventRecord] = {}
        self._lock = threading.Lock()
        self._thread = server_thread(self._work, f"pytrio-events-{run}")
        self._thread.start()

    def submit(self, record: EventRecord) -> EventRecord | None:
        """Queue `record`; returns the existing record instead when its event id was already submitted."""
        with self._lock:
            existing = self.events.get(record.event_id)
            if existing is not None:
                return existing
            self.events[record.event_id] = record
            if len(self.events) > MAX_EVENTS_PER_RUN:
                for key in [k for k, v in self.events.items() if v.finished.done()][: len(self.events) // 2]:
                    del self.events[key]
        self._queue.put(record)
        return None

    def refuse(self, record: EventRecord, failure: EventFailure) -> EventRecord | None:
        """Record `record` as failed with `failure`, unexecuted (refused at admission: the client reads a failed
        event, as if it had run, and its run stays usable); the existing record when the id was submitted before."""
        record.error = {"code": failure.code, "message": failure.message}
        record.status, record.payload = "failed", {}
        record.finished.set_result(None)
        with self._lock:
            existing = self.events.get(record.event_id)
            if existing is not None:
                return existing
            self.events[record.event_id] = record
        return None

    def get(self, event_id: str) -> EventRecord | None:
        with self._lock:
            return self.events.get(event_id)

    def close(self) -> None:
        self._queue.put(None)

    def _work(self) -> None:
        while True:
            record = self._queue.get()
            if record is None:
                return
            record.status = "running"
            try:
                record.result = self._handler(record)
                record.status = "succeeded"
            except EventFailure as failure:
                record.error = {"code": failure.code, "message": failure.message}
                record.status = "failed"
            except Exception as exc:  # a bug or an unexpected input: fail the event, keep the run alive
                logger.exception("event %s (%s) crashed", record.event_id, record.type)
                record.error = {"code": "internal_error", "message": describe(exc)}
                record.status = "failed"
            finally:
                record.payload = {}  # the batch is no longer needed; only the answer is polled
                record.finished.set_result(None)
