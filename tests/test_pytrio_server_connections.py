"""Local PyTRIO server: connection limits over real sockets (read deadlines, connection caps, accept-error log)."""

from __future__ import annotations

import logging
import socket
import time

import pytest

pytest.importorskip("pytrio")


from trl_grpo_ext.pytrio_server.serving import IdleTimeoutProtocol, ThrottledAcceptErrors  # noqa: E402

VERIFY = b"GET /api/openapi/v1/api-key/verify HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n\r\n"


def _answer(sock: socket.socket) -> bytes:
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
        if b"\r\n\r\n" in data and data.endswith(b"}"):
            return data


def _record_closes(monkeypatch) -> list[str]:
    """Which timer closed each connection: 'deadline' (the request's read deadline) or 'idle' (the idle timer);
    the timer that fired is the one due by now."""
    closes = []
    original = IdleTimeoutProtocol.timeout_keep_alive_handler

    def handler(self):
        due = self._deadline is not None and self._deadline.when() <= self.loop.time()
        closes.append("deadline" if due else "idle")
        original(self)

    monkeypatch.setattr(IdleTimeoutProtocol, "timeout_keep_alive_handler", handler)
    return closes


def test_a_slow_sender_cannot_extend_the_read_deadline(make_server, monkeypatch):
    """One header line every 0.2 s: the idle timer (2 s) never fires, the request's deadline (3 s) does. (With a 1 s
    idle timer a 1 s stall of this process on a busy CI host let the idle timer close it first, at 1.14 s.)"""
    closes = _record_closes(monkeypatch)
    server = make_server(api_key="k", idle_timeout_seconds=2.0, request_timeout_seconds=3.0)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /api/openapi/v1/api-key/verify HTTP/1.1\r\n")
        closed = False
        sent = 0
        for i in range(100):  # 20 s of trickling if nothing stopped it
            time.sleep(0.2)
            try:
                sock.sendall(f"X-Slow-{i}: y\r\n".encode())
                sent += 1
            except OSError:
                closed = True
                break
            sock.setblocking(False)
            try:
                closed = sock.recv(1024) == b""
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
            if closed:
                break
        # closed before the trickle ended, by the request's deadline: the idle timer, restarted by every line, never
        # fired, and the lines kept coming until the deadline
        assert closed and sent < 99
        assert closes == ["deadline"]
    # a request sent at once is answered, and the keep-alive connection serves several within the deadline
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        for _ in range(3):
            sock.sendall(VERIFY)
            assert _answer(sock).startswith(b"HTTP/1.1 200")
            # idle between requests, below the idle timeout; 3.6 s in all, past one 3 s deadline: each request gets its own
            time.sleep(1.2)


def test_connections_are_capped_per_peer_and_in_all_with_a_fast_refusal(make_server):
    server = make_server(api_key="k", max_connections=6, max_connections_per_peer=3)
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(3)]
    try:
        limits = server._http.limits  # the counters its connections share
        refused = limits.refused
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as extra:
            answer = _answer(extra)  # without sending anything: refused before a byte is read
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer, answer
        assert b"limit of 3 connections" in answer and limits.refused == refused + 1
        for sock in held:  # the held ones still work
            sock.sendall(VERIFY)
            assert _answer(sock).startswith(b"HTTP/1.1 200")
        held.pop().close()  # a slot frees up
        deadline = time.monotonic() + 10
        while True:
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                sock.sendall(VERIFY)
                answer = _answer(sock)
            if answer.startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # the close may reach the server a moment later
        assert answer.startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
    # the total cap, from addresses of 127.0.0.0/8 (each its own peer)
    held = []
    try:
        for i in range(6):
            sock = socket.socket()
            sock.bind((f"127.0.0.{2 + i}", 0))
            sock.connect(("127.0.0.1", server.port))
            held.append(sock)
        sock.sendall(VERIFY)  # the last one admitted works
        assert _answer(sock).startswith(b"HTTP/1.1 200")
        with socket.socket() as extra:
            extra.bind(("127.0.0.20", 0))
            extra.settimeout(30)
            extra.connect(("127.0.0.1", server.port))
            answer = _answer(extra)
        assert answer.startswith(b"HTTP/1.1 503") and b"limit of 6 connections" in answer, answer
    finally:
        for sock in held:
            sock.close()
    assert server._http.limits.refused == 2


def test_accept_errors_are_logged_at_most_once_per_interval(caplog):
    class Loop:
        def default_exception_handler(self, context):
            logging.getLogger("asyncio").error(context["message"])

    handler = ThrottledAcceptErrors(every=3600)
    context = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
    with caplog.at_level(logging.ERROR):
        for _ in range(5000):
            handler(Loop(), context)
        handler(Loop(), {"message": "something else"})
    accept_lines = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(accept_lines) == 1 and handler.suppressed == 4999
    assert any(r.getMessage() == "something else" for r in caplog.records)  # other errors pass through
    handler.last -= 7200  # the interval has passed: the next one is logged with the count left out
    with caplog.at_level(logging.ERROR):
        handler(Loop(), context)
    assert "4999 more" in caplog.records[-1].getMessage()


def test_cli_flags_set_the_limits():
    import argparse

    from trl_grpo_ext.cli import pytrio_serve

    parser = argparse.ArgumentParser()
    pytrio_serve.add_arguments(parser)
    args = parser.parse_args(["--model", "embedded", "--request-timeout", "5", "--max-connections", "10",
                              "--max-connections-per-peer", "4", "--max-topk-logprobs", "3", "--idle-timeout", "7",
                              "--memory-budget-gb", "1.5"])  # fmt: skip
    config, _ = pytrio_serve._config(args)
    assert (config.request_timeout_seconds, config.max_connections, config.max_connections_per_peer) == (5, 10, 4)
    assert (config.max_topk_logprobs, config.idle_timeout_seconds) == (3, 7)
    assert config.memory_budget_bytes == int(1.5 * 1024**3)
    defaults = pytrio_serve._config(parser.parse_args(["--model", "embedded"]))[0]
    assert defaults.memory_budget_bytes is None and defaults.max_connections == 1024
    with pytest.raises(ValueError, match="max_connections_per_peer"):
        pytrio_serve._config(parser.parse_args(["--model", "embedded", "--max-connections-per-peer", "0"]))
