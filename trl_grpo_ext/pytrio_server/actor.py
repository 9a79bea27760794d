"""Actor API handlers (``<base>/actor/v1/...``): event submission and status, sampling requests.

A mixin of `LocalPyTrioServer`. The two that wait are coroutines run on the server's event loop: an event status
read waits (long poll) for the event, a sample request for its decode batch, and neither holds a thread meanwhile;
their blocking parts run in the server's request threads (`_in_thread`).
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Future
from dataclasses import dataclass

import msgpack
from pytrio.protocol.actor.events.event import EventEnvelope
from pytrio.protocol.actor.sampling_run.sample import SampleRequest

from trl_grpo_ext.pytrio_server.adapters import LoraSnapshot
from trl_grpo_ext.pytrio_server.decoding import SampleResult
from trl_grpo_ext.pytrio_server.errors import ApiError, EngineError, EventFailure
from trl_grpo_ext.pytrio_server.events import EventRecord, RunEventQueue
from trl_grpo_ext.pytrio_server.images import memory_positions
from trl_grpo_ext.pytrio_server.registry import ActorToken
from trl_grpo_ext.pytrio_server.sample_params import check_topk, sample_spec
from trl_grpo_ext.pytrio_server.wire import item_lengths, prompt_input, require_finite, validate

KNOWN_EVENTS = (
    "trainer.init_run",
    "trainer.forward",
    "trainer.forward_backward",
    "trainer.optimize_step",
    "trainer.save_state",
    "trainer.save_weights",
    "trainer.end_run",
)


@dataclass
class SampleJob:
    """A validated sample request, queued for decoding: `results` completes with its sequences."""

    request: SampleRequest
    run: str
    prompt: list[int]
    snapshot: LoraSnapshot | None
    results: Future  # list[SampleResult]
    engine: object = None  # the served model's engine (`LocalPyTrioServer.model_for`)
    vision: object = None  # the prompt's images (`images.VisionInput`), None for a token prompt


@contextlib.contextmanager
def _sampling_errors():
    """A request the engine refuses, or parameters it cannot take, are 400 answers with the engine's code."""
    try:
        yield
    except EngineError as error:
        raise ApiError(400, error.code, error.message) from None
    except (TypeError, ValueError) as error:
        raise ApiError(400, "invalid_sampling_params", str(error)) from None


