"""Local server speaking the ``pytrio`` client protocol (0.2.8, 0.2.9) on a transformers + PEFT LoRA model.

    from trl_grpo_ext.pytrio_server import running_server

    with running_server("path/to/model") as server:
        server.configure_client()          # or: os.environ.update(server.client_env()) before `import pytrio`
        service = pytrio.ServiceClient()
        trainer = service.create_lora_training_client(base_model=server.model_alias, rank=8)

See docs/pytrio_server.md for what is implemented.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager

# the client's protocol models validate every request; Starlette and uvicorn serve them
_MISSING = [name for name in ("pytrio", "starlette", "uvicorn") if importlib.util.find_spec(name) is None]
if _MISSING:
    raise ImportError(f"the local PyTRIO server needs {', '.join(_MISSING)}: pip install 'trl-grpo-ext[pytrio]'")

from trl_grpo_ext.pytrio_server.app import LocalPyTrioServer, ServerConfig  # noqa: E402 - after the check

__all__ = ["LocalPyTrioServer", "ServerConfig", "running_server"]


@contextmanager
def running_server(model: str, **options):
    """Start a `LocalPyTrioServer` for `model` on 127.0.0.1 (free port) in a background thread; stop on exit.

    ``options`` are `ServerConfig` fields (``api_key``, ``port``, ``storage_dir``, ``max_batch_size``...).
    """
    server = LocalPyTrioServer(ServerConfig(model=model, **options))
    server.start()
    try:
        yield server
    finally:
        server.stop()
