"""Control-plane records of the local PyTRIO server: sessions, runs, actor tokens and checkpoints.

Sessions, runs and tokens live in memory; one lock guards them. Checkpoint records are also written next to the
checkpoint files (`RECORD_FILE` in each checkpoint folder), so a new server process on the same storage root
finds the checkpoints of earlier processes (`load_state` after a restart).

Every session, run and checkpoint has an owner (`clients`): the lookups that take a ``caller`` answer another
client's object exactly as they answer a missing one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from trl_grpo_ext.pytrio_server.adapters import LoraSettings, next_snapshot_uid
from trl_grpo_ext.pytrio_server.base_model import UNKNOWN_BASE, BaseModel
from trl_grpo_ext.pytrio_server.clients import INTERNAL, LOCAL_OWNER, Caller
from trl_grpo_ext.pytrio_server.errors import ApiError
from trl_grpo_ext.runs import atomic_write_text

logger = logging.getLogger(__name__)

CHECKPOINT_SCHEME = "trio"
RECORD_FILE = "trio_record.json"  # the persisted CheckpointRecord, written last (its presence = complete)
KIND_FOLDERS = {"state": "weights", "sampler": "sampler_weights"}
# run ids and checkpoint names become folder names: no separators, no "..", nothing hidden
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
_URI = re.compile(rf"^{CHECKPOINT_SCHEME}://([^/]+)/(weights|sampler_weights)/([^/]+)$")
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
class CheckpointRecord:
    cuid: str
    uri: str
    run: str
    name: str
    kind: str  # "state" (save_state) or "sampler" (save_weights_for_sampler)
    path: Path
    lora: LoraSettings
    size: int
    visibility: str
    step: int
    snapshot_uid: int = 0  # identifies the weights (the in-memory snapshot cache and sampler slots key on it)
    expires: float | None = None  # from ttl_seconds: past it the checkpoint is gone (`expired`, `expire_checkpoints`)
    created: float = field(default_factory=time.time)
    owner: str = LOCAL_OWNER
    base: BaseModel = UNKNOWN_BASE  # the base model it was trained on; unknown for records written before

    def expired(self, now: float | None = None) -> bool:
        return self.expires is not None and self.expires <= (time.time() if now is None else now)


@dataclass
class ActorToken:
    token: str
    kind: str  # "training" | "sampling"
    run: str
    expires: datetime


class Registry:
    def __init__(self, storage: Path | None = None, legacy_owner: str = LOCAL_OWNER):
        self.storage = storage  # where checkpoint records persist; None keeps them in memory only
        self.legacy_owner = legacy_owner  # owner of persisted records written before records had one
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
        """Register `record` and persist it next to its files (atomically: a reader sees all of it or nothing)."""
        if self.storage is not None:
            write_record(record, self.storage)
        with self.lock:
            self.checkpoints[record.uri] = record

    def forget_checkpoint(self, uri: str) -> None:
        with self.lock:
            self.checkpoints.pop(uri, None)

    def visible_checkpoints(self, caller: Caller, run: str | None = None) -> list[CheckpointRecord]:
        """The checkpoints `caller` may see (of `run`, or all), expired ones left out: what listings hold."""
        now = time.time()
        with self.lock:
            return [
                c for c in self.checkpoints.values()
                if caller.may_see(c.owner) and not c.expired(now) and (run is None or c.run == run)
            ]  # fmt: skip

    def load_persisted(self) -> int:
        """Register every complete checkpoint record under the storage root; returns how many were new."""
        if self.storage is None or not self.storage.is_dir():
            return 0
        added = 0
        for path in sorted(self.storage.glob(f"*/*/*/{RECORD_FILE}")):
            record = read_record(path, self.storage, self.legacy_owner)
            if record is None:
                continue
            with self.lock:
                if record.uri not in self.checkpoints:
                    self.checkpoints[record.uri] = record
                    added += 1
        return added

    def _load_persisted(self, uri: str) -> CheckpointRecord | None:
        if self.storage is None:
            return None
        folder = checkpoint_folder(self.storage, uri)
        if folder is None or not (folder / RECORD_FILE).is_file():
            return None
        record = read_record(folder / RECORD_FILE, self.storage, self.legacy_owner)
        if record is None or record.uri != uri:
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


def checkpoint_uri(run: str, kind: str, name: str) -> str:
    return f"{CHECKPOINT_SCHEME}://{run}/{KIND_FOLDERS[kind]}/{name}"


def safe_name(name: str) -> bool:
    """Whether `name` can be used as one folder name under the storage root."""
    return bool(_SAFE_NAME.match(name)) and ".." not in name


def checkpoint_folder(storage: Path, uri: str) -> Path | None:
    """``storage/<run>/<weights|sampler_weights>/<name>`` for a well-formed URI of this server, else None."""
    match = _URI.match(uri)
    if match is None or not (safe_name(match.group(1)) and safe_name(match.group(3))):
        return None
    return storage / match.group(1) / match.group(2) / match.group(3)


def write_record(record: CheckpointRecord, storage: Path) -> None:
    data = {
        "cuid": record.cuid, "uri": record.uri, "run": record.run, "name": record.name, "kind": record.kind,
        "path": os.path.relpath(record.path, storage), "lora": asdict(record.lora), "size": record.size,
        "visibility": record.visibility, "step": record.step, "expires": record.expires, "created": record.created,
        "owner": record.owner, "base_model": record.base.name, "base_model_fingerprint": record.base.fingerprint,
    }  # fmt: skip
    atomic_write_text(Path(record.path) / RECORD_FILE, json.dumps(data, indent=1))


def read_record(path: Path, storage: Path, legacy_owner: str = LOCAL_OWNER) -> CheckpointRecord | None:
    """The record persisted at `path`, or None (logged) when it is unreadable or points outside `storage`.
    A record without an owner (written before records had one) is `legacy_owner`'s; one without a base model has
    `UNKNOWN_BASE`."""
    try:
        data = json.loads(path.read_text())
        folder = (storage / data["path"]).resolve()
        if not folder.is_relative_to(storage.resolve()) or data["kind"] not in KIND_FOLDERS:
            raise ValueError(f"path {data['path']!r} / kind {data['kind']!r} not valid")
        return CheckpointRecord(
            str(data["cuid"]), str(data["uri"]), str(data["run"]), str(data["name"]), data["kind"], folder,
            LoraSettings(**data["lora"]), int(data["size"]), str(data["visibility"]), int(data["step"]),
            snapshot_uid=next_snapshot_uid(), expires=data.get("expires"), created=float(data["created"]),
            owner=str(data.get("owner") or legacy_owner),
            base=BaseModel(str(data.get("base_model") or ""), str(data.get("base_model_fingerprint") or "")),
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("ignoring unreadable checkpoint record %s: %s", path, error)
        return None
