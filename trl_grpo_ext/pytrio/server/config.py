"""`ServerConfig`: how to start a local PyTRIO server, and the default checkpoint folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class ServerConfig:
    """How to start a `LocalPyTrioServer`; every field has a safe default except ``model``."""

    model: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port chosen by the OS
    api_key: str | None = None  # None: a random key, read it from `server.api_key`
    model_name: str | None = None  # alias the client may pass as base_model (besides the path)
    # Checkpoints and their records; None: `default_storage_dir()`, a stable folder, so a restarted server can
    # load_state from an earlier process's checkpoints. ephemeral_storage: a temporary folder removed on stop.
    storage_dir: str | None = None
    ephemeral_storage: bool = False
    device: str | None = None
    dtype: str = "float32"
    max_batch_size: int | None = None  # advertised to the client, which then splits batches into events
    max_tokens_per_request: int | None = None
    max_batch_tokens: int = 4096  # forward/backward: padded tokens per model call (memory of the logits)
    long_poll_seconds: float = 20.0  # below the client's 65 s read timeout for event polls
    snapshot_cache_size: int = 8  # adapter snapshots kept in memory; older ones reload from disk
    max_temporary_checkpoints: int = 8  # per run: save_weights_and_get_sampling_client hand-offs kept
    heartbeat_ms: int = 60_000


def default_storage_dir() -> Path:
    """``$TRL_GRPO_EXT_CACHE/pytrio-server`` (default ``~/.cache/trl_grpo_ext/pytrio-server``): the same folder
    for every server of this user, so a restarted one finds earlier checkpoints."""
    from trl_grpo_ext.models import cache_dir

    return cache_dir() / "pytrio-server"
