"""The fleet edge of one replica: a completion this device cannot serve is served by a sibling.

One replica owns one device (§5 invariant 1). When that device stops serving (lifecycle
Failed, Recovering, Warming..., or the server draining), the fleet still can: another replica
owns another device. :class:`ReplicaEdge` is the ASGI wrapper in front of a replica's reference
server app that makes this true for ``POST /v1/completions`` without the client seeing the
failed replica (``POST /v1/chat/completions`` too):

1. A completion that arrives while this replica does not serve is **relayed** at once to a
   sibling that serves (the router learns a replica's lifecycle a routing-stats period late, so
   some requests still reach a replica that has just failed).
2. A completion this replica answers **503** before any byte reached the client is relayed
   once: §8 maps every 503 to "retry later" (device recovering, drained from the queue, device
   fault, transient), and the fleet does that retry on another device. A completion the replica
   answers **500** while it no longer serves (the failure took the device down, e.g. a
   Compatibility-class code) is a 503 at the fleet's level (the device failed, not the
   request) and is relayed the same way; its Status, with category and raw CalRT code, stays
   in the body and in the replica's metrics.
3. One hop only: a relayed request carries ``x-calexec-relayed-from`` and is never relayed
   again, so a request refused by two devices answers 503 + ``Retry-After`` instead of
   bouncing; a client sending that header opts out of relaying.
4. Nothing is replayed here once a byte has reached the client: a streaming completion that
   already sent tokens and then fails ends with its SSE error event, as on a single server.
   Continuing such a stream on a sibling needs something that outlives this replica's
   process: the fleet ingress (drivers/fleet/ingress.py), the HTTP entry of the Ray fleet,
   whose requests are marked relayed (``x-calexec-relayed-from: ingress``) so that this edge
   passes them through and the ingress alone retries. A request body over ``max_body_bytes``,
   or one not whole ``body_timeout_s`` after its first read, is passed through untouched (the
   server answers 413, or 408 once its own ``body_timeout_s`` passes).

With no sibling that serves (one replica, or all of them down) the replica answers itself, as
the single server does: the clear 503 + ``Retry-After``. Every relayed response carries
``x-calexec-relayed-from: <this replica>`` beside the sibling's own ``x-calexec-replica``.

:func:`serve_relayed` is also how the ingress reaches a replica: it hands the request's
out-of-band state (progress reports, resume state, whether a hand-off is possible) to the app
as ASGI scope keys (drivers/serving/handoff.py), which no HTTP client can set.

The edge knows nothing of Ray: ``relay(request) -> async iterator of ASGI messages`` and
``relay_target() -> bool`` are given by the host (drivers/fleet/ray_serve.py: a streaming
DeploymentHandle call to :func:`serve_relayed`, and whether the router knows a sibling that
serves), so tests drive it with plain functions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from calexec.drivers.serving import handoff, wire

log = logging.getLogger("calexec.fleet_edge")

#: header naming the replica that relayed a request (and marking it as relayed: one hop).
RELAYED_FROM = b"x-calexec-relayed-from"
#: (method, path) the edge may relay: the data plane. /ready, /health, /metrics, /admin and
#: /debug describe or steer this replica and are always answered here.
RELAY_ROUTES = frozenset({("POST", "/v1/completions"), ("POST", "/v1/chat/completions")})

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ClientGone(Exception):
    """Sending to the client failed: its connection is closed (ASGI 2.4: the server raises a
    subclass of OSError; any exception a ``send`` raises means the same here), or (the fleet
    ingress) it stopped reading and the send waited past the request's deadline + slack. A
    client that left is never a relay or a replica that failed: the sibling's call is
    stopped, nothing is retried or counted."""


class ReplicaEdge:
    """ASGI wrapper around one replica's app (see the module docstring for the rules).

    ``serving()``: whether this replica admits requests now (lifecycle Ready and the server not
    draining). ``relay(request)``: start serving ``request`` (a dict made by
    :func:`relay_request`) on a sibling; returns an async iterator of the sibling's ASGI send
    messages, optionally with ``cancel()`` (a Ray streaming response) to stop it when the client
    leaves. ``relay_target()``: whether a sibling that serves is known now; when False the
    replica answers itself. ``relayed`` counts relays started; ``relay_failures`` counts relays
    whose sibling call failed before answering (the replica then answers itself)."""

    def __init__(self, app: Any, *, replica: str, serving: Callable[[], bool],
                 relay: Callable[[Message], Any] | None, relay_target: Callable[[], bool],
                 max_body_bytes: int, retry_after_s: int = 1,
                 body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.replica = replica
        self.serving = serving
        self.relay = relay
        self.relay_target = relay_target
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.retry_after_s = retry_after_s
        self.relayed = 0
        self.relay_failures = 0

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], route_path(scope)) not in RELAY_ROUTES:
            await self.app(scope, receive, send)
            return
        chunks, read = await read_body(receive, self.max_body_bytes, self.body_timeout_s)
        if read == BODY_GONE:  # the client left while sending its body: nobody to answer
            return
        if read != BODY_WHOLE:  # too large to hold, or too slow: the server answers 413, or
            # 408 once its own body_timeout_s passes, from the same stream
            await self.app(scope, replay(chunks, receive, more=True), send)
            return
        body = b"".join(chunks)
        may_relay = self.relay is not None and header(scope, RELAYED_FROM) is None
        if may_relay and not self.serving() and self.relay_target():
            await self._relay(scope, body, receive, send, fallback=None)
            return
        held = await self._run_here(scope, body, receive, send)
        if held is None:
            return  # answered (success, 4xx, or a stream that started)
        start, payload = self._fleet_view(*held)
        if start["status"] == 503 and may_relay and self.relay_target():
            await self._relay(scope, body, receive, send, fallback=(start, payload))
            return
        await send_held(send, start, payload)

    async def _run_here(self, scope: Message, body: bytes, receive: Receive,
                        send: Send) -> tuple[Message, bytes] | None:
        """Run the app on this replica. A 500 or 503 response is held back (start and whole
        body) and returned for the relay decision; anything else goes to the client."""
        held: list[Message] = []
        payload: list[bytes] = []

        async def hold_errors(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] in (500, 503):
                held.append(message)
                return
            if held and message["type"] == "http.response.body":
                payload.append(message.get("body", b""))
                return
            await send(message)

        await self.app(scope, replay([body], receive, more=False), hold_errors)
        return (held[0], b"".join(payload)) if held else None

    def _fleet_view(self, start: Message, payload: bytes) -> tuple[Message, bytes]:
        """A 500 from a replica that no longer serves is the device's failure, not the
        request's: 503 + Retry-After (the body, with its Status, unchanged), without the
        500's ``x-should-retry: false`` (a compatibility or programming failure's: no retry
        on this device fixes it, but another device may serve it, which the OpenAI SDKs,
        obeying that header, never tried)."""
        if start["status"] == 500 and not self.serving():
            headers = [(k, v) for k, v in start.get("headers", [])
                       if k.lower() not in (b"retry-after", b"x-should-retry")]
            headers.append((b"retry-after", str(self.retry_after_s).encode()))
            start = {**start, "status": 503, "headers": headers}
        return start, payload

    async def _relay(self, scope: Message, body: bytes, receive: Receive, send: Send,
                     fallback: tuple[Message, bytes] | None) -> None:
        """Serve the request on a sibling and forward its response; on a relay that fails
        before the sibling answers, send ``fallback`` (or this replica's own 503)."""
        self.relayed += 1
        started = False
        stream: Any = None

        async def forward() -> None:
            nonlocal started, stream
            if self.relay is None:  # _relay runs only when the replica may relay
                raise RuntimeError("relay without a relay target")
            stream = self.relay(relay_request(scope, body, self.replica))
            async for message in stream:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (RELAYED_FROM, self.replica.encode())]}
                    started = True
                try:
                    await send(message)
                except Exception as err:  # noqa: BLE001 - whatever the server raises for a closed connection
                    raise ClientGone(repr(err)) from err

        forwarding = asyncio.ensure_future(forward())
        watching = asyncio.ensure_future(wait_disconnect(receive))
        client_left = True  # also when this handler itself is cancelled: stop the sibling
        try:
            done, _ = await asyncio.wait({forwarding, watching},
                                         return_when=asyncio.FIRST_COMPLETED)
            client_left = forwarding not in done or isinstance(forwarding.exception(),
                                                               ClientGone)
        finally:
            for task in (forwarding, watching):
                if not task.done():
                    task.cancel()
            await asyncio.gather(forwarding, watching, return_exceptions=True)
            if client_left:
                await stop_stream(stream)
        if client_left or forwarding.exception() is None:
            return  # forwarded, or the client left (the sibling's work was stopped)
        self.relay_failures += 1
        log.warning("relay from %s failed%s: %r", self.replica,
                    " after the response started" if started else "", forwarding.exception())
        if started:
            return  # the sibling's response is cut short; the client sees a broken stream
        if fallback is None:
            fallback = await self._run_here(scope, body, receive, send)
            if fallback is None:
                return
            fallback = self._fleet_view(*fallback)
        await send_held(send, *fallback)


