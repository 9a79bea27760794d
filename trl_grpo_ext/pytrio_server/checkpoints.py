"""Checkpoint side of the local server: writing checkpoint folders, the in-memory snapshot cache and pruning of old
checkpoints.

A mixin of `LocalPyTrioServer`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from trl_grpo_ext.pytrio_server.adapters import LoraSnapshot
from trl_grpo_ext.pytrio_server.base_model import mismatch
from trl_grpo_ext.pytrio_server.errors import ApiError, EngineError, EventFailure
from trl_grpo_ext.pytrio_server.records import CheckpointRecord, same_checkpoint
from trl_grpo_ext.pytrio_server.storage import RECORD_FILE, CheckpointFolder, StorageError, remove_checkpoint_folder
from trl_grpo_ext.runs.loop_state import load_loop_state

logger = logging.getLogger(__name__)

STAGING_SUFFIX = ".saving"  # a checkpoint being written: `.<name>.saving` beside its final folder
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# how the libraries that write a checkpoint word a full disk when they raise no OSError (safetensors: "No space
# left on device (os error 28)"; torch.save says only "unexpected pos", caught by the free-space check instead)
_FULL_MESSAGES = ("no space left on device", "disk quota exceeded", "file too large", "os error 28", "os error 122")


class CheckpointStore:
    def _write_checkpoint(self, record: CheckpointRecord, snapshot: LoraSnapshot) -> None:
        """Write `snapshot` to its checkpoint folder and register `record` (its ``size`` set), or leave nothing behind.

        The files go to a staging folder first; only a complete one replaces the final folder (an overwritten
        checkpoint survives a failed save), and the record, written last and signed, marks it complete. The folders
        on the way are reached without following a link (`storage.CheckpointFolder`; new ones readable by the
        server's user only). A save the disk cannot hold fails as ``insufficient_storage`` (HTTP's 507 name; an event
        failure, not a 5xx answer, which the client would retry for 15 minutes), checked before writing when the free
        space is already short; any other failure as ``checkpoint_save_failed``. Messages name the URI, never a local
        path.
        """
        run, kind_folder, name = record.parts
        staging = f".{name}{STAGING_SUFFIX}"
        needed = snapshot_bytes(snapshot)
        parent = None
        try:
            parent = CheckpointFolder(self.storage, (run, kind_folder), create=True)
            if shutil.disk_usage(parent.pinned).free < needed:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            parent.remove(staging)
            os.mkdir(staging, 0o700, dir_fd=parent.fd)
            record.size = snapshot.save(parent.pinned / staging, self.model_id, self.engine.peft_config(snapshot.lora))
            parent.remove(name)
            parent.rename(staging, name)
            self.registry.add_checkpoint(record)
        except Exception as error:  # noqa: BLE001 - every failure leaves no partial folder and one clear code
            if parent is not None:
                with contextlib.suppress(OSError, StorageError):
                    parent.remove(staging)
                if not _record_complete(parent, name):  # moved into place without its record, or the old one gone
                    with contextlib.suppress(OSError, StorageError):
                        parent.remove(name)
                    self.registry.forget_checkpoint(record.uri)
            if storage_full(error, self.storage, needed):
                logger.warning("checkpoint %s not saved: the storage folder is full (%s)", record.uri, error)
                raise EventFailure(
                    "insufficient_storage",
                    f"no space left on the server's checkpoint storage for {record.uri} (about {needed} bytes "
                    "needed); nothing was kept. Free space or delete old checkpoints, then save again",
                ) from None
            logger.exception("checkpoint %s not saved", record.uri)
            reason = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
            message = f"could not save {record.uri} ({reason}); nothing was kept"
            raise EventFailure("checkpoint_save_failed", message) from None
        finally:
            if parent is not None:
                parent.close()

    def checkpoint_files(self, record: CheckpointRecord) -> CheckpointFolder:
        """The checkpoint's folder, opened without following a link (`storage.CheckpointFolder`): 404
        ``checkpoint_not_found`` when it is gone (the record is forgotten then), 409 ``checkpoint_unreadable`` when
        something else than the server's folder lies there. Answers name the checkpoint, never the path."""
        try:
            return CheckpointFolder(self.storage, record.parts)
        except FileNotFoundError:
            self.registry.forget_checkpoint(record.uri, record)
            logger.warning("checkpoint %s: its folder %s is gone", record.uri, record.path)
            raise ApiError(
                404, "checkpoint_not_found", f"checkpoint {record.uri} not found: its files are gone"
            ) from None
        except (OSError, StorageError) as error:
            raise self._unreadable(record, error) from None

    def _unreadable(self, record: CheckpointRecord, error: BaseException) -> ApiError:
        logger.warning("checkpoint %s cannot be read from %s: %s", record.uri, record.path, error)
        return ApiError(
            409,
            "checkpoint_unreadable",
            f"checkpoint {record.uri} ({record.cuid}) cannot be read on the server's storage: its files are not the "
            "ones the server wrote (a link, another user's file, or damaged); the server's log has the details",
        )

    def _check_base(self, record: CheckpointRecord) -> None:
        """409 ``base_model_mismatch`` (one line naming both) for a checkpoint trained on another base model than this
        server's, or one whose base is unknown (it cannot be checked)."""
        problem = mismatch(record.uri, record.base, self.engine.base_model)
        if problem:  # the answer names the models by their short names; the log has the full ones
            logger.info("checkpoint %s: trained on %r, this server serves %r (refused)", record.uri, record.base.name,
                        self.engine.base_model.name)  # fmt: skip
            raise ApiError(409, "base_model_mismatch", problem)

    def _base_differs(self, record: CheckpointRecord) -> bool:
        """Whether `record` cannot be used on this server's base model (trained on another, or its base unknown)."""
        return mismatch(record.uri, record.base, self.engine.base_model) is not None

    def _snapshot(self, record: CheckpointRecord, with_optimizer: bool) -> LoraSnapshot:
        """The checkpoint's weights, from the in-memory cache of recent snapshots or from disk, once its base model is
        this server's (`_check_base`): every path that loads, samples from, resumes or teaches with a checkpoint
        comes through here. Its files are read as `checkpoint_files` opens them; a file missing is 409
        ``checkpoint_incomplete``, one that cannot be read 409 ``checkpoint_unreadable`` (the path in the log)."""
        self._check_base(record)
        with self._cache_lock:
            cached = self._snapshot_cache.get(record.uri)
            if cached is not None and cached.uid == record.snapshot_uid:
                self._snapshot_cache.move_to_end(record.uri)
                if cached.optimizer is not None or not with_optimizer:
                    return cached
        with self.checkpoint_files(record) as folder:
            try:
                snapshot = LoraSnapshot.load(folder, with_optimizer, record.uri, self.memory)
            except EngineError as error:  # no optimizer state, an optimizer file refused: its own code
                raise ApiError(409, error.code, error.message) from None
            except ApiError:
                raise
            except FileNotFoundError as error:  # deleted under it (another server, a hand on the disk)
                logger.warning("checkpoint %s is incomplete in %s: %s", record.uri, record.path, error)
                raise ApiError(
                    409,
                    "checkpoint_incomplete",
                    f"checkpoint {record.uri} ({record.cuid}) is incomplete on the server's storage (a file is "
                    "missing: deleted meanwhile, or damaged); it cannot be loaded",
                ) from None
            except Exception as error:  # noqa: BLE001 - a damaged or foreign file: one answer, no path in it
                raise self._unreadable(record, error) from None
        snapshot.uid = record.snapshot_uid  # same weights: a sampler slot holding them needs no reload
        self._remember(record.uri, snapshot)
        return snapshot

    def _remember(self, uri: str, snapshot: LoraSnapshot) -> None:
        with self._cache_lock:
            self._snapshot_cache[uri] = snapshot
            self._snapshot_cache.move_to_end(uri)
            while len(self._snapshot_cache) > self.config.snapshot_cache_size:
                self._snapshot_cache.popitem(last=False)

    def expire_checkpoints(self) -> int:
        """Delete every checkpoint past its ``ttl_seconds`` (its record and files); returns how many. Lookups answer
        an expired checkpoint as a missing one already (`CheckpointRecord.expired`); this reclaims its disk."""
        now = time.time()
        with self.registry.lock:
            expired = [c for c in self.registry.checkpoints.values() if c.expired(now)]
            for record in expired:
                self.registry.forget_checkpoint(record.uri, record)
        deleted = 0
        for record in expired:
            if self._delete_files(record):
                deleted += 1
                logger.info("ttl: deleted checkpoint %s (%d bytes; its ttl_seconds passed)", record.uri, record.size)
        return deleted

    def _delete_files(self, record: CheckpointRecord) -> bool:
        """Delete the checkpoint folder of `record`, and only when it still holds that checkpoint: its signed record
        with the same id (not one saved again since, by this or another server), reached without following a link;
        returns whether it did. A refusal is logged; nothing else is touched."""
        with self._cache_lock:
            self._snapshot_cache.pop(record.uri, None)

        def holds_it(folder: CheckpointFolder) -> bool:
            if same_checkpoint(folder, record, self.registry.key):
                return True
            logger.warning("not deleting %s: its folder %s holds another checkpoint's record now", record.uri,
                           record.path)  # fmt: skip
            return False

        try:
            return remove_checkpoint_folder(self.storage, record.parts, holds_it)
        except (OSError, StorageError) as error:
            logger.warning("not deleting %s (%s): %s", record.uri, record.path, error)
            return False

    def _prune_temporary(self, run: str) -> None:
        """Keep the newest `max_temporary_checkpoints` TEMPORARY checkpoints of `run` (sampler hand-offs).

        Every hand-off has its sampling client, so "referenced by a live sampler" cannot protect them: a sampler
        left on a pruned hand-off gets ``checkpoint_not_found``.
        """
        self._prune(run, lambda c: c.visibility == "TEMPORARY", self.config.max_temporary_checkpoints, set())

    def _prune_durable(self, run: str, kind: str) -> None:
        """Retention of `run`'s durable checkpoints of `kind`: the newest `keep_checkpoints` stay (0: all).

        Never deleted: a checkpoint a sampling run of an active session was created from, and the ones the loop
        state file beside the storage folder names (`protected_uris`).
        """
        keep = self.config.keep_checkpoints
        if keep > 0:
            protected = self.protected_uris()
            self._prune(run, lambda c: c.kind == kind and c.visibility != "TEMPORARY", keep, protected)

    def protected_uris(self) -> set[str]:
        """Checkpoint URIs retention must keep: sources of live samplers and what a saved loop state resumes from."""
        with self.registry.lock:
            active = {s.cuid for s in self.registry.sessions.values() if s.status == "ACTIVE"}
            uris = {r.source_checkpoint_uri for r in self.registry.sampling_runs.values() if r.session in active}
        uris |= loop_state_uris(self.storage.parent)
        uris.discard("")
        return uris

    def _prune(self, run: str, selected, keep: int, protected: set[str]) -> None:
        with self.registry.lock:
            records = sorted(
                (c for c in self.registry.checkpoints.values() if c.run == run and selected(c)),
                key=lambda c: c.created,
            )
            stale = [c for c in records[: max(0, len(records) - keep)] if c.uri not in protected]
            for record in stale:
                self.registry.forget_checkpoint(record.uri, record)
        for record in stale:
            if not self._delete_files(record):
                continue
            logger.info(
                "retention: deleted checkpoint %s (%d bytes; keeps the newest %d)", record.uri, record.size, keep
            )


