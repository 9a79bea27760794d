"""HTTP layer of the local PyTRIO server: every route in one table, served by Starlette (`create_app`).

Control routes (``/api/...``, `CONTROL_ROUTES`) name their handler (a `ControlHandlers` method), the client's request
model the JSON body is validated with before the handler runs, and the client's response model the answer is checked
against before it is sent. Actor routes (``/actor/v1/...``, `ACTOR_ROUTES`) carry per-run tokens and msgpack or JSON
bodies; their handlers (`ActorHandlers`) validate with the client's models in the order their errors rank.

Limits, enforced before an endpoint reads a body: `RequestGuard` checks the API key or actor token, then the declared
size (413 above ``max_request_bytes``); Starlette's `RequestBodyLimitMiddleware` stops a body sent without a length
(chunked) at the same size. Errors are ``{"code", "message"}`` bodies (msgpack where the client reads msgpack);
unexpected exceptions answer 422, never 5xx, because the client retries 5xx for up to 15 minutes, and their message
names no path on the server's disk (`errors.describe`; the log has the traceback). Blocking work runs
in the server's request threads (`LocalPyTrioServer._in_thread`); waits (long polls, decode batches) hold none.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs

import msgpack
from pydantic import BaseModel
from pytrio.protocol.control.api_key.verify import APIKeyInfo
from pytrio.protocol.control.checkpoint.download import CheckpointDownloadResponse
from pytrio.protocol.control.checkpoint.list import CheckpointListResponse
from pytrio.protocol.control.model.list import ModelListResponse
from pytrio.protocol.control.platform.bootstrap import SDKBootstrapResponse
from pytrio.protocol.control.sampling_run.create import SamplingRunCreateRequest, SamplingRunCreateResponse
from pytrio.protocol.control.sampling_run.get import SamplingRunGetResponse
from pytrio.protocol.control.sampling_run.renew import SamplingRunRenewResponse
from pytrio.protocol.control.service_session.close import ServiceSessionCloseRequest
from pytrio.protocol.control.service_session.create import ServiceSessionCreateRequest, ServiceSessionCreateResponse
from pytrio.protocol.control.service_session.get import ServiceSessionGetResponse
from pytrio.protocol.control.service_session.list import ServiceSessionListResponse
from pytrio.protocol.control.service_session.renew import ServiceSessionRenewResponse
from pytrio.protocol.control.training_run.create import TrainingRunCreateRequest, TrainingRunCreateResponse
from pytrio.protocol.control.training_run.find_by_checkpoint_uri import TrainingRunFindByCheckpointURIResponse
from pytrio.protocol.control.training_run.get import TrainingRunGetResponse
from pytrio.protocol.control.training_run.list import TrainingRunListResponse
from pytrio.protocol.control.training_run.renew import TrainingRunRenewResponse
from pytrio.protocol.control.training_run.update import TrainingRunUpdateRequest, TrainingRunUpdateResponse
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trl_grpo_ext.pytrio_server.control import ControlHandlers as C
from trl_grpo_ext.pytrio_server.downloads import FILES_PREFIX, archive_name, byte_range
from trl_grpo_ext.pytrio_server.downloads import CheckpointDownloads as D
from trl_grpo_ext.pytrio_server.errors import ApiError, describe
from trl_grpo_ext.pytrio_server.openai_api import sse_events
from trl_grpo_ext.pytrio_server.wire import require_finite, validate, validation_message

logger = logging.getLogger(__name__)

# An error answered before the request body was read (bad key, no route) leaves a body of at most this size to
# uvicorn, which reads and drops it so the connection stays usable; above it (or of unknown size) the answer says
# ``Connection: close`` instead of making the server read it.
DISCARD_LIMIT = 64 * 1024
_WAIT = re.compile(r"wait=(\d+(?:\.\d+)?)")


@dataclass(frozen=True)
class ControlRoute:
    """A Control API route: ``handler(server, query, body, caller, **path_params)`` answers ``method`` ``/api{path}``."""

    method: str
    path: str
    handler: Callable[..., dict]
    request: type[BaseModel] | None = None  # the client's model of the body; None: the parsed JSON, unchecked
    reply: type[BaseModel] | None = None  # the client's model of the answer
    json_body: bool = True  # False: the body is not parsed (telemetry events are counted, not read)


# fmt: off
CONTROL_ROUTES = [
    ControlRoute("GET", "/openapi/v1/api-key/verify", C.verify, reply=APIKeyInfo),
    ControlRoute("GET", "/sdk/bootstrap", C.bootstrap, reply=SDKBootstrapResponse),
    ControlRoute("GET", "/models", C.models, reply=ModelListResponse),
    ControlRoute("POST", "/openapi/v1/service-sessions", C.create_session, ServiceSessionCreateRequest,
                 ServiceSessionCreateResponse),
    ControlRoute("GET", "/openapi/v1/service-sessions", C.list_sessions, reply=ServiceSessionListResponse),
    ControlRoute("GET", "/openapi/v1/service-sessions/{sid}", C.get_session, reply=ServiceSessionGetResponse),
    ControlRoute("POST", "/openapi/v1/service-sessions/{sid}/renew", C.renew_session,
                 reply=ServiceSessionRenewResponse),
    ControlRoute("POST", "/openapi/v1/service-sessions/{sid}/close", C.close_session, ServiceSessionCloseRequest),
    ControlRoute("POST", "/openapi/v1/service-sessions/{sid}/training-runs", C.create_training_run,
                 TrainingRunCreateRequest, TrainingRunCreateResponse),
    ControlRoute("PATCH", "/openapi/v1/service-sessions/{sid}/training-runs/{rid}", C.update_training_run,
                 TrainingRunUpdateRequest, TrainingRunUpdateResponse),
    ControlRoute("POST", "/openapi/v1/service-sessions/{sid}/sampling-runs", C.create_sampling_run,
                 SamplingRunCreateRequest, SamplingRunCreateResponse),
    ControlRoute("GET", "/openapi/v1/training-runs", C.list_training_runs, reply=TrainingRunListResponse),
    ControlRoute("GET", "/openapi/v1/training-runs/by-checkpoint-uri", C.find_by_checkpoint,
                 reply=TrainingRunFindByCheckpointURIResponse),
    ControlRoute("GET", "/openapi/v1/training-runs/{rid}", C.get_training_run, reply=TrainingRunGetResponse),
    ControlRoute("GET", "/openapi/v1/training-runs/{rid}/checkpoints", C.list_run_checkpoints,
                 reply=CheckpointListResponse),
    ControlRoute("POST", "/openapi/v1/training-runs/{rid}/renew", C.renew_training_run,
                 reply=TrainingRunRenewResponse),
    ControlRoute("GET", "/openapi/v1/sampling-runs/{rid}", C.get_sampling_run, reply=SamplingRunGetResponse),
    ControlRoute("POST", "/openapi/v1/sampling-runs/{rid}/renew", C.renew_sampling_run,
                 reply=SamplingRunRenewResponse),
    ControlRoute("GET", "/openapi/v1/checkpoints", C.list_checkpoints, reply=CheckpointListResponse),
    ControlRoute("GET", "/openapi/v1/checkpoints/{cid}/download-url", D.checkpoint_download,
                 reply=CheckpointDownloadResponse),
    ControlRoute("DELETE", "/openapi/v1/checkpoints/{cid}", C.delete_checkpoint),
    ControlRoute("POST", "/telemetry/event", C.telemetry, json_body=False),
]
# fmt: on


# ---------------------------------------------------------------- answers
def respond(status: int, body: object, msgpack_body: bool = False, close: bool = False) -> Response:
    """An answer of the local server: JSON (or msgpack) with a request id for the client's logs."""
    if msgpack_body:
        content, media_type = msgpack.packb(body, use_bin_type=True), "application/msgpack"
    else:
        content, media_type = json.dumps(body).encode(), "application/json"
    headers = {"X-Request-Id": secrets.token_hex(6)}
    if close:
        headers["Connection"] = "close"
    return Response(content, status, headers, media_type)


