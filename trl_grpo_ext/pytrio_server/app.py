"""The local PyTRIO server: Control API under ``/api``, actor API under ``/actor``, one model engine.

One Starlette app served by uvicorn (`routes`, `serving`) answers both; Control hands out ``<base_url>/actor`` as
every run's actor endpoint. Requests and answers follow the schemas in ``pytrio.protocol`` (the client's own models
validate them, so the server accepts exactly what the 0.2.8 and 0.2.9 clients send). This module holds the lifecycle
and what every handler shares; the handlers are in `control` (Control API), `actor` (events, sampling), `training`
(``trainer.*`` events), `checkpoints` (snapshot cache, base-model check, retention) and `downloads`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path

from trl_grpo_ext.compat import pytrio_configure_options
from trl_grpo_ext.models import EMBEDDED_NAME, is_embedded, resolve_model
from trl_grpo_ext.pytrio_server.actor import ActorHandlers
from trl_grpo_ext.pytrio_server.adapters import LoraSnapshot
from trl_grpo_ext.pytrio_server.checkpoints import CheckpointStore
from trl_grpo_ext.pytrio_server.clients import KeyRing
from trl_grpo_ext.pytrio_server.config import ServerConfig, default_storage_dir, split_sampling_model
from trl_grpo_ext.pytrio_server.control import ControlHandlers
from trl_grpo_ext.pytrio_server.downloads import CheckpointDownloads
from trl_grpo_ext.pytrio_server.engine import ModelEngine
from trl_grpo_ext.pytrio_server.errors import ApiError
from trl_grpo_ext.pytrio_server.events import RunEventQueue, started_future
from trl_grpo_ext.pytrio_server.inprocess import (
    close_clients_of,
    defer_client_closes,
    mark_server_thread,
    server_thread,
)
from trl_grpo_ext.pytrio_server.memory import MemoryGate, default_budget, gib, tune_allocator
from trl_grpo_ext.pytrio_server.openai_api import OpenAIHandlers
from trl_grpo_ext.pytrio_server.registry import Registry, StorageScan, new_id
from trl_grpo_ext.pytrio_server.routes import create_app
from trl_grpo_ext.pytrio_server.sampling import SamplingBatcher
from trl_grpo_ext.pytrio_server.serving import BackgroundServer
from trl_grpo_ext.pytrio_server.storage import StorageKey, prepare_root
from trl_grpo_ext.pytrio_server.training import TrainingHandlers
from trl_grpo_ext.pytrio_server.wire import ACTOR_CUID

__all__ = ["LocalPyTrioServer", "ServerConfig", "default_storage_dir"]

logger = logging.getLogger(__name__)

# Threads that run the handlers' blocking work (registry, checkpoint files, model calls of a prompt-logprob answer).
# A request holds one only while that work runs: waits for an event or a decode batch hold none.
REQUEST_THREADS = 32
HOUSEKEEPING_SECONDS = 30.0  # how often expired checkpoints are deleted (and idle sessions looked for, at most)


class LocalPyTrioServer(
    ControlHandlers, ActorHandlers, OpenAIHandlers, TrainingHandlers, CheckpointStore, CheckpointDownloads
):
    """A Control + actor server for the ``pytrio`` client (0.2.8, 0.2.9), backed by `ModelEngine`.

    Use as a context manager (or `start`/`stop`); it serves from a background thread. Point the client at it
    with `client_env` (environment variables, read when ``pytrio`` is imported) or `configure_client`.
    `app` is the Starlette app it serves.
    """

    def __init__(self, config: ServerConfig, engine: ModelEngine | None = None):
        self.config = config
        tune_allocator()  # before the model loads: freed activations go back to the system
        client_keys = [k for k in (config.api_key, *config.api_keys) if k]
        self.keys = KeyRing(client_keys, config.admin_keys) if client_keys else KeyRing.generate()
        self.api_key = self.keys.primary
        self._own_storage = config.ephemeral_storage
        if not config.ephemeral_storage:  # before the model loads: a storage key it refuses is one line at once
            storage = Path(config.storage_dir).expanduser() if config.storage_dir else default_storage_dir()
            prepare_root(storage)
            self.storage = storage.resolve()  # once: what lies below it is reached without following links
            storage_key = StorageKey.of(self.storage)
        self.engine = engine or ModelEngine(
            _resolve_model(config.model),
            device=config.device,
            dtype=config.dtype,
            bf16=config.bf16,
            bf16_sampling=config.bf16_sampling,
            max_batch_tokens=config.max_batch_tokens,
            share_prefix=config.share_prefix,
            vision=config.vision,
            concurrent_sampling=config.concurrent_sampling,
        )
        self.model_id = self.engine.model_path
        # what a client may pass as base_model: the served names (the first is reported), path, default alias
        self.served_names = tuple(dict.fromkeys(config.served_names))
        self.model_alias = self.served_names[0] if self.served_names else _default_alias(config.model, self.model_id)
        self.aliases = {self.model_id, self.model_alias, str(config.model), *self.served_names}
        self.memory = MemoryGate(config.memory_budget_bytes or default_budget())
        logger.info("PyTRIO local server: working memory budget %s", gib(self.memory.budget))
        logger.info("PyTRIO local server: %s", self.engine.precision.line())
        self.sampler = SamplingBatcher(self.engine.for_sampling, config.max_sampling_rows, self.memory)
        # sampling-only base models (`ServerConfig.sampling_models`): engine and decode batcher each, one budget
        self.sampling_models: dict[str, SamplingModel] = {}
        for entry in config.sampling_models:  # each trains nothing: one model object, one lock
            requested, served_name = split_sampling_model(entry)
            engine = ModelEngine(_resolve_model(requested), device=config.device, dtype=config.dtype,
                                 bf16=config.bf16, bf16_sampling=config.bf16_sampling,
                                 max_batch_tokens=config.max_batch_tokens,
                                 share_prefix=config.share_prefix, vision=config.vision,
                                 concurrent_sampling=False)  # fmt: skip
            names = {engine.model_path, str(requested), _default_alias(requested, engine.model_path)}
            names |= {served_name} if served_name else set()
            if names & (self.aliases | {n for m in self.sampling_models.values() for n in m.names}):
                raise ValueError(f"sampling model {requested!r} has a name another served model has: {sorted(names)}")
            alias = served_name or _default_alias(requested, engine.model_path)
            model = SamplingModel(engine, SamplingBatcher(engine, config.max_sampling_rows, self.memory), names, alias)
            self.sampling_models[engine.model_path] = model
            logger.info("PyTRIO local server: also serving %s for sampling (%s)", requested, engine.model_path)
        self._queues: dict[str, RunEventQueue] = {}
        self._snapshot_cache: OrderedDict[str, LoraSnapshot] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._download_key = secrets.token_bytes(32)  # signs this process's download URLs (`downloads`)
        if config.ephemeral_storage:
            self.storage = Path(tempfile.mkdtemp(prefix="pytrio-server-")).resolve()
            storage_key = StorageKey.of(self.storage)
        # this process's id: its stop removes the TEMPORARY checkpoints it saved, never another server's
        self.server_id = new_id("srv")
        self.registry = Registry(self.storage, self.keys.legacy_owner, storage_key)
        adopt_on = self.engine.base_model if config.adopt_unsigned_checkpoints else None
        self._report_scan(self.registry.load_persisted(adopt_on))
        self.expire_checkpoints()  # those whose ttl_seconds passed while no server ran
        self.app = create_app(self)
        self._http: BackgroundServer | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closing = started_future()  # done once `stop` begins: long polls return, new event queues are refused
        self._closing_waiter: asyncio.Future | None = None  # `_closing` on the serving loop
        self._reaper: threading.Thread | None = None  # idle sessions and expired checkpoints (`_housekeeping`)
        self.started = time.time()

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> LocalPyTrioServer:
        if self._http is not None:
            return self
        if self._closing.done():
            raise RuntimeError("a stopped local PyTRIO server cannot start again; create a new one")
        defer_client_closes()  # before any client can know this server's address
        self._pool = ThreadPoolExecutor(
            REQUEST_THREADS, thread_name_prefix="pytrio-request", initializer=mark_server_thread
        )
        config = self.config
        http = BackgroundServer(
            self.app, host=config.host, port=config.port, idle_timeout=config.idle_timeout_seconds,
            request_timeout=config.request_timeout_seconds, max_connections=config.max_connections,
            max_connections_per_peer=config.max_connections_per_peer,
        )  # fmt: skip
        self._http = http.start()
        self._reaper = server_thread(self._housekeeping, "pytrio-housekeeping")
        self._reaper.start()
        logger.info("PyTRIO local server on %s serving %s (%s)", self.base_url, self.model_alias, self.model_id)
        return self

    def stop(self) -> None:
        """Stop serving and release every thread the server started; the storage folder as `ServerConfig` says.

        In-process pytrio clients are closed first; waiting long polls return and queued or decoding sample requests
        fail at once, so in-flight requests end before uvicorn stops. An event a run's worker is executing finishes
        in the background (that thread then exits).
        """
        if self._http is not None:  # this process's clients of this server, while it still answers (`inprocess`)
            close_clients_of(self.base_url)
        if not self._closing.done():
            self._closing.set_result(None)
        self.sampler.stop()
        for model in self.sampling_models.values():
            model.sampler.stop()
        if self._reaper is not None:
            self._reaper.join()
            self._reaper = None
        if self._http is not None:
            self._http.stop()
            self._http = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        with self.registry.lock:
            queues = list(self._queues.values())
            self._queues.clear()
        for q in queues:
            q.close()
        if self._own_storage:
            shutil.rmtree(self.storage, ignore_errors=True)
        else:  # its sampler hand-offs only serve its own samplers; durable checkpoints stay for a restart, and
            # another server's hand-offs on this folder are that server's to remove
            with self.registry.lock:
                temporary = [
                    c for c in self.registry.checkpoints.values()
                    if c.visibility == "TEMPORARY" and c.server == self.server_id
                ]  # fmt: skip
            for record in temporary:
                self.registry.forget_checkpoint(record.uri, record)
                self._delete_files(record)

    def _report_scan(self, scan: StorageScan) -> None:
        """The start's one line on what the storage folder held, and one on what was refused and what to do."""
        if scan.loaded:
            logger.info("PyTRIO local server: %d checkpoints of earlier processes in %s", scan.loaded, self.storage)
        if scan.adopted:
            logger.warning(
                "PyTRIO local server: adopted %d unsigned checkpoint records (--adopt-unsigned-checkpoints); start "
                "without the option from now on, so a record planted later is refused", scan.adopted,
            )  # fmt: skip
        if scan.unsigned:
            logger.warning(
                "PyTRIO local server: %d checkpoint records in %s are unsigned (written by an earlier version) and "
                "were not loaded. If no one else can write into that folder, start once with "
                "--adopt-unsigned-checkpoints (ServerConfig(adopt_unsigned_checkpoints=True)) to sign and keep them",
                scan.unsigned, self.storage,
            )  # fmt: skip
        if scan.refused:
            logger.warning(
                "PyTRIO local server: %d checkpoint records in %s were refused (each logged above with its reason)",
                scan.refused, self.storage,
            )  # fmt: skip

    def __enter__(self) -> LocalPyTrioServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._http is None:
            raise RuntimeError("server is not started")
        return self._http.port

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def client_env(self) -> dict[str, str]:
        """Environment variables that point a ``pytrio`` process at this server (read at ``import pytrio``)."""
        return {"PYTRIO_BASE_URL": self.base_url, "PYTRIO_API_KEY": self.api_key}

    def configure_client(self, **options) -> None:
        """Point the already-imported ``pytrio`` at this server; extra options go to `pytrio.configure`, named as
        pytrio 0.2.9 names them (renamed for a 0.2.8 client: `compat.pytrio_configure_options`)."""
        import pytrio

        pytrio.configure(api_key=self.api_key, base_url=self.base_url, **pytrio_configure_options(options))

    def _housekeeping(self) -> None:
        """Until `stop`: `reclaim_idle_sessions` a few times per session timeout, `expire_checkpoints` (their disk;
        lookups already answer them as missing) at least every `HOUSEKEEPING_SECONDS`."""
        timeout = self.config.session_timeout_seconds
        interval = min(HOUSEKEEPING_SECONDS, timeout / 4) if timeout else HOUSEKEEPING_SECONDS
        while not wait_futures([self._closing], timeout=interval).done:
            for task in (self.reclaim_idle_sessions, self.expire_checkpoints):
                try:
                    task()
                except Exception:  # noqa: BLE001 - a bug here must not stop the housekeeping
                    logger.exception("%s failed", task.__name__)

    # ---------------------------------------------------------------- shared helpers
    async def _in_thread(self, fn, *args):
        """``fn(*args)`` in a request thread, awaited from the event loop (handlers' blocking work)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def _closing_signal(self) -> asyncio.Future:
        """A future of the serving loop, done once `stop` begins (one for all waiters: they add no callbacks to
        `_closing` each)."""
        if self._closing_waiter is None:
            self._closing_waiter = asyncio.wrap_future(self._closing)
        return self._closing_waiter

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

    def _caps(self, training: bool, engine: ModelEngine | None = None) -> dict:
        max_seq = (engine or self.engine).max_seq_len
        return {
            "max_batch_size": self.config.max_batch_size if training else None,
            "max_tokens_per_request": self.config.max_tokens_per_request if training else None,
            "max_seq_len": max_seq,
        }

    def _resolve_base_model(self, name: str) -> str:
        """The key of the served model `name` names: "" for the main (training) model, else a sampling model's."""
        if name in self.aliases:
            return ""
        for key, model in self.sampling_models.items():
            if name in model.names:
                return key
        raise ApiError(404, "model_not_found", self.not_served_message(name))

    def model_for(self, key: str):
        """(engine to sample on, decode batcher) of the served model `key` (`_resolve_base_model`)."""
        if not key:
            return self.engine.for_sampling, self.sampler
        model = self.sampling_models[key]
        return model.engine, model.sampler

    def not_served_message(self, name: str) -> str:
        """The "model not served" error: the names served, and the option that adds one."""
        return (
            f"model {name!r} is not served here; served names: {sorted(self.aliases)}"
            + "".join(f", for sampling: {sorted(m.names)}" for m in self.sampling_models.values())
            + f". To serve this model under "
            f"that name start the server with --served-name {name!r} (ServerConfig(served_names=...))"
        )


@dataclass(frozen=True)
class SamplingModel:
    """A base model served for sampling and log-probs only: its engine, decode batcher and the names it answers to."""

    engine: ModelEngine
    sampler: SamplingBatcher
    names: frozenset | set
    alias: str = ""  # the name listings give it: its NAME=, else its folder's name (or "embedded")


def _resolve_model(model: str) -> str:
    if is_embedded(model):
        return resolve_model(model)
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


def _default_alias(requested: str, model_id: str) -> str:
    if is_embedded(requested):
        return EMBEDDED_NAME
    return Path(model_id).name or model_id
