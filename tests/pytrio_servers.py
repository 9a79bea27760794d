"""Fixtures of the local PyTRIO server's tests: one `ModelEngine` per module on the tiny model, and servers on it.

Bind them in a test module (``engine, make_server = pytrio_servers.engine, pytrio_servers.make_server``); each
server listens on a free port of 127.0.0.1 with API key ``k`` and a temporary storage folder unless told otherwise,
and the in-process pytrio client points at the latest one.
"""

from __future__ import annotations

import pytest

from trl_grpo_ext.pytrio.server import LocalPyTrioServer, ServerConfig
from trl_grpo_ext.pytrio.server.engine import ModelEngine


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return ModelEngine(tiny_model_path)


@pytest.fixture
def make_server(engine, tiny_model_path, tmp_path):
    """``make_server(**ServerConfig options)``: a started server; all are stopped after the test."""
    started = []

    def make(**options) -> LocalPyTrioServer:
        options = {"api_key": "k", "ephemeral_storage": "storage_dir" not in options, **options}
        server = LocalPyTrioServer(ServerConfig(model=tiny_model_path, **options), engine=engine).start()
        server.configure_client(home=str(tmp_path / "trio-home"), retry_initial_delay_seconds=0.05)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()
