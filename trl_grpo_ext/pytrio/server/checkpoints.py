"""Checkpoint side of the local server: the in-memory snapshot cache and pruning of old checkpoints.

A mixin of `LocalPyTrioServer`.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from trl_grpo_ext.pytrio.checkpoint import load_loop_state
from trl_grpo_ext.pytrio.server.adapters import LoraSnapshot
from trl_grpo_ext.pytrio.server.errors import ApiError
from trl_grpo_ext.pytrio.server.registry import CheckpointRecord

logger = logging.getLogger(__name__)


class CheckpointStore:
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
                self.registry.forget_checkpoint(record.uri)
        for record in stale:
            with self._cache_lock:
                self._snapshot_cache.pop(record.uri, None)
            shutil.rmtree(record.path, ignore_errors=True)
            logger.info("retention: deleted checkpoint %s (%d bytes)", record.uri, record.size)


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
