"""Checkpoint side of the local server: the in-memory snapshot cache and pruning of old checkpoints.

A mixin of `LocalPyTrioServer`.
"""

from __future__ import annotations

import shutil

from trl_grpo_ext.pytrio.server.engine import LoraSnapshot
from trl_grpo_ext.pytrio.server.registry import ApiError, CheckpointRecord


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