def error_response(scope: Scope, error: ApiError, close: bool = False) -> Response:
    """``{"code", "message"}`` with the error's status; msgpack where the client reads events as msgpack."""
    headers = Headers(scope=scope)
    wants_msgpack = "msgpack" in headers.get("accept", "") and scope["path"].startswith("/actor/v1/events")
    return respond(error.status, {"code": error.code, "message": error.message}, wants_msgpack, close)


def large_unread_body(scope: Scope) -> bool:
    """Whether answering now, before the body is read, should close the connection (see `DISCARD_LIMIT`)."""
    headers = Headers(scope=scope)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return True
    length = headers.get("content-length", "0").strip()
    return not length.isdigit() or int(length) > DISCARD_LIMIT


def too_large(size: str, limit: int) -> ApiError:
    return ApiError(
        413,
        "request_too_large",
        f"request body of {size} bytes exceeds this server's limit of {limit} bytes "
        "(ServerConfig.max_request_bytes, pytrio-serve --max-request-mb); send smaller batches",
    )


# ---------------------------------------------------------------- credentials and size, before any body
class RequestGuard:
    """ASGI middleware: checks a request's credentials, then its declared body size, before anything reads the body.

    Control requests (``/api/``) need one of the server's API keys (``Authorization: Bearer`` or ``X-API-Key``),
    whose client (`clients.Caller`) it puts in ``request.state.caller``; actor requests (``/actor/``) an actor token,
    which it puts in ``request.state.actor_token`` (and counts as a sign of life of the run's session).
    """

    def __init__(self, app: ASGIApp, server):
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope["path"] = scope["path"].rstrip("/") or "/"
        try:
            self._check(scope)
        except ApiError as error:
            await error_response(scope, error, close=large_unread_body(scope))(scope, receive, send)
            return
        except Exception as error:  # noqa: BLE001 - 4xx, not 5xx: the client would retry a 500 for minutes
            logger.exception("checking request %s %s failed", scope["method"], scope["path"])
            answer = ApiError(422, "internal_error", describe(error))
            await error_response(scope, answer, close=large_unread_body(scope))(scope, receive, send)
            return
        if logger.isEnabledFor(logging.DEBUG):  # request lines only: keys and tokens travel in headers
            send = _logging_send(scope, send)
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> None:
        headers = Headers(scope=scope)
        path = scope["path"]
        if path.startswith("/api/"):
            caller = self.server.keys.identify(_bearer(headers) or headers.get("x-api-key"))
            if caller is None:
                raise ApiError(401, "unauthorized", "invalid API key for this local PyTRIO server")
            scope.setdefault("state", {})["caller"] = caller
        elif path.startswith("/actor/"):
            token = self.server.registry.check_token(_bearer(headers))
            self.server.registry.touch(token.run)
            scope.setdefault("state", {})["actor_token"] = token
        elif path.startswith(FILES_PREFIX):  # a download URL carries its own signed credential
            record = self.server.download_record(path, scope.get("query_string", b"").decode("latin-1"))
            scope.setdefault("state", {})["download"] = record
        length = headers.get("content-length", "").strip()
        limit = self.server.config.max_request_bytes
        if length.isdigit() and int(length) > limit:  # h11 has already refused a malformed Content-Length
            raise too_large(length, limit)


