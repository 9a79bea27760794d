"""`ServerConfig`: how to start a local PyTRIO server, and the default checkpoint folder."""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field
from pathlib import Path

from trl_grpo_ext.cpu.precision import parse_bf16_setting
from trl_grpo_ext.models import cache_dir
from trl_grpo_ext.pytrio_server.memory import GIB
from trl_grpo_ext.pytrio_server.normalization import NORMALIZATIONS
from trl_grpo_ext.runs import PYTRIO_SERVER_DIRNAME

API_KEY_ENV = "TRL_GRPO_EXT_PYTRIO_API_KEY"  # read by `trl-grpo-ext pytrio-serve`: keeps the key out of `ps`
MIB = 1024 * 1024


def option(default=MISSING, help: str = "", flag: str | None = None, **cli):
    """A `ServerConfig` field: its default and `help`; with `flag`, also a ``pytrio-serve`` option, whose type, default
    and help come from the field (`trl_grpo_ext.cli.pytrio_serve` derives them). `cli` keys: ``cli_default`` (the
    option's default where it differs from the field's), ``unit`` ((name, bytes): the option counts in that unit, the
    field in bytes), ``choices``, ``metavar``, ``cli_help`` (the option's help where it differs, as a ``--no-`` switch's
    does)."""
    return field(default=default, metadata={"help": help, "flag": flag, **cli})


