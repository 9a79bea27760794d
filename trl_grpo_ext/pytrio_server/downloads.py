"""Checkpoint downloads: what the client's ``RestClient.download_checkpoint``, ``get_checkpoint_download_url`` and
``get_checkpoint_archive_url`` fetch.

A mixin of `LocalPyTrioServer`. ``GET /api/openapi/v1/checkpoints/{id}/download-url`` (the caller's own checkpoint;
another key's answers as a missing one) gives a URL under `FILES_PREFIX` that carries its own credential, as a
presigned object-storage URL does (the client's downloader sends no API key): the checkpoint id and an expiry, signed
with a key this server process drew at start (HMAC-SHA256). `RequestGuard` checks the signature and the expiry before
anything else (``403 download_url_invalid`` / ``download_url_expired``: the client then asks Control for a fresh URL).

The URL serves one uncompressed tar archive, ``<name>/`` (the checkpoint's name as its folder in the layout gives it,
else its id: `archive_name`) holding the checkpoint's PEFT adapter folder
(`ARCHIVE_FILES`: ``adapter_config.json`` and ``adapter_model.safetensors``, loadable with
``peft.PeftModel.from_pretrained(base, "<name>")``; a ``save_state`` checkpoint also its AdamW state,
``optimizer.json`` + ``optimizer.safetensors``) and ``trio_checkpoint.json`` (LoRA settings, step). Its bytes are the
same at every request (fixed member order, times and owners), so a download resumes with ``Range: bytes=N-`` (206, or
416 once complete). It is streamed from the files a `CHUNK` at a time, each chunk admitted against the working-memory
budget while it is in flight; nothing is built in memory or on disk. The files are the server's own only: each is
opened through the checkpoint's `storage.CheckpointFolder` (no link followed, regular files of the server's user), and
a checkpoint missing one of `REQUIRED_FILES` (a delete cut short, a damaged folder) is refused, ``409
checkpoint_incomplete`` naming it, rather than served without its weights.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import tarfile
import time
from dataclasses import dataclass
from urllib.parse import parse_qs

from trl_grpo_ext.pytrio_server.adapters import ADAPTER_FILE, META_FILE
from trl_grpo_ext.pytrio_server.clients import Caller
from trl_grpo_ext.pytrio_server.errors import ApiError, EngineError
from trl_grpo_ext.pytrio_server.optimizer_state import (
    LEGACY_OPTIMIZER,
    OPTIMIZER_META,
    OPTIMIZER_TENSORS,
    load_optimizer,
)
from trl_grpo_ext.pytrio_server.records import CheckpointRecord
from trl_grpo_ext.pytrio_server.registry import iso, safe_name
from trl_grpo_ext.pytrio_server.storage import CheckpointFolder, StorageError
from trl_grpo_ext.runs import ADAPTER_CONFIG_FILENAME

logger = logging.getLogger(__name__)

FILES_PREFIX = "/files/v1/checkpoints/"
_ARCHIVE_PATH = re.compile(rf"{FILES_PREFIX}([A-Za-z0-9_\-]{{1,80}})/archive\.tar")
_EXPIRES = re.compile(r"[0-9]{1,12}")  # seconds since the epoch, ASCII digits only
_SIGNATURE = re.compile(r"[0-9a-f]{64}")  # `_sign`'s hex digest
URL_LIFETIME_SECONDS = 3600  # the client asks for a new URL within 60 s of its expiry
CHUNK = 1024 * 1024
# In this order, those that exist; an optimizer pickle of a checkpoint saved before (`LEGACY_OPTIMIZER`) is
# converted before its first download and never served.
ARCHIVE_FILES = (ADAPTER_CONFIG_FILENAME, ADAPTER_FILE, OPTIMIZER_META, OPTIMIZER_TENSORS, META_FILE)
REQUIRED_FILES = (ADAPTER_CONFIG_FILENAME, ADAPTER_FILE, META_FILE)  # without them the archive loads nowhere


class MissingFiles(Exception):
    """Files of `REQUIRED_FILES` a checkpoint folder lacks."""

    def __init__(self, names: list[str]):
        super().__init__(", ".join(names))
        self.names = names


@dataclass
class ArchivePart:
    """A stretch of the archive: bytes of its own (a tar header, padding) or `size` bytes of an open file."""

    size: int
    data: bytes = b""
    file: object = None  # an open binary file, read from its start


class Archive:
    """The tar archive of one checkpoint folder, laid out from its files' sizes; `read` serves any range of it.

    The files are opened when it is laid out, so a checkpoint replaced meanwhile (``overwrite=True``) cannot mix
    two versions into one answer."""

    def __init__(self, folder: CheckpointFolder, name: str, mtime: float):
        self.parts: list[ArchivePart] = []
        try:
            missing = [file_name for file_name in REQUIRED_FILES if folder.entry(file_name) is None]
            if missing:
                raise MissingFiles(missing)
            for file_name in ARCHIVE_FILES:
                try:
                    handle = folder.open(file_name)  # the server's own regular file, no link followed
                except FileNotFoundError:
                    if file_name in REQUIRED_FILES:  # removed since the check above
                        raise MissingFiles([file_name]) from None
                    continue
                try:
                    size = _file_size(handle)
                    info = tarfile.TarInfo(f"{name}/{file_name}")
                    info.size, info.mtime, info.mode = size, int(mtime), 0o644
                    header = info.tobuf(tarfile.PAX_FORMAT)
                except BaseException:
                    handle.close()
                    raise
                self.parts.append(ArchivePart(len(header), header))
                self.parts.append(ArchivePart(size, file=handle))
                self.parts.append(ArchivePart(-size % tarfile.BLOCKSIZE, bytes(-size % tarfile.BLOCKSIZE)))
        except BaseException:
            self.close()
            raise
        used = sum(p.size for p in self.parts) + 2 * tarfile.BLOCKSIZE  # two zero blocks end a tar archive
        end = 2 * tarfile.BLOCKSIZE + (-used % tarfile.RECORDSIZE)  # padded to a whole record, as tarfile writes
        self.parts.append(ArchivePart(end, bytes(end)))
        self.size = sum(p.size for p in self.parts)

    def read(self, start: int, length: int) -> bytes:
        """Up to `length` bytes from offset `start`."""
        out, offset = [], 0
        for part in self.parts:
            if length <= 0:
                break
            if start < offset + part.size:
                skip = max(0, start - offset)
                take = min(part.size - skip, length)
                if part.file is not None:
                    part.file.seek(skip)
                    out.append(part.file.read(take))
                else:
                    out.append(part.data[skip : skip + take])
                start, length = start + take, length - take
            offset += part.size
        return b"".join(out)

    def close(self) -> None:
        for part in self.parts:
            if part.file is not None:
                part.file.close()


class CheckpointDownloads:
    def checkpoint_download(self, _q, _b, caller: Caller, cid) -> dict:
        """The Control answer to ``download-url``: a signed URL of the checkpoint's archive, valid for an hour."""
        record = self.registry.checkpoint_by_cuid(cid, caller)
        self._downloadable(record)
        expires = int(time.time()) + URL_LIFETIME_SECONDS
        url = f"{self.base_url}{FILES_PREFIX}{cid}/archive.tar?expires={expires}&signature={self._sign(cid, expires)}"
        return {"url": url, "expires_at": iso(expires), "source": "actor", "checkpoint_status": "LOCAL",
                "tls_cert_pem": None, "tls_not_after": None}  # fmt: skip

    def download_record(self, path: str, query: str) -> CheckpointRecord:
        """The checkpoint a download URL names, once its signature and expiry hold (`RequestGuard`, before any
        body); 403 otherwise (every malformed expiry or signature: ``download_url_invalid``), 404 when the checkpoint
        is gone since."""
        match = _ARCHIVE_PATH.fullmatch(path)
        params = parse_qs(query)
        expires = (params.get("expires") or [""])[0]
        signature = (params.get("signature") or [""])[0]
        if match is None or not _EXPIRES.fullmatch(expires) or not _SIGNATURE.fullmatch(signature):
            raise ApiError(403, "download_url_invalid", "not a download URL of this server; ask Control for one")
        cid = match.group(1)
        if not hmac.compare_digest(signature, self._sign(cid, int(expires))):
            raise ApiError(403, "download_url_invalid", "this download URL's signature does not hold; ask for another")
        if int(expires) < time.time():
            raise ApiError(403, "download_url_expired", "this download URL has expired; ask Control for a new one")
        return self.registry.checkpoint_by_cuid(cid)  # still there (deleted, expired, pruned: 404)

    def open_archive(self, record: CheckpointRecord) -> Archive:
        """The archive of `record`'s files: 404 when its folder is gone, 409 ``checkpoint_incomplete`` when it lacks
        adapter files, 409 ``checkpoint_unreadable`` for a file that is not the server's own (each naming it)."""
        with self.checkpoint_files(record) as folder:
            try:
                return Archive(folder, archive_name(record), record.created)
            except MissingFiles as missing:
                raise self._incomplete(record, missing.names) from None
            except (OSError, StorageError) as error:
                raise self._unreadable(record, error) from None

    def _incomplete(self, record: CheckpointRecord, names: list[str]) -> ApiError:
        logger.warning("checkpoint %s lacks %s in %s", record.uri, ", ".join(names), record.path)
        return ApiError(
            409,
            "checkpoint_incomplete",
            f"checkpoint {record.cuid} ({record.uri}) lacks {', '.join(names)} on the server's storage (deleted "
            "meanwhile, or damaged): it cannot be downloaded",
        )

    def _downloadable(self, record: CheckpointRecord) -> None:
        """Refuse now what its archive would refuse (files missing or not the server's), and convert the pickled
        optimizer of a state checkpoint saved before, so its archive is the same at every request
        (`optimizer_state`; one that cannot be converted is 409 ``checkpoint_unreadable`` with the reason)."""
        with self.checkpoint_files(record) as folder:
            legacy = folder.entry(OPTIMIZER_META) is None and folder.entry(LEGACY_OPTIMIZER) is not None
            if record.kind == "state" and legacy:
                try:
                    load_optimizer(folder, record.uri, self.memory)
                except EngineError as error:
                    raise ApiError(409, error.code, error.message) from None
        self.open_archive(record).close()

    def _sign(self, cid: str, expires: int) -> str:
        return hmac.new(self._download_key, f"{cid}\n{expires}".encode(), hashlib.sha256).hexdigest()

    async def stream_archive(self, archive: Archive, start: int, end: int):
        """Bytes `start`..`end` of `archive`, a `CHUNK` at a time, each read admitted against the working-memory
        budget (it waits while training or sampling holds it); the files are closed however the stream ends."""
        try:
            while start <= end:
                length = min(CHUNK, end - start + 1)
                yield await self._in_thread(self._read_admitted, archive, start, length)
                start += length
        finally:
            archive.close()

    def _read_admitted(self, archive: Archive, start: int, length: int) -> bytes:
        with self.memory.reserve(length):
            return archive.read(start, length)


def archive_name(record: CheckpointRecord) -> str:
    """The archive's folder and the download's file name: the checkpoint's name where it is a plain folder name (as
    every name the layout holds is), else its id."""
    return record.name if safe_name(record.name) else record.cuid


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end inclusive) of a single ``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` range within `size`; None for no
    (or an unusable) Range header, which gets the whole archive; ApiError 416 for one past the end."""
    match = re.fullmatch(r"bytes=(\d*)-(\d*)", (header or "").strip())
    if match is None or match.group(1) == match.group(2) == "":
        return None
    first, last = match.groups()
    if first == "":  # the last n bytes
        start, end = max(0, size - int(last)), size - 1
    else:
        start, end = int(first), min(size - 1, int(last)) if last else size - 1
    if start >= size or start > end:
        raise ApiError(416, "range_not_satisfiable", f"the archive has {size} bytes")
    return start, end


def _file_size(handle) -> int:
    return os.fstat(handle.fileno()).st_size
