"""`trl-grpo-ext pytrio-serve`: run the local PyTRIO server in the foreground until Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from trl_grpo_ext.models import EMBEDDED_NAME
from trl_grpo_ext.pytrio_server.config import API_KEY_ENV, MIB, ServerConfig, read_api_key_file

# (flag, ServerConfig field, type, help) of the server's limits that map one to one onto a field
LIMIT_FLAGS = [
    ("--max-num-samples", "max_num_samples", int, "most sequences one sample request may ask for"),
    ("--max-topk-logprobs", "max_topk_logprobs", int, "largest topk_prompt_logprobs a sample request may ask"),
    ("--idle-timeout", "idle_timeout_seconds", float, "seconds a connection may stay silent before it is closed"),
    ("--request-timeout", "request_timeout_seconds", float,
     "seconds a request's head and body may take to arrive from its first byte; later bytes do not extend it"),
    ("--max-connections", "max_connections", int, "open connections in all; one more is refused with 503 at once"),
    ("--max-connections-per-peer", "max_connections_per_peer", int, "open connections from one address"),
]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig(model=EMBEDDED_NAME)
    parser.add_argument(
        "--model",
        required=True,
        action="append",
        help="model folder, hub id, or 'embedded' (SmolLM2-135M-Instruct). Repeat it to serve more base models: "
        "the first is trained (LoRA), the others are served for sampling and log-probs only (e.g. a distillation "
        "teacher: create_sampling_client(base_model=<its path or folder name>) + compute_logprobs); NAME=MODEL "
        "also answers to NAME (e.g. Qwen/Qwen3-8B=outputs/teacher for a script written for the hosted service)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8710, help="port (0 picks a free one)")
    parser.add_argument(
        "--api-key-file",
        default=None,
        help="file of the bearer tokens clients send, one key per line, one line per client: each client sees only "
        "its own sessions, runs and checkpoints (safest: keys never show in `ps`); else --api-key, else "
        f"${API_KEY_ENV}, else a random key printed once at start",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"a client key itself, repeatable (visible in `ps` to other users: prefer --api-key-file or ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--admin-key-file",
        default=None,
        help="file of admin keys, one per line: an admin sees and may act on every client's objects",
    )
    parser.add_argument(
        "--session-timeout",
        type=float,
        default=defaults.session_timeout_seconds,
        help="seconds without a heartbeat (or any request) after which a client's session is reclaimed: its runs "
        f"ended, their memory freed (0: never; default {defaults.session_timeout_seconds:g})",
    )
    parser.add_argument(
        "--served-name",
        action="append",
        default=[],
        metavar="NAME",
        help="a name clients may pass as base_model for this model, e.g. Qwen/Qwen3-4B-Instruct-2507 so scripts "
        "written for the hosted service run unmodified (repeatable; the first is the reported alias)",
    )
    parser.add_argument("--storage-dir", default=None, help="checkpoint folder, kept across restarts (default: $TRL_GRPO_EXT_CACHE/pytrio-server or ~/.cache/trl_grpo_ext/pytrio-server)")  # fmt: skip
    parser.add_argument(
        "--keep-checkpoints",
        type=int,
        default=defaults.keep_checkpoints,
        help="delete old checkpoints: per training run, keep the newest N save_state and N sampler checkpoints "
        "(N >= 2; each deletion is logged). Default 0: nothing a client saved is deleted",
    )
    parser.add_argument(
        "--loss-normalization",
        choices=("client_totals", "sum"),
        default=defaults.loss_normalization,
        help="forward_backward: divide each micro-batch's loss by the logical batch's token total the client sends, "
        "as the hosted service does (client_totals, default), or keep the plain sum over tokens (sum)",
    )
    parser.add_argument("--device", default=None, help="torch device (default cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", help="model dtype: float32, bfloat16, float16")
    parser.add_argument(
        "--bf16",
        default="auto",
        choices=("auto", "true", "false"),
        help="bf16 autocast of a float32 model in forward/backward: auto (where the CPU has bf16 matrix units), "
        "true, false; LoRA weights and optimizer state stay fp32 (default auto)",
    )
    parser.add_argument(
        "--bf16-sampling",
        action="store_true",
        help="sample (and compute_logprobs) in bf16 too where --bf16 is on: faster on some CPUs, but a request's "
        "tokens may then depend on the requests decoded beside it (default: fp32 sampling, batch-invariant)",
    )
    parser.add_argument(
        "--no-vision",
        dest="vision",
        action="store_false",
        help="load an image-text checkpoint's language model only, as a causal LM: less memory, image chunks "
        "refused (default: with its vision tower, image chunks accepted)",
    )
    parser.add_argument("--max-batch-size", type=int, default=None, help="per-event batch cap advertised to clients")
    parser.add_argument(
        "--max-request-mb",
        type=float,
        default=defaults.max_request_bytes / MIB,
        help=f"largest request body accepted, MiB (default {defaults.max_request_bytes // MIB}); larger ones get 413",
    )
    for flag, field, kind, what in LIMIT_FLAGS:  # each a `ServerConfig` field, its default shown
        default = getattr(defaults, field)
        metavar = flag[2:].upper().replace("-", "_")
        parser.add_argument(
            flag, type=kind, default=default, dest=field, metavar=metavar, help=f"{what} (default {default:g})"
        )
    parser.add_argument(
        "--memory-budget-gb",
        type=float,
        default=None,
        help="working memory admitted at once, GiB (activations, sampling caches; estimated per request from the "
        "model's shape): larger requests get 413, others wait their turn (default: 60%% of the memory available "
        "at start)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level")


def _config(args: argparse.Namespace) -> tuple[ServerConfig, bool]:
    """The server config from the command line; also whether the key was chosen by the user. ValueError if bad."""
    keys = [*(read_api_key_file(args.api_key_file) if args.api_key_file else []), *args.api_key]
    if not keys and os.environ.get(API_KEY_ENV):
        keys = [os.environ[API_KEY_ENV]]
    admin_keys = read_api_key_file(args.admin_key_file) if args.admin_key_file else []
    config = ServerConfig(
        model=args.model[0],
        sampling_models=tuple(args.model[1:]),
        host=args.host,
        port=args.port,
        api_key=keys[0] if keys else None,
        api_keys=tuple(keys[1:]),
        admin_keys=tuple(admin_keys),
        session_timeout_seconds=args.session_timeout,
        served_names=tuple(args.served_name),
        storage_dir=args.storage_dir,
        keep_checkpoints=args.keep_checkpoints,
        loss_normalization=args.loss_normalization,
        device=args.device,
        dtype=args.dtype,
        bf16=args.bf16,
        bf16_sampling=args.bf16_sampling,
        vision=args.vision,
        max_batch_size=args.max_batch_size,
        max_request_bytes=int(args.max_request_mb * MIB),
        **{field: getattr(args, field) for _flag, field, _kind, _what in LIMIT_FLAGS},
        memory_budget_bytes=None if args.memory_budget_gb is None else int(args.memory_budget_gb * 1024**3),
    )
    return config, bool(keys)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # every option is checked before the model loads
        config, chosen_key = _config(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.api_key:
        logging.warning("--api-key is visible to other users in `ps`; prefer --api-key-file or $%s", API_KEY_ENV)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.warning("binding %s exposes the server beyond this machine; anyone with the key can train", args.host)

    from trl_grpo_ext.pytrio_server import LocalPyTrioServer  # torch, starlette: after the arguments are checked

    stop = threading.Event()
    # installed before the address is printed: a supervisor may send SIGTERM as soon as it reads it
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = LocalPyTrioServer(config).start()
    names = ", ".join(sorted(server.aliases))
    print(f"PyTRIO local server: {server.base_url}  model: {server.model_alias} ({server.model_id})", flush=True)
    print(f"  base_model may be any of: {names}", flush=True)
    for model in server.sampling_models.values():
        print(f"  for sampling and log-probs only: {', '.join(sorted(model.names))}", flush=True)
    clients = 1 + len(set(config.api_keys) - {config.api_key})
    if clients > 1 or config.admin_keys:
        print(f"  {clients} client keys, each seeing only its own sessions, runs and checkpoints; "
              f"{len(set(config.admin_keys))} admin keys", flush=True)  # fmt: skip
    if config.keep_checkpoints:
        print(f"  checkpoints: the newest {config.keep_checkpoints} of each kind kept per training run, older "
              f"ones deleted (--keep-checkpoints)", flush=True)  # fmt: skip
    else:
        print(f"  checkpoints: all kept in {server.storage} (--keep-checkpoints N deletes older ones)", flush=True)
    print(f"  export PYTRIO_BASE_URL={server.base_url}", flush=True)
    if not chosen_key:  # a generated key is shown once so the user can copy it; a chosen key is never echoed
        print(f"  export PYTRIO_API_KEY={server.api_key}", flush=True)
    else:
        print("  export PYTRIO_API_KEY=<the key you configured>", flush=True)
    try:
        while not stop.wait(0.5):  # short waits keep the main thread responsive to signals
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
