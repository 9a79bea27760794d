"""Control API handlers (``<base>/api/...``): sessions, training and sampling runs, checkpoints.

A mixin of `LocalPyTrioServer`. `routes.CONTROL_ROUTES` binds each handler to its route: it is called as
``handler(query, body, caller, **path_params)`` with ``query`` as `urllib.parse.parse_qs` returns it, ``body`` the
request already validated with the client's request model (the parsed JSON where the route declares none) and
``caller`` the `clients.Caller` its API key identifies, and returns the JSON answer. Every lookup passes the caller:
another client's sessions, runs and checkpoints answer 404 like missing ones, and listings hold the caller's own
(an admin's: everyone's). Checkpoint views carry the URI, never the folder on the server's disk.
"""

from __future__ import annotations

import logging
import time

from pytrio.protocol.control.sampling_run.create import SamplingRunCreateRequest
from pytrio.protocol.control.service_session.close import ServiceSessionCloseRequest
from pytrio.protocol.control.service_session.create import ServiceSessionCreateRequest
from pytrio.protocol.control.training_run.create import TrainingRunCreateRequest
from pytrio.protocol.control.training_run.update import TrainingRunUpdateRequest

from trl_grpo_ext.pytrio_server.adapters import LoraSettings
from trl_grpo_ext.pytrio_server.clients import Caller
from trl_grpo_ext.pytrio_server.errors import ApiError
from trl_grpo_ext.pytrio_server.records import CheckpointRecord
from trl_grpo_ext.pytrio_server.registry import (
    SamplingRunRecord,
    ServiceSession,
    TrainingRunRecord,
    iso,
    new_id,
)
from trl_grpo_ext.pytrio_server.wire import USER, WORKSPACE, page, query_int

logger = logging.getLogger(__name__)