def route_path(scope: Message) -> str:
    """The path the replica's server routes the request on, below the app's mount point
    (``root_path``): the server's own rule (``wire.routed_path``, its ``RawPaths``) on the path
    as sent, so an encoded slash outside a model id is no separator and an escape of no UTF-8
    character stays as written; the decoded path where that rule keeps it. The edge and the
    fleet ingress decide on it (relay, resume, bounds) and name it in their own answers: on
    the decoded path, ``POST /v1%2Fcompletions`` was a completion to them (progress asked,
    failed over on a 503) while the replica answered it 404, and an ingress 504 named
    ``GET /nope%FFx`` as ``GET /nope\ufffdx``."""
    routed = wire.routed_path(route_raw_path(scope))
    return decoded_path(scope) if routed is None else routed


def decoded_path(scope: Message) -> str:
    """The request path as the HTTP server decoded it (``path``) below the app's mount point
    (``root_path``): what the ASGI scope of a relayed request carries as its ``path``."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def route_raw_path(scope: Message) -> bytes:
    """The request path as the client sent it (``raw_path``, its escapes undecoded: an encoded
    slash is no separator, ``wire.routed_path``) below the app's mount point; the decoded
    path encoded when the server gave no ``raw_path``."""
    raw = scope.get("raw_path")
    if not isinstance(raw, bytes):
        return decoded_path(scope).encode()
    root = scope.get("root_path", "").encode()
    return raw[len(root):] if root and raw.startswith(root) else raw


def header(scope: Message, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", []) if k.lower() == name), None)


def relay_request(scope: Message, body: bytes, replica: str) -> Message:
    """What crosses to the sibling: method, path (decoded and as sent), query, headers (plus
    ``x-calexec-relayed-from``; the body is whole now, so its length replaces any chunked
    framing) and the body; plain bytes and strings, so it pickles."""
    headers = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])
               if k.lower() not in (RELAYED_FROM, b"content-length", b"transfer-encoding")]
    headers += [(RELAYED_FROM, replica.encode()), (b"content-length", str(len(body)).encode())]
    request = {"method": scope["method"], "path": decoded_path(scope),
               "raw_path": route_raw_path(scope),
               "query_string": bytes(scope.get("query_string", b"")), "headers": headers,
               "body": body, "http_version": scope.get("http_version", "1.1")}
    # a fleet request's out-of-band state goes along (drivers/serving/handoff.py)
    if scope.get(handoff.PROGRESS) is not None:
        request["progress"] = True
    if scope.get(handoff.RESUME) is not None:
        request["resume"] = scope[handoff.RESUME]
    return request


async def serve_relayed(app: Any, request: Message, stop_grace_s: float = 5.0,
                        handoff_ok: Callable[[], bool] | None = None) -> AsyncIterator[Message]:
    """The sibling's side of a relay: run ``app`` (the sibling's :class:`ReplicaEdge`) on
    ``request`` and yield its ASGI send messages as they come (a stream stays a stream).
    Closing the iterator early (the relaying replica's client left) tells the app the client
    disconnected and cancels it after ``stop_grace_s``.

    ``request["progress"]`` (the fleet ingress asks for it): the app's progress reports are
    yielded too, as ``{"type": "calexec.progress", ...}`` messages in order with the ASGI
    ones; ``request["resume"]``: the state the app continues a handed-over generation from;
    ``handoff_ok``: whether a draining app may hand the request to a sibling now. All three
    reach the app as ASGI scope keys (drivers/serving/handoff.py), which no HTTP client can
    set."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": request["http_version"], "method": request["method"],
             "scheme": "http", "path": request["path"],
             # (as sent: the sibling routes an encoded slash as the first server would)
             "raw_path": request.get("raw_path") or request["path"].encode(),
             "root_path": "", "query_string": request["query_string"],
             "headers": request["headers"], "client": None, "server": None}
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    if request.get("progress"):
        scope[handoff.PROGRESS] = lambda info: messages.put_nowait(
            {"type": handoff.PROGRESS_TYPE, **info})
        if handoff_ok is not None:
            scope[handoff.HANDOFF] = handoff_ok
    if request.get("resume") is not None:
        scope[handoff.RESUME] = request["resume"]
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request["body"], "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(scope, receive, messages.put)
        finally:
            messages.put_nowait(None)  # end of the response

    running = asyncio.ensure_future(run())
    try:
        while (message := await messages.get()) is not None:
            yield message
        await running  # surfaces the app's exception, if any
    finally:
        if not running.done():
            disconnected.set()
            done, _ = await asyncio.wait({running}, timeout=stop_grace_s)
            if not done:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)