def _bearer(headers: Headers) -> str | None:
    value = headers.get("authorization", "")
    return value[7:].strip() if value.startswith("Bearer ") else None


def _logging_send(scope: Scope, send: Send) -> Send:
    async def logged(message: Message) -> None:
        if message["type"] == "http.response.start":
            logger.debug("%s %s -> %d", scope["method"], scope["path"], message["status"])
        await send(message)

    return logged


# ---------------------------------------------------------------- endpoints
def answers_errors(endpoint: Callable) -> Callable:
    """An endpoint whose `ApiError` is its answer and whose unexpected exceptions answer 422."""

    @functools.wraps(endpoint)
    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ApiError as error:
            return error_response(request.scope, error)
        except HTTPException as error:  # Starlette's body limit stopped a body sent without a length
            if error.status_code != 413:
                raise
            limit = request.app.state.server.config.max_request_bytes
            return error_response(request.scope, too_large(f"more than {limit}", limit), close=True)
        except ClientDisconnect:  # gone while sending its body: nobody reads an answer
            logger.debug("client closed the connection during %s %s", request.method, request.url.path)
            return Response(status_code=400)
        except Exception as error:  # noqa: BLE001 - 4xx, not 5xx: the client would retry a 500 for minutes
            logger.exception("request %s %s failed", request.method, request.url.path)
            return error_response(request.scope, ApiError(422, "internal_error", describe(error)))

    return wrapped