class ActorHandlers:
    def submit_event(self, token: ActorToken, raw: bytes) -> tuple[int, dict]:
        try:
            data = msgpack.unpackb(raw, raw=False)
        except Exception as error:  # noqa: BLE001 - any undecodable body is a client error
            raise ApiError(400, "invalid_envelope", f"event body is not valid MessagePack: {error}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "invalid_envelope", "event body must be a MessagePack map")
        require_finite({k: v for k, v in data.items() if k != "payload"}, "non_finite_number")
        event_type = data.get("type")
        if event_type not in KNOWN_EVENTS:
            raise ApiError(
                400,
                "unknown_event_type",
                f"unknown event type {event_type!r}; this server handles {list(KNOWN_EVENTS)}",
            )
        envelope = validate(EventEnvelope, data, "invalid_envelope")
        run_id = envelope.metadata.run_id
        if token.kind != "training" or token.run != run_id:  # as for a missing run: no existence leak
            raise ApiError(404, "training_run_not_found", f"training run {run_id} not found")
        run = self.registry.training_run(run_id)
        if run.status in ("ENDED", "CANCELLED"):
            raise ApiError(409, "run_ended", f"training run {run_id} is {run.status}")
        record = EventRecord(envelope.event_id, event_type, run_id, envelope.payload)
        if self._closing.done():  # a queue made now would outlive the server
            raise ApiError(503, "server_stopping", "the local PyTRIO server is stopping")
        with self.registry.lock:
            q = self._queues.get(run_id)
            if q is None:
                q = self._queues[run_id] = RunEventQueue(run_id, self._handle_event)
        refusal = self._admission_refusal(event_type, envelope.payload)
        if (q.refuse(record, refusal) if refusal else q.submit(record)) is not None:
            raise ApiError(409, "event_exists", f"event {envelope.event_id} was already submitted")
        return 202, record.wire()

    def _admission_refusal(self, event_type: str, payload: object) -> EventFailure | None:
        """Why an event is refused before it is queued: a NaN or infinite number (a NaN learning rate would poison
        the run's weights), a forward item longer than the model's context, or working memory that could never be
        admitted. None when it may queue (a payload of the wrong shape is left to the event's own validation).

        The refusal is a failed event, not an HTTP error: pytrio's training client treats a refused submission as
        uncertain and stops the whole run, while a failed event fails that call only."""
        try:
            require_finite(payload, "non_finite_number")
            if event_type in ("trainer.forward", "trainer.forward_backward"):
                lengths = item_lengths(payload)
                if lengths is not None:
                    self.engine.check_lengths(lengths)
                    backward = event_type == "trainer.forward_backward"
                    cost = self.engine.forward_bytes(lengths, backward, self.memory.budget)
                    self.memory.refuse_beyond(cost, f"this {event_type.split('.')[1]} ({sum(lengths)} tokens)")
        except (ApiError, EngineError) as error:
            return EventFailure(error.code, error.message)
        return None

    async def get_event(self, token: ActorToken, event_id: str, wait: float) -> dict:
        """The event's status once it finished, or after ``min(wait, long_poll_seconds)`` (or when the server stops)."""
        q = self._queues.get(token.run)
        record = q.get(event_id) if q is not None else None
        if record is None:
            raise ApiError(404, "event_not_found", f"event {event_id} not found for run {token.run}")
        await record.wait(min(wait, self.config.long_poll_seconds), self._closing_signal())
        return record.wire()

    async def sample(self, token: ActorToken, rid: str, body: dict) -> dict:
        """Sample a request in a decode batch shared with concurrent ones (`SamplingBatcher`)."""
        job = await self._in_thread(self._queue_sample, token, rid, body)
        with _sampling_errors():
            results = await asyncio.wrap_future(job.results)  # cancelled while queued: the request is withdrawn
        return await self._in_thread(self._sample_answer, job, results)

    def _queue_sample(self, token: ActorToken, rid: str, body: dict) -> SampleJob:
        """Check the request (token, run, schema, limits), load its weights and queue it for decoding."""
        if token.kind != "sampling" or token.run != rid:  # as for a missing run: no existence leak
            raise ApiError(404, "sampling_run_not_found", f"sampling run {rid} not found")
        run = self.registry.sampling_run(rid)
        request = validate(SampleRequest, body, "invalid_sample_request")
        engine, sampler = self.model_for(run.model)
        prompt, vision = prompt_input(request.prompt, engine)
        limits = engine.sample_limits(self.config.max_num_samples)
        with _sampling_errors():  # every value checked here, before the request can join a decode batch
            spec = sample_spec(prompt, request.num_samples, request.sampling_params, limits, request.return_text)
            spec.vision = vision
            check_topk(request.topk_prompt_logprobs, self.config.max_topk_logprobs)
        model = engine.memory_model
        positions = memory_positions(len(prompt), vision)
        cost = model.sample_bytes(positions, spec.num_samples, spec.max_tokens)
        self.memory.refuse_beyond(cost, f"this sample request ({spec.num_samples} x {spec.max_tokens} tokens)")
        if request.return_prompt_logprobs or request.topk_prompt_logprobs:
            scoring = model.prompt_logprobs_bytes(positions, request.topk_prompt_logprobs)
            self.memory.refuse_beyond(scoring, f"prompt log-probs of {len(prompt)} tokens")
        snapshot = None
        if run.source_checkpoint_uri:
            snapshot = self._snapshot(self.registry.checkpoint(run.source_checkpoint_uri), with_optimizer=False)
        with _sampling_errors():
            return SampleJob(request, rid, prompt, snapshot, sampler.submit(snapshot, spec, cost), engine, vision)

    def _sample_answer(self, job: SampleJob, results: list[SampleResult]) -> dict:
        request, prompt = job.request, job.prompt
        prompt_logprobs, topk = None, None
        if request.return_prompt_logprobs or request.topk_prompt_logprobs:
            engine = job.engine or self.engine.for_sampling
            positions = memory_positions(len(prompt), job.vision)
            cost = engine.memory_model.prompt_logprobs_bytes(positions, request.topk_prompt_logprobs)
            with _sampling_errors(), self.memory.reserve(cost):
                prompt_logprobs, topk = engine.prompt_logprobs(
                    job.snapshot, prompt, request.topk_prompt_logprobs, vision=job.vision
                )
        return {
            "request_id": request.request_id,
            "sampling_run": job.run,
            "sequences": [
                {
                    "tokens": r.tokens,
                    "text": r.text,
                    "logprobs": r.logprobs if request.return_token_logprobs else [],
                    "stop_reason": r.stop_reason,
                }
                for r in results
            ],
            "prompt_logprobs": prompt_logprobs if request.return_prompt_logprobs else None,
            "topk_prompt_logprobs": topk,
            "usage": {"input_tokens": len(prompt), "output_tokens": sum(len(r.tokens) for r in results)},
        }