@dataclass
class ServerConfig:
    """How to start a `LocalPyTrioServer`; every field has a safe default except ``model``.

    Invalid values raise `ValueError` with one line naming the field, before any model loads. A field with a ``flag``
    is also a ``pytrio-serve`` option (`option`): a new setting is one field here.
    """

    model: str = option(help="model folder, hub id, or 'embedded' (SmolLM2-135M-Instruct): the one training runs use")
    host: str = option("127.0.0.1", "bind address; 127.0.0.1 is this machine only", "--host")
    port: int = option(0, "port (0 picks a free one)", "--port", cli_default=8710)
    api_key: str | None = option(None, "the client key `server.api_key` reports; None (and no api_keys): a random key")
    # More clients: every key is one client, owning its sessions, runs and checkpoints (`clients`); an admin key
    # sees every client's. `api_key` (else the first of `api_keys`) is the one `server.api_key` reports.
    api_keys: tuple[str, ...] = option((), "more client keys, one client each")
    admin_keys: tuple[str, ...] = option((), "admin keys: an admin sees and may act on every client's objects")
    # The first one is the alias the server reports (`models`, run views).
    served_names: tuple[str, ...] = option(
        (),
        "a name clients may pass as base_model for the served model, besides its path and default alias, e.g. "
        "Qwen/Qwen3-4B-Instruct-2507 so scripts written for the hosted service run unmodified (repeatable; the first "
        "is the reported alias)",
        "--served-name",
        metavar="NAME",
    )
    # Training runs use `model`; these share the working-memory budget. (pytrio-serve: `--model` repeated.)
    sampling_models: tuple[str, ...] = option(
        (),
        "more base models, served for sampling and log-probs only (e.g. a distillation teacher): each a model folder, "
        "hub id or 'embedded', passed as base_model by its path, the name given here or its folder name; written "
        "NAME=MODEL it answers to NAME too (a hosted model's id, for scripts written for the hosted service)",
    )
    # None: `default_storage_dir()`, a stable folder, so a restarted server can load_state from an earlier process's
    # checkpoints.
    storage_dir: str | None = option(
        None,
        f"checkpoint folder, kept across restarts (default: $TRL_GRPO_EXT_CACHE/{PYTRIO_SERVER_DIRNAME} or "
        f"~/.cache/trl_grpo_ext/{PYTRIO_SERVER_DIRNAME})",
        "--storage-dir",
    )
    ephemeral_storage: bool = option(False, "checkpoints in a temporary folder removed on stop (tests)")
    # (`records`) For a storage folder written by a version that did not sign records; once, then without it.
    adopt_unsigned_checkpoints: bool = option(
        False,
        "at start, sign and keep the unsigned checkpoint records of an earlier version that agree with the place they "
        "lie (otherwise they are refused); use it once, on a storage folder no one else can write",
        "--adopt-unsigned-checkpoints",
    )
    device: str | None = option(None, "torch device (default cuda if available, else cpu)", "--device")
    dtype: str = option("float32", "model dtype: float32, bfloat16, float16", "--dtype")
    # (`trl_grpo_ext.cpu.precision`)
    bf16: str | bool = option(
        "auto",
        "bf16 autocast of a float32 model in forward/backward: auto (where the CPU has bf16 matrix units), true, "
        "false; LoRA weights and optimizer state stay fp32",
        "--bf16",
        choices=("auto", "true", "false"),
    )
    # Off by default: in fp32 a request's tokens do not depend on its batch-mates; in bf16 the rounding of a shared
    # decode step can change them.
    bf16_sampling: bool = option(
        False,
        "sample (and compute_logprobs) in bf16 too where bf16 is on: faster on some CPUs, but a request's tokens may "
        "then depend on the requests decoded beside it (default: fp32 sampling, batch-invariant)",
        "--bf16-sampling",
    )
    max_batch_size: int | None = option(
        None, "per-event batch cap advertised to clients (they then split batches into events)", "--max-batch-size"
    )
    max_tokens_per_request: int | None = option(None, "per-event token cap advertised to clients")
    max_batch_tokens: int = option(4096, "forward/backward: padded tokens per model call (memory of the logits)")
    share_prefix: bool = option(
        True,
        "forward/backward: data that share a token prefix (a GRPO group's prompt) encode it once; outputs and "
        "gradients equal the unshared computation to float rounding",
    )
    # (`model_sides`)
    concurrent_sampling: bool = option(
        True,
        "sampler snapshots (sample, compute_logprobs, the OpenAI route) run beside training on a second module tree "
        "over the same weights, each side on its share of the CPU threads; off: one lock serves both",
        "--no-concurrent-sampling",
        cli_help="one lock for sampling and training: a sample request waits for a running forward_backward (default: "
        "sampling runs beside training, each on its share of the CPU threads)",
    )
    # (`images`)
    vision: bool = option(
        True,
        "load an image-text checkpoint with its vision tower, image chunks accepted; off: its language model only, "
        "as a causal LM (less memory, image chunks refused)",
        "--no-vision",
        cli_help="load an image-text checkpoint's language model only, as a causal LM: less memory, image chunks "
        "refused (default: with its vision tower, image chunks accepted)",
    )
    long_poll_seconds: float = option(20.0, "longest wait of an event status read (below the client's 65 s timeout)")
    snapshot_cache_size: int = option(8, "adapter snapshots kept in memory; older ones reload from disk")
    max_temporary_checkpoints: int = option(8, "per run: save_weights_and_get_sampling_client hand-offs kept")
    # At least 2, so the checkpoint a loop's state file names survives until the loop has recorded the next one.
    keep_checkpoints: int = option(
        0,
        "delete old checkpoints: per training run, keep the newest N save_state and N sampler checkpoints (N >= 2; "
        "each deletion is logged). 0: nothing a client saved is deleted, as on the hosted service",
        "--keep-checkpoints",
    )
    # (`normalization`)
    loss_normalization: str = option(
        "client_totals",
        "forward_backward: divide each micro-batch's loss by the logical batch's token total the client sends, as "
        "the hosted service does (client_totals), or keep the plain sum over tokens (sum, Tinker's documented "
        "semantics, for clients that normalise themselves)",
        "--loss-normalization",
        choices=NORMALIZATIONS,
    )
    heartbeat_ms: int = option(60_000, "the heartbeat interval the server asks clients for")
    max_request_bytes: int = option(
        64 * MIB, "largest request body accepted; larger ones get 413 unread", "--max-request-mb", unit=("MiB", MIB)
    )
    max_num_samples: int = option(128, "most sequences one sample request may ask for", "--max-num-samples")
    max_topk_logprobs: int = option(
        20, "largest topk_prompt_logprobs a sample request may ask (k pairs per prompt token)", "--max-topk-logprobs"
    )
    max_sampling_rows: int = option(64, "rows of concurrent sample requests on the same weights in one decode batch")
    # Above a slow CPU step (forward_backward measured up to ~100 s loaded).
    idle_timeout_seconds: float = option(
        300.0, "seconds a connection may stay silent before it is closed", "--idle-timeout"
    )
    # Its runs ended and their adapters freed. The client heartbeats every `heartbeat_ms` (at least 1 s), so the
    # timeout must allow two missed beats.
    session_timeout_seconds: float = option(
        900.0,
        "seconds without a heartbeat (or any request) after which a client's session is reclaimed: its runs ended, "
        "their memory freed (0: never)",
        "--session-timeout",
    )
    # Estimated per request from the model's shape; a request that can never fit is refused (413), one that does not
    # fit now waits for running work to finish.
    memory_budget_bytes: int | None = option(
        None,
        "working memory admitted at once (activations, sampling caches; estimated per request from the model's "
        "shape): larger requests get 413, others wait their turn (default: 60% of the memory available at start)",
        "--memory-budget-gb",
        unit=("GiB", GIB),
    )
    # 64 MiB in 120 s is 0.5 MB/s, far below any local link.
    request_timeout_seconds: float = option(
        120.0,
        "seconds a request's head and body may take to arrive from its first byte; later bytes do not extend it",
        "--request-timeout",
    )
    max_connections: int = option(
        1024, "open connections in all; one more is refused with 503 at once", "--max-connections"
    )
    max_connections_per_peer: int = option(256, "open connections from one address", "--max-connections-per-peer")

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
        if not isinstance(self.concurrent_sampling, bool):
            problems.append(f"concurrent_sampling must be true or false, got {self.concurrent_sampling!r}")
        if not isinstance(self.adopt_unsigned_checkpoints, bool):
            problems.append(
                f"adopt_unsigned_checkpoints must be true or false, got {self.adopt_unsigned_checkpoints!r}"
            )
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