#: what :func:`read_body` read: the whole body, more than the limit (the rest is still in
#: ``receive``), nothing more because the client left, or not all of it in time (slowloris)
BODY_WHOLE, BODY_TOO_LARGE, BODY_GONE, BODY_LATE = "whole", "too_large", "gone", "late"


async def read_body(receive: Receive, limit: int, timeout_s: float
                    ) -> tuple[list[bytes], str]:
    """The request body's chunks read so far and why the reading stopped: ``BODY_WHOLE``,
    ``BODY_TOO_LARGE`` (more than ``limit`` bytes), ``BODY_GONE`` (client disconnected) or
    ``BODY_LATE`` (the whole body had not arrived ``timeout_s`` after this call: a client
    sending it a byte at a time would hold the request for as long as it keeps sending; the
    server's ``ServerConfig.body_timeout_s``)."""
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return chunks, BODY_GONE
                chunk = message.get("body", b"")
                chunks.append(chunk)
                size += len(chunk)
                if not message.get("more_body", False):
                    return chunks, BODY_WHOLE
                if size > limit:
                    return chunks, BODY_TOO_LARGE
    except TimeoutError:
        return chunks, BODY_LATE


def replay(chunks: list[bytes], receive: Receive, more: bool) -> Receive:
    """A ``receive`` that gives ``chunks`` first (the last with ``more_body=more``), then
    whatever ``receive`` gives (the rest of the body, or the client's disconnect)."""
    pending = list(chunks) or [b""]

    async def replayed() -> Message:
        if pending:
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending) or more}
        return await receive()

    return replayed


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the body was already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def stop_stream(stream: Any) -> None:
    """Stop a relay stream whose client left: ``cancel()`` (Ray) or ``aclose()`` (generator)."""
    if stream is None:
        return
    try:
        if hasattr(stream, "cancel"):
            stream.cancel()
        elif hasattr(stream, "aclose"):
            await stream.aclose()
    except Exception as err:  # noqa: BLE001 - stopping is best effort; the sibling's deadline bounds the rest
        log.warning("could not stop a relay stream: %r", err)


def with_request_id(scope: Message, send: Send,
                    sent: Callable[[str], None] | None = None) -> Send:
    """``send`` adding ``x-request-id`` (the client's sane ``X-Request-Id``, else a new id:
    ``wire.RequestId``, the server's rule) to a response start that has none: a relay's own
    answers need one, while a response it relays keeps the replica's. ``sent`` is told the
    id the client was answered with (its own or the replica's) as the response starts."""
    ids = wire.RequestId(wire.client_request_id(scope.get("headers", [])))
    key = wire.REQUEST_ID_HEADER.encode()

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            given = [value for name, value in headers if name.lower() == key]
            if not given:
                given = [ids.value().encode("ascii")]
                headers.append((key, given[0]))
                message = {**message, "headers": headers}
            if sent is not None:
                sent(given[0].decode("latin-1"))
        await send(message)
    return send_with_id


async def send_held(send: Send, start: Message, payload: bytes) -> None:
    """Send a held response (start + whole body)."""
    await send(start)
    await send({"type": "http.response.body", "body": payload, "more_body": False})