def _json_body(raw: bytes) -> object:
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise ApiError(400, "invalid_json", f"request body is not JSON: {error}") from None
    require_finite(body, "non_finite_number")  # Python's JSON reads NaN and Infinity
    return body


def _control_endpoint(route: ControlRoute) -> Callable:
    @answers_errors
    async def endpoint(request: Request) -> Response:
        raw = await request.body()
        body = _json_body(raw) if raw and route.json_body else {}
        query = parse_qs(request.url.query)
        server = request.app.state.server
        call = (route, server, query, body, request.state.caller, request.path_params)
        return respond(200, await server._in_thread(_call_control, *call))

    return endpoint


def _call_control(route: ControlRoute, server, query: dict, body: object, caller, params: dict) -> dict:
    """The handler's answer to a Control request (in a request thread): body and answer through the client's models."""
    if route.request is not None:
        body = validate(route.request, body, "invalid_request")
    answer = route.handler(server, query, body, caller, **params)
    if route.reply is not None:
        try:
            route.reply.model_validate(answer)
        except ValueError as error:  # a server bug: say so rather than let the client fail to parse it
            message = f"answer to {route.method} /api{route.path} is not a valid {route.reply.__name__}"
            raise ApiError(422, "internal_error", f"{message}: {validation_message(error)}") from None
    return answer


@answers_errors
async def submit_event(request: Request) -> Response:
    server = request.app.state.server
    raw = await request.body()
    status, body = await server._in_thread(server.submit_event, request.state.actor_token, raw)
    return respond(status, body, msgpack_body=True)


@answers_errors
async def event_status(request: Request) -> Response:
    wait = _WAIT.search(request.headers.get("prefer", ""))
    server = request.app.state.server
    seconds = float(wait.group(1)) if wait else 0.0
    body = await server.get_event(request.state.actor_token, request.path_params["event_id"], seconds)
    return respond(200, body, msgpack_body=True)


@answers_errors
async def heartbeat(request: Request) -> Response:
    await request.body()
    return respond(200, {"heartbeat_ms": request.app.state.server.config.heartbeat_ms})


@answers_errors
async def sample(request: Request) -> Response:
    body = _json_body(await request.body() or b"{}")
    server = request.app.state.server
    return respond(200, await server.sample(request.state.actor_token, request.path_params["rid"], body))


