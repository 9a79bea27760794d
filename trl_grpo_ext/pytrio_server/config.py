"""`ServerConfig`: how to start a local PyTRIO server, and the default checkpoint folder."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trl_grpo_ext.cpu.precision import parse_bf16_setting
from trl_grpo_ext.models import cache_dir
from trl_grpo_ext.pytrio_server.normalization import NORMALIZATIONS
from trl_grpo_ext.runs import PYTRIO_SERVER_DIRNAME

API_KEY_ENV = "TRL_GRPO_EXT_PYTRIO_API_KEY"  # read by `trl-grpo-ext pytrio-serve`: keeps the key out of `ps`
MIB = 1024 * 1024


@dataclass
class ServerConfig:
    """How to start a `LocalPyTrioServer`; every field has a safe default except ``model``.

    Invalid values raise `ValueError` with one line naming the field, before any model loads.
    """

    model: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port chosen by the OS
    api_key: str | None = None  # None (and no api_keys): a random key, read it from `server.api_key`
    # More clients: every key is one client, owning its sessions, runs and checkpoints (`clients`); an admin key
    # sees every client's. `api_key` (else the first of `api_keys`) is the one `server.api_key` reports.
    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()
    # Names a client may pass as ``base_model`` for the served model, besides its path and default alias
    # (e.g. "Qwen/Qwen3-4B-Instruct-2507", so a script written for the hosted service runs unmodified).
    # The first one is the alias the server reports (`models`, run views).
    served_names: tuple[str, ...] = ()
    # More base models, served for sampling and log-probs only (e.g. a distillation teacher): each a model folder,
    # hub id or 'embedded', passed as ``base_model`` by its path, the name given here or its folder name; written
    # ``NAME=MODEL`` it answers to NAME too (a hosted model's id, for scripts written for the hosted service).
    # Training runs use `model`. They share the working-memory budget.
    sampling_models: tuple[str, ...] = ()
    # Checkpoints and their records; None: `default_storage_dir()`, a stable folder, so a restarted server can
    # load_state from an earlier process's checkpoints. ephemeral_storage: a temporary folder removed on stop.
    storage_dir: str | None = None
    ephemeral_storage: bool = False
    device: str | None = None
    dtype: str = "float32"
    # bf16 autocast of an fp32 model in forward/backward: auto (where the CPU has bf16 matrix units), true, false
    # (`trl_grpo_ext.cpu.precision`); the LoRA weights and their optimizer state stay fp32
    bf16: str | bool = "auto"
    # sampling and compute_logprobs in bf16 too (where `bf16` is on). Off by default: in fp32 a request's tokens do
    # not depend on its batch-mates; in bf16 the rounding of a shared decode step can change them
    bf16_sampling: bool = False
    max_batch_size: int | None = None  # advertised to the client, which then splits batches into events
    max_tokens_per_request: int | None = None
    max_batch_tokens: int = 4096  # forward/backward: padded tokens per model call (memory of the logits)
    # forward/backward: data that share a token prefix (a GRPO group's prompt) encode it once; outputs and
    # gradients equal the unshared computation to float rounding
    share_prefix: bool = True
    # an image-text checkpoint (Qwen-VL style) is loaded with its vision tower and takes image chunks (`images`);
    # false loads its language model only, as a causal LM (less memory, image chunks refused)
    vision: bool = True
    long_poll_seconds: float = 20.0  # below the client's 65 s read timeout for event polls
    snapshot_cache_size: int = 8  # adapter snapshots kept in memory; older ones reload from disk
    max_temporary_checkpoints: int = 8  # per run: save_weights_and_get_sampling_client hand-offs kept
    # 0 (default): nothing a client saved is deleted, as on the hosted service. N >= 2, only when the operator
    # asks: per training run, the newest N durable checkpoints of each kind (save_state,
    # save_weights_for_sampler) are kept and older ones deleted (logged). At least 2, so the checkpoint a loop's
    # state file names survives until the loop has recorded the next one.
    keep_checkpoints: int = 0
    # forward_backward: "client_totals" divides each micro-batch's summed loss by the logical batch's denominator
    # the client sends (`normalization`), as the hosted service does; "sum" keeps the plain sum (Tinker's
    # documented semantics) for clients that normalise themselves.
    loss_normalization: str = "client_totals"
    heartbeat_ms: int = 60_000
    # Hardening: a request body above `max_request_bytes` answers 413 unread; a sample request asks for at most
    # `max_num_samples` sequences; a connection that sends nothing for `idle_timeout_seconds` is closed.
    max_request_bytes: int = 64 * MIB
    max_num_samples: int = 128
    # top-k prompt log-probs per position: the answer holds k (token, logprob) pairs per prompt token
    max_topk_logprobs: int = 20
    # Concurrent sample requests on the same weights share decode steps, up to this many rows in one batch.
    max_sampling_rows: int = 64
    idle_timeout_seconds: float = 300.0  # above a slow CPU step (forward_backward measured up to ~100 s loaded)
    # A session none of whose runs was heard of (heartbeat, event, sample, Control call) for this long is reclaimed:
    # closed as EXPIRED, its training runs ended and their adapters freed. 0 keeps sessions forever. The client
    # heartbeats every `heartbeat_ms` (at least 1 s), so the timeout must allow two missed beats.
    session_timeout_seconds: float = 900.0
    # Working memory admitted at once (forward/backward activations, sampling KV caches, prompt log-probs), estimated
    # per request from the model's shape; None: 60% of the memory available when the server starts. A request that
    # can never fit is refused (413); one that does not fit now waits for running work to finish.
    memory_budget_bytes: int | None = None
    # A request's head and body must arrive within this of its first byte (a deadline later bytes do not move);
    # 64 MiB in 120 s is 0.5 MB/s, far below any local link.
    request_timeout_seconds: float = 120.0
    # Open connections, in all and from one address; one more is answered 503 and closed before anything is read.
    max_connections: int = 1024
    max_connections_per_peer: int = 256

    def __post_init__(self):
        for name in ("served_names", "api_keys", "admin_keys", "sampling_models"):
            value = getattr(self, name)
            setattr(self, name, (value,) if isinstance(value, str) else tuple(value))
        problems = []
        if not str(self.model).strip():
            problems.append("model must be a model folder, a hub id or 'embedded'")
        try:
            parse_bf16_setting(self.bf16)
        except ValueError as error:
            problems.append(str(error))
        if not isinstance(self.bf16_sampling, bool):
            problems.append(f"bf16_sampling must be true or false, got {self.bf16_sampling!r}")
        if not isinstance(self.vision, bool):
            problems.append(f"vision must be true or false, got {self.vision!r}")
        if any(not isinstance(m, str) or not split_sampling_model(m)[0].strip() for m in self.sampling_models):
            problems.append(
                f"sampling_models must be model folders, hub ids or 'embedded', got {list(self.sampling_models)}"
            )
        if any(not isinstance(n, str) or not n.strip() for n in self.served_names):
            problems.append(f"served_names must be non-empty strings, got {list(self.served_names)}")
        for name in ("max_batch_tokens", "snapshot_cache_size", "max_temporary_checkpoints", "max_request_bytes",
                     "max_num_samples", "max_sampling_rows", "max_topk_logprobs", "max_connections",
                     "max_connections_per_peer"):  # fmt: skip
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                problems.append(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("max_batch_size", "max_tokens_per_request", "memory_budget_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                problems.append(f"{name} must be None or an integer >= 1, got {value!r}")
        if not isinstance(self.keep_checkpoints, int) or self.keep_checkpoints == 1 or self.keep_checkpoints < 0:
            problems.append(f"keep_checkpoints must be 0 (keep all) or >= 2, got {self.keep_checkpoints!r}")
        if self.loss_normalization not in NORMALIZATIONS:
            problems.append(f"loss_normalization must be one of {NORMALIZATIONS}, got {self.loss_normalization!r}")
        for name in ("long_poll_seconds", "idle_timeout_seconds", "request_timeout_seconds"):
            if not getattr(self, name) > 0 or getattr(self, name) == float("inf"):
                problems.append(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            problems.append(f"port must be in [0, 65535], got {self.port!r}")
        if self.api_key is not None and not _usable_key(self.api_key):
            problems.append("api_key must be a non-empty string without whitespace")
        for name in ("api_keys", "admin_keys"):
            if not all(_usable_key(k) for k in getattr(self, name)):
                problems.append(f"{name} must be non-empty strings without whitespace")
        if set(self.admin_keys) & {self.api_key, *self.api_keys}:
            problems.append("a key cannot be both a client key and an admin key")
        beat = max(1.0, self.heartbeat_ms / 1000)  # pytrio beats at least once a second
        if not self.session_timeout_seconds >= 0 or 0 < self.session_timeout_seconds < 2 * beat:
            problems.append(
                f"session_timeout_seconds must be 0 (never) or >= {2 * beat:g} (two heartbeats of heartbeat_ms), "
                f"got {self.session_timeout_seconds!r}"
            )
        if problems:
            raise ValueError("invalid local PyTRIO server config: " + "; ".join(problems))


def split_sampling_model(entry: str) -> tuple[str, str | None]:
    """(model, served name or None) of a `ServerConfig.sampling_models` entry: ``MODEL`` or ``NAME=MODEL``."""
    name, sep, model = entry.partition("=")
    return (model, name.strip()) if sep and name.strip() else (entry, None)


def _usable_key(key: object) -> bool:
    return isinstance(key, str) and bool(key.strip()) and not any(c.isspace() for c in key)


def read_api_key_file(path: str | os.PathLike) -> list[str]:
    """The keys stored in `path`, one per line (one per client; blank lines and ``#`` comments skipped); a one-line
    `ValueError` when the file is unreadable, holds no key or a line with whitespace inside."""
    file = Path(path).expanduser()
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read the API key file {file}: {error}") from None
    entries = [(i, line.strip()) for i, line in enumerate(lines, 1) if line.strip() and not line.strip()[0] == "#"]
    keys = [key for _, key in entries]
    bad = [i for i, key in entries if not _usable_key(key)]
    if not keys or bad:
        where = f" (line {bad[0]} has whitespace inside)" if bad else ""
        raise ValueError(f"the API key file {file} must hold one key per line, without whitespace inside{where}")
    return keys


def default_storage_dir() -> Path:
    """``$TRL_GRPO_EXT_CACHE/pytrio-server`` (default ``~/.cache/trl_grpo_ext/pytrio-server``): the same folder
    for every server of this user, so a restarted one finds earlier checkpoints."""
    return cache_dir() / PYTRIO_SERVER_DIRNAME
