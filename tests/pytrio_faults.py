"""Test helper: make the local PyTRIO server answer matching requests with an error status a fixed number of times.

    faults = FaultInjector().install(server)   # before the server's first request (Starlette builds its stack then)
    fault = faults.add("/actor/v1/events", status=500, times=1, method="POST")
    ...
    assert fault.hits == 1

The faults answer before anything else, credentials included, with the server's own error body.

`full_storage` makes the server's checkpoint disk full for a block (see its modes).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
from dataclasses import dataclass

from trl_grpo_ext.pytrio_server.errors import ApiError
from trl_grpo_ext.pytrio_server.routes import error_response


@dataclass
class Fault:
    path_contains: str
    status: int
    remaining: int
    method: str | None = None
    hits: int = 0


class FaultInjector:
    """The faults to inject, and the ASGI middleware that answers them (`install`)."""

    def __init__(self):
        self.faults: list[Fault] = []
        self.lock = threading.Lock()

    def install(self, server) -> FaultInjector:
        server.app.add_middleware(_FaultMiddleware, injector=self)
        return self

    def add(self, path_contains: str, status: int = 500, times: int = 1, method: str | None = None) -> Fault:
        fault = Fault(path_contains, status, times, method.upper() if method else None)
        with self.lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()

    def take(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.remaining > 0 and fault.path_contains in path and fault.method in (None, method):
                    fault.remaining -= 1
                    fault.hits += 1
                    return fault
        return None


class _FaultMiddleware:
    def __init__(self, app, injector: FaultInjector):
        self.app = app
        self.injector = injector

    async def __call__(self, scope, receive, send):
        fault = self.injector.take(scope["method"], scope["path"]) if scope["type"] == "http" else None
        if fault is None:
            await self.app(scope, receive, send)
            return
        error = ApiError(fault.status, "injected_fault", f"injected HTTP {fault.status} for tests")
        await error_response(scope, error)(scope, receive, send)


@contextlib.contextmanager
def full_storage(monkeypatch, mode: str = "mid-write"):
    """The local server's checkpoint disk is full while the block runs.

    ``mid-write``: each checkpoint save writes its files, then fails as a full disk does (`OSError` ENOSPC), so a
    partial folder is left for the server to clean up. ``no-room``: the disk reports almost no free space, so the
    server refuses before writing anything.
    """
    from trl_grpo_ext.pytrio_server import checkpoints
    from trl_grpo_ext.pytrio_server.adapters import LoraSnapshot

    with monkeypatch.context() as patch:
        if mode == "mid-write":
            save = LoraSnapshot.save

            def failing_save(self, folder, *args, **kwargs):
                save(self, folder, *args, **kwargs)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            patch.setattr(LoraSnapshot, "save", failing_save)
        elif mode == "no-room":
            usage = shutil.disk_usage

            def no_room(path):
                return usage(path)._replace(free=1024)

            patch.setattr(checkpoints.shutil, "disk_usage", no_room)
        else:
            raise ValueError(f"unknown full_storage mode {mode!r}")
        yield
