"""Checkpoint downloads: what the client's ``RestClient.download_checkpoint``, ``get_checkpoint_download_url`` and
``get_checkpoint_archive_url`` fetch.

A mixin of `LocalPyTrioServer`. ``GET /api/openapi/v1/checkpoints/{id}/download-url`` (the caller's own checkpoint;
another key's answers as a missing one) gives a URL under `FILES_PREFIX` that carries its own credential, as a
presigned object-storage URL does (the client's downloader sends no API key): the checkpoint id and an expiry, signed
with a key this server process drew at start (HMAC-SHA256). `RequestGuard` checks the signature and the expiry before
anything else (``403 download_url_invalid`` / ``download_url_expired``: the client then asks Control for a fresh URL).

The URL serves one uncompressed tar archive, ``<name>/`` holding the checkpoint's PEFT adapter folder
(`ARCHIVE_FILES`: ``adapter_config.json`` and ``adapter_model.safetensors``, loadable with
``peft.PeftModel.from_pretrained(base, "<name>")``; a ``save_state`` checkpoint also its AdamW state,
``optimizer.json`` + ``optimizer.safetensors``) and ``trio_checkpoint.json`` (LoRA settings, step). Its bytes are the
same at every request (fixed member order, times and owners), so a download resumes with ``Range: bytes=N-`` (206, or
416 once complete). It is streamed from the files a `CHUNK` at a time, each chunk admitted against the working-memory
budget while it is in flight; nothing is built in memory or on disk.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

from trl_grpo_ext.pytrio_server.adapters import ADAPTER_FILE, META_FILE
from trl_grpo_ext.pytrio_server.clients import Caller
from trl_grpo_ext.pytrio_server.errors import ApiError
from trl_grpo_ext.pytrio_server.optimizer_state import (
    LEGACY_OPTIMIZER,
    OPTIMIZER_META,
    OPTIMIZER_TENSORS,
    load_optimizer,
)
from trl_grpo_ext.pytrio_server.registry import CheckpointRecord, iso
from trl_grpo_ext.runs import ADAPTER_CONFIG_FILENAME

FILES_PREFIX = "/files/v1/checkpoints/"
_ARCHIVE_PATH = re.compile(rf"^{FILES_PREFIX}([A-Za-z0-9_\-]{{1,80}})/archive\.tar$")
URL_LIFETIME_SECONDS = 3600  # the client asks for a new URL within 60 s of its expiry
CHUNK = 1024 * 1024
# In this order, those that exist; an optimizer pickle of a checkpoint saved before (`LEGACY_OPTIMIZER`) is
# converted before its first download and never served.
ARCHIVE_FILES = (ADAPTER_CONFIG_FILENAME, ADAPTER_FILE, OPTIMIZER_META, OPTIMIZER_TENSORS, META_FILE)


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

    def __init__(self, folder: Path, name: str, mtime: float):
        self.parts: list[ArchivePart] = []
        try:
            for file_name in ARCHIVE_FILES:
                path = folder / file_name
                if not path.is_file():
                    continue
                handle = path.open("rb")
                size = _file_size(handle)
                info = tarfile.TarInfo(f"{name}/{file_name}")
                info.size, info.mtime, info.mode = size, int(mtime), 0o644
                self.parts.append(ArchivePart(len(header := info.tobuf(tarfile.PAX_FORMAT)), header))
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
        body); 403 otherwise, 404 when the checkpoint is gone since."""
        match = _ARCHIVE_PATH.match(path)
        params = parse_qs(query)
        expires = (params.get("expires") or [""])[0]
        signature = (params.get("signature") or [""])[0]
        if match is None or not expires.isdigit():
            raise ApiError(403, "download_url_invalid", "not a download URL of this server; ask Control for one")
        cid = match.group(1)
        if not hmac.compare_digest(signature, self._sign(cid, int(expires))):
            raise ApiError(403, "download_url_invalid", "this download URL's signature does not hold; ask for another")
        if int(expires) < time.time():
            raise ApiError(403, "download_url_expired", "this download URL has expired; ask Control for a new one")
        return self.registry.checkpoint_by_cuid(cid)  # still there (deleted, expired, pruned: 404)

    def open_archive(self, record: CheckpointRecord) -> Archive:
        if not record.path.is_dir():
            raise ApiError(404, "checkpoint_not_found", f"checkpoint {record.cuid} not found")
        return Archive(record.path, record.name, record.created)

    def _downloadable(self, record: CheckpointRecord) -> None:
        """A state checkpoint saved before holds a pickled optimizer: convert it now, so its archive is the same
        at every request (`optimizer_state`; one that cannot be converted is refused with the reason)."""
        if record.kind == "state" and (record.path / LEGACY_OPTIMIZER).is_file():
            load_optimizer(record.path, record.uri)

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
