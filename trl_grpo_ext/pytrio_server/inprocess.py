"""pytrio clients living in the local server's own process (``pytrio_base_url: local``, notebooks, tests).

A pytrio `ServiceClient`'s runtime closes its remote session when it is shut down or garbage-collected: a blocking
Control request, with pytrio's timeout and retries. Python's cyclic collector runs such finalizers in whichever thread
happens to allocate, the server's own threads included. A client of this server closed from the server's event-loop
thread waits on a loop that cannot answer until pytrio gives up (3 attempts of 30 s with pytrio 0.2.8; longer with
0.2.9), and every other request to the server waits with it. So:

- the server's threads say so (`server_thread`, `mark_server_thread`), and `defer_client_closes` makes a pytrio
  runtime's close that would run on one of them run on a thread of its own instead;
- `close_clients_of` shuts down a stopping server's in-process clients while it still answers (else their close
  would retry a server that is gone, for pytrio's ``control_retry_timeout_seconds``, 15 min by default).

Both reach into pytrio's runtime module (``pytrio.runtime.service``: its runtimes' finalizer function and the set of
live runtimes), which 0.2.8 and 0.2.9, the versions the ``pytrio`` extra accepts, have alike.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

_local = threading.local()
_install_lock = threading.Lock()
_DEFERRING = "_trl_grpo_ext_defers_on_server_threads"  # marks the wrapper, so it is installed once


def mark_server_thread() -> None:
    """Record that the calling thread is one of a local server's (its event loop, request threads, workers)."""
    _local.server = True


def on_server_thread() -> bool:
    return getattr(_local, "server", False)


def server_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread running `target` marked as a server thread (not started)."""

    def run() -> None:
        mark_server_thread()
        target()

    return threading.Thread(target=run, name=name, daemon=True)


def defer_client_closes() -> None:
    """From now on, a pytrio runtime's close that would run on a server thread runs on a new thread instead.

    pytrio binds its finalizer function when a runtime is made, so this covers the runtimes made after the call (a
    server calls it when it starts, before any client can know its address). Without pytrio there is nothing to do.
    """
    try:
        from pytrio.runtime import service
    except ImportError:
        return
    with _install_lock:
        close = getattr(service, "_shutdown_service_runtime", None)
        if close is None:
            logger.warning("this pytrio has no _shutdown_service_runtime: its clients' closes are not deferred")
            return
        if getattr(close, _DEFERRING, False):
            return

        @functools.wraps(close)
        def close_off_server_threads(*args, **kwargs):
            if not on_server_thread():
                return close(*args, **kwargs)
            # the close is best effort (pytrio logs its own failures); nothing waits for it
            threading.Thread(target=close, args=args, kwargs=kwargs, name="pytrio-client-close", daemon=True).start()
            return None

        setattr(close_off_server_threads, _DEFERRING, True)
        service._shutdown_service_runtime = close_off_server_threads


def close_clients_of(base_url: str) -> None:
    """Shut down this process's pytrio runtimes that point at `base_url` (a server about to stop)."""
    runtime_module = sys.modules.get("pytrio.runtime.service")
    if runtime_module is None:  # pytrio's runtime never imported here: no in-process clients (and no slow import)
        return
    with runtime_module._active_service_runtimes_lock:
        runtimes = list(runtime_module._active_service_runtimes)
    for runtime in runtimes:
        if getattr(runtime.configuration, "base_url", None) == base_url:
            try:
                runtime.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the server stops regardless
                logger.debug("could not shut down a pytrio runtime", exc_info=True)
