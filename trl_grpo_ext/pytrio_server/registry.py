"""Control-plane records of the local PyTRIO server: sessions, runs, actor tokens and checkpoints.

Sessions, runs and tokens live in memory; one lock guards them. Checkpoint records are also written, signed, next to
the checkpoint files (`records`: `RECORD_FILE` in each checkpoint folder), so a new server process on the same storage
root finds the checkpoints of earlier processes (`load_state` after a restart), and a record it did not sign is
refused.

Every session, run and checkpoint has an owner (`clients`): the lookups that take a ``caller`` answer another
client's object exactly as they answer a missing one.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from trl_grpo_ext.pytrio_server.adapters import LoraSettings
from trl_grpo_ext.pytrio_server.base_model import BaseModel
from trl_grpo_ext.pytrio_server.clients import INTERNAL, LOCAL_OWNER, Caller
from trl_grpo_ext.pytrio_server.errors import ApiError
from trl_grpo_ext.pytrio_server.records import (
    CHECKPOINT_SCHEME,
    KIND_FOLDERS,
    CheckpointRecord,
    read_record,
    write_record,
)
from trl_grpo_ext.pytrio_server.storage import RECORD_FILE, StorageKey, scan_layout

logger = logging.getLogger(__name__)

# run ids and checkpoint names become folder names: no separators, no "..", nothing hidden
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")
_URI = re.compile(rf"{CHECKPOINT_SCHEME}://([^/]+)/(weights|sampler_weights)/([^/]+)")
# The client renews an actor token within 300 s of expiry; an hour keeps renewals out of normal runs.
TOKEN_LIFETIME = timedelta(hours=1)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()


@dataclass
class ServiceSession:
    cuid: str
    sdk_version: str
    caller: Caller = INTERNAL  # who opened it; its runs act with its rights
    status: str = "ACTIVE"
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    seen: float = field(default_factory=time.monotonic)  # last sign of life of its client (`Registry.touch`)
    training_runs: list[str] = field(default_factory=list)
    sampling_runs: list[str] = field(default_factory=list)

    @property
    def owner(self) -> str:
        return self.caller.owner


@dataclass
class TrainingRunRecord:
    cuid: str
    session: str
    index: int
    lora: LoraSettings
    source_checkpoint_uri: str = ""
    restore_optimizer: bool = False
    owner: str = LOCAL_OWNER
    status: str = "CREATED"
    created: float = field(default_factory=time.time)
    started: float | None = None
    updated: float = field(default_factory=time.time)


@dataclass
class SamplingRunRecord:
    cuid: str
    session: str
    index: int
    source_checkpoint_uri: str  # "" samples the base model
    owner: str = LOCAL_OWNER
    status: str = "RUNNING"
    model: str = ""  # one of the server's sampling-only models (`LocalPyTrioServer.sampling_models`); "": the main one
    created: float = field(default_factory=time.time)


@dataclass
class ActorToken:
    token: str
    kind: str  # "training" | "sampling"
    run: str
    expires: datetime


@dataclass
class StorageScan:
    """What a server found under its storage root at start (`Registry.load_persisted`)."""

    loaded: int = 0  # checkpoint records registered
    adopted: int = 0  # of those, unsigned records adopted (`ServerConfig.adopt_unsigned_checkpoints`)
    unsigned: int = 0  # unsigned records refused (written before records were signed)
    refused: int = 0  # records refused for another reason (each logged with its file)


class Registry:
    def __init__(
        self,
        storage: Path | None = None,
        legacy_owner: str = LOCAL_OWNER,
        key: StorageKey | None = None,
    ):
        self.storage = storage  # where checkpoint records persist; None keeps them in memory only
        if storage is not None and key is None:
            raise ValueError("a registry that persists checkpoint records needs the storage folder's key")
        self.key = key  # signs the records written, checks the records read (`records`)
        self.legacy_owner = legacy_owner  # owner of adopted records written before records had one
        self.lock = threading.RLock()
        self.sessions: dict[str, ServiceSession] = {}
        self.training_runs: dict[str, TrainingRunRecord] = {}
        self.sampling_runs: dict[str, SamplingRunRecord] = {}
        self.checkpoints: dict[str, CheckpointRecord] = {}  # by uri
        self.tokens: dict[str, ActorToken] = {}
        self.telemetry_events = 0
        self.rejected_tokens = 0  # actor requests answered 401

    # ------------------------------------------------------------------ sessions and runs
    def any_session(self, cuid: str, caller: Caller = INTERNAL) -> ServiceSession:
        """The session `cuid`, open or closed, if `caller` may see it; else 404."""
        session = self.sessions.get(cuid)
        if session is None or not caller.may_see(session.owner):
            raise ApiError(404, "service_session_not_found", f"service session {cuid} not found")
        return session

    def session(self, cuid: str, caller: Caller = INTERNAL) -> ServiceSession:
        """The open session `cuid` (409 when closed), if `caller` may see it; else 404."""
        session = self.any_session(cuid, caller)
        if session.status != "ACTIVE":
            raise ApiError(409, "service_session_closed", f"service session {cuid} is {session.status}")
        return session

    def training_run(self, cuid: str, caller: Caller = INTERNAL) -> TrainingRunRecord:
        run = self.training_runs.get(cuid)
        if run is None or not caller.may_see(run.owner):
            raise ApiError(404, "training_run_not_found", f"training run {cuid} not found")
        return run

    def sampling_run(self, cuid: str, caller: Caller = INTERNAL) -> SamplingRunRecord:
        run = self.sampling_runs.get(cuid)
        if run is None or not caller.may_see(run.owner):
            raise ApiError(404, "sampling_run_not_found", f"sampling run {cuid} not found")
        return run

    def checkpoint(self, uri: str, caller: Caller = INTERNAL) -> CheckpointRecord:
        with self.lock:
            record = self.checkpoints.get(uri)
        if record is None:
            record = self._load_persisted(uri)  # saved by an earlier (or another) server process on this root
        if record is None or not caller.may_see(record.owner) or record.expired():  # expired: gone, files or not
            raise ApiError(404, "checkpoint_not_found", f"checkpoint {uri!r} not found on this server")
        return record

    def touch(self, run: str) -> None:
        """A sign of life from the client of `run` (a training or sampling run): its session is not idle."""
        with self.lock:
            record = self.training_runs.get(run) or self.sampling_runs.get(run)
            session = self.sessions.get(record.session) if record is not None else None
            if session is not None:
                session.seen = time.monotonic()

    # ------------------------------------------------------------------ persisted checkpoint records
    def add_checkpoint(self, record: CheckpointRecord) -> None:
        """Register `record` and persist it, signed, next to its files (atomically: a reader sees all or nothing)."""
        if self.storage is not None:
            write_record(record, self.key, self.storage)
        with self.lock:
            self.checkpoints[record.uri] = record

    def forget_checkpoint(self, uri: str, record: CheckpointRecord | None = None) -> None:
        """Forget the checkpoint `uri` (only if it is still `record`, when given: not one saved again since)."""
        with self.lock:
            if record is None or self.checkpoints.get(uri) is record:
                self.checkpoints.pop(uri, None)

    def visible_checkpoints(self, caller: Caller, run: str | None = None) -> list[CheckpointRecord]:
        """The checkpoints `caller` may see (of `run`, or all), expired ones left out: what listings hold."""
        now = time.time()
        with self.lock:
            return [
                c for c in self.checkpoints.values()
                if caller.may_see(c.owner) and not c.expired(now) and (run is None or c.run == run)
            ]  # fmt: skip

    def load_persisted(self, adopt_on: BaseModel | None = None) -> StorageScan:
        """Register every complete checkpoint whose record holds under the storage root (`records`); with `adopt_on`
        (the serving base model), unsigned records that agree with their place are adopted."""
        scan = StorageScan()
        if self.storage is None or not self.storage.is_dir():
            return scan
        for parts in scan_layout(self.storage, tuple(KIND_FOLDERS.values())):
            reading = read_record(self.storage, parts, self.key, self.legacy_owner, adopt_on)
            if reading.record is None:
                scan.unsigned += reading.unsigned
                scan.refused += not reading.unsigned
                continue
            with self.lock:
                if reading.record.uri not in self.checkpoints:
                    self.checkpoints[reading.record.uri] = reading.record
                    scan.loaded += 1
                    scan.adopted += reading.adopted
        return scan

    def _load_persisted(self, uri: str) -> CheckpointRecord | None:
        """The record of `uri` on disk (saved by another server on this root since this one started), if it holds."""
        if self.storage is None or checkpoint_folder(self.storage, uri) is None:
            return None
        match = _URI.fullmatch(uri)
        parts = (match.group(1), match.group(2), match.group(3))
        if not (self.storage.joinpath(*parts) / RECORD_FILE).is_file():
            return None
        record = read_record(self.storage, parts, self.key, self.legacy_owner).record
        if record is None:
            return None
        with self.lock:
            return self.checkpoints.setdefault(uri, record)

    def checkpoint_by_cuid(self, cuid: str, caller: Caller = INTERNAL) -> CheckpointRecord:
        with self.lock:
            records = list(self.checkpoints.values())
        for record in records:
            if record.cuid == cuid and caller.may_see(record.owner) and not record.expired():
                return record
        raise ApiError(404, "checkpoint_not_found", f"checkpoint {cuid} not found")

    # ------------------------------------------------------------------ actor tokens
    def issue_token(self, kind: str, run: str) -> ActorToken:
        token = ActorToken(secrets.token_urlsafe(24), kind, run, datetime.now(timezone.utc) + TOKEN_LIFETIME)
        with self.lock:
            self.tokens[token.token] = token
        return token

    def check_token(self, token: str | None) -> ActorToken:
        record = self.tokens.get(token or "")
        if record is None or record.expires <= datetime.now(timezone.utc):
            with self.lock:
                self.rejected_tokens += 1
            raise ApiError(401, "unauthorized", "actor token is missing, unknown or expired; renew it through Control")
        return record


def safe_name(name: str) -> bool:
    """Whether `name` can be used as one folder name under the storage root."""
    return bool(_SAFE_NAME.fullmatch(name)) and ".." not in name


def checkpoint_folder(storage: Path, uri: str) -> Path | None:
    """``storage/<run>/<weights|sampler_weights>/<name>`` for a well-formed URI of this server, else None."""
    match = _URI.fullmatch(uri)
    if match is None or not (safe_name(match.group(1)) and safe_name(match.group(3))):
        return None
    return storage / match.group(1) / match.group(2) / match.group(3)