@answers_errors
async def checkpoint_archive(request: Request) -> Response:
    """A checkpoint's archive (`downloads`), whole or from a ``Range: bytes=N-`` on (206; 416 past its end)."""
    server = request.app.state.server
    record = request.state.download
    archive = await server._in_thread(server.open_archive, record)
    try:
        span = byte_range(request.headers.get("range"), archive.size)
    except ApiError:  # the client's sign that its file is already complete
        archive.close()
        return Response(status_code=416, headers={"Content-Range": f"bytes */{archive.size}"})
    start, end = span or (0, archive.size - 1)
    headers = {"Accept-Ranges": "bytes", "Content-Length": str(end - start + 1),
               "Content-Disposition": f'attachment; filename="{archive_name(record)}.tar"'}  # fmt: skip
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{end}/{archive.size}"
    body = server.stream_archive(archive, start, end)
    return StreamingResponse(body, 206 if span else 200, headers, media_type="application/x-tar")


FILE_ROUTES = [Route(FILES_PREFIX + "{cid}/archive.tar", checkpoint_archive, methods=["GET"])]

ACTOR_ROUTES = [
    Route("/actor/v1/events", submit_event, methods=["POST"]),
    Route("/actor/v1/events/{event_id}", event_status, methods=["GET"]),
    Route("/actor/v1/client/heartbeat", heartbeat, methods=["POST"]),
    Route("/actor/v1/sampling-runs/{rid}/sample", sample, methods=["POST"]),
]


def openai_error(error: ApiError) -> Response:
    """An error as OpenAI's API answers it (``{"error": {"message", "type", "code"}}``), which its clients read."""
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    body = {"error": {"message": error.message, "type": kind, "code": error.code, "param": None}}
    return respond(error.status, body)


def answers_openai_errors(endpoint: Callable) -> Callable:
    """`answers_errors` for the OpenAI-compatible routes: their errors in OpenAI's shape."""

    @functools.wraps(endpoint)
    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ApiError as error:
            return openai_error(error)
        except HTTPException as error:
            if error.status_code != 413:
                raise
            limit = request.app.state.server.config.max_request_bytes
            return openai_error(too_large(f"more than {limit}", limit))
        except ClientDisconnect:
            return Response(status_code=400)
        except Exception as error:  # noqa: BLE001 - 4xx, not 5xx, as every route of this server
            logger.exception("request %s %s failed", request.method, request.url.path)
            return openai_error(ApiError(422, "internal_error", describe(error)))

    return wrapped


@answers_openai_errors
async def chat_completions(request: Request) -> Response:
    body = _json_body(await request.body() or b"{}")
    server = request.app.state.server
    answer, chunks = await server.chat_completion(request.state.caller, body)
    if chunks is None:
        return respond(200, answer)
    headers = {"Cache-Control": "no-cache", "X-Request-Id": secrets.token_hex(6)}
    return Response(sse_events(chunks), 200, headers, media_type="text/event-stream")


@answers_openai_errors
async def openai_models(request: Request) -> Response:
    server = request.app.state.server
    return respond(200, await server._in_thread(server.openai_models, request.state.caller))


# Under /api/: the same API keys as the Control API (`RequestGuard`), each key's checkpoints its own.
OPENAI_ROUTES = [
    Route("/api/openai/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/api/openai/v1/models", openai_models, methods=["GET"]),
]


async def _no_route(request: Request, _error: Exception) -> Response:
    error = ApiError(404, "not_found", f"no route {request.method} {request.url.path}")
    return error_response(request.scope, error, close=large_unread_body(request.scope))


def create_app(server) -> Starlette:
    """The ASGI app of `server` (a `LocalPyTrioServer`): its routes behind `RequestGuard` and the body limit.

    Middleware added with ``app.add_middleware`` before the first request wraps all of it (tests inject faults so).
    """
    control = [Route(f"/api{r.path}", _control_endpoint(r), methods=[r.method]) for r in CONTROL_ROUTES]
    app = Starlette(
        routes=[*control, *ACTOR_ROUTES, *OPENAI_ROUTES, *FILE_ROUTES],
        middleware=[
            Middleware(RequestGuard, server=server),
            Middleware(RequestBodyLimitMiddleware, max_body_size=server.config.max_request_bytes),
        ],
        exception_handlers={404: _no_route, 405: _no_route},
    )
    app.state.server = server
    return app
