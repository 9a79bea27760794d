"""`trl-grpo-ext pytrio-serve`: run the local PyTRIO server in the foreground until Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

API_KEY_ENV = "TRL_GRPO_EXT_PYTRIO_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model folder, hub id, or 'embedded' (SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8710, help="port (0 picks a free one)")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"bearer token clients must send; default ${API_KEY_ENV}, else a random key printed once at start",
    )
    parser.add_argument("--model-name", default=None, help="alias clients may pass as base_model")
    parser.add_argument("--storage-dir", default=None, help="checkpoint folder, kept across restarts (default: $TRL_GRPO_EXT_CACHE/pytrio-server or ~/.cache/trl_grpo_ext/pytrio-server)")
    parser.add_argument("--device", default=None, help="torch device (default cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", help="model dtype: float32, bfloat16, float16")
    parser.add_argument("--max-batch-size", type=int, default=None, help="per-event batch cap advertised to clients")
    parser.add_argument("--log-level", default="INFO", help="logging level")


def run(args: argparse.Namespace) -> int:
    from trl_grpo_ext.pytrio.server import LocalPyTrioServer, ServerConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.warning("binding %s exposes the server beyond this machine; anyone with the key can train", args.host)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    config = ServerConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        api_key=api_key,
        model_name=args.model_name,
        storage_dir=args.storage_dir,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
    )
    stop = threading.Event()
    # installed before the address is printed: a supervisor may send SIGTERM as soon as it reads it
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = LocalPyTrioServer(config).start()
    print(f"PyTRIO local server: {server.base_url}  model: {server.model_alias} ({server.model_id})", flush=True)
    print(f"  export PYTRIO_BASE_URL={server.base_url}", flush=True)
    if api_key is None:  # a generated key is shown once so the user can copy it; a chosen key is never echoed
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
