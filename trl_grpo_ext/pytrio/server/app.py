"""HTTP front of the local PyTRIO server: Control API under ``/api``, actor API under ``/actor``.

One `ThreadingHTTPServer` serves both; Control hands out ``<base_url>/actor`` as every run's actor endpoint.
Requests and answers follow the schemas in ``pytrio.protocol`` (reused here for validation, so the server accepts
exactly what the 0.2.9 client sends). Errors are ``{"code", "message"}`` bodies with 4xx statuses; 5xx only
come from injected faults, because the client retries 5xx for up to 15 minutes.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import msgpack
import numpy as np

from trl_grpo_ext.pytrio.server.engine import (
    EngineError,
    ForwardDatum,
    LoraSettings,
    LoraSnapshot,
    ModelEngine,
)
from trl_grpo_ext.pytrio.server.events import EventFailure, EventRecord, RunEventQueue
from trl_grpo_ext.pytrio.server.losses import LossConfigError, parse_loss
from trl_grpo_ext.pytrio.server.registry import (
    ApiError,
    CheckpointRecord,
    Registry,
    SamplingRunRecord,
    ServiceSession,
    TrainingRunRecord,
    checkpoint_uri,
    iso,
    new_id,
    safe_name,
)

logger = logging.getLogger(__name__)

WORKSPACE = "ws_local"
USER = "user_local"
ACTOR_CUID = "actor_local"
KNOWN_EVENTS = (
    "trainer.init_run",
    "trainer.forward",
    "trainer.forward_backward",
    "trainer.optimize_step",
    "trainer.save_state",
    "trainer.save_weights",
    "trainer.end_run",
)
SAMPLING_PARAM_KEYS = {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids"}


@dataclass
class ServerConfig:
    """How to start a `LocalPyTrioServer`; every field has a safe default except ``model``."""

    model: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port chosen by the OS
    api_key: str | None = None  # None: a random key, read it from `server.api_key`
    model_name: str | None = None  # alias the client may pass as base_model (besides the path)
    # Checkpoints and their records; None: `default_storage_dir()`, a stable folder, so a restarted server can
    # load_state from an earlier process's checkpoints. ephemeral_storage: a temporary folder removed on stop.
    storage_dir: str | None = None
    ephemeral_storage: bool = False
    device: str | None = None
    dtype: str = "float32"
    max_batch_size: int | None = None  # advertised to the client, which then splits batches into events
    max_tokens_per_request: int | None = None
    max_batch_tokens: int = 4096  # forward/backward: padded tokens per model call (memory of the logits)
    long_poll_seconds: float = 20.0  # below the client's 65 s read timeout for event polls
    snapshot_cache_size: int = 8  # adapter snapshots kept in memory; older ones reload from disk
    max_temporary_checkpoints: int = 8  # per run: save_weights_and_get_sampling_client hand-offs kept
    heartbeat_ms: int = 60_000


@dataclass
class Fault:
    path_contains: str
    status: int
    remaining: int
    method: str | None = None
    hits: int = 0


@dataclass
class FaultInjector:
    """Test hook: answer matching requests with an error status a fixed number of times."""

    faults: list[Fault] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, path_contains: str, status: int = 500, times: int = 1, method: str | None = None) -> Fault:
        fault = Fault(path_contains, status, times, method.upper() if method else None)
        with self.lock:
            self.faults.append(fault)
        return fault

    def take(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.remaining > 0 and fault.path_contains in path and fault.method in (None, method):
                    fault.remaining -= 1
                    fault.hits += 1
                    return fault
        return None


def _wire_tensor(array: np.ndarray) -> dict:
    data = np.ascontiguousarray(array, dtype="<f4")
    return {"dtype": "<f4", "shape": list(data.shape), "encoding": "raw_le", "data": data.tobytes()}


def _validation_message(error: Exception) -> str:
    errors = getattr(error, "errors", None)
    if callable(errors):
        parts = []
        for item in errors(include_url=False, include_input=False):
            loc = ".".join(str(p) for p in item["loc"])
            parts.append(f"{loc}: {item['msg']}" if loc else item["msg"])
        return "; ".join(parts)
    return str(error)


def _validate(model, data: object, code: str, status: int = 400):
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ApiError(status, code, _validation_message(error)) from None


class LocalPyTrioServer:
    """A Control + actor server for the ``pytrio==0.2.9`` client, backed by `ModelEngine`.

    Use as a context manager (or `start`/`stop`); it serves from a background thread. Point the client at it
    with `client_env` (environment variables, read when ``pytrio`` is imported) or `configure_client`.
    """

    def __init__(self, config: ServerConfig, engine: ModelEngine | None = None):
        if importlib.util.find_spec("pytrio") is None:  # its protocol models validate every request
            raise RuntimeError("the local PyTRIO server needs the pytrio client package: pip install 'pytrio==0.2.9'")
        self.config = config
        self.api_key = config.api_key or "trio-local-" + secrets.token_urlsafe(18)
        self.engine = engine or ModelEngine(
            _resolve_model(config.model), device=config.device, dtype=config.dtype,
            max_batch_tokens=config.max_batch_tokens,
        )
        self.model_id = self.engine.model_path
        self.model_alias = config.model_name or _default_alias(config.model, self.model_id)
        self.aliases = {self.model_id, self.model_alias, str(config.model)}
        self.faults = FaultInjector()
        self._queues: dict[str, RunEventQueue] = {}
        self._snapshot_cache: OrderedDict[str, LoraSnapshot] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._own_storage = config.ephemeral_storage
        if config.ephemeral_storage:
            self.storage = Path(tempfile.mkdtemp(prefix="pytrio-server-"))
        else:
            self.storage = Path(config.storage_dir).expanduser() if config.storage_dir else default_storage_dir()
            self.storage.mkdir(parents=True, exist_ok=True)
        self.registry = Registry(self.storage)
        restored = self.registry.load_persisted()
        if restored:
            logger.info("PyTRIO local server: %d checkpoints of earlier processes in %s", restored, self.storage)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.started = time.time()

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> LocalPyTrioServer:
        if self._httpd is not None:
            return self
        handler = _make_handler(self)
        self._httpd = ThreadingHTTPServer((self.config.host, self.config.port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="pytrio-local-server", daemon=True)
        self._thread.start()
        logger.info("PyTRIO local server on %s serving %s (%s)", self.base_url, self.model_alias, self.model_id)
        return self

    def stop(self) -> None:
        self._close_inprocess_clients()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        for q in self._queues.values():
            q.close()
        self._queues.clear()
        if self._own_storage:
            shutil.rmtree(self.storage, ignore_errors=True)
        else:  # sampler hand-offs only serve this process's samplers; durable checkpoints stay for a restart
            with self.registry.lock:
                temporary = [c for c in self.registry.checkpoints.values() if c.visibility == "TEMPORARY"]
            for record in temporary:
                self.registry.forget_checkpoint(record.uri)
                shutil.rmtree(record.path, ignore_errors=True)

    def _close_inprocess_clients(self) -> None:
        """Shut down this process's pytrio runtimes bound to this server while it still answers.

        A `ServiceClient` closes its session when garbage-collected or at interpreter exit; against a stopped
        server that close would retry connection errors for ``control_retry_timeout_seconds`` (15 min).
        """
        if self._httpd is None:
            return
        runtime_module = sys.modules.get("pytrio.runtime.service")
        if runtime_module is None:  # pytrio never imported here: no in-process clients (and no slow import)
            return
        with runtime_module._active_service_runtimes_lock:
            runtimes = list(runtime_module._active_service_runtimes)
        for runtime in runtimes:
            if getattr(runtime.configuration, "base_url", None) == self.base_url:
                try:
                    runtime.shutdown()
                except Exception:  # noqa: BLE001 - best effort; the server stops regardless
                    logger.debug("could not shut down a pytrio runtime", exc_info=True)

    def __enter__(self) -> LocalPyTrioServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("server is not started")
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def client_env(self) -> dict[str, str]:
        """Environment variables that point a ``pytrio`` process at this server (read at ``import pytrio``)."""
        return {"PYTRIO_BASE_URL": self.base_url, "PYTRIO_API_KEY": self.api_key}

    def configure_client(self, **options) -> None:
        """Point the already-imported ``pytrio`` at this server; extra options go to `pytrio.configure`."""
        import pytrio

        pytrio.configure(api_key=self.api_key, base_url=self.base_url, **options)

    def revoke_actor_tokens(self) -> int:
        """Expire every actor token now (tests of the client's 401 -> renew path)."""
        return self.registry.revoke_tokens()

    # ---------------------------------------------------------------- shared helpers
    def _actor(self) -> dict:
        return {
            "actor_cuid": ACTOR_CUID,
            "endpoint": f"{self.base_url}/actor",
            "connect_mode": "direct",
            "tls_enabled": False,
            "tls_cert_pem": None,
            "tls_not_after": None,
        }

    def _jwt(self, kind: str, run: str) -> dict:
        token = self.registry.issue_token(kind, run)
        return {"token": token.token, "expires_at": token.expires.isoformat()}

    def _caps(self, training: bool) -> dict:
        max_seq = self.engine.max_seq_len
        return {
            "max_batch_size": self.config.max_batch_size if training else None,
            "max_tokens_per_request": self.config.max_tokens_per_request if training else None,
            "max_seq_len": max_seq,
        }

    def _resolve_base_model(self, name: str) -> None:
        if name not in self.aliases:
            raise ApiError(
                404, "model_not_found", f"model {name!r} is not served here; use one of {sorted(self.aliases)}"
            )

    # ---------------------------------------------------------------- control API
    def verify(self, _q, _b) -> dict:
        return {
            "api_key_tid": "key_local",
            "api_key_name": "local",
            "user_cuid": USER,
            "username": "local",
            "display_name": "Local PyTRIO server",
            "workspace_cuid": WORKSPACE,
            "workspace_name": "local",
            "workspace_type": "PERSONAL",
            "expires_at": None,
        }

    def bootstrap(self, query, _b) -> dict:
        version = (query.get("sdk_version") or ["unknown"])[0]
        return {"compatibility": {"status": "compatible", "sdk_version": version}, "notices": []}

    def models(self, query, _b) -> dict:
        created = iso(self.started)
        item = {
            "cuid": "model_local",
            "alias": self.model_alias,
            "model_id": self.model_id,
            "display_name": self.model_alias,
            "context_length": self.engine.max_seq_len,
            "train_available": True,
            "sample_available": True,
            "trainer": self._caps(True),
            "sampler": self._caps(False),
            "created_at": created,
            "updated_at": created,
        }
        offset = int((query.get("offset") or ["0"])[0])
        return {"items": [item][offset:], "total": 1, "limit": 100, "offset": offset}

    def create_session(self, _q, body) -> dict:
        from pytrio.protocol.control.service_session.create import ServiceSessionCreateRequest

        request = _validate(ServiceSessionCreateRequest, body, "invalid_request")
        session = ServiceSession(new_id("ss"), request.sdk_version)
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

    def get_session(self, _q, _b, sid) -> dict:
        session = self.registry.sessions.get(sid)
        if session is None:
            raise ApiError(404, "service_session_not_found", f"service session {sid} not found")
        return self._session_view(session)

    def list_sessions(self, query, _b) -> dict:
        with self.registry.lock:
            items = [self._session_view(s, brief=True) for s in self.registry.sessions.values()]
        return _page(items, query, "service_sessions")

    def renew_session(self, _q, _b, sid) -> dict:
        session = self.registry.session(sid)
        session.updated = time.time()
        return {"service_session_cuid": sid, "workspace_cuid": WORKSPACE, "status": session.status,
                "updated_at": iso(session.updated)}  # fmt: skip

    def close_session(self, _q, body, sid) -> dict:
        from pytrio.protocol.control.service_session.close import ServiceSessionCloseRequest

        request = _validate(ServiceSessionCloseRequest, body, "invalid_request")
        with self.registry.lock:
            session = self.registry.sessions.get(sid)
            if session is None:
                raise ApiError(404, "service_session_not_found", f"service session {sid} not found")
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

    def create_training_run(self, _q, body, sid) -> dict:
        from pytrio.protocol.control.training_run.create import TrainingRunCreateRequest

        request = _validate(TrainingRunCreateRequest, body, "invalid_request")
        if not 1 <= request.lora_rank <= 256:
            raise ApiError(400, "invalid_lora_rank", f"lora_rank must be in [1, 256], got {request.lora_rank}")
        lora = LoraSettings(
            request.lora_rank, request.seed, request.train_mlp, request.train_attn, request.train_unembed
        )
        if request.source_checkpoint_uri:
            source = self.registry.checkpoint(request.source_checkpoint_uri)
            lora = source.lora if not request.base_model else lora
        elif not request.base_model:
            raise ApiError(400, "invalid_request", "base_model is required without source_checkpoint_uri")
        if request.base_model:
            self._resolve_base_model(request.base_model)
        with self.registry.lock:
            session = self.registry.session(sid)
            run = TrainingRunRecord(
                new_id("tr"),
                sid,
                len(session.training_runs),
                lora,
                request.source_checkpoint_uri,
                request.restore_optimizer,
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
            "model_alias": self.model_alias,
            "model_id": self.model_id,
            "trainer" if training else "sampler": self._caps(training),
            "actor": self._actor(),
            "actor_jwt": self._jwt(kind, run.cuid),
            "created_at": iso(run.created),
        }

    def update_training_run(self, _q, body, sid, rid) -> dict:
        from pytrio.protocol.control.training_run.update import TrainingRunUpdateRequest

        request = _validate(TrainingRunUpdateRequest, body, "invalid_request")
        run = self.registry.training_run(rid)
        if run.session != sid:
            raise ApiError(404, "training_run_not_found", f"training run {rid} is not in session {sid}")
        if rid in self.engine.runs:
            raise ApiError(409, "run_already_initialized", "the trainer is initialized; load state before training")
        source = self.registry.checkpoint(request.source_checkpoint_uri)
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
            "restore_optimizer": run.restore_optimizer,
            "lora_rank": lora.rank,
            "seed": lora.seed,
            "train_mlp": lora.train_mlp,
            "train_attn": lora.train_attn,
            "train_unembed": lora.train_unembed,
            "corrupted": False,
            "training_params": {
                "restore_optimizer": run.restore_optimizer,
                "lora_rank": lora.rank,
                "seed": lora.seed,
                "train_mlp": lora.train_mlp,
                "train_attn": lora.train_attn,
                "train_unembed": lora.train_unembed,
            },
            "created_at": iso(run.created),
            "started_at": iso(run.started),
            "updated_at": iso(run.updated),
        }

    def get_training_run(self, _q, _b, rid) -> dict:
        return self._run_view(self.registry.training_run(rid))

    def list_training_runs(self, query, _b) -> dict:
        with self.registry.lock:
            items = [self._run_view(r) for r in self.registry.training_runs.values()]
        return _page(items, query, "training_runs")

    def renew_training_run(self, _q, _b, rid) -> dict:
        run = self.registry.training_run(rid)
        return {"training_run_cuid": rid, "service_session_cuid": run.session, "workspace_cuid": WORKSPACE,
                "actor": self._actor(), "actor_jwt": self._jwt("training", rid)}  # fmt: skip

    def find_by_checkpoint(self, query, _b) -> dict:
        uri = (query.get("checkpoint_uri") or [""])[0]
        record = self.registry.checkpoint(uri)
        lora = record.lora
        return {"base_model": self.model_id, "lora_rank": lora.rank, "seed": lora.seed, "train_mlp": lora.train_mlp,
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
            "model": self.model_alias,
            "base_model": self.model_id,
            "model_spec_cuid": "model_local",
            "task_id": c.run,
            "task_created_at": iso(run.created if run else c.created),
            "task_status": run.status if run else "ENDED",
            "step": c.step,
            "path": str(c.path),
            "created_at": iso(c.created),
            "uploaded_at": None,
            "size_bytes": c.size,
            "lora_rank": c.lora.rank,
            "is_uploaded": False,
            "expired_at": iso(c.expires),
        }

    def list_run_checkpoints(self, query, _b, rid) -> dict:
        with self.registry.lock:
            items = [self._checkpoint_view(c) for c in self.registry.checkpoints.values() if c.run == rid]
        if not items:  # a run of an earlier process is known through its checkpoints only
            self.registry.training_run(rid)
        return _page(items, query, "checkpoints")

    def list_checkpoints(self, query, _b) -> dict:
        with self.registry.lock:
            items = [self._checkpoint_view(c) for c in self.registry.checkpoints.values()]
        return _page(items, query, "checkpoints")

    def delete_checkpoint(self, _q, _b, cid) -> dict:
        record = self.registry.checkpoint_by_cuid(cid)
        self.registry.forget_checkpoint(record.uri)
        shutil.rmtree(record.path, ignore_errors=True)
        return {}

    def checkpoint_download(self, _q, _b, cid) -> dict:
        record = self.registry.checkpoint_by_cuid(cid)
        raise ApiError(
            501, "not_implemented", f"downloads are not served locally; the checkpoint folder is {record.path}"
        )

    def create_sampling_run(self, _q, body, sid) -> dict:
        from pytrio.protocol.control.sampling_run.create import SamplingRunCreateRequest

        request = _validate(SamplingRunCreateRequest, body, "invalid_request")
        self._resolve_base_model(request.base_model)
        if request.source_checkpoint_uri:
            self._snapshot(self.registry.checkpoint(request.source_checkpoint_uri), with_optimizer=False)
        with self.registry.lock:
            session = self.registry.session(sid)
            run = SamplingRunRecord(new_id("sr"), sid, len(session.sampling_runs), request.source_checkpoint_uri)
            self.registry.sampling_runs[run.cuid] = run
            session.sampling_runs.append(run.cuid)
        return self._created_reply("sampling", run)

    def get_sampling_run(self, _q, _b, rid) -> dict:
        run = self.registry.sampling_run(rid)
        return {"sampling_run_cuid": rid, "service_session_cuid": run.session, "workspace_cuid": WORKSPACE,
                "status": run.status, "base_model": self.model_id, "model_id": self.model_id,
                "alias": self.model_alias, "source_checkpoint_uri": run.source_checkpoint_uri or None,
                "created_at": iso(run.created), "updated_at": iso(run.created)}  # fmt: skip

    def renew_sampling_run(self, _q, _b, rid) -> dict:
        run = self.registry.sampling_run(rid)
        return {"sampling_run_cuid": rid, "service_session_cuid": run.session, "workspace_cuid": WORKSPACE,
                "actor": self._actor(), "actor_jwt": self._jwt("sampling", rid)}  # fmt: skip

    def telemetry(self, _q, _b) -> dict:
        with self.registry.lock:
            self.registry.telemetry_events += 1
        return {"accepted": True}

    # ---------------------------------------------------------------- actor API
    def submit_event(self, token, raw: bytes) -> tuple[int, dict]:
        from pytrio.protocol.actor.events.event import EventEnvelope

        try:
            data = msgpack.unpackb(raw, raw=False)
        except Exception as error:  # noqa: BLE001 - any undecodable body is a client error
            raise ApiError(400, "invalid_envelope", f"event body is not valid MessagePack: {error}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "invalid_envelope", "event body must be a MessagePack map")
        event_type = data.get("type")
        if event_type not in KNOWN_EVENTS:
            raise ApiError(
                400,
                "unknown_event_type",
                f"unknown event type {event_type!r}; this server handles {list(KNOWN_EVENTS)}",
            )
        envelope = _validate(EventEnvelope, data, "invalid_envelope")
        run_id = envelope.metadata.run_id
        if token.kind != "training" or token.run != run_id:
            raise ApiError(403, "run_mismatch", f"this actor token does not grant access to run {run_id}")
        run = self.registry.training_run(run_id)
        if run.status in ("ENDED", "CANCELLED"):
            raise ApiError(409, "run_ended", f"training run {run_id} is {run.status}")
        record = EventRecord(envelope.event_id, event_type, run_id, envelope.payload)
        with self.registry.lock:
            q = self._queues.get(run_id)
            if q is None:
                q = self._queues[run_id] = RunEventQueue(run_id, self._handle_event)
        if q.submit(record) is not None:
            raise ApiError(409, "event_exists", f"event {envelope.event_id} was already submitted")
        return 202, record.wire()

    def get_event(self, token, event_id: str, wait: float) -> dict:
        q = self._queues.get(token.run)
        record = q.get(event_id) if q is not None else None
        if record is None:
            raise ApiError(404, "event_not_found", f"event {event_id} not found for run {token.run}")
        record.done.wait(max(0.0, min(wait, self.config.long_poll_seconds)))
        return record.wire()

    def sample(self, token, rid: str, body: dict) -> dict:
        from pytrio.protocol.actor.sampling_run.sample import SampleRequest

        if token.kind != "sampling" or token.run != rid:
            raise ApiError(403, "run_mismatch", f"this actor token does not grant access to sampling run {rid}")
        run = self.registry.sampling_run(rid)
        request = _validate(SampleRequest, body, "invalid_sample_request")
        params = dict(request.sampling_params)
        unknown = sorted(set(params) - SAMPLING_PARAM_KEYS)
        if unknown:
            raise ApiError(400, "invalid_sampling_params", f"unsupported sampling params {unknown}")
        prompt = _tokens(request.prompt)
        snapshot = None
        if run.source_checkpoint_uri:
            snapshot = self._snapshot(self.registry.checkpoint(run.source_checkpoint_uri), with_optimizer=False)
        stop = params.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        try:
            results = self.engine.sample(
                snapshot,
                prompt,
                num_samples=request.num_samples,
                max_tokens=int(params["max_tokens"]),
                temperature=float(params.get("temperature", 1.0)),
                top_k=int(params.get("top_k", -1)),
                top_p=float(params.get("top_p", 1.0)),
                seed=params.get("seed"),
                stop=list(stop or []),
                stop_token_ids=[int(t) for t in params.get("stop_token_ids") or []],
                return_text=request.return_text,
            )
            prompt_logprobs, topk = None, None
            if request.return_prompt_logprobs or request.topk_prompt_logprobs:
                prompt_logprobs, topk = self.engine.prompt_logprobs(snapshot, prompt, request.topk_prompt_logprobs)
        except EngineError as error:
            raise ApiError(400, error.code, error.message) from None
        except (TypeError, ValueError) as error:
            raise ApiError(400, "invalid_sampling_params", str(error)) from None
        return {
            "request_id": request.request_id,
            "sampling_run": rid,
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

    # ---------------------------------------------------------------- event handlers (worker threads)
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

    def _payload(self, model, record: EventRecord):
        from pydantic import ValidationError

        try:
            return model.model_validate(record.payload)
        except ValidationError as error:
            raise EventFailure("invalid_payload", f"{record.type}: {_validation_message(error)}") from None

    def _snapshot(self, record: CheckpointRecord, with_optimizer: bool) -> LoraSnapshot:
        """The checkpoint's weights, from the in-memory cache of recent snapshots or from disk."""
        with self._cache_lock:
            cached = self._snapshot_cache.get(record.uri)
            if cached is not None and cached.uid == record.snapshot_uid:
                self._snapshot_cache.move_to_end(record.uri)
                if cached.optimizer is not None or not with_optimizer:
                    return cached
        if not record.path.is_dir():
            raise ApiError(410, "checkpoint_gone", f"checkpoint files of {record.uri} are gone")
        snapshot = LoraSnapshot.load(record.path, with_optimizer)
        snapshot.uid = record.snapshot_uid  # same weights: a sampler slot holding them needs no reload
        self._remember(record.uri, snapshot)
        return snapshot

    def _remember(self, uri: str, snapshot: LoraSnapshot) -> None:
        with self._cache_lock:
            self._snapshot_cache[uri] = snapshot
            self._snapshot_cache.move_to_end(uri)
            while len(self._snapshot_cache) > self.config.snapshot_cache_size:
                self._snapshot_cache.popitem(last=False)

    def _prune_temporary(self, run: str) -> None:
        """Keep the newest `max_temporary_checkpoints` TEMPORARY checkpoints of `run` (sampler hand-offs)."""
        with self.registry.lock:
            temporary = [c for c in self.registry.checkpoints.values() if c.run == run and c.visibility == "TEMPORARY"]
            temporary.sort(key=lambda c: c.created)
            stale = temporary[: max(0, len(temporary) - self.config.max_temporary_checkpoints)]
            for record in stale:
                self.registry.forget_checkpoint(record.uri)
        for record in stale:
            with self._cache_lock:
                self._snapshot_cache.pop(record.uri, None)
            shutil.rmtree(record.path, ignore_errors=True)

    def _ev_init(self, record: EventRecord) -> dict:
        from pytrio.protocol.actor.events.trainer.init_run import TrainerInitRunPayload

        payload = self._payload(TrainerInitRunPayload, record)
        if payload.base_model not in self.aliases:
            raise EventFailure("model_not_found", f"base model {payload.base_model!r} is not served here")
        run = self.registry.training_run(record.run)
        c = payload.lora_config
        lora = LoraSettings(c.rank, c.seed, c.train_mlp, c.train_attn, c.train_unembed)
        source = None
        if payload.checkpoint_uri:
            source = self._snapshot(self.registry.checkpoint(payload.checkpoint_uri), payload.load_optimizer)
        self.engine.create_run(record.run, lora, source, load_optimizer=payload.load_optimizer)
        run.status, run.started, run.updated = "RUNNING", time.time(), time.time()
        return {"training_run_cuid": record.run, "step": self.engine.runs[record.run].step}

    def _ev_forward(self, record: EventRecord) -> dict:
        from pytrio.protocol.actor.events.trainer.forward import TrainerForwardBackwardPayload

        payload = self._payload(TrainerForwardBackwardPayload, record)
        try:
            spec = parse_loss(payload.loss.type, payload.loss.config)
        except LossConfigError as error:
            raise EventFailure("invalid_loss_config", str(error)) from None
        data = []
        for i, d in enumerate(payload.data):
            tokens = _tokens(d.model_input, event=True)
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
            data.append(
                ForwardDatum(
                    tokens, d.target_ids, fields.get("weights"), fields.get("logprobs"), fields.get("advantages")
                )
            )
        backward = record.type == "trainer.forward_backward"
        outputs, metrics = self.engine.forward(
            record.run, data, spec, backward=backward, auto_shift=payload.auto_shift
        )
        count = metrics["token_count"]
        record.usage = {
            "input_tokens": sum(len(d.tokens) for d in data),
            "output_tokens": 0,
            "train_tokens": count if backward else 0,
        }
        return {
            "loss_fn_outputs": [{k: _wire_tensor(v) for k, v in out.items()} for out in outputs],
            "metrics": {
                "loss_sum": metrics["loss_sum"],
                "loss_mean": metrics["loss_sum"] / count if count else 0.0,
                "token_count": count,
            },
        }

    def _ev_optim(self, record: EventRecord) -> dict:
        from pytrio.protocol.actor.events.trainer.optimize_step import TrainerOptimizeStepPayload

        payload = self._payload(TrainerOptimizeStepPayload, record)
        adam = payload.adam_params.model_dump()
        if adam["learning_rate"] < 0 or not (0 <= adam["beta1"] < 1 and 0 <= adam["beta2"] < 1) or adam["eps"] <= 0:
            raise EventFailure("invalid_adam_params", f"invalid AdamW parameters {adam}")
        return {"metrics": self.engine.optim_step(record.run, adam)}

    def _ev_save(self, record: EventRecord) -> dict:
        from pytrio.protocol.actor.events.trainer.save import TrainerSavePayload

        payload = self._payload(TrainerSavePayload, record)
        kind = "state" if record.type == "trainer.save_state" else "sampler"
        if not safe_name(payload.name):
            raise EventFailure(
                "invalid_checkpoint_name", f"checkpoint name {payload.name!r}: use letters, digits, '_', '-', '.'"
            )
        uri = checkpoint_uri(record.run, kind, payload.name)
        with self.registry.lock:
            existing = self.registry.checkpoints.get(uri)
        if existing is not None and not payload.overwrite:
            raise EventFailure("checkpoint_exists", f"{uri} exists; pass overwrite=True or choose another name")
        snapshot = self.engine.snapshot(record.run, with_optimizer=kind == "state")
        folder = self.storage / record.run / ("weights" if kind == "state" else "sampler_weights") / payload.name
        shutil.rmtree(folder, ignore_errors=True)
        size = snapshot.save(folder, self.model_id, self.engine.peft_config(snapshot.lora))
        checkpoint = CheckpointRecord(
            new_id("ckpt"), uri, record.run, payload.name, kind, folder, snapshot.lora, size, payload.visibility,
            snapshot.step, snapshot_uid=snapshot.uid,
            expires=time.time() + payload.ttl_seconds if payload.ttl_seconds else None,
        )  # fmt: skip
        self.registry.add_checkpoint(checkpoint)
        self._remember(uri, snapshot)
        if payload.visibility == "TEMPORARY":
            self._prune_temporary(record.run)
        return {
            "checkpoint": {
                "uri": uri,
                "model_id": self.model_id,
                "size_bytes": size,
                "checkpoint_cuid": checkpoint.cuid,
                "name": payload.name,
                "path": str(folder),
            }
        }

    def _ev_end(self, record: EventRecord) -> dict:
        self.engine.drop_run(record.run)
        run = self.registry.training_run(record.run)
        run.status, run.updated = "ENDED", time.time()
        return {}


def default_storage_dir() -> Path:
    """``$TRL_GRPO_EXT_CACHE/pytrio-server`` (default ``~/.cache/trl_grpo_ext/pytrio-server``): the same folder
    for every server of this user, so a restarted one finds earlier checkpoints."""
    from trl_grpo_ext.models import cache_dir

    return cache_dir() / "pytrio-server"


def _tokens(model_input, event: bool = False) -> list[int]:
    tokens: list[int] = []
    for chunk in model_input.chunks:
        if getattr(chunk, "type", "") != "encoded_text":
            message = "image chunks are not supported by the local server (text models only)"
            if event:
                raise EventFailure("unsupported_input", message)
            raise ApiError(400, "unsupported_input", message)
        tokens.extend(chunk.tokens)
    return tokens


def _page(items: list, query: dict, key: str) -> dict:
    offset = int((query.get("offset") or ["0"])[0])
    limit = int((query.get("limit") or ["100"])[0])
    return {key: items[offset : offset + limit], "cursor": {"offset": offset, "limit": limit, "total": len(items)}}


def _resolve_model(model: str) -> str:
    if str(model).strip().lower() == "embedded":
        from trl_grpo_ext.models import resolve_model  # lazy: only the embedded model needs it

        return resolve_model(model)
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


def _default_alias(requested: str, model_id: str) -> str:
    if str(requested).strip().lower() == "embedded":
        return "embedded"
    return Path(model_id).name or model_id


_CONTROL_ROUTES: list[tuple[str, re.Pattern, str]] = [
    (m, re.compile(f"^/api/{p}$"), h)
    for m, p, h in [
        ("GET", r"openapi/v1/api-key/verify", "verify"),
        ("GET", r"sdk/bootstrap", "bootstrap"),
        ("GET", r"models", "models"),
        ("POST", r"openapi/v1/service-sessions", "create_session"),
        ("GET", r"openapi/v1/service-sessions", "list_sessions"),
        ("GET", r"openapi/v1/service-sessions/([\w-]+)", "get_session"),
        ("POST", r"openapi/v1/service-sessions/([\w-]+)/renew", "renew_session"),
        ("POST", r"openapi/v1/service-sessions/([\w-]+)/close", "close_session"),
        ("POST", r"openapi/v1/service-sessions/([\w-]+)/training-runs", "create_training_run"),
        ("PATCH", r"openapi/v1/service-sessions/([\w-]+)/training-runs/([\w-]+)", "update_training_run"),
        ("POST", r"openapi/v1/service-sessions/([\w-]+)/sampling-runs", "create_sampling_run"),
        ("GET", r"openapi/v1/training-runs", "list_training_runs"),
        ("GET", r"openapi/v1/training-runs/by-checkpoint-uri", "find_by_checkpoint"),
        ("GET", r"openapi/v1/training-runs/([\w-]+)", "get_training_run"),
        ("GET", r"openapi/v1/training-runs/([\w-]+)/checkpoints", "list_run_checkpoints"),
        ("POST", r"openapi/v1/training-runs/([\w-]+)/renew", "renew_training_run"),
        ("GET", r"openapi/v1/sampling-runs/([\w-]+)", "get_sampling_run"),
        ("POST", r"openapi/v1/sampling-runs/([\w-]+)/renew", "renew_sampling_run"),
        ("GET", r"openapi/v1/checkpoints", "list_checkpoints"),
        ("GET", r"openapi/v1/checkpoints/([\w-]+)/download-url", "checkpoint_download"),
        ("DELETE", r"openapi/v1/checkpoints/([\w-]+)", "delete_checkpoint"),
        ("POST", r"telemetry/event", "telemetry"),
    ]
]
_EVENT_GET = re.compile(r"^/actor/v1/events/([\w-]+)$")
_SAMPLE = re.compile(r"^/actor/v1/sampling-runs/([\w-]+)/sample$")
_WAIT = re.compile(r"wait=(\d+(?:\.\d+)?)")


def _make_handler(server: LocalPyTrioServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "trl-grpo-ext-pytrio/0.1"

        def log_message(self, fmt, *args):  # request lines only: tokens travel in headers, never logged
            logger.debug("%s %s", self.address_string(), fmt % args)

        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _send(self, status: int, body: object, msgpack_body: bool = False) -> None:
            if msgpack_body:
                payload, ctype = msgpack.packb(body, use_bin_type=True), "application/msgpack"
            else:
                payload, ctype = json.dumps(body).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("X-Request-Id", secrets.token_hex(6))
            self.end_headers()
            self.wfile.write(payload)

        def _bearer(self) -> str | None:
            value = self.headers.get("Authorization", "")
            return value[7:].strip() if value.startswith("Bearer ") else None

        def _dispatch(self, method: str) -> None:
            raw = self._body()
            url = urlsplit(self.path)
            path, query = url.path.rstrip("/") or "/", parse_qs(url.query)
            wants_msgpack = "msgpack" in self.headers.get("Accept", "") and path.startswith("/actor/v1/events")
            try:
                fault = server.faults.take(method, path)
                if fault is not None:
                    raise ApiError(fault.status, "injected_fault", f"injected HTTP {fault.status} for tests")
                if path.startswith("/api/"):
                    self._control(method, path, query, raw)
                elif path.startswith("/actor/"):
                    self._actor(method, path, raw)
                else:
                    raise ApiError(404, "not_found", f"no route {method} {path}")
            except (BrokenPipeError, ConnectionResetError):  # the client gave up on this request
                logger.debug("client closed the connection during %s %s", method, path)
                self.close_connection = True
            except ApiError as error:
                self._send(error.status, {"code": error.code, "message": error.message}, wants_msgpack)
            except Exception as error:  # noqa: BLE001 - 4xx, not 5xx: the client would retry a 500 for minutes
                logger.exception("request %s %s failed", method, path)
                self._send(
                    422, {"code": "internal_error", "message": f"{type(error).__name__}: {error}"}, wants_msgpack
                )

        def _control(self, method: str, path: str, query: dict, raw: bytes) -> None:
            key = self._bearer() or self.headers.get("X-API-Key")
            if not key or not secrets.compare_digest(key.encode(), server.api_key.encode()):
                raise ApiError(401, "unauthorized", "invalid API key for this local PyTRIO server")
            for route_method, pattern, name in _CONTROL_ROUTES:
                match = pattern.match(path)
                if match and route_method == method:
                    body = {}
                    if raw and name != "telemetry":
                        try:
                            body = json.loads(raw)
                        except ValueError as error:
                            raise ApiError(400, "invalid_json", f"request body is not JSON: {error}") from None
                    result = getattr(server, name)(query, body, *match.groups())
                    self._send(200, result)
                    return
            raise ApiError(404, "not_found", f"no route {method} {path}")

        def _actor(self, method: str, path: str, raw: bytes) -> None:
            token = server.registry.check_token(self._bearer())
            if method == "POST" and path == "/actor/v1/events":
                status, body = server.submit_event(token, raw)
                self._send(status, body, msgpack_body=True)
            elif method == "GET" and (match := _EVENT_GET.match(path)):
                wait = _WAIT.search(self.headers.get("Prefer", ""))
                body = server.get_event(token, match.group(1), float(wait.group(1)) if wait else 0.0)
                self._send(200, body, msgpack_body=True)
            elif method == "POST" and path == "/actor/v1/client/heartbeat":
                self._send(200, {"heartbeat_ms": server.config.heartbeat_ms})
            elif method == "POST" and (match := _SAMPLE.match(path)):
                try:
                    body = json.loads(raw or b"{}")
                except ValueError as error:
                    raise ApiError(400, "invalid_json", f"request body is not JSON: {error}") from None
                self._send(200, server.sample(token, match.group(1), body))
            else:
                raise ApiError(404, "not_found", f"no route {method} {path}")

        def do_GET(self):  # noqa: N802 - http.server naming
            self._dispatch("GET")

        def do_POST(self):  # noqa: N802
            self._dispatch("POST")

        def do_PATCH(self):  # noqa: N802
            self._dispatch("PATCH")

        def do_DELETE(self):  # noqa: N802
            self._dispatch("DELETE")

    return Handler
