"""The reference HTTP server: one ``DeviceExecutor`` embedded in a FastAPI app (issue 6).

``create_app(executor, config, dump)`` builds the app around an executor that is already
started; ``CompletionService`` (``app.state.service``, drivers/serving/service.py) does the
work; the routes live in ``openai_api.py`` (completions, chat, models, tokenize),
``responses_api.py`` (the Responses API, on the chat path), ``admin.py``
and ``debug.py``, error bodies in ``error_bodies.py``; ``DrainingServer`` is the
uvicorn server whose SIGTERM/SIGINT starts a drain instead of an immediate stop. docs/server.md
is the reference for endpoints, errors, metrics and the tokenizer.

The path of one completion is in drivers/serving/service.py's docstring.

Errors are §8 Status values rendered with ``Status.http_status``; the body has the OpenAI shape
``{"error": {"message", "type", "code", "param"}}`` plus ``"status": Status.to_dict()``; 429
and 503 carry ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import re
import signal
import socket
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from types import FrameType
from typing import Any, cast

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute, request_response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from calexec import __version__
from calexec.contracts.errors import Category
from calexec.contracts.fields import shown
from calexec.contracts.status import Phase, Status
from calexec.drivers.serving import error_bodies, openai_api, responses_api, wire
from calexec.drivers.serving.admin import MAX_PATH_CHARS, add_admin_routes
from calexec.drivers.serving.debug import add_debug_routes
from calexec.drivers.serving.dumpsink import DumpSink
from calexec.drivers.serving.error_bodies import (
    PARAM_OF_CODE,
    error_body,
    error_response,
    invalid,
    route_error,
)
from calexec.drivers.serving.executor_view import ServedExecutor
from calexec.drivers.serving.metrics import RequestTally, api_route
from calexec.drivers.serving.service import (
    Admission,
    CompletionService,
    RequestRun,
    RouteService,
    SequencePool,
    ServerConfig,
)
from calexec.machines.api import InferenceExecutor

#: what embedders and the tests import from here (the app's parts live in the modules above)
__all__ = ["Admission", "CompletionService", "DrainingServer", "HOT_ROUTES", "MAX_PATH_CHARS",
           "PARAM_OF_CODE", "RequestRun", "SequencePool", "ServerConfig",
           "create_app", "error_body", "error_response", "invalid",
           "uvicorn_config"]

log = logging.getLogger("calexec.server")

#: how long the app's shutdown waits for the dump's queued records to be written
DUMP_FLUSH_S = 5.0


def create_app(executor: ServedExecutor, config: ServerConfig | None = None,
               dump: DumpSink | None = None) -> FastAPI:
    """The FastAPI app serving ``executor`` (already started; not shut down by the app: use
    ``app.state.service.drain(grace)``). An ``executor`` that is no ``InferenceExecutor`` or
    a ``config`` that is no ``ServerConfig`` (a dict of its settings, say) is a TypeError
    naming it, not an AttributeError from deep in the service."""
    if config is None:
        config = ServerConfig()
    elif not isinstance(config, ServerConfig):
        hint = " (build one: ServerConfig(**settings))" if isinstance(config, dict) else ""
        raise TypeError(f"create_app: config={config!r:.200}: expected a ServerConfig or "
                        f"None, got {type(config).__name__}{hint}")
    if not isinstance(executor, InferenceExecutor):
        raise TypeError(f"create_app: executor={executor!r:.200}: expected a started "
                        f"DeviceExecutor (an InferenceExecutor), got {type(executor).__name__}")
    owned = CompletionService(executor, config, dump)
    # the app's closures (its routes, handlers, lifespan) reach the service, and through it
    # the executor, by a weak reference: ``app.state.service`` is its one owner
    owner = RouteService(owned)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        # the app stops (uvicorn's shutdown, a TestClient's end): the dump records still
        # queued for its writer thread reach the file first, and the writer ends (a drain
        # has done so); the idle decode-burst threads end
        service = owner.service  # (taken now: the lifespan's frame holds nothing meanwhile)
        service.close_burst_threads()
        await service.flush_dump(DUMP_FLUSH_S, close=True)

    # no redirect_slashes: Starlette answered "/v1/completions/" with a 307 whose Location
    # it built from the client's Host header (and SDKs do not re-POST a 307 reliably); a
    # path with a trailing slash is the OpenAI-shaped 404 naming it, as any unknown path
    app = FastAPI(title="calexec reference server", docs_url=None, redoc_url=None,
                  openapi_url=None, redirect_slashes=False, lifespan=lifespan)
    app.state.service = owned
    retry = config.retry_after_s

    if config.cors_origins:  # off by default: a browser page may call only when asked for
        # any request header: the official SDKs send their own (the openai JS SDK's
        # x-stainless-*, openai-organization...), which a browser's preflight lists
        app.add_middleware(OpenAICORS, allow_origins=list(config.cors_origins),
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                           allow_headers=["*"],
                           # what the SDKs read of an answer: a browser shows a page's script
                           # no other header (x-should-retry unexposed, the JS SDK in a page
                           # retried answers the server said no retry fixes, until stop 75)
                           expose_headers=["retry-after", "x-should-retry",
                                           wire.REQUEST_ID_HEADER],
                           max_age=600)
    app.add_middleware(AsteriskForm)
    # each completion and chat request counted once, by outcome (calexec_api_requests_total)
    app.add_middleware(RequestTally, metrics=owned.metrics)
    # outside CORS: its preflight answers carry the id too
    app.add_middleware(wire.RequestIds)
    # outermost: every other middleware (the tally's route, CORS) sees the path routed on
    app.add_middleware(RawPaths)

    @app.exception_handler(StarletteHTTPException)
    async def no_route(request: Request, exc: StarletteHTTPException) -> Response:
        """An unknown path (404) or method (405): OpenAI-shaped, like every other error. With
        an API key, a ``/v1`` path asked without it is a 401 first (as vLLM and OpenAI answer):
        a client without the key learns no route or method."""
        path = request.url.path
        if path == "/v1" or path.startswith("/v1/"):
            auth = openai_api.auth_refusal(request, config.api_key)
            if auth is not None:
                return error_response(auth.status, auth.param, retry, auth.http_status)
        under = error_bodies.under_v1(path) if exc.status_code == 404 else None
        match = Match.NONE if under is None else _routed(app, request.scope, under)
        meant = None if under is None or match is Match.NONE else (under, match is Match.FULL)
        # a WebSocket handshake (RFC 6455 section 4.1: its key and version fields, which stay
        # when its Upgrade is dropped to serve it as a plain request, ``abortable``)
        websocket = "sec-websocket-key" in request.headers or (
            request.headers.get("upgrade", "").lower() == error_bodies.WEBSOCKET)
        routes = fixed_paths()
        if exc.status_code == 404 and meant is None:
            # a slash slip before a path parameter (``//v1/models/<id>``): the tidied path, when
            # a parameter route takes it, is one the 404 may name (until stop 75 only routes
            # without a parameter were: ``no such route`` alone)
            tidied = "/" + "/".join(part for part in path.split("/") if part)
            tidy = error_bodies.slash_slip(path, [tidied])
            if tidy is not None and _routed(app, request.scope, tidy) is not Match.NONE:
                routes.append(tidy)
        return route_error(request.method, request.url.path, exc.status_code,
                           dict(exc.headers or {}), meant, routes=routes,
                           websocket=websocket)

    def fixed_paths() -> list[str]:
        """The paths of the app's routes that take no path parameter (a 404's "did you mean")."""
        return [path for route in app.routes
                if isinstance(path := getattr(route, "path", None), str) and "{" not in path]

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        """A bug this server did not foresee: an OpenAI-shaped 500 naming no detail (the
        exception and its traceback go to the log: Starlette re-raises it to uvicorn), never
        a plain-text page. Counted in ``calexec_request_failures_total`` as the route's
        refusals are: a completion, chat or Responses request's, not another route's (its
        refusals are answered only; counting its bug made ``success + failures = requests +
        api_requests{refused}`` false)."""
        service = owner.service
        status = Status.failure("server.unexpected_error", Category.PROGRAMMING, Phase.VALIDATE,
                                f"{request.method} {request.url.path[:200]}: an unexpected "
                                f"error ({type(exc).__name__}); the server logged it")
        if api_route(request.scope) is not None:
            service.metrics.observe_refusal(status)
        request_id = wire.request_id(request.scope)
        # the id the client was answered with, so its report finds the traceback that follows
        log.error("request %s: %s %s: unexpected %s (traceback below)", request_id,
                  request.method, request.url.path[:200], type(exc).__name__)
        # (sent by Starlette's outermost middleware: wire.RequestIds does not see it).
        # ``Connection: close``: uvicorn closes the connection once the exception Starlette
        # re-raises reaches it; unsaid, a client kept it alive and its next request on it
        # met ECONNRESET (until stop 73)
        return error_response(status, None, retry, 500,
                              {wire.REQUEST_ID_HEADER: request_id, **wire.CLOSE})

    def fail(status: Status, param: str | None = None, http_status: int | None = None,
             count: bool = True, headers: dict[str, str] | None = None) -> JSONResponse:
        """Error response of a completion request; counted unless it was counted already."""
        service = owner.service
        param = param or PARAM_OF_CODE.get(status.code)
        if count:  # (one the route counts, not a choice's end: a refusal)
            service.metrics.observe_refusal(status)
        if error_bodies.own_deadline(status, http_status) and service.ready:
            # the request's own deadline (its ``timeout``, or the server's): sent again as
            # it is, it gets the same budget on the same server, which the SDKs' retries
            # (twice, after a back-off) spent for the same 504. One met while the lifecycle
            # was not serving (a recovery, a model switch) may be served once it is: retried
            headers = {**(headers or {}), "x-should-retry": "false"}
        return error_response(status, param, retry, http_status, headers)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """200 while the process serves HTTP; ``reasons`` says why the executor cannot serve
        (``executor.health()``: a dead executor thread, a job past its deadline, lifecycle
        not Ready), ``status`` is then ``degraded``."""
        service = owner.service
        reasons = service.health()
        snap = service.executor.snapshot()
        return {"status": "degraded" if reasons else "ok", "reasons": reasons,
                "lifecycle": service.executor.state, "generation": snap.get("generation"),
                # §9.2: "unpinned" while serving a calbin whose golden no file pins
                # (--allow-unpinned-golden); §8 PROGRAMMING: features off until generation+1
                "golden": snap.get("golden"),
                "disabled_features": snap.get("disabled_features", []),
                "thread_faults": snap.get("thread_faults", 0)}

    @app.get("/ready")
    async def ready() -> Response:
        service = owner.service
        state = service.executor.state
        reasons = service.health()
        if service.ready:
            return JSONResponse({"status": "ready", "lifecycle": state,
                                 "generation": service.executor.snapshot()["generation"]})
        reason = ("server is draining" if service.draining else "; ".join(reasons) if reasons
                  else f"device lifecycle is {state}")
        return error_response(Status.unavailable(Phase.ADMISSION, reason), retry_after=retry)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's ``/ping`` (SageMaker's health probe, GET or POST), which answers as its
        ``/health``: 200 with no body while the engine lives, 503 once it is dead. Here: 503
        once the executor's lifecycle ended (``Failed``, ``Stopped``) or the server drains,
        when it will not serve again, so a probe routes away (a recovery or a model switch,
        after which it serves, stays 200, as vLLM's busy engine does; ``/ready`` says when
        it serves)."""
        service = owner.service
        state = service.executor.state
        if state in ("Failed", "Stopped") or service.draining:
            reason = "server is draining" if service.draining else f"device lifecycle is {state}"
            return error_response(Status.unavailable(Phase.ADMISSION, reason),
                                  retry_after=retry)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's ``/version``, ``{"version": ...}``: calexec's version here."""
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        service = owner.service
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    add_admin_routes(app, owner)
    add_debug_routes(app, owner)
    chat_path = openai_api.add_routes(app, owner, fail)
    responses_api.add_routes(app, owner, chat_path)
    head_with_get(app)
    hot_routes_first(app)
    lean_endpoints(app)
    whole_paths(app.router.routes)

    return app


def whole_paths(routes: list[Any]) -> None:
    """Make each of ``routes`` (and of the apps mounted among them) match a path only whole.
    Starlette's route patterns end in ``$``, which Python's ``re`` also matches before a
    final line feed, so ``/health%0A`` (decoded ``/health\\n``) was served as ``/health``,
    ``/v1/models/<id>%0A`` as the id without its line feed, and a mount's path lost it: a
    path no route has reached the route past a proxy in front that filters exact paths.
    ``\\Z`` ends a match at the end of the path alone; such a path is now the 404 of a path
    no route serves, an id ending in a line feed a model id no model has (``tests/test_server_probe72.py``)."""
    for route in routes:
        regex = getattr(route, "path_regex", None)
        if isinstance(regex, re.Pattern) and regex.pattern.endswith("$"):
            # (and a ``{name:path}`` parameter, ``.*``, takes a line feed as any other
            # character: ``/v1/models/a%0Ab`` is a model id no model has, as in a body)
            route.path_regex = re.compile(regex.pattern[:-1] + r"\Z", regex.flags | re.DOTALL)
        whole_paths(list(getattr(route, "routes", None) or []))


#: the routes nearly every request takes: tried first (:func:`hot_routes_first`)
HOT_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def hot_routes_first(app: FastAPI) -> None:
    """Put the completion routes (:data:`HOT_ROUTES`) at the head of ``app``'s routes: the
    router tries routes in order, and a completion went through the 13 routes before it
    (health, admin, debug, models) first, about 15 us of the event loop's CPU per request on
    the 2-core VM (stop 63). No route but its own matches a request one of them matches
    (its path, any method), so the order decides no answer
    (``tests/test_server_answers_golden.py``)."""
    routes = app.router.routes
    hot = [r for r in routes if getattr(r, "path", None) in HOT_ROUTES]
    routes[:] = hot + [r for r in routes if r not in hot]


#: the routes :func:`lean_endpoints` calls without FastAPI's per-request handler
LEAN_ROUTES = ("/v1/chat/completions", "/v1/completions")


def lean_endpoints(app: FastAPI) -> None:
    """The POST routes of :data:`LEAN_ROUTES` call their endpoint with the request itself.
    FastAPI's handler around an endpoint (``get_request_handler``) reads the body for its
    parameters, solves its dependencies (for the one ``Request`` parameter: a cookie parse
    and three telemetry lookups) and wraps a returned ``Response`` as it is; these endpoints
    take nothing but the ``Request`` and always return a ``Response``, so the endpoint's
    answer is the same without it (about 30 Python calls a request on the event loop, stop
    67; ``tests/test_server_lean_routes.py`` compares every answer with FastAPI's handler).
    The route stays the same ``APIRoute`` (its matching, methods, ``/openapi.json``, the
    router's telemetry); its ASGI app is FastAPI's own ``request_response`` around the
    endpoint. A request FastAPI traces (OpenTelemetry configured: :func:`traced`)
    goes through FastAPI's handler, whose spans it records. A route whose endpoint takes
    anything but the request is left as it is."""
    for route in app.router.routes:
        if not (isinstance(route, APIRoute) and route.path in LEAN_ROUTES
                and route.methods == {"POST"} and _request_only(route)):
            continue
        route.app = request_response(_LeanEndpoint(
            route.endpoint, cast(str, route.dependant.request_param_name),
            route.get_route_handler()))


def _request_only(route: APIRoute) -> bool:
    """``route``'s endpoint takes the request alone: no other parameter, dependency,
    response model or status code FastAPI's handler would apply."""
    d = route.dependant
    return (d.request_param_name is not None and not d.dependencies
            and not (d.path_params or d.query_params or d.header_params or d.cookie_params
                     or d.body_params)
            and d.websocket_param_name is None and d.http_connection_param_name is None
            and d.response_param_name is None and d.background_tasks_param_name is None
            and d.security_scopes_param_name is None
            and route.response_model is None and route.status_code is None
            and inspect.iscoroutinefunction(route.endpoint))


class _LeanEndpoint:
    """(:func:`lean_endpoints`) The endpoint called with the request (its one parameter,
    by name), or FastAPI's handler while FastAPI traces the request."""

    def __init__(self, endpoint: Callable[..., Any], name: str,
                 handler: Callable[..., Any]) -> None:
        self.endpoint, self.name, self.handler = endpoint, name, handler

    async def __call__(self, request: Request) -> Response:
        if traced():
            return cast(Response, await self.handler(request))
        return cast(Response, await self.endpoint(**{self.name: request}))


def _telemetry_data() -> Callable[[], object] | None:
    """FastAPI's ``get_telemetry_data`` (its native OpenTelemetry, FastAPI 0.163 on); None
    before it, when FastAPI traced nothing itself."""
    try:
        from fastapi.telemetry import get_telemetry_data
    except ImportError:  # pragma: no cover - an older FastAPI within pyproject's range
        return None
    return get_telemetry_data


_TELEMETRY_DATA = _telemetry_data()


def traced() -> bool:
    """FastAPI traces the request being handled (its OpenTelemetry is configured)."""
    return _TELEMETRY_DATA is not None and _TELEMETRY_DATA() is not None


def head_with_get(app: FastAPI) -> None:
    """Every GET route of ``app`` answers HEAD too (RFC 9110 section 9.1: a general-purpose
    server MUST support HEAD where it supports GET; load balancers and uptime checks probe
    with it): FastAPI's ``@app.get`` takes GET alone (Starlette's own routes, the mounted
    inspector's, add HEAD themselves). The handler runs as for GET; uvicorn sends no body."""
    for route in app.routes:
        if isinstance(route, APIRoute) and route.methods and "GET" in route.methods:
            route.methods.add("HEAD")


#: the methods the server's routes take, what ``OPTIONS *`` answers in ``Allow``
SERVER_METHODS = "GET, HEAD, POST, OPTIONS"


class AsteriskForm:
    """ASGI middleware answering the asterisk-form request target (``*``), which names no
    resource: ``OPTIONS *`` asks about the server in general (RFC 9110 section 9.3.7) and
    is answered 200 with ``Allow`` and no body, as Go's net/http answers it; any other
    method with it is a 400 ``request.invalid_target`` (RFC 9112 section 3.2.4: the form is
    only for OPTIONS). Both were the 404 ``OPTIONS /*: no such route``, a path never sent."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("raw_path") != b"*":
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        if method == "OPTIONS":
            response: Response = Response(status_code=200,
                                          headers={"allow": SERVER_METHODS})
        else:
            status = Status.failure(
                "request.invalid_target", Category.INVALID_REQUEST, Phase.VALIDATE,
                f"{method} *: the asterisk-form request target is only for OPTIONS (RFC 9112 "
                "section 3.2.4); send a path, as docs/server.md lists them")
            response = error_response(status, None, http_status=400)
        await response(scope, receive, send)


def _routed(app: FastAPI, scope: Any, path: str) -> Match:
    """How ``app``'s routes take ``path`` with the request's method: ``FULL`` (a route
    takes it), ``PARTIAL`` (a route of the path, for another method), ``NONE``."""
    probe = {**scope, "path": path, "raw_path": path.encode("utf-8", "replace")}
    matches = {route.matches(probe)[0] for route in app.routes}
    return next((m for m in (Match.FULL, Match.PARTIAL) if m in matches), Match.NONE)


class RawPaths:
    """ASGI middleware routing a request on the path as the client sent it where uvicorn's
    decoding lost it (``wire.routed_path``): an encoded slash outside a model id is no
    separator, a byte no UTF-8 character holds stays its escape, in the query too
    (``wire.readable_query``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            routed = wire.routed_path(scope.get("raw_path") or b"")
            if routed is not None:
                scope = {**scope, "path": routed}
            query = wire.readable_query(scope.get("query_string") or b"")
            if query is not None:
                scope = {**scope, "query_string": query}
        await self.app(scope, receive, send)


class OpenAICORS(CORSMiddleware):
    """Starlette's CORS middleware whose refused preflight (an origin, method or header not
    allowed) is an OpenAI-shaped 400 like every other error, not its plain text."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """A request with more than one ``Origin`` field is a 400 naming them: RFC 6454
        section 7 lets a user agent send one (a browser never sends two), and Starlette
        judged the first alone, where a proxy in front may read the last."""
        origins = [value for key, value in scope.get("headers", ()) if key.lower() == b"origin"] \
            if scope["type"] == "http" else []
        if len(origins) > 1:
            said = ", ".join(shown(value.decode("latin-1"), 100) for value in origins[:4])
            refusal = error_response(invalid(
                f"origin: given {len(origins)} times ({said}); a request has one Origin "
                "(RFC 6454 section 7), send it once"), "origin")
            await refusal(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def preflight_response(self, request_headers: Headers) -> Response:
        answer = super().preflight_response(request_headers)
        if answer.status_code == 200:
            return answer
        refused = bytes(answer.body).decode("utf-8", "replace")  # "Disallowed CORS origin, ..."
        allowed = {k: v for k, v in answer.headers.items()
                   if k.lower().startswith("access-control-") or k.lower() == "vary"}
        origin = request_headers.get("origin", "")
        method = request_headers.get("access-control-request-method", "")
        if not self.is_allowed_origin(origin=origin):  # what was refused, first the origin
            param, why = "origin", (f"origin {shown(origin, 200)} is not allowed (allowed: the "
                                    "--cors-origin ones)")
        elif method not in self.allow_methods:
            param, why = "method", (f"method {shown(method, 40)} is not allowed (allowed: "
                                    f"{', '.join(self.allow_methods)})")
        else:
            param, why = None, refused
        return error_response(invalid(f"CORS preflight refused: {why}"), param, headers=allowed)


#: how long uvicorn waits, after a drain, for connections still open before it ends their
#: tasks (seconds): a connection whose response was cut is aborted at once (``abortable``);
#: this bounds the exit when a server without that extension closes it gracefully
SHUTDOWN_WAIT_S = 2


#: a connection's next request head must arrive whole within this many seconds of the
#: connection or of its last response, else the connection is closed (uvicorn bounds neither
#: a connection that sends nothing nor a head that trickles in: slowloris); the body then
#: has ``ServerConfig.body_timeout_s``. A last response its client has not read at all in
#: that time (a non-streamed answer is buffered whole at once) is dropped: the connection
#: is aborted
HEAD_TIMEOUT_S = 30.0


#: a request head (request line and header fields) longer than this many bytes is answered
#: 431 and its connection closed, before the head is read whole (httptools bounds neither the
#: head nor a header; uvicorn's h11 protocol refuses past its own 16 KiB); Go's default
MAX_HEAD_BYTES = 1 << 20


#: the longest request target (path and query) uvicorn's httptools protocol parses
#: (``httptools.parse_url``: http_parser's 16-bit offsets); a longer one is answered 414
MAX_TARGET_BYTES = 65535


def abortable(protocol: type) -> type:
    """``protocol`` (a uvicorn HTTP protocol class) whose requests get, in their ASGI scope's
    ``extensions``, a callable aborting their connection at once (``wire.ABORT_EXTENSION``:
    the transport's ``abort()``): a response cut because its client stopped reading ends the
    connection without waiting for that client to read what is buffered. Its connections are
    closed when a request head has not arrived whole ``HEAD_TIMEOUT_S`` after the connection
    was made or the last response was sent (the ASGI app is called once a head is whole);
    aborted when that response is still unsent and none of it was read in that time.

    Bytes the parser refuses are answered the OpenAI-shaped 400, after the answers to the
    requests pipelined before them. With uvicorn's httptools protocol also: a request head
    over ``MAX_HEAD_BYTES`` is answered 431 (:meth:`data_received`), the same way (so is a
    chunked body's trailer section over it: trailer fields are discarded, :meth:`on_header`), and an
    HTTP/1.1 head without exactly one Host field 400 (:meth:`on_headers_complete`); an
    answer without a Content-Length to an HTTP/1.0 request is close-delimited, never
    chunked, and its ``Expect: 100-continue`` is ignored (no ``100 Continue``); an answer
    given before the body a request expecting ``100-continue`` announced closes the
    connection (:func:`answer_framing`); a request asking to switch protocols (``Upgrade``)
    is served as a plain one, its body read (:meth:`_feed`)."""
    parses_heads = hasattr(protocol, "on_headers_complete")  # httptools' (h11 has a limit)

    class Abortable(protocol):
        _head_timer: asyncio.TimerHandle | None = None
        #: bytes received since the last request head ended (while one is being read)
        _head_bytes = 0
        _reading_head = True
        #: the parser began the request whose head is being read (its ``url`` is this one's)
        _head_started = False
        #: the refusal the connection answers (400, 431) once the requests before it are
        #: answered; nothing more is read once it is set (:meth:`_refuse`)
        _refusal: bytes | None = None
        #: the request whose own body the parser refused: the refusal is its answer
        _refused_cycle: Any = None
        #: the head of a request asking to switch protocols, without the upgrade: parsed
        #: again once the parser stops at the upgrade (:meth:`_feed`)
        _plain_head: bytes | None = None
        #: the request target is longer than MAX_TARGET_BYTES: answered 414 (:meth:`_feed`)
        _target_too_long = False
        #: why the request head is refused (an HTTP/1.1 head without exactly one Host):
        #: answered 400 (:meth:`_feed`)
        _head_refused: str | None = None
        #: the HTTP version ("M.m") of a request line whose major version is not 1: answered
        #: 505 (:meth:`_feed`)
        _version_refused: str | None = None
        #: a chunk header was parsed and no chunk data followed it yet: after the last
        #: chunk's (size 0), the bytes that come are the request's trailer section
        _chunk_open = False
        #: bytes received while ``_chunk_open`` (the trailer section, counted by reads)
        _trailer_bytes = 0
        parser: Any  # uvicorn's httptools parser (replaced for a head parsed again: _feed)

        def connection_made(self, transport: Any) -> None:
            #: the connection's requests not yet answered, in request order
            self._cycles: deque[Any] = deque()
            super().connection_made(transport)
            if parses_heads:
                _lenient(self.parser)
            self._await_head()
            app = getattr(self, "app", None)  # uvicorn's protocols keep the ASGI app there
            if app is None:
                return

            async def with_abort(scope: Any, receive: Any, send: Any) -> None:
                self._head_arrived()
                extensions = scope.setdefault("extensions", {})
                extensions[wire.ABORT_EXTENSION] = transport.abort
                await app(scope, receive, send)
            self.app = with_abort

        def send_400_response(self, msg: str) -> None:
            """Bytes that are not an HTTP request: uvicorn's plain-text 400, as the OpenAI
            -shaped JSON every other error of this server is (``malformed_http``).

            Refused inside a request's body (a malformed chunk: the head was whole, so its
            route runs, waiting for the rest of a body nothing more is read of), the 400 is
            that request's answer: unless the route already started its own, the route is
            told its client is gone (what it would answer is dropped) and the 400 goes once
            the requests before it are answered. Otherwise the route waited
            ``body_timeout_s`` for its 408, and the 400 followed it: two answers to one
            request. A route that answered before the body came (a 404, a 401) gave the
            request's one answer: the connection is closed after it, with no 400 behind it
            (a second answer the client would take for its next request's)."""
            self._refuse_request(error_bodies.malformed_http(str(msg), uuid.uuid4().hex))

        def _refuse_request(self, answer: bytes) -> None:
            """:meth:`_refuse` with ``answer``, which is the answer of the request whose
            body is being read when there is one (see :meth:`send_400_response`)."""
            cycle = getattr(self, "cycle", None)
            if parses_heads and not self._reading_head and cycle is not None:
                if cycle.response_started:
                    answer = b""
                else:
                    self._refused_cycle = cycle
                    cycle.disconnected = True
                    cycle.message_event.set()
            self._refuse(answer)

        def data_received(self, data: bytes) -> None:
            if self._refusal is not None:  # refused: nothing more is read
                return
            if parses_heads and self._reading_head:
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:  # 431; nothing more is parsed
                    # (a target over MAX_TARGET_BYTES is a 414 however long: a 1 MiB one
                    # reached this bound first, its request line still arriving, and was
                    # answered 431 for header fields it did not have; self.url is what the
                    # parser gave of this head's target so far: on_message_begin reset it)
                    url = getattr(self, "url", b"") if self._head_started else b""
                    self._refuse(
                        error_bodies.target_too_long(len(url), MAX_TARGET_BYTES,
                                                     uuid.uuid4().hex, at_least=True)
                        if len(url) > MAX_TARGET_BYTES else
                        error_bodies.head_too_large(MAX_HEAD_BYTES, uuid.uuid4().hex))
                    return
            elif parses_heads and self._chunk_open:
                self._trailer_bytes += len(data)
                if self._trailer_bytes > MAX_HEAD_BYTES:  # 431; nothing more is parsed
                    self.logger.warning("Invalid HTTP request received: a trailer section "
                                        "over %d bytes.", MAX_HEAD_BYTES)
                    self._refuse_request(error_bodies.trailers_too_large(
                        MAX_HEAD_BYTES, uuid.uuid4().hex))
                    return
            if not parses_heads:
                super().data_received(data)
                return
            self._feed(data)

        def _feed(self, data: bytes) -> None:
            """uvicorn's httptools ``data_received``, except for a request asking to switch
            protocols (``Connection: upgrade`` and an ``Upgrade`` header: ``curl --http2``'s
            ``h2c``, a WebSocket handshake): uvicorn served it as a plain request without its
            body (the parser skips the body of an upgrade; a completion got ``Invalid JSON:
            EOF``) and dropped every byte after its head, or handed a WebSocket handshake to
            its WebSocket protocol (a bodiless 403, no route being one). Such a request is
            served as a plain one, body and all (RFC 9110 section 7.8: a server may ignore
            ``Upgrade``): its head is parsed again without the upgrade (:meth:`_ignore_upgrade`)."""
            import httptools

            self._unset_keepalive_if_required()
            while self._refusal is None:  # once per upgrade in data (pipelined: a loop)
                try:
                    self.parser.feed_data(data)
                except httptools.HttpParserError as err:
                    if self._target_too_long:  # on_headers_complete stopped the parser
                        self.logger.warning("Invalid HTTP request received: request target "
                                            "of %d bytes.", len(self.url))
                        self._refuse(error_bodies.target_too_long(
                            len(self.url), MAX_TARGET_BYTES, uuid.uuid4().hex))
                        return
                    if self._version_refused is not None:  # on_headers_complete stopped it
                        self._refuse_version(self._version_refused)
                        return
                    if str(err).strip() == "Pause on PRI/Upgrade":
                        # HTTP/2's connection preface ("PRI * HTTP/2.0", h2 with prior
                        # knowledge: curl --http2-prior-knowledge): llhttp stops at it
                        self._refuse_version("2.0 preface")
                        return
                    if self._head_refused is not None:  # on_headers_complete stopped it
                        self.logger.warning("Invalid HTTP request received: %s.",
                                            self._head_refused)
                        self._refuse(error_bodies.malformed_http(self._head_refused,
                                                                 uuid.uuid4().hex))
                        return
                    read = [value.decode("latin-1") for name, value
                            in getattr(self, "headers", None) or ()
                            if name.lower() == b"transfer-encoding"]
                    if "transfer-encoding" in str(err).lower():
                        # the field the parser stopped in, never delivered (on_header)
                        refused = error_bodies.refused_transfer_encoding(data, read)
                        read += [refused] if refused is not None else []
                    framing = error_bodies.framing_refused(str(err), read)
                    # the parser's own words (llhttp's fixed reasons: "Invalid header value
                    # char", "Duplicate Content-Length", "Invalid HTTP version"), which
                    # uvicorn dropped: every refusal read "Invalid HTTP request received."
                    said = str(err).strip()[:120]
                    if said == "User callback error":  # (one of uvicorn's callbacks raised:
                        # a target its URL parser refuses; says nothing to a client)
                        said = self._target_refused()
                    elif framing is None and self._reading_head:  # the field line it stopped at
                        said += error_bodies.field_line_refused(
                            said, data, getattr(self, "url", b"") or b"",
                            len(getattr(self, "headers", None) or ())) or ""
                    msg = ("Invalid HTTP request received." if framing is None and not said
                           else f"Invalid HTTP request received: {framing or said}.")
                    self.logger.warning(msg)
                    self.send_400_response(framing or msg)
                except httptools.HttpParserUpgrade as upgrade:
                    head, self._plain_head = self._plain_head, None
                    if head is None:  # CONNECT: uvicorn's way (its route answers)
                        self._unsupported_upgrade_warning()
                        return
                    self.parser = httptools.HttpRequestParser(self)
                    _lenient(self.parser)
                    self._reading_head, self._head_bytes = True, 0
                    data = head + data[upgrade.args[0]:]
                    continue
                return

        def _target_refused(self) -> str:
            """Why the request target failed uvicorn's URL parser (``httptools.parse_url``),
            naming it, or "" when it parses (another callback raised): the authority-form
            ``host:port`` of a ``CONNECT`` (a client taking this server for its proxy) was
            answered the bare ``Invalid HTTP request received.``"""
            import httptools

            url = getattr(self, "url", None)
            if not url:
                return ""
            try:
                httptools.parse_url(url)
            except httptools.HttpParserInvalidURLError:
                shown = json.dumps(bytes(url).decode("latin-1"))[:80]
                return (f"request target {shown}: not a path (/path) nor an absolute URL "
                        "(RFC 9112 section 3.2; host:port is the form of CONNECT, for a "
                        "proxy, which this server is not)")
            return ""

        def _refuse_version(self, version: str) -> None:
            """Answer a request line of an HTTP version this server does not speak 505."""
            self.logger.warning("Invalid HTTP request received: HTTP version %s.", version)
            self._refuse(error_bodies.version_not_supported(version, uuid.uuid4().hex))

        def _ignore_upgrade(self) -> bytes:
            """The head of the request being parsed (its method, target, version and header
            fields as received) without its ``Upgrade`` field and ``upgrade`` connection
            option: what the parser reads as a plain request."""
            connection = [token.strip() for name, value in self.headers
                          if name == b"connection" for token in value.split(b",")]
            kept = [t for t in connection if t and t.lower() != b"upgrade"]
            lines = [b"%s %s HTTP/%s" % (self.parser.get_method(), self.url,
                                         self.parser.get_http_version().encode())]
            lines += [name + b": " + value for name, value in self.headers
                      if name not in (b"upgrade", b"connection")]
            if kept:
                lines.append(b"connection: " + b", ".join(kept))
            return b"\r\n".join(lines) + b"\r\n\r\n"

        def _refuse(self, answer: bytes) -> None:
            """Answer what the connection received with ``answer`` (a whole HTTP response
            written by the connection itself) and close it; nothing more is read. Requests
            pipelined before it are answered first (RFC 9112 section 9.3.2: in request
            order; written now, it would land in front of their answers or inside one being
            streamed): it is written once the last of them is sent."""
            transport = getattr(self, "transport", None)
            if self._refusal is not None or transport is None or transport.is_closing():
                return
            self._refusal = answer
            self._refuse_when_answered()

        def _refuse_when_answered(self) -> None:
            transport = self.transport
            if self._refusal is None or transport.is_closing():
                return
            cycle = getattr(self, "cycle", None)
            if getattr(self, "pipeline", None) or (
                    cycle is not None and not cycle.response_complete
                    and cycle is not self._refused_cycle):
                return  # on_response_complete calls again
            transport.write(self._refusal)
            transport.close()

        def on_headers_complete(self) -> None:
            if parses_heads and len(self.url) > MAX_TARGET_BYTES:
                # uvicorn's URL parser (httptools.parse_url) refuses it: the connection
                # answered the bare 400 "Invalid HTTP request received." (RFC 9112 section
                # 3: 414), and as a refusal of the body of the request pipelined before it,
                # which went unanswered. The parser stops here; _feed answers 414
                self._target_too_long = True
                raise ValueError("request target too long")
            if parses_heads:
                version = self.parser.get_http_version()
                if not version.startswith("1."):
                    # RFC 9112 section 2.3, RFC 9110 section 15.6.6: a major version other
                    # than 1 (HTTP/2.0, HTTP/3.0 in an HTTP/1 request line; HTTP/0.9) is no
                    # HTTP/1 request: 505. llhttp parsed 2.0 and 0.9 (served as HTTP/1.1)
                    # and refused the others as 400 "Invalid HTTP version" (the parser is
                    # lenient about the version: _lenient). The parser stops here
                    self._version_refused = version
                    raise ValueError(f"HTTP/{version}")
                hosts = sum(1 for name, _ in self.headers if name == b"host")
                if hosts > 1 or (hosts == 0 and version != "1.0"):
                    # RFC 9112 section 3.2: a server MUST answer 400 to an HTTP/1.1 request
                    # without a Host field or with several (uvicorn's h11 protocol refuses
                    # both; its httptools one served them). The parser stops here
                    self._head_refused = (
                        f"an HTTP/1.1 request with {hosts} Host headers" if hosts
                        else "an HTTP/1.1 request with no Host header"
                    ) + " (RFC 9112 section 3.2: exactly one)"
                    raise ValueError(self._head_refused)
                if b"#" in self.url:
                    # RFC 9112 section 3.2: a request target has no fragment (a client strips
                    # it, RFC 9110 section 7.1); uvicorn's URL parser dropped it and the path
                    # before it was served, so a proxy matching exact paths passed
                    # `/admin/reload#x` on to the route (stop 75). The parser stops here
                    target = self.url.decode("latin-1")
                    self._head_refused = (
                        f"request target {json.dumps(target)[:120]} holds a fragment "
                        f"({json.dumps(target[target.index('#'):])[:60]}): a request target "
                        "has none (RFC 9112 section 3.2); send it without the # and what "
                        "follows")
                    raise ValueError(self._head_refused)
                bad_host = next((value for name, value in self.headers
                                 if name == b"host" and not valid_host(value)), None)
                if bad_host is not None:
                    # RFC 9112 section 3.2: a server MUST answer 400 to a Host field with an
                    # invalid value too (`Host: a b`, a path, a userinfo were served). The
                    # parser stops here
                    shown = json.dumps(bad_host.decode("latin-1"))[:80]
                    self._head_refused = (f"Host {shown}: not a host[:port] (RFC 9112 section "
                                          "3.2: a Host field with an invalid value)")
                    raise ValueError(self._head_refused)
            if parses_heads and self.parser.should_upgrade() and any(
                    name == b"upgrade" for name, _ in self.headers):
                # parsed again without the upgrade once the parser stops at it (_feed): no
                # request yet (the parser skips the body of an upgrade)
                self._reading_head, self._head_bytes = False, 0
                self._plain_head = self._ignore_upgrade()
                return
            before = getattr(self, "cycle", None)
            super().on_headers_complete()
            if parses_heads and self.scope.get("http_version") not in ("1.0", "1.1"):
                # HTTP/1.2 and on: RFC 9112 section 2.3, a recipient SHOULD process it as
                # the highest minor version it conforms to (llhttp frames it as 1.1)
                self.scope["http_version"] = "1.1"
            # after uvicorn's: bytes it refuses in the head are no refusal of a body
            self._reading_head, self._head_bytes = False, 0
            cycle = getattr(self, "cycle", None)
            if cycle is None or cycle is before:
                return  # no request started (uvicorn's WebSocket upgrade path): no cycle
            # the connection's requests not yet answered (connection_lost disconnects them):
            # answered in request order, so the answered ones are at the front (rebuilding
            # the list at every head made a read of N pipelined requests cost N * N / 2)
            while self._cycles and self._cycles[0].response_complete:
                self._cycles.popleft()
            self._cycles.append(self.cycle)
            version_1_0 = self.scope.get("http_version") == "1.0"
            if version_1_0:
                # RFC 9110 sections 10.1.1, 15.2: a 1.0 request's 100-continue is ignored
                # (uvicorn writes "100 Continue" to any version: a 1.0 client takes it for
                # the answer)
                self.cycle.waiting_for_100_continue = False
            if version_1_0 or self.cycle.waiting_for_100_continue:
                answer_framing(self.cycle)

        def on_header(self, name: bytes, value: bytes) -> None:
            if parses_heads and not self._reading_head:
                # a trailer field (after a chunked body's last chunk): uvicorn appended it
                # to the request's headers, which the route had (its scope's list), so a
                # trailer `Authorization`, `Content-Type` or `X-Request-Id` was taken as
                # the request's header (RFC 9110 section 6.5.1: a recipient MUST NOT merge
                # a trailer field into the header section), and a client sending trailer
                # fields held them all in memory, without bound. Discarded (section 6.5.1
                # allows it); the section is bounded in data_received
                return
            super().on_header(name, value)

        def on_chunk_header(self) -> None:
            self._chunk_open, self._trailer_bytes = True, 0

        def on_chunk_complete(self) -> None:
            self._chunk_open = False

        def on_body(self, body: bytes) -> None:
            self._chunk_open = False  # a chunk's data: no trailer section
            super().on_body(body)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_started = True

        def on_message_complete(self) -> None:
            if self._plain_head is not None:
                return  # an upgrade's head, without its body: parsed again (_feed)
            self._reading_head = True  # the next request's head, from the next read on
            self._head_started = False  # (its url is the answered request's until it begins)
            super().on_message_complete()

        def on_response_complete(self) -> None:
            self._await_head()  # first: a pipelined request it starts cancels the wait
            super().on_response_complete()
            if getattr(self, "pipeline", None) and not self.transport.is_closing():
                # uvicorn reads on after every answer, while requests it read are still
                # queued (``pipeline``): each answer queued another read's worth (a 256
                # KiB read of small requests is thousands), so a client pipelining
                # requests without reading their answers filled the server's memory. The
                # connection is read again once they are answered: one read of them held
                self.flow.pause_reading()
            self._refuse_when_answered()

        def connection_lost(self, exc: Exception | None) -> None:
            """uvicorn's httptools protocol tells only the connection's last request (one
            pipelined behind the others, never started) that the client is gone: the one
            being answered (a stream) saw no disconnect and wrote on into the closed
            transport (uvloop raises). Every unanswered request of the connection is
            disconnected."""
            self._head_arrived()
            cycles, self._cycles = self._cycles, deque()
            for cycle in cycles:
                if cycle is not getattr(self, "cycle", None) and not cycle.response_complete:
                    cycle.disconnected = True
                    cycle.message_event.set()
            super().connection_lost(exc)

        def abort_unanswered(self) -> None:
            """A forced exit (``DrainingServer``, a second signal): the requests of this
            connection not yet answered whole are told their client is gone (nothing more is
            sent for them) and the connection is aborted. uvicorn otherwise answered each
            request the exit's task cancellation ended before its response started with its
            plain-text ``500 Internal Server Error`` (no OpenAI body, no ``x-request-id``),
            which a client takes for a bug of the server, not a cut."""
            cycles = [c for c in (*self._cycles, getattr(self, "cycle", None))
                      if c is not None and not c.response_complete]
            if not cycles:
                return  # answered: uvicorn's shutdown closes it
            for cycle in cycles:
                cycle.disconnected = True
                cycle.message_event.set()
            transport = getattr(self, "transport", None)
            if transport is not None:
                transport.abort()

        def _await_head(self) -> None:
            self._head_arrived()
            transport = getattr(self, "transport", None)
            if transport is None:
                return
            unsent = transport.get_write_buffer_size()
            # closing already (connection: close, HTTP/1.0, a 413): watched while unsent
            if unsent or not transport.is_closing():
                self._arm(unsent)

        def _arm(self, unsent: int) -> None:
            self._head_timer = asyncio.get_running_loop().call_later(
                HEAD_TIMEOUT_S, self._head_late, unsent)

        def _head_late(self, unsent_before: int) -> None:
            """No head came in time: close, once what the last response left unsent (the
            whole of a non-streamed answer whose client does not read) is read; abort when
            none of it was read in that time (a close would wait for it for ever)."""
            self._head_timer = None
            transport = self.transport
            unsent = transport.get_write_buffer_size()
            if unsent == 0:
                transport.close()
            elif unsent < unsent_before:  # its client reads, slowly: wait on
                self._arm(unsent)
            else:
                transport.abort()

        def _head_arrived(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

    Abortable.__name__ = Abortable.__qualname__ = f"Abortable{protocol.__name__}"
    return Abortable


def _lenient(parser: Any) -> None:
    """``parser`` (httptools') takes what uvicorn's own parser takes (what follows a
    ``connection: close`` request is no error: its answer is the connection's last) and any
    one-digit HTTP version, which ``Abortable.on_headers_complete`` judges: a major version
    other than 1 is answered 505, HTTP/1.2 and on served as HTTP/1.1 (RFC 9112 section 2.3;
    llhttp refused them 400 "Invalid HTTP version", and parsed 2.0 and 0.9 as if they were
    1.1)."""
    with contextlib.suppress(AttributeError):  # httptools < 0.6.3: none
        parser.set_dangerous_leniencies(lenient_data_after_close=True, lenient_version=True)


def answer_framing(cycle: Any) -> None:
    """Make ``cycle`` (uvicorn's httptools ``RequestResponseCycle`` of an HTTP/1.0 request
    or of one that expects ``100-continue``) frame its answer as the request needs:

    - HTTP/1.0: an answer without a Content-Length is close-delimited. uvicorn adds
      ``transfer-encoding: chunked`` to any such answer whatever the request's version, and
      an HTTP/1.0 client has no chunked coding (RFC 9112 section 6.1: a server MUST NOT send
      Transfer-Encoding unless the request indicates HTTP/1.1); the streamed answer's bytes
      go as they are and the connection's close ends it (as uvicorn's h11 protocol does).
    - an answer started while the body the request announced with ``Expect: 100-continue``
      has not come (the route did not read it: a 404, a 401, a 415) closes the connection
      (``connection: close``, RFC 9110 section 10.1.1; Go's server does the same): kept
      open, the client's next request would be read as that body."""
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    if type(cycle) is RequestResponseCycle:
        cycle.__class__ = _framed_cycle()


@functools.cache
def _framed_cycle() -> type:
    """The subclass of uvicorn's httptools ``RequestResponseCycle`` :func:`answer_framing`
    gives a cycle (made once, when first needed: it needs httptools)."""
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    class FramedCycle(RequestResponseCycle):
        """An HTTP/1.0 request's, or an expecting one's, cycle (:func:`answer_framing`)."""

        undelimited = False

        async def send(self, message: Any) -> None:
            if message["type"] == "http.response.start" and not self.response_started:
                if self.waiting_for_100_continue and self.more_body:
                    self.keep_alive = False  # the body never asked for: close after
                names = {name.lower() for name, _ in message.get("headers", ())}
                if (self.scope["http_version"] == "1.0"
                        and not names & {b"content-length", b"transfer-encoding"}
                        and self.scope["method"] != "HEAD"
                        and message["status"] not in (204, 304)):
                    # uvicorn frames nothing (``chunked_encoding`` decided) and closes after
                    self.undelimited, self.chunked_encoding, self.keep_alive = True, False, False
            elif (self.undelimited and message["type"] == "http.response.body"
                  and not self.response_complete):
                self.expected_content_length = len(message.get("body", b""))  # sent whole
            await super().send(message)
    return FramedCycle


#: the bytes a Host field's value may hold: RFC 3986's ``host [":" port]`` (an IP literal's
#: brackets, a zone's ``%25``), as Go's net/http takes them (``httpguts.ValidHostHeader``)
_HOST_BYTES = frozenset(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                        b"!$%&'()*+,-.:;=[]_~")


def valid_host(value: bytes) -> bool:
    """Whether ``value`` may be a Host field's (RFC 9112 section 3.2; empty is: a target
    with no authority): no space, ``/``, ``@``, ``?``, ``#``, quote or non-ASCII byte."""
    return all(byte in _HOST_BYTES for byte in value)


def uvicorn_config(app: Any, host: str = "127.0.0.1", port: int = 8000,
                   **kwargs: Any) -> uvicorn.Config:
    """The uvicorn configuration ``calexec serve`` runs ``app`` with: HTTP connections a cut
    response can abort (:func:`abortable`) and a bounded wait for open connections at
    shutdown (``SHUTDOWN_WAIT_S``); ``kwargs`` go to ``uvicorn.Config``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    kwargs.setdefault("http", abortable(AutoHTTPProtocol))
    kwargs.setdefault("timeout_graceful_shutdown", SHUTDOWN_WAIT_S)
    return uvicorn.Config(app, host=host, port=port, **kwargs)


def listening_url(host: str, port: int, *, reachable: bool = False) -> str:
    """``http://HOST:PORT`` for a server on ``host`` (a ``--host``, or a bound socket's
    address), an IPv6 address in brackets (RFC 3986 section 3.2.2: ``http://::1:8000`` is
    no URL a client reads) and its zone's ``%`` as ``%25`` (RFC 6874); ``reachable``: a
    wildcard bind (``0.0.0.0``, ``::``) is written as the loopback address a client on this
    machine connects to."""
    if reachable:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host:
        return f"http://[{host.replace('%', '%25')}]:{port}"
    return f"http://{host}:{port}"


class _CutTracebacks(logging.Filter):
    """After a forced exit, or once a drain ended: drops uvicorn's tracebacks of the tasks
    the exit cancels (each cut request's ``Exception in ASGI application`` and the
    lifespan's, both a ``CancelledError``; after a drain, requests whose clients never sent
    their whole body, which ``SHUTDOWN_WAIT_S`` cuts), and makes uvicorn's ``Cancel N
    running task(s), timeout graceful shutdown exceeded`` a WARNING: the cut is expected,
    no error of the server. A forced exit's cut is the one WARNING line ``DrainingServer``
    writes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[0] is asyncio.CancelledError:
            return False
        message = record.getMessage()
        if message.startswith("Cancel ") and "timeout graceful shutdown exceeded" in message:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            return True
        return not (message.startswith("Traceback")
                    and message.rstrip().endswith("CancelledError"))


class DrainingServer(uvicorn.Server):
    """uvicorn server whose first SIGTERM/SIGINT drains the service (new requests 503,
    admitted ones finish, executor shut down) and then exits; a second signal forces exit,
    cutting the requests still running (counted in ``cut``).
    It also drains and exits when the executor's lifecycle ends Failed (a supervisor
    restarts it)."""

    def __init__(self, config: uvicorn.Config, service: CompletionService, grace: float,
                 on_started: Callable[[DrainingServer, str], None] | None = None) -> None:
        """``on_started(server, url)`` runs on the event loop once the socket listens (``url``
        is ``http://HOST:PORT`` of the bound socket, a wildcard bind given as loopback); it
        must not block."""
        super().__init__(config)
        self.service = service
        self.grace = grace
        self.on_started = on_started
        #: admitted requests still running when a second signal forced the exit (they are
        #: cut: no clean drain, ``calexec serve`` exits 3); 0 otherwise
        self.cut = 0
        #: a signal was handled (the next one forces the exit)
        self.signalled = False
        self._cut_tracebacks = _CutTracebacks()
        self._loop: asyncio.AbstractEventLoop | None = None
        service.on_drained.append(self._drained)

    def _drained(self, status: Status) -> None:
        # connections still open (a client that does not read what was buffered for it; a
        # client still sending its body got the draining 503 at the grace's end, which
        # ``service.bodies`` cut) are cut by uvicorn after SHUTDOWN_WAIT_S: an expected end
        # of a drain, not an error with a traceback per connection
        logging.getLogger("uvicorn.error").addFilter(self._cut_tracebacks)
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's SIGTERM/SIGINT handlers, and SIGHUP handled as they are (a drain, then
        a forced exit): by default SIGHUP (a closed terminal, ``kill -HUP``) ended the process
        at once, every request cut, nothing logged."""
        hup = getattr(signal, "SIGHUP", None)
        if hup is None or threading.current_thread() is not threading.main_thread():
            with super().capture_signals():
                yield
            return
        previous = signal.signal(hup, self.handle_exit)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(hup, previous)

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            super().run(sockets=sockets)
        finally:
            logging.getLogger("uvicorn.error").removeFilter(self._cut_tracebacks)

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            bound = self.servers[0].sockets[0].getsockname()
            self.on_started(self, listening_url(bound[0], bound[1], reachable=True))

    def drain_soon(self) -> None:
        """Start the drain from any thread (no-op before the loop runs or once draining)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.service.start_drain, self.grace)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self.signalled or self._loop is None:
            if not self.force_exit:  # the requests this forced exit cuts (``cut``)
                self.cut = self.service.running_requests()  # (n choices: one request)
                log.warning("signal %s again: forced exit, %d request(s) cut%s", name, self.cut,
                            self.service.running_ids())
                logging.getLogger("uvicorn.error").addFilter(self._cut_tracebacks)
            self.should_exit = self.force_exit = True
            if self._loop is not None:  # (from the signal handler: on the loop, soon)
                self._loop.call_soon_threadsafe(self._abort_unanswered)
            return
        self.signalled = True
        if self.service.drain_grace is not None:  # POST /admin/drain (a preStop hook's): the
            # first signal is no "second" one; the drain keeps its own grace
            log.info("signal %s: already draining (grace %gs); a second signal forces the "
                     "exit", name, self.service.drain_grace)
            return
        log.info("signal %s: draining (grace %.1fs)", name, self.grace)
        self.drain_soon()

    def _abort_unanswered(self) -> None:
        """A forced exit cuts the requests still running: their connections are aborted
        (``abortable``'s ``abort_unanswered``), no answer is made up for them."""
        for connection in list(self.server_state.connections):
            abort = getattr(connection, "abort_unanswered", None)
            if abort is not None:
                abort()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.force_exit:  # (a second signal that came before the loop ran the callback)
            self._abort_unanswered()
        await super().shutdown(sockets=sockets)

    async def on_tick(self, counter: int) -> bool:
        service = self.service
        if (service.executor.state == "Failed" and service.drain_grace is None
                and not service.draining):
            # drained as after a signal, then the exit (3: the drain's shutdown answers the
            # failure): a request whose job the device still held was cut after uvicorn's
            # SHUTDOWN_WAIT_S (a plain-text 500 and an ERROR traceback) where its job ends
            # by its execution deadline and the client gets its error
            log.error("executor lifecycle is Failed: draining (grace %.1fs), then exiting",
                      self.grace)
            service.start_drain(self.grace)
        return await super().on_tick(counter)
