"""uvicorn serving an ASGI app from a background thread: its own event loop, a port bound before start, clean stop.

The HTTP/1.1 parsing, keep-alive and its timeout are uvicorn's (h11 protocol). `IdleTimeoutProtocol` adds what
uvicorn leaves open:

- a connection that never sends a request, or stops sending halfway through one, is closed after the idle timeout
  (uvicorn's keep-alive timer, armed at once and again with every chunk of an incomplete request); and a request's
  head and body must arrive within `request_timeout` of its first byte, a deadline that later bytes do not move
  (a sender trickling one header line at a time cannot hold a connection);
- at most `max_connections` connections in all and `max_connections_per_peer` from one address: one above either
  is answered 503 and closed as soon as it is accepted, before anything is read (uvicorn's ``limit_concurrency``
  refuses only once a request's head has been read, and logs a warning for each);
- the event loop's accept errors (descriptors exhausted) are logged at most once per `LOG_EVERY_SECONDS`, with a
  count of those left out (asyncio logs one per failed accept, thousands a second).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from trl_grpo_ext.pytrio_server.inprocess import server_thread

logger = logging.getLogger(__name__)

SERVER_HEADER = "trl-grpo-ext-pytrio/0.1"
# In-flight requests get this long to finish when the server stops (long polls and sample requests end at once:
# the server wakes them before it stops serving), then uvicorn cancels them.
GRACEFUL_STOP_SECONDS = 5.0


# Descriptors kept free beyond the connection cap: model files, checkpoints, threads, the listening socket.
RESERVED_DESCRIPTORS = 256
LOG_EVERY_SECONDS = 10.0


@dataclass
class ConnectionLimits:
    """What `IdleTimeoutProtocol` enforces, shared by every connection of one server."""

    request_timeout: float
    max_connections: int
    max_connections_per_peer: int
    peers: Counter = field(default_factory=Counter)  # open connections per client address
    refused: int = 0


def refusal(message: str) -> bytes:
    """A complete 503 answer, written before closing a connection refused at accept (the client may retry)."""
    body = json.dumps({"code": "too_many_connections", "message": message}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
            "\r\nconnection: close\r\nretry-after: 1\r\n\r\n")  # fmt: skip
    return head.encode() + body


class IdleTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines and connection caps (see the module's docstring).

    uvicorn arms its keep-alive timer (``timeout_keep_alive``) only once a response is complete. Here it also runs
    from the moment a connection opens and restarts with every chunk of an incomplete request; the first byte of a
    request also starts the request's read deadline, which stays where it is until the request is complete. While
    the server works on a complete request (a long poll, a slow model call) nothing times out.
    """

    limits: ConnectionLimits  # set by `BackgroundServer` on its subclass

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None  # the incomplete request's read deadline
        self._peer = self.client[0] if self.client else None
        limits = self.limits
        limits.peers[self._peer] += 1
        why = None
        if len(self.connections) > limits.max_connections:
            why = f"this server holds its limit of {limits.max_connections} connections"
        elif limits.peers[self._peer] > limits.max_connections_per_peer:
            why = f"your address holds this server's limit of {limits.max_connections_per_peer} connections"
        if why is not None:  # refused before anything is read: it costs a descriptor for a moment only
            limits.refused += 1
            transport.write(refusal(why + "; retry after closing some"))
            transport.close()
            return
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._end_deadline()
        peers = self.limits.peers
        peers[self._peer] -= 1
        if peers[self._peer] <= 0:
            del peers[self._peer]

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # uvicorn cancels its keep-alive timer on any data
        if self.transport.is_closing():
            return
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):  # a request's head or body is incomplete
            # a sender that stops is closed after the idle timeout, one that trickles at its fixed deadline
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            if self._deadline is None:  # its first bytes: the deadline is fixed from now
                self._deadline = self.loop.call_later(self.limits.request_timeout, self.timeout_keep_alive_handler)
        else:  # the whole request arrived: the server's turn, no deadline
            self._end_deadline()

    def _end_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def timeout_keep_alive_handler(self) -> None:
        # uvicorn's also tells h11 the connection closed, which h11 refuses halfway through a request
        # (`connection_lost` does that bookkeeping); closing the transport is the whole point
        if not self.transport.is_closing():
            self.transport.close()


class ThrottledAcceptErrors:
    """The event loop's exception handler: accept errors (EMFILE and the like) logged at most once per
    `LOG_EVERY_SECONDS` with the count left out; everything else as asyncio would."""

    def __init__(self, every: float = LOG_EVERY_SECONDS):
        self.every = every
        self.last = -float("inf")
        self.suppressed = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if "accept" not in str(context.get("message", "")):
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self.last < self.every:
            self.suppressed += 1
            return
        error = context.get("exception")
        extra = f" ({self.suppressed} more since the last report)" if self.suppressed else ""
        logger.error("accepting connections failed: %s: %s%s", context.get("message"), error, extra)
        self.last, self.suppressed = now, 0


def descriptor_room(wanted: int) -> int:
    """Raise this process's descriptor limit towards `wanted` + `RESERVED_DESCRIPTORS` (up to the hard limit);
    the number of connections it then leaves room for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + RESERVED_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - RESERVED_DESCRIPTORS))


class BackgroundServer:
    """uvicorn serving `app` on ``host:port`` (0: a free port, known as soon as this object exists) from a thread."""

    def __init__(
        self,
        app,
        *,
        host: str,
        port: int,
        idle_timeout: float,
        request_timeout: float = 60.0,
        max_connections: int = 1024,
        max_connections_per_peer: int = 256,
    ):
        self._socket = _listening_socket(host, port)  # bound now: `port` is known at once
        total = descriptor_room(max_connections)
        if total < max_connections:
            logger.warning("descriptor limit: at most %d connections instead of %d", total, max_connections)
        self.limits = ConnectionLimits(request_timeout, total, min(max_connections_per_peer, total))
        protocol = type("LimitedProtocol", (IdleTimeoutProtocol,), {"limits": self.limits})
        config = uvicorn.Config(
            app,
            http=protocol,
            h11_max_incomplete_event_size=64 * 1024,  # a request head larger than this is refused (431) by h11
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
        self._thread = server_thread(self._serve, "pytrio-local-server")
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
            asyncio.run(self._serve_here())
        except BaseException as error:  # noqa: BLE001 - reported by `start` (uvicorn exits on a failed start)
            self._error = error
            logger.exception("the local server's HTTP thread failed")

    async def _serve_here(self) -> None:
        asyncio.get_running_loop().set_exception_handler(ThrottledAcceptErrors())
        await self._server.serve(sockets=[self._socket])


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
