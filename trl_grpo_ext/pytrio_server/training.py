"""Training event handlers (``trainer.*``), run in order by each training run's worker thread.

A mixin of `LocalPyTrioServer`; every handler takes the `EventRecord` and returns the event's result map.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

from pydantic import ValidationError
from pytrio.protocol.actor.events.trainer.forward import TrainerForwardBackwardPayload
from pytrio.protocol.actor.events.trainer.init_run import TrainerInitRunPayload
from pytrio.protocol.actor.events.trainer.optimize_step import TrainerOptimizeStepPayload
from pytrio.protocol.actor.events.trainer.save import TrainerSavePayload

from trl_grpo_ext.pytrio_server.adapters import LoraSettings
from trl_grpo_ext.pytrio_server.errors import ApiError, EngineError, EventFailure
from trl_grpo_ext.pytrio_server.events import EventRecord
from trl_grpo_ext.pytrio_server.forward import ForwardDatum
from trl_grpo_ext.pytrio_server.images import mask_image_targets, memory_positions
from trl_grpo_ext.pytrio_server.loss_fns import LossConfigError, parse_loss
from trl_grpo_ext.pytrio_server.normalization import TotalsError, counted_tokens, loss_scale, parse_totals
from trl_grpo_ext.pytrio_server.records import KIND_FOLDERS, CheckpointRecord, checkpoint_uri
from trl_grpo_ext.pytrio_server.registry import new_id, safe_name
from trl_grpo_ext.pytrio_server.wire import prompt_input, validation_message, wire_tensor

logger = logging.getLogger(__name__)

MAX_TTL_SECONDS = 10 * 365 * 24 * 3600  # a checkpoint's ttl_seconds: ten years at most (dates stay representable)


class TrainingHandlers:
    def _handle_event(self, record: EventRecord) -> dict:
        handler: Callable[[EventRecord], dict] = {
            "trainer.init_run": self._ev_init,
            "trainer.forward": self._ev_forward,
            "trainer.forward_backward": self._ev_forward,
            "trainer.optimize_step": self._ev_optim,
            "trainer.save_state": self._ev_save,
            "trainer.save_weights": self._ev_save,
            "trainer.end_run": self._ev_end,
        }[record.type]
        try:
            return handler(record)
        except EngineError as error:
            raise EventFailure(error.code, error.message) from None
        except ApiError as error:
            raise EventFailure(error.code, error.message) from None
        except OSError as error:  # its text would name a file of the server's disk: no client's business
            logger.warning("%s of run %s failed on the storage: %s", record.type, record.run, error)
            raise EventFailure(
                "storage_error", f"{error.strerror or type(error).__name__} on the server's storage"
            ) from None

    def _payload(self, model, record: EventRecord):
        try:
            return model.model_validate(record.payload)
        except ValidationError as error:
            raise EventFailure("invalid_payload", f"{record.type}: {validation_message(error)}") from None

    def _ev_init(self, record: EventRecord) -> dict:
        payload = self._payload(TrainerInitRunPayload, record)
        if payload.base_model not in self.aliases:
            raise EventFailure("model_not_found", self.not_served_message(payload.base_model))
        run = self.registry.training_run(record.run)
        c = payload.lora_config
        # the bounds of run creation: the event carries its own copy (a huge rank is gigabytes of adapter); a seed
        # outside torch's range cannot travel in msgpack
        if not 1 <= c.rank <= 256:
            raise EventFailure("invalid_payload", f"lora_config.rank must be in [1, 256], got {c.rank}")
        lora = LoraSettings(c.rank, c.seed, c.train_mlp, c.train_attn, c.train_unembed)
        source = None
        if payload.checkpoint_uri:  # with the rights of the client that opened the run's session
            caller = self.registry.sessions[run.session].caller
            checkpoint = self.registry.checkpoint(payload.checkpoint_uri, caller)
            source = self._snapshot(checkpoint, payload.load_optimizer)
        self.engine.create_run(record.run, lora, source, load_optimizer=payload.load_optimizer)
        run.status, run.started, run.updated = "RUNNING", time.time(), time.time()
        return {"training_run_cuid": record.run, "step": self.engine.runs[record.run].step}

    def _ev_forward(self, record: EventRecord) -> dict:
        raw = record.payload if isinstance(record.payload, dict) else {}
        try:  # checked here, before the schema: a request without totals keeps the plain sum
            totals = parse_totals(raw.get("gradient_accumulation"))
        except TotalsError as error:
            raise EventFailure("invalid_gradient_accumulation", str(error)) from None
        view = record  # a request without totals is validated with placeholders (`loss_scale` then gets None)
        if totals is None and isinstance(record.payload, dict):
            view = _with_payload(record, {**raw, "gradient_accumulation": _PLACEHOLDER_TOTALS})
        payload = self._payload(TrainerForwardBackwardPayload, view)
        try:
            spec = parse_loss(payload.loss.type, payload.loss.config)
        except LossConfigError as error:
            raise EventFailure("invalid_loss_config", str(error)) from None
        data = []
        for i, d in enumerate(payload.data):
            tokens, vision = prompt_input(d.model_input, self.engine, event=True)
            n = len(tokens)
            fields = {"target_ids": d.target_ids}
            if spec.name == "cross_entropy":
                fields["weights"] = d.weights if d.weights is not None else [1.0] * n
            else:
                if d.logprobs is None or d.advantages is None:
                    raise EventFailure("invalid_payload", f"data[{i}]: {spec.name} needs logprobs and advantages")
                fields["logprobs"], fields["advantages"] = d.logprobs, d.advantages
            for name, values in fields.items():
                if len(values) != n:
                    raise EventFailure("invalid_payload", f"data[{i}].{name} has {len(values)} values for {n} tokens")
            targets = mask_image_targets(d.target_ids, vision, payload.auto_shift)  # image placeholders: no loss
            data.append(
                ForwardDatum(
                    tokens, targets, fields.get("weights"), fields.get("logprobs"), fields.get("advantages"), vision
                )
            )
        backward = record.type == "trainer.forward_backward"
        counted = sum(
            counted_tokens(spec.name, d.targets, d.weights, d.advantages, payload.auto_shift) for d in data if d.tokens
        )
        try:
            scale = loss_scale(spec.name, totals, len(data), counted, self.config.loss_normalization)
        except TotalsError as error:
            raise EventFailure("invalid_gradient_accumulation", str(error)) from None
        self.engine.check_lengths([len(d.tokens) for d in data])
        budget = self.memory.budget  # chunks are cut to fit it: only an item alone above it is refused
        sizes = [memory_positions(len(d.tokens), d.vision) for d in data]
        cost = self.engine.forward_bytes(sizes, backward, budget)
        self.memory.refuse_beyond(cost, f"this {record.type.split('.')[1]}")
        with self.memory.reserve(cost):  # waits while running work holds the budget
            outputs, metrics = self.engine.forward(
                record.run, data, spec, backward=backward, auto_shift=payload.auto_shift, budget=budget,
                loss_scale=scale,
            )  # fmt: skip
        count = metrics["token_count"]
        record.usage = {
            "input_tokens": sum(len(d.tokens) for d in data),
            "output_tokens": 0,
            "train_tokens": count if backward else 0,
        }
        return {
            "loss_fn_outputs": [{k: wire_tensor(v) for k, v in out.items()} for out in outputs],
            "metrics": {
                "loss_sum": metrics["loss_sum"],
                "loss_mean": metrics["loss_sum"] / count if count else 0.0,
                "token_count": count,
            },
        }

    def _ev_optim(self, record: EventRecord) -> dict:
        payload = self._payload(TrainerOptimizeStepPayload, record)
        adam = payload.adam_params.model_dump()
        # written so that NaN fails every test (a NaN comparison is False)
        valid = {
            "learning_rate": adam["learning_rate"] >= 0,
            "beta1": 0 <= adam["beta1"] < 1,
            "beta2": 0 <= adam["beta2"] < 1,
            "eps": adam["eps"] > 0,
            "weight_decay": adam["weight_decay"] >= 0,
            "grad_clip_norm": adam["grad_clip_norm"] >= 0,
        }
        bad = [f"{k}={adam[k]!r}" for k, ok in valid.items() if not (ok and math.isfinite(adam[k]))]
        if bad:
            raise EventFailure(
                "invalid_adam_params",
                f"invalid AdamW parameters {', '.join(bad)}: each must be finite, learning_rate, weight_decay and "
                "grad_clip_norm >= 0, beta1 and beta2 in [0, 1), eps > 0",
            )
        return {"metrics": self.engine.optim_step(record.run, adam)}

    def _ev_save(self, record: EventRecord) -> dict:
        payload = self._payload(TrainerSavePayload, record)
        kind = "state" if record.type == "trainer.save_state" else "sampler"
        if not safe_name(payload.name):
            raise EventFailure(
                "invalid_checkpoint_name", f"checkpoint name {payload.name!r}: use letters, digits, '_', '-', '.'"
            )
        ttl = payload.ttl_seconds
        if ttl is not None and not 1 <= ttl <= MAX_TTL_SECONDS:
            raise EventFailure("invalid_payload", f"ttl_seconds must be None or in [1, {MAX_TTL_SECONDS}], got {ttl}")
        uri = checkpoint_uri(record.run, kind, payload.name)
        with self.registry.lock:
            existing = self.registry.checkpoints.get(uri)
        if existing is not None and not payload.overwrite:
            raise EventFailure("checkpoint_exists", f"{uri} exists; pass overwrite=True or choose another name")
        snapshot = self.engine.snapshot(record.run, with_optimizer=kind == "state")
        folder = self.storage / record.run / KIND_FOLDERS[kind] / payload.name
        checkpoint = CheckpointRecord(
            new_id("ckpt"), uri, record.run, payload.name, kind, folder, snapshot.lora, 0, payload.visibility,
            snapshot.step, snapshot_uid=snapshot.uid, expires=time.time() + ttl if ttl else None,
            owner=self.registry.training_run(record.run).owner, base=self.engine.base_model, server=self.server_id,
        )  # fmt: skip
        self._write_checkpoint(checkpoint, snapshot)  # EventFailure (insufficient_storage, ...): nothing left behind
        self._remember(uri, snapshot)
        if payload.visibility == "TEMPORARY":
            self._prune_temporary(record.run)
        else:
            self._prune_durable(record.run, kind)
        return {
            "checkpoint": {
                "uri": uri,
                "model_id": self.model_id,
                "size_bytes": checkpoint.size,
                "checkpoint_cuid": checkpoint.cuid,
                "name": payload.name,
            }  # no "path": the folder on the server's disk is no client's business
        }

    def _ev_end(self, record: EventRecord) -> dict:
        self.engine.drop_run(record.run)
        run = self.registry.training_run(record.run)
        run.status, run.updated = "ENDED", time.time()
        return {}


# Stands in for the totals of a request that sent none, only to pass the client's schema (which requires them); such
# a request is not normalised (`loss_scale` gets None).
_PLACEHOLDER_TOTALS = {"total_samples": 1, "total_active_tokens": 0, "total_advantage_tokens": 0}


def _with_payload(record: EventRecord, payload: dict) -> EventRecord:
    """A view of `record` with another payload for validation (the queued record is left as it came)."""
    return dataclasses.replace(record, payload=payload)
