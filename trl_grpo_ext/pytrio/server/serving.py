"""uvicorn serving an ASGI app from a background thread: its own event loop, a port bound before start, clean stop.

The HTTP/1.1 parsing, keep-alive and its timeout are uvicorn's (h11 protocol). `IdleTimeoutProtocol` adds what
uvicorn leaves open: a connection that never sends a request, or stops sending halfway through one, is closed after
the same idle timeout as an idle keep-alive connection, so slow or stuck clients cannot hold connections forever.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

SERVER_HEADER = "trl-grpo-ext-pytrio/0.1"
# In-flight requests get this long to finish when the server stops (long polls and sample requests end at once:
# the server wakes them before it stops serving), then uvicorn cancels them.
GRACEFUL_STOP_SECONDS = 5.0


class IdleTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, also timing out a connection that leaves the server waiting for the client's bytes.

    uvicorn arms its keep-alive timer (``timeout_keep_alive``) only once a response is complete. Here the same timer
    also runs from the moment a connection opens and restarts on every chunk received while a request's head or body
    is incomplete (h11 state IDLE or SEND_BODY on the client's side). While the server works on a complete request
    (a long poll, a slow model call) nothing times out.
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_client()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._await_client()

    def _await_client(self) -> None:
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def timeout_keep_alive_handler(self) -> None:
        # uvicorn's also tells h11 the connection closed, which h11 refuses halfway through a request
        # (`connection_lost` does that bookkeeping); closing the transport is the whole point
        if not self.transport.is_closing():
            self.transport.close()


class BackgroundServer:
    """uvicorn serving `app` on ``host:port`` (0: a free port, known as soon as this object exists) from a thread."""

    def __init__(self, app, *, host: str, port: int, idle_timeout: float):
        self._socket = _listening_socket(host, port)  # bound now: `port` is known at once
        config = uvicorn.Config(
            app,
            http=IdleTimeoutProtocol,
            ws="none",
            lifespan="off",
            loop="asyncio",
            timeout_keep_alive=idle_timeout,  # type: ignore[arg-type] - seconds; asyncio takes a float
            timeout_graceful_shutdown=GRACEFUL_STOP_SECONDS,  # type: ignore[arg-type]
            log_config=None,  # the process's logging stays as the caller set it up
            log_level="warning",  # uvicorn's start/stop chatter off; its warnings and errors stay
            access_log=False,  # request lines are logged at DEBUG by the app (`routes.RequestGuard`)
            server_header=False,
            headers=[("server", SERVER_HEADER)],
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="pytrio-local-server", daemon=True)
        self._error: BaseException | None = None

    @property
    def port(self) -> int:
        return self._socket.getsockname()[1]

    def start(self) -> BackgroundServer:
        """Serve from the thread; returns once uvicorn accepts connections (raises if it could not start)."""
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the local server's HTTP thread exited at start: {self._error!r}")
            self._thread.join(0.01)
        return self

    def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (at most `GRACEFUL_STOP_SECONDS`), join the thread."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join()
        self._socket.close()

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as error:  # noqa: BLE001 - reported by `start` (uvicorn exits on a failed start)
            self._error = error
            logger.exception("the local server's HTTP thread failed")


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port``.

    Made with ``IPPROTO_TCP`` explicitly: asyncio sets ``TCP_NODELAY`` only on connections of such a socket. Without
    it a response's head and body (two writes) wait on the client's delayed ACK, ~40 ms per request on Linux.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock
