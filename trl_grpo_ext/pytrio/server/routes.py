"""HTTP routing of the local PyTRIO server: one `BaseHTTPRequestHandler` class bound to a server.

Control requests (``/api/...``) are matched against `CONTROL_ROUTES` and answered by the server's handler
method of that name; actor requests (``/actor/...``) go to `ActorHandlers`. Errors are ``{"code", "message"}``
bodies; unexpected exceptions answer 422, never 5xx, because the client retries 5xx for up to 15 minutes.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

import msgpack

from trl_grpo_ext.pytrio.server.registry import ApiError

if TYPE_CHECKING:
    from trl_grpo_ext.pytrio.server.app import LocalPyTrioServer

logger = logging.getLogger(__name__)

CONTROL_ROUTES: list[tuple[str, re.Pattern, str]] = [
    (m, re.compile(f"^/api/{p}$"), h)
    for m, p, h in [
        ("GET", r"openapi/v1/api-key/verify", "verify"),
        ("GET", r"sdk/bootstrap", "bootstrap"),
        ("GET", r"models", "models"),
        ("POST", r"openapi/v1/service-sessions", "create_session"),
        ("GET", r"openapi/v1/service-sessions", "list_sessions"),
        ("GET", r"openapi/v1/service-sessions/([\w-]+)", "get_session"),
        ("POST", r"openapi/v1/service-sessions/([\w-]+)/renew", "renew_session"),
        ("POST", r"openapi/v1/service-sessions/([\w-]+)/close", "close_session"),
        ("POST", r"openapi/v1/service-sessions/([\w-]+)/training-runs", "create_training_run"),
        ("PATCH", r"openapi/v1/service-sessions/([\w-]+)/training-runs/([\w-]+)", "update_training_run"),
        ("POST", r"openapi/v1/service-sessions/([\w-]+)/sampling-runs", "create_sampling_run"),
        ("GET", r"openapi/v1/training-runs", "list_training_runs"),
        ("GET", r"openapi/v1/training-runs/by-checkpoint-uri", "find_by_checkpoint"),
        ("GET", r"openapi/v1/training-runs/([\w-]+)", "get_training_run"),
        ("GET", r"openapi/v1/training-runs/([\w-]+)/checkpoints", "list_run_checkpoints"),
        ("POST", r"openapi/v1/training-runs/([\w-]+)/renew", "renew_training_run"),
        ("GET", r"openapi/v1/sampling-runs/([\w-]+)", "get_sampling_run"),
        ("POST", r"openapi/v1/sampling-runs/([\w-]+)/renew", "renew_sampling_run"),
        ("GET", r"openapi/v1/checkpoints", "list_checkpoints"),
        ("GET", r"openapi/v1/checkpoints/([\w-]+)/download-url", "checkpoint_download"),
        ("DELETE", r"openapi/v1/checkpoints/([\w-]+)", "delete_checkpoint"),
        ("POST", r"telemetry/event", "telemetry"),
    ]
]
_EVENT_GET = re.compile(r"^/actor/v1/events/([\w-]+)$")
_SAMPLE = re.compile(r"^/actor/v1/sampling-runs/([\w-]+)/sample$")
_WAIT = re.compile(r"wait=(\d+(?:\.\d+)?)")
# An error answered before the body was read (bad key, injected fault, no route) first discards a body up to this
# size (not parsed), so the client reads the answer; a larger one closes the connection instead.
DISCARD_LIMIT = 64 * 1024


def make_handler(server: LocalPyTrioServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "trl-grpo-ext-pytrio/0.1"
        # socket timeout (StreamRequestHandler): a connection that sends nothing for this long - an idle keep-alive
        # one or a half-sent request - is closed, so slow or stuck clients cannot hold threads forever
        timeout = server.config.idle_timeout_seconds

        def log_message(self, fmt, *args):  # request lines only: tokens travel in headers, never logged
            logger.debug("%s %s", self.address_string(), fmt % args)

        def _declared_length(self) -> int:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                raise ApiError(
                    411, "length_required", "send the request body with a Content-Length (no chunked bodies)"
                )
            value = (self.headers.get("Content-Length") or "0").strip()
            if not value.isdigit():
                raise ApiError(400, "invalid_content_length", f"Content-Length must be a byte count, got {value!r}")
            return int(value)

        def _body(self) -> bytes:
            """The request body, read only after the caller checked the credentials; 413 above the size cap."""
            length = self._declared_length()
            limit = server.config.max_request_bytes
            if length > limit:
                raise ApiError(
                    413,
                    "request_too_large",
                    f"request body of {length} bytes exceeds this server's limit of {limit} bytes "
                    "(ServerConfig.max_request_bytes, pytrio-serve --max-request-mb); send smaller batches",
                )
            self._body_read = True
            return self.rfile.read(length) if length else b""

        def _discard_unread_body(self) -> None:
            """Before an error answer to a request whose body was not read: discard a small body so the client
            reads the answer (closing on unread data resets the connection, which clients retry as a network
            error); for a large or unknown one, close the connection instead of reading it."""
            if self._body_read:
                return
            value = (self.headers.get("Content-Length") or "0").strip()
            length = int(value) if value.isdigit() else -1
            if 0 <= length <= DISCARD_LIMIT and "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
                if length:
                    self.rfile.read(length)
                self._body_read = True
            else:
                self.close_connection = True

        def _send(self, status: int, body: object, msgpack_body: bool = False) -> None:
            if msgpack_body:
                payload, ctype = msgpack.packb(body, use_bin_type=True), "application/msgpack"
            else:
                payload, ctype = json.dumps(body).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("X-Request-Id", secrets.token_hex(6))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(payload)

        def _bearer(self) -> str | None:
            value = self.headers.get("Authorization", "")
            return value[7:].strip() if value.startswith("Bearer ") else None

        def _dispatch(self, method: str) -> None:
            url = urlsplit(self.path)
            path, query = url.path.rstrip("/") or "/", parse_qs(url.query)
            wants_msgpack = "msgpack" in self.headers.get("Accept", "") and path.startswith("/actor/v1/events")
            self._body_read = False
            try:
                fault = server.faults.take(method, path)
                if fault is not None:
                    raise ApiError(fault.status, "injected_fault", f"injected HTTP {fault.status} for tests")
                if path.startswith("/api/"):
                    self._control(method, path, query)
                elif path.startswith("/actor/"):
                    self._actor(method, path)
                else:
                    raise ApiError(404, "not_found", f"no route {method} {path}")
            except (BrokenPipeError, ConnectionResetError):  # the client gave up on this request
                logger.debug("client closed the connection during %s %s", method, path)
                self.close_connection = True
            except ApiError as error:
                self._discard_unread_body()
                self._send(error.status, {"code": error.code, "message": error.message}, wants_msgpack)
            except Exception as error:  # noqa: BLE001 - 4xx, not 5xx: the client would retry a 500 for minutes
                logger.exception("request %s %s failed", method, path)
                self._send(
                    422, {"code": "internal_error", "message": f"{type(error).__name__}: {error}"}, wants_msgpack
                )

        def _control(self, method: str, path: str, query: dict) -> None:
            key = self._bearer() or self.headers.get("X-API-Key")  # checked before the body is read
            if not key or not secrets.compare_digest(key.encode(), server.api_key.encode()):
                raise ApiError(401, "unauthorized", "invalid API key for this local PyTRIO server")
            for route_method, pattern, name in CONTROL_ROUTES:
                match = pattern.match(path)
                if match and route_method == method:
                    raw = self._body()
                    body = {}
                    if raw and name != "telemetry":
                        try:
                            body = json.loads(raw)
                        except ValueError as error:
                            raise ApiError(400, "invalid_json", f"request body is not JSON: {error}") from None
                    result = getattr(server, name)(query, body, *match.groups())
                    self._send(200, result)
                    return
            raise ApiError(404, "not_found", f"no route {method} {path}")

        def _actor(self, method: str, path: str) -> None:
            token = server.registry.check_token(self._bearer())  # checked before the body is read
            if method == "POST" and path == "/actor/v1/events":
                status, body = server.submit_event(token, self._body())
                self._send(status, body, msgpack_body=True)
            elif method == "GET" and (match := _EVENT_GET.match(path)):
                wait = _WAIT.search(self.headers.get("Prefer", ""))
                body = server.get_event(token, match.group(1), float(wait.group(1)) if wait else 0.0)
                self._send(200, body, msgpack_body=True)
            elif method == "POST" and path == "/actor/v1/client/heartbeat":
                self._body()
                self._send(200, {"heartbeat_ms": server.config.heartbeat_ms})
            elif method == "POST" and (match := _SAMPLE.match(path)):
                try:
                    body = json.loads(self._body() or b"{}")
                except ValueError as error:
                    raise ApiError(400, "invalid_json", f"request body is not JSON: {error}") from None
                self._send(200, server.sample(token, match.group(1), body))
            else:
                raise ApiError(404, "not_found", f"no route {method} {path}")

        def do_GET(self):  # noqa: N802 - http.server naming
            self._dispatch("GET")

        def do_POST(self):  # noqa: N802
            self._dispatch("POST")

        def do_PATCH(self):  # noqa: N802
            self._dispatch("PATCH")

        def do_DELETE(self):  # noqa: N802
            self._dispatch("DELETE")

    return Handler
