"""A checkpoint's record on disk (`RECORD_FILE` in its folder): its fields, its signature, and its agreement with the
place it lies.

Where a record lies says which checkpoint it is: ``<storage>/<run>/<weights|sampler_weights>/<name>`` gives the run,
the kind, the name, the URI and the folder, never a field of the record. What a server acts on besides (the owner,
the expiry, the base model, the server that wrote a TEMPORARY one) is signed with the storage folder's key
(`storage.StorageKey`): a record planted or edited by anyone who cannot read the key is refused, and so is a signed
record copied to another place (its URI then disagrees with the place). A refused record is logged with its file and
the reason, and its checkpoint does not exist for the server: nothing of it is listed, loaded, served or deleted.

Records written before records were signed have no ``signature``; they are refused the same way, unless the
operator adopts them (`ServerConfig.adopt_unsigned_checkpoints`, at the server's start only): a record that agrees with
its place is then signed as it stands, its base model's weights-only fingerprint (this server's, where it matches)
replaced by the fingerprint of today's scheme.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from trl_grpo_ext.pytrio_server.adapters import LoraSettings, next_snapshot_uid
from trl_grpo_ext.pytrio_server.base_model import UNKNOWN_BASE, BaseModel
from trl_grpo_ext.pytrio_server.clients import LOCAL_OWNER
from trl_grpo_ext.pytrio_server.storage import RECORD_FILE, CheckpointFolder, StorageError, StorageKey

logger = logging.getLogger(__name__)

CHECKPOINT_SCHEME = "trio"
KIND_FOLDERS = {"state": "weights", "sampler": "sampler_weights"}
FOLDER_KINDS = {folder: kind for kind, folder in KIND_FOLDERS.items()}
RECORD_FORMAT = 2  # signed; records without a format field came before
RECORD_LIMIT = 64 * 1024  # a record is a few hundred bytes: a larger file is not one
VISIBILITIES = ("WORKSPACE", "TEMPORARY")
_ID = re.compile(r"[A-Za-z0-9_\-]{1,80}")  # checkpoint ids and owner ids
_TEXT_LIMIT = 4096  # base model names, fingerprints, server ids


@dataclass
class CheckpointRecord:
    cuid: str
    uri: str
    run: str
    name: str
    kind: str  # "state" (save_state) or "sampler" (save_weights_for_sampler)
    path: Path  # the folder, from the place in the layout (the server's log and tests; files are reached by `parts`)
    lora: LoraSettings
    size: int
    visibility: str
    step: int
    snapshot_uid: int = 0  # identifies the weights (the in-memory snapshot cache and sampler slots key on it)
    expires: float | None = None  # from ttl_seconds: past it the checkpoint is gone (`expired`, `expire_checkpoints`)
    created: float = field(default_factory=time.time)
    owner: str = LOCAL_OWNER
    base: BaseModel = UNKNOWN_BASE  # the base model it was trained on; unknown for records written before
    server: str = ""  # the id of the server process that saved it (its stop removes its own TEMPORARY ones only)

    def expired(self, now: float | None = None) -> bool:
        return self.expires is not None and self.expires <= (time.time() if now is None else now)

    @property
    def parts(self) -> tuple[str, str, str]:
        """Its place under the storage root: (run, kind folder, name)."""
        return self.run, KIND_FOLDERS[self.kind], self.name


def checkpoint_uri(run: str, kind: str, name: str) -> str:
    return f"{CHECKPOINT_SCHEME}://{run}/{KIND_FOLDERS[kind]}/{name}"


def record_fields(record: CheckpointRecord) -> dict:
    """What the record file holds, its signature aside."""
    return {
        "format": RECORD_FORMAT, "cuid": record.cuid, "uri": record.uri, "run": record.run, "name": record.name,
        "kind": record.kind, "lora": asdict(record.lora), "size": record.size, "visibility": record.visibility,
        "step": record.step, "expires": record.expires, "created": record.created, "owner": record.owner,
        "base_model": record.base.name, "base_model_fingerprint": record.base.fingerprint, "server": record.server,
    }  # fmt: skip


def write_record(record: CheckpointRecord, key: StorageKey, storage: Path) -> None:
    """Sign `record` and write it into its folder, atomically (a reader sees all of it or nothing)."""
    data = record_fields(record)
    data["signature"] = key.sign(data)
    with CheckpointFolder(storage, record.parts) as folder:
        folder.write_atomic(RECORD_FILE, json.dumps(data, indent=1).encode())


@dataclass
class Reading:
    """What reading one record gave: the record, or None when it was refused (the reason is logged; `unsigned`:
    written before records were signed, and not adopted); `adopted`: an unsigned record signed now."""

    record: CheckpointRecord | None
    unsigned: bool = False
    adopted: bool = False


class _Refused(ValueError):
    pass


def read_record(
    storage: Path,
    parts: tuple[str, str, str],
    key: StorageKey,
    legacy_owner: str = LOCAL_OWNER,
    adopt_on: BaseModel | None = None,
) -> Reading:
    """The record of the checkpoint folder ``storage/run/kind/name`` (`parts`), or the reason it is refused (logged
    here, with the file). With `adopt_on` (the serving base model), an unsigned record that agrees with its place is
    adopted: signed and written again (see the module's docstring)."""
    run, kind_folder, name = parts
    where = storage.joinpath(*parts, RECORD_FILE)
    try:
        kind = FOLDER_KINDS.get(kind_folder)
        if kind is None:
            raise _Refused(f"{kind_folder!r} is not a checkpoint kind's folder")
        with CheckpointFolder(storage, parts) as folder:
            data = json.loads(folder.read(RECORD_FILE, RECORD_LIMIT))
        if not isinstance(data, dict):
            raise _Refused("it is not a JSON object")
        signature = data.pop("signature", None)
        if signature is None and adopt_on is None:
            return Reading(None, unsigned=True)  # counted, and reported once, by the start (`load_persisted`)
        if signature is not None and not key.verify(data, signature):
            raise _Refused("its signature does not hold (edited, or signed with another storage folder's key)")
        record = _record(data, storage, run, kind, name, legacy=signature is None, legacy_owner=legacy_owner)
    # RecursionError: JSON nested deeper than the parser goes; OverflowError: an integer beyond a float's range
    except (OSError, StorageError, ValueError, TypeError, KeyError, RecursionError, OverflowError) as error:
        problem = str(error) if isinstance(error, (_Refused, StorageError)) else f"{type(error).__name__}: {error}"
        logger.warning("refusing checkpoint record %s: %s", where, problem)
        return Reading(None)
    if signature is None:
        return _adopt(record, key, storage, adopt_on, where)
    return Reading(record)


def _adopt(record: CheckpointRecord, key: StorageKey, storage: Path, serving: BaseModel, where: Path) -> Reading:
    if record.base.fingerprint and record.base.fingerprint == serving.weights_only:
        record.base = BaseModel(record.base.name, serving.fingerprint)  # the same weights, today's fingerprint
    try:
        write_record(record, key, storage)
    except (OSError, StorageError) as error:
        logger.warning("refusing checkpoint record %s: it is unsigned and could not be signed (%s)", where, error)
        return Reading(None, unsigned=True)
    logger.warning(
        "adopted the unsigned checkpoint record of %s (owner %s, base model %r %s): it is signed now",
        record.uri, record.owner, record.base.name, record.base.short(),
    )  # fmt: skip
    return Reading(record, adopted=True)


def _record(data: dict, storage: Path, run: str, kind: str, name: str, legacy: bool, legacy_owner: str):
    """The `CheckpointRecord` of `data`, read from ``storage/run/<kind's folder>/name``: every field checked, and those
    that name the checkpoint equal to what its place says."""
    uri = checkpoint_uri(run, kind, name)
    place = {"uri": uri, "run": run, "name": name, "kind": kind}
    if legacy:  # the records of before also held the folder, relative to the storage root
        place["path"] = os.path.join(run, KIND_FOLDERS[kind], name)
    elif data.get("format") != RECORD_FORMAT:
        raise _Refused(f"its format {data.get('format')!r} is not {RECORD_FORMAT}")
    disagree = sorted(k for k, value in place.items() if data.get(k) != value)
    if disagree:
        raise _Refused(f"its {', '.join(disagree)} disagree with the place it lies ({uri})")
    lora = data["lora"]
    names = {f.name for f in fields(LoraSettings)}
    if not isinstance(lora, dict) or set(lora) - names or "rank" not in lora:
        raise _Refused("its lora settings are not LoRA settings")
    settings = LoraSettings(**lora)
    if not (_is_int(settings.rank) and 1 <= settings.rank <= 256) or not (
        settings.seed is None or _is_int(settings.seed)
    ):
        raise _Refused("its lora rank or seed is out of range")
    if not all(isinstance(getattr(settings, n), bool) for n in ("train_mlp", "train_attn", "train_unembed")):
        raise _Refused("its lora switches are not booleans")
    owner = data.get("owner") or (legacy_owner if legacy else None)
    base_name, fingerprint = data.get("base_model") or "", data.get("base_model_fingerprint") or ""
    checks = {
        "cuid": isinstance(data.get("cuid"), str) and bool(_ID.fullmatch(data["cuid"])),
        "owner": isinstance(owner, str) and bool(_ID.fullmatch(owner)),
        "size": _is_int(data.get("size")) and data["size"] >= 0,
        "step": _is_int(data.get("step")) and data["step"] >= 0,
        "visibility": data.get("visibility") in VISIBILITIES,
        "created": _is_number(data.get("created")),
        "expires": data.get("expires") is None or _is_number(data.get("expires")),
        "base_model": _is_text(base_name) and _is_text(fingerprint),
        "server": _is_text(data.get("server", "")),
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise _Refused(f"its {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not valid")
    return CheckpointRecord(
        data["cuid"], uri, run, name, kind, storage / run / KIND_FOLDERS[kind] / name, settings, data["size"],
        data["visibility"], data["step"], snapshot_uid=next_snapshot_uid(), expires=data.get("expires"),
        created=float(data["created"]), owner=owner, base=BaseModel(base_name, fingerprint),
        server=data.get("server", ""),
    )  # fmt: skip


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_text(value: object) -> bool:
    return isinstance(value, str) and len(value) <= _TEXT_LIMIT


def same_checkpoint(folder: CheckpointFolder, record: CheckpointRecord, key: StorageKey) -> bool:
    """Whether `folder` (open) still holds `record`'s checkpoint: a record signed with `key`, of the same id, URI and
    owner (a delete checks it first, so it never removes a checkpoint saved again since, nor a planted folder)."""
    try:
        data = json.loads(folder.read(RECORD_FILE, RECORD_LIMIT))
    except (OSError, StorageError, ValueError, RecursionError):  # RecursionError: JSON nested beyond the parser
        return False
    if not isinstance(data, dict):
        return False
    signature = data.pop("signature", None)
    same = (data.get("cuid"), data.get("uri"), data.get("owner")) == (record.cuid, record.uri, record.owner)
    return same and key.verify(data, signature)
