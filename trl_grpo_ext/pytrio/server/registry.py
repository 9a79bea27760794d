"""Control-plane records of the local PyTRIO server: sessions, runs, actor tokens and checkpoints.

Everything is in memory (checkpoint files live under the server's storage folder); one lock guards it all.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from trl_grpo_ext.pytrio.server.engine import LoraSettings

CHECKPOINT_SCHEME = "trio"
# The client renews an actor token within 300 s of expiry; an hour keeps renewals out of normal runs.
TOKEN_LIFETIME = timedelta(hours=1)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()


class ApiError(Exception):
    """An HTTP error answer: ``{"code": ..., "message": ...}`` with `status`."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class ServiceSession:
    cuid: str
    sdk_version: str
    status: str = "ACTIVE"
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    training_runs: list[str] = field(default_factory=list)
    sampling_runs: list[str] = field(default_factory=list)


@dataclass
class TrainingRunRecord:
    cuid: str
    session: str
    index: int
    lora: LoraSettings
    source_checkpoint_uri: str = ""
    restore_optimizer: bool = False
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
    status: str = "RUNNING"
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
    expires: float | None = None  # reported from ttl_seconds; not enforced (see max_temporary_checkpoints)
    created: float = field(default_factory=time.time)


@dataclass
class ActorToken:
    token: str
    kind: str  # "training" | "sampling"
    run: str
    expires: datetime


class Registry:
    def __init__(self):
        self.lock = threading.RLock()
        self.sessions: dict[str, ServiceSession] = {}
        self.training_runs: dict[str, TrainingRunRecord] = {}
        self.sampling_runs: dict[str, SamplingRunRecord] = {}
        self.checkpoints: dict[str, CheckpointRecord] = {}  # by uri
        self.tokens: dict[str, ActorToken] = {}
        self.telemetry_events = 0
        self.rejected_tokens = 0  # actor requests answered 401

    # ------------------------------------------------------------------ sessions and runs
    def session(self, cuid: str) -> ServiceSession:
        session = self.sessions.get(cuid)
        if session is None:
            raise ApiError(404, "service_session_not_found", f"service session {cuid} not found")
        if session.status != "ACTIVE":
            raise ApiError(409, "service_session_closed", f"service session {cuid} is {session.status}")
        return session

    def training_run(self, cuid: str) -> TrainingRunRecord:
        run = self.training_runs.get(cuid)
        if run is None:
            raise ApiError(404, "training_run_not_found", f"training run {cuid} not found")
        return run

    def sampling_run(self, cuid: str) -> SamplingRunRecord:
        run = self.sampling_runs.get(cuid)
        if run is None:
            raise ApiError(404, "sampling_run_not_found", f"sampling run {cuid} not found")
        return run

    def checkpoint(self, uri: str) -> CheckpointRecord:
        record = self.checkpoints.get(uri)
        if record is None:
            raise ApiError(404, "checkpoint_not_found", f"checkpoint {uri!r} not found on this server")
        return record

    def checkpoint_by_cuid(self, cuid: str) -> CheckpointRecord:
        with self.lock:
            records = list(self.checkpoints.values())
        for record in records:
            if record.cuid == cuid:
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

    def revoke_tokens(self) -> int:
        """Invalidate every actor token (the client then renews through Control); returns how many."""
        with self.lock:
            count = len(self.tokens)
            self.tokens.clear()
            return count


def checkpoint_uri(run: str, kind: str, name: str) -> str:
    folder = "weights" if kind == "state" else "sampler_weights"
    return f"{CHECKPOINT_SCHEME}://{run}/{folder}/{name}"