def loop_state_uris(folder: Path) -> set[str]:
    """The checkpoint URIs the PyTRIO loop's state file in `folder` resumes from (none when there is no file).

    The recipe keeps its server storage in ``<output_dir>/pytrio-server``, beside the loop's state file, so the
    server can see which checkpoints a later ``resume: true`` needs.
    """
    try:
        state = load_loop_state(folder)
    except (OSError, ValueError):  # an unreadable state protects nothing it could name; the newest N still stay
        return set()
    if state is None:
        return set()
    return {uri for uri in (state.state_path, state.sampler_path) if isinstance(uri, str) and uri}


def snapshot_bytes(snapshot: LoraSnapshot) -> int:
    """Bytes of the tensors `snapshot` writes (adapter weights, optimizer moments): about its checkpoint's size."""

    def size(value) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(size(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(size(v) for v in value)
        return 0

    return size(snapshot.weights) + size(snapshot.optimizer)


def storage_full(error: BaseException, folder: Path, needed: int) -> bool:
    """Whether `error`, raised while writing a checkpoint of about `needed` bytes into `folder`, means a full disk."""
    if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
        return True
    if any(marker in str(error).lower() for marker in _FULL_MESSAGES):
        return True
    try:
        return shutil.disk_usage(folder).free < needed
    except OSError:
        return False


def _record_complete(parent: CheckpointFolder, name: str) -> bool:
    """Whether the folder `name` in `parent` holds its record (a complete checkpoint)."""
    try:
        with parent.child(name) as folder:
            return folder.entry(RECORD_FILE) is not None
    except (OSError, StorageError):
        return False