class ControlHandlers:
    def verify(self, _q, _b, caller: Caller) -> dict:
        return {
            "api_key_tid": f"key_{caller.owner}",
            "api_key_name": "admin" if caller.admin else caller.owner,
            "user_cuid": USER,
            "username": caller.owner,
            "display_name": "Local PyTRIO server",
            "workspace_cuid": WORKSPACE,
            "workspace_name": "local",
            "workspace_type": "PERSONAL",
            "expires_at": None,
        }

    def bootstrap(self, query, _b, _caller) -> dict:
        version = (query.get("sdk_version") or ["unknown"])[0]
        return {"compatibility": {"status": "compatible", "sdk_version": version}, "notices": []}

    def models(self, query, _b, _caller) -> dict:
        """The served model under its path, then once under each served name, then the sampling-only models (what
        `get_supported_models` lists)."""
        created = iso(self.started)
        items = [
            {
                "cuid": f"model_local_{i}" if i else "model_local",
                "alias": self.model_alias,
                "model_id": model_id,
                "display_name": self.model_alias,
                "context_length": self.engine.max_seq_len,
                "train_available": True,
                "sample_available": True,
                "trainer": self._caps(True),
                "sampler": self._caps(False),
                "created_at": created,
                "updated_at": created,
            }
            for i, model_id in enumerate(dict.fromkeys([self.model_id, *self.served_names]))
        ]
        for key, model in self.sampling_models.items():  # sampling-only models (a distillation teacher)
            items.append({
                "cuid": f"model_local_sampling_{len(items)}", "alias": key, "model_id": key, "display_name": key,
                "context_length": model.engine.max_seq_len, "train_available": False, "sample_available": True,
                "trainer": self._caps(True, model.engine), "sampler": self._caps(False, model.engine), "created_at": created,
                "updated_at": created,
            })  # fmt: skip
        offset = query_int(query, "offset", 0)
        return {"items": items[offset:], "total": len(items), "limit": 100, "offset": offset}

    def create_session(self, _q, request: ServiceSessionCreateRequest, caller: Caller) -> dict:
        session = ServiceSession(new_id("ss"), request.sdk_version, caller)
        with self.registry.lock:
            self.registry.sessions[session.cuid] = session
        return self._session_view(session, brief=True)

    def _session_view(self, s: ServiceSession, brief=False) -> dict:
        view = {
            "service_session_cuid": s.cuid,
            "workspace_cuid": WORKSPACE,
            "status": s.status,
            "sdk_version": s.sdk_version,
            "created_at": iso(s.created),
            "updated_at": iso(s.updated),
        }
        if not brief:
            view["training_run_cuids"] = list(s.training_runs)
            view["sampling_run_cuids"] = list(s.sampling_runs)
        return view

    def get_session(self, _q, _b, caller: Caller, sid) -> dict:
        return self._session_view(self.registry.any_session(sid, caller))

    def list_sessions(self, query, _b, caller: Caller) -> dict:
        with self.registry.lock:
            sessions = [s for s in self.registry.sessions.values() if caller.may_see(s.owner)]
            items = [self._session_view(s, brief=True) for s in sessions]
        return page(items, query, "service_sessions")

    def renew_session(self, _q, _b, caller: Caller, sid) -> dict:
        session = self.registry.session(sid, caller)
        session.updated, session.seen = time.time(), time.monotonic()
        return {"service_session_cuid": sid, "workspace_cuid": WORKSPACE, "status": session.status,
                "updated_at": iso(session.updated)}  # fmt: skip

    def close_session(self, _q, request: ServiceSessionCloseRequest, caller: Caller, sid) -> dict:
        with self.registry.lock:
            session = self.registry.any_session(sid, caller)
            session.status, session.updated = request.status, time.time()
            runs = list(session.training_runs)
        for run in runs:
            self._end_run(run, request.status)
        return {}

    def _end_run(self, run_cuid: str, status: str = "ENDED") -> None:
        record = self.registry.training_runs.get(run_cuid)
        if record is not None and record.status not in ("ENDED", "CANCELLED"):
            record.status, record.updated = status, time.time()
        q = self._queues.pop(run_cuid, None)
        if q is not None:
            q.close()
        self.engine.drop_run(run_cuid)

    def reclaim_idle_sessions(self) -> list[str]:
        """Close (as EXPIRED) every open session whose client gave no sign of life (`Registry.touch`: heartbeats,
        events, samples; renewals) for `session_timeout_seconds`, ending its runs; returns their ids."""
        timeout = self.config.session_timeout_seconds
        if not timeout:
            return []
        cutoff = time.monotonic() - timeout
        with self.registry.lock:
            idle = [s for s in self.registry.sessions.values() if s.status == "ACTIVE" and s.seen < cutoff]
            for session in idle:
                session.status, session.updated = "EXPIRED", time.time()
                for rid in session.sampling_runs:
                    self.registry.sampling_runs[rid].status = "ENDED"
        for session in idle:
            for run in session.training_runs:
                self._end_run(run, "CANCELLED")
            logger.info(
                "reclaimed session %s: no sign of life from its client for %.0f s (%d training, %d sampling runs "
                "ended)", session.cuid, timeout, len(session.training_runs), len(session.sampling_runs),
            )  # fmt: skip
        return [s.cuid for s in idle]

    def create_training_run(self, _q, request: TrainingRunCreateRequest, caller: Caller, sid) -> dict:
        if not 1 <= request.lora_rank <= 256:
            raise ApiError(400, "invalid_lora_rank", f"lora_rank must be in [1, 256], got {request.lora_rank}")
        lora = LoraSettings(
            request.lora_rank, request.seed, request.train_mlp, request.train_attn, request.train_unembed
        )
        if request.source_checkpoint_uri:
            source = self.registry.checkpoint(request.source_checkpoint_uri, caller)
            self._check_base(source)  # before the name: a checkpoint of another base names a model not served here
            lora = source.lora if not request.base_model else lora
        elif not request.base_model:
            raise ApiError(400, "invalid_request", "base_model is required without source_checkpoint_uri")
        if request.base_model and self._resolve_base_model(request.base_model):
            raise ApiError(
                400,
                "invalid_request",
                f"model {request.base_model!r} is served for sampling only; train on {self.model_alias!r}",
            )
        with self.registry.lock:
            session = self.registry.session(sid, caller)
            run = TrainingRunRecord(
                new_id("tr"),
                sid,
                len(session.training_runs),
                lora,
                request.source_checkpoint_uri,
                request.restore_optimizer,
                owner=session.owner,
            )
            self.registry.training_runs[run.cuid] = run
            session.training_runs.append(run.cuid)
        return self._created_reply("training", run)

    def _created_reply(self, kind: str, run: TrainingRunRecord | SamplingRunRecord) -> dict:
        """Reply to a create request: the new run, the model, and the actor token for its data-plane calls."""
        training = kind == "training"
        return {
            f"{kind}_run_cuid": run.cuid,
            "service_session_cuid": run.session,
            "workspace_cuid": WORKSPACE,
            "status": run.status,
            "run_index": run.index,
            "model_spec_cuid": "model_local",
            # a sampling-only model's run (its `model`) reports that model: its tokenizer is the client's
            "model_alias": getattr(run, "model", "") or self.model_alias,
            "model_id": getattr(run, "model", "") or self.model_id,
            "trainer" if training else "sampler": self._caps(training, self.model_for(getattr(run, "model", ""))[0]),
            "actor": self._actor(),
            "actor_jwt": self._jwt(kind, run.cuid),
            "created_at": iso(run.created),
        }

    def update_training_run(self, _q, request: TrainingRunUpdateRequest, caller: Caller, sid, rid) -> dict:
        run = self.registry.training_run(rid, caller)
        if run.session != sid:
            raise ApiError(404, "training_run_not_found", f"training run {rid} is not in session {sid}")
        if rid in self.engine.runs:
            raise ApiError(409, "run_already_initialized", "the trainer is initialized; load state before training")
        source = self.registry.checkpoint(request.source_checkpoint_uri, caller)
        self._check_base(source)
        if source.lora.shape_key != run.lora.shape_key:
            raise ApiError(409, "checkpoint_mismatch", f"checkpoint LoRA {source.lora} does not match {run.lora}")
        run.source_checkpoint_uri, run.restore_optimizer = request.source_checkpoint_uri, request.restore_optimizer
        return {
            "source_checkpoint_uri": run.source_checkpoint_uri,
            "restore_optimizer": run.restore_optimizer,
            "trainer": self._caps(True),
            "actor": self._actor(),
            "actor_jwt": self._jwt("training", rid),
        }

    def _run_view(self, run: TrainingRunRecord) -> dict:
        lora = run.lora
        # the protocol's run view carries the training parameters twice: at the top and as `training_params`
        params = {
            "restore_optimizer": run.restore_optimizer,
            "lora_rank": lora.rank,
            "seed": lora.seed,
            "train_mlp": lora.train_mlp,
            "train_attn": lora.train_attn,
            "train_unembed": lora.train_unembed,
        }
        return {
            "training_run_cuid": run.cuid,
            "base_model": self.model_id,
            "service_session_cuid": run.session,
            "workspace_cuid": WORKSPACE,
            "status": run.status,
            "run_index": run.index,
            "model_spec_cuid": "model_local",
            "is_lora": True,
            "source_checkpoint_uri": run.source_checkpoint_uri or None,
            **params,
            "corrupted": False,
            "training_params": dict(params),
            "created_at": iso(run.created),
            "started_at": iso(run.started),
            "updated_at": iso(run.updated),
        }

    def get_training_run(self, _q, _b, caller: Caller, rid) -> dict:
        return self._run_view(self.registry.training_run(rid, caller))

    def list_training_runs(self, query, _b, caller: Caller) -> dict:
        with self.registry.lock:
            items = [self._run_view(r) for r in self.registry.training_runs.values() if caller.may_see(r.owner)]
        return page(items, query, "training_runs")

    def renew_training_run(self, _q, _b, caller: Caller, rid) -> dict:
        run = self.registry.training_run(rid, caller)
        return {"training_run_cuid": rid, "service_session_cuid": run.session, "workspace_cuid": WORKSPACE,
                "actor": self._actor(), "actor_jwt": self._jwt("training", rid)}  # fmt: skip

    def find_by_checkpoint(self, query, _b, caller: Caller) -> dict:
        uri = (query.get("checkpoint_uri") or [""])[0]
        record = self.registry.checkpoint(uri, caller)
        lora = record.lora
        # the name a resume passes back as base_model: this server's where the weights are the same, else the one
        # the checkpoint records ("" where it records none: it cannot be checked, so no server resumes it)
        base = record.base.name if self._base_differs(record) else self.model_id
        return {"base_model": base, "lora_rank": lora.rank, "seed": lora.seed, "train_mlp": lora.train_mlp,
                "train_attn": lora.train_attn, "train_unembed": lora.train_unembed}  # fmt: skip

    def _checkpoint_view(self, c: CheckpointRecord) -> dict:
        run = self.registry.training_runs.get(c.run)
        return {
            "cuid": c.cuid,
            "checkpoint_cuid": c.cuid,
            "training_run_cuid": c.run,
            "workspace_cuid": WORKSPACE,
            "name": c.name,
            "checkpoint_type": "TRAINING" if c.kind == "state" else "SAMPLER",
            "status": "READY",
            "checkpoint_uri": c.uri,
            # the base model it was trained on ("" when it was saved before checkpoints recorded theirs)
            "model": c.base.name if self._base_differs(c) else self.model_alias,
            "base_model": c.base.name,
            "base_model_fingerprint": c.base.fingerprint or None,
            "base_model_served": not self._base_differs(c),  # whether this server can load it
            "model_spec_cuid": "model_local",
            "task_id": c.run,
            "task_created_at": iso(run.created if run else c.created),
            "task_status": run.status if run else "ENDED",
            "step": c.step,
            "path": c.uri,  # the protocol's field; the folder on this machine is no client's business
            "created_at": iso(c.created),
            "uploaded_at": None,
            "size_bytes": c.size,
            "lora_rank": c.lora.rank,
            "is_uploaded": False,
            "expired_at": iso(c.expires),
        }

    def list_run_checkpoints(self, query, _b, caller: Caller, rid) -> dict:
        with self.registry.lock:
            items = [self._checkpoint_view(c) for c in self.registry.visible_checkpoints(caller, rid)]
        if not items:  # a run of an earlier process is known through its checkpoints only
            self.registry.training_run(rid, caller)
        return page(items, query, "checkpoints")

    def list_checkpoints(self, query, _b, caller: Caller) -> dict:
        with self.registry.lock:
            items = [self._checkpoint_view(c) for c in self.registry.visible_checkpoints(caller)]
        return page(items, query, "checkpoints")

    def delete_checkpoint(self, _q, _b, caller: Caller, cid) -> dict:
        record = self.registry.checkpoint_by_cuid(cid, caller)
        self.registry.forget_checkpoint(record.uri, record)
        self._delete_files(record)
        return {}

    def create_sampling_run(self, _q, request: SamplingRunCreateRequest, caller: Caller, sid) -> dict:
        model = self._resolve_base_model(request.base_model)
        if model and request.source_checkpoint_uri:
            raise ApiError(
                400,
                "invalid_request",
                f"checkpoints are adapters of {self.model_alias!r}; model "
                f"{request.base_model!r} is served without one",
            )
        if request.source_checkpoint_uri:
            source = self.registry.checkpoint(request.source_checkpoint_uri, caller)
            self._snapshot(source, with_optimizer=False)
        with self.registry.lock:
            session = self.registry.session(sid, caller)
            run = SamplingRunRecord(
                new_id("sr"), sid, len(session.sampling_runs), request.source_checkpoint_uri, owner=session.owner,
                model=model,
            )  # fmt: skip
            self.registry.sampling_runs[run.cuid] = run
            session.sampling_runs.append(run.cuid)
        return self._created_reply("sampling", run)

    def get_sampling_run(self, _q, _b, caller: Caller, rid) -> dict:
        run = self.registry.sampling_run(rid, caller)
        return {"sampling_run_cuid": rid, "service_session_cuid": run.session, "workspace_cuid": WORKSPACE,
                "status": run.status, "base_model": run.model or self.model_id, "model_id": run.model or self.model_id,
                "alias": run.model or self.model_alias, "source_checkpoint_uri": run.source_checkpoint_uri or None,
                "created_at": iso(run.created), "updated_at": iso(run.created)}  # fmt: skip

    def renew_sampling_run(self, _q, _b, caller: Caller, rid) -> dict:
        run = self.registry.sampling_run(rid, caller)
        return {"sampling_run_cuid": rid, "service_session_cuid": run.session, "workspace_cuid": WORKSPACE,
                "actor": self._actor(), "actor_jwt": self._jwt("sampling", rid)}  # fmt: skip

    def telemetry(self, _q, _b, _caller) -> dict:
        with self.registry.lock:
            self.registry.telemetry_events += 1
        return {"accepted": True}
