"""The fleet ingress: a generation outlives the replica that started it (issue 16).

A replica process that dies cannot hand anything over, so the client's connection must end
somewhere that survives it. :class:`FleetIngress` is that place: the HTTP entry of the Ray
fleet (drivers/fleet/ray_serve.py runs it as its own deployment, with no device), in front of
the device replicas, each reached through a streaming call (``call(request)``: the replica's
``relay_http`` → :func:`~calexec.drivers.fleet.edge.serve_relayed`). For ``POST
/v1/completions`` and ``POST /v1/chat/completions``:

1. The ingress asks the replica for **progress** (drivers/serving/handoff.py): the seed, id,
   ``created`` and prompt length once admitted, and each token right before the SSE chunk that
   carries it. Progress messages travel on the call's stream, out of band: they are never
   forwarded to the client, and resume state never crosses HTTP (a client cannot forge it).
   A token counts as the client's once its chunk was forwarded.
2. **Failover.** The attempt fails when the call raises or its stream ends before the response
   did (the replica process died: ``replica_died``), when a draining replica hands the stream
   off at a token boundary (``drained``), when a stream ends in an SSE error event the replica
   marks retryable (a retryable or device-side category, or the replica no longer serves:
   ``drained`` while draining, else ``unavailable``), or when the replica answers 503 (429 too
   once the client's response started: ``unavailable``). The ingress then calls a sibling with
   ``resume`` = the tokens the client has, the seed, id, ``created``, whether a chat opening
   went out, and the time left. The sibling re-prefills prompt + tokens and sends only what the
   client has not seen; the ingress drops its second ``http.response.start``, so the client
   sees one well-formed stream: one ``[DONE]``, the final ``usage`` counting every completion
   token, the same id. A whole (non-streaming) answer is re-run on the sibling with the same
   seed: identical for greedy and seeded sampling. Routing avoids the replicas that failed
   this request (``request["avoid"]``, read by ``LifecycleRouter``) while others exist.
   A request of several choices (``n`` > 1 or a list of two prompts or more) reports its
   seed, id, ``created`` and the choice of each event: the sibling runs every choice again
   from its start with them and sends, of each choice, only the events after those the
   client has (``resume["choices"]``), so its stream finishes as the uncut one would. A
   response that started without resume state (a replica that reported no progress) is
   never continued: the sibling would run it again from its start and the client would get
   every choice's chunks twice, under two ids; it ends with the SSE error event, as on a
   single server. Before its first byte it is run again whole on a sibling, as any request.
3. **Bounded.** At most ``max_failovers`` failovers and the request's deadline (its
   ``timeout`` or ``default_timeout_s``), which bounds each attempt too (at the deadline +
   twice ``deadline_slack_s``: a replica that stopped answering, or a call no replica
   took); later retries back off (``backoff_s`` doubling up to ``max_backoff_s``; the
   first retry after a replica that answered goes at once). Past the budget the client
   gets what it got before: the replica's 503 (or the ingress's own 503 +
   ``Retry-After``) when nothing was sent yet, else the SSE error event and the end of the
   stream. A client that leaves stops the replica's work (``cancel()`` of the call), and so
   does one that stops reading: a send to it waits at most until the request's deadline +
   ``deadline_slack_s`` (at least that slack), as the server cuts such a stream.
4. ``POST /v1/responses`` (``RERUN_ROUTES``: the Responses API, answered by the chat path
   under its own event format) is bounded like a generation, by the request's deadline (its
   ``timeout`` or ``default_timeout_s``, + twice ``deadline_slack_s``), and run again on a
   sibling only before its first byte (the replica's 503, a replica that died before it
   answered), within the same budget. It reports no progress and is never resumed: a sibling
   would send its events again from ``response.created`` under another id. Once its answer
   started, a replica's failure ends it: a whole answer left unfinished (the client sees an
   incomplete body), a stream with the Responses API's ``error`` event
   (:func:`responses_error`: chat's SSE error event until stop 64, which no Responses event
   type parses). Until stop 63 it
   was forwarded once and cut at ``route_timeout_s`` (10 s) whatever its ``timeout``: a 504
   for any generation longer than that.
5. Other routes (/ready, /health, /metrics, /admin, /debug, /v1/models, /tokenize) are
   forwarded once, to whichever replica the router picks: they describe or steer one replica,
   and an admin POST is never repeated on another. ``POST /admin/cancel/{id}`` goes to the
   replica running the request it names, when the ingress can place it
   (:meth:`FleetIngress.cancel_target`). Each is bounded: its whole answer within
   ``route_timeout_s`` (``admin_timeout_s`` for ``/admin/*``, whose reload runs a model
   switch), else the replica's call is cancelled and the client gets 504 ``wait.deadline``
   naming the route, the replica and the bound (with ``Retry-After`` on the routes a retry
   may serve elsewhere; ``x-should-retry: false`` on ``/admin/*``, whose work may still be
   under way on that replica): a replica that hangs without dying held such a request, and
   its client's connection, for ever. Which route a request is (here, in 1-4 and 6) and the
   path the ingress's own answers and log lines name is the path the replica's server routes
   (:func:`~calexec.drivers.fleet.edge.route_path`: ``POST /v1%2Fcompletions`` is no
   completion, ``GET /nope%FFx`` is named as sent), until stop 64 the decoded path.
   A JSON or text answer cut after it started (a replica
   that died mid-body, a bound met while the body went out) is left unfinished, so the
   server closes the connection and the client sees an incomplete body: the SSE error event
   goes only into an SSE stream (it was appended to the JSON body, which then looked whole).
   A request marked relayed by the ingress (``x-calexec-relayed-from: ingress``) is never
   relayed again by the replica's own edge: the ingress is the one place that retries. A
   response from a sibling after a failover carries ``x-calexec-relayed-from: <the replica
   that failed>``.
6. **Drain.** :meth:`FleetIngress.drain` (the fleet's SIGTERM/SIGINT, before Serve shuts
   down) answers every new request 503 + ``Retry-After`` ("fleet is draining"; its body read
   first, bounded: :meth:`FleetIngress._refuse_draining`), except the
   probes ``GET``/``HEAD`` ``/health`` and ``/metrics`` (``PROBES``: still forwarded, as a
   single server answers them while it drains), and waits, bounded, for the admitted ones
   to finish.

Nothing here knows Ray: ``call`` is given by the host, so tests drive the ingress with plain
async generators as replicas. Counters: ``failovers`` by cause, ``reprefilled`` (prompt +
tokens re-prefilled by siblings), ``exhausted`` (requests whose budget ran out); ``on_failover``
lets the host export them (ray_serve: Ray Serve counters).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import re
import time
from collections.abc import Callable
from typing import Any

import attrs

from calexec.contracts.status import Phase, Status
from calexec.drivers.fleet.edge import (
    BODY_GONE,
    BODY_LATE,
    BODY_TOO_LARGE,
    BODY_WHOLE,
    RELAY_ROUTES,
    RELAYED_FROM,
    ClientGone,
    Message,
    Receive,
    Send,
    read_body,
    relay_request,
    route_path,
    send_held,
    stop_stream,
    wait_disconnect,
    with_request_id,
)
from calexec.drivers.serving import admin, error_bodies, wire
from calexec.drivers.serving.handoff import PROGRESS_TYPE

log = logging.getLogger("calexec.fleet_ingress")

#: the ``x-calexec-relayed-from`` of requests the ingress sends (the replica never relays them)
INGRESS = "ingress"
REPLICA_HEADER = b"x-calexec-replica"
#: what a draining ingress still forwards: liveness and metrics describe the fleet and admit
#: no work (a single server keeps /health 200 while it drains: a liveness probe must not kill
#: a process finishing its work, nor a scrape miss it); /ready is refused, as all the rest
PROBES = frozenset((method, path) for method in ("GET", "HEAD")
                   for path in ("/health", "/metrics"))
#: the outcome of an attempt the request's deadline ended (no failover follows)
DEADLINE = "deadline"
#: ``failovers`` causes
CAUSES = ("replica_died", "drained", "unavailable")
#: generation routes bounded by the request's deadline and run again on a sibling before their
#: first byte, never resumed (module docstring, 4): the Responses API's events cannot be
#: continued by a sibling, which would start them again under another id
RERUN_ROUTES = frozenset({("POST", "/v1/responses")})
#: the Responses API's route: a failure in its stream is said as a Responses ``error`` event
RESPONSES = ("POST", "/v1/responses")
#: the route an operator cancels a request by (its id is the rest of the path): forwarded to
#: the replica running that request (:meth:`FleetIngress.cancel_target`)
CANCEL_PATH = "/admin/cancel/"
#: an event's ``sequence_number`` as the server writes it (compact JSON, right after ``type``;
#: inside a string value a quote is escaped, so no text matches it) and how much of the bytes
#: forwarded is kept to find one cut between two chunks
SEQUENCE = re.compile(rb'"sequence_number":([0-9]{1,18})')
SEQUENCE_TAIL = 128
#: why a response of ``RERUN_ROUTES`` that started is not failed over (said to the client)
NOT_RESUMED = ("a /v1/responses answer that started is not continued on a sibling (a sibling "
               "would send its events again from response.created); send it again")


#: what the ingress's 413 of a body over ``max_body_bytes`` tells a client of the fleet to do,
#: per route: an admin route's body is small by its nature (the replica's own words); any
#: other route's limit is the fleet's, which ``calexec serve --ray --max-body-bytes`` sets for
#: the ingress and every replica (until stop 72 the single server's advice, "start the server
#: with a larger --max-body-bytes", and the API's for a reload's calbin sent as its bytes)
FLEET_TAKES = {"/admin/reload": admin.RELOAD_TAKES, "/admin/drain": admin.DRAIN_TAKES}
FLEET_MORE_BYTES = ("send a smaller body (fewer or shorter prompts), or start the fleet with a "
                    "larger --max-body-bytes (calexec serve --ray --max-body-bytes N: the "
                    "ingress's limit and every replica's; FailoverSettings.max_body_bytes for "
                    "an ingress built in code)")


def fleet_body_too_large(limit: int, path: str) -> Status:
    """The failure of the ingress's 413 for a body to ``path`` over ``limit`` bytes
    (:data:`FLEET_TAKES`, else :data:`FLEET_MORE_BYTES`)."""
    takes = FLEET_TAKES.get(path)
    if takes is None and path.startswith(CANCEL_PATH):  # (its id is in the path)
        takes = admin.CANCEL_TAKES
    return error_bodies.body_too_large(limit, takes or FLEET_MORE_BYTES)


@attrs.frozen
class FailoverSettings:
    """The ingress's budget and limits (module docstring)."""

    #: failovers of one request to a sibling; 0: none (a failure reaches the client)
    max_failovers: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    #: first backoff between attempts that found no replica answering, doubled up to the max
    backoff_s: float = attrs.field(default=0.05, validator=attrs.validators.gt(0))
    max_backoff_s: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    #: a request's deadline when its body gives no ``timeout`` (the server's default)
    default_timeout_s: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    #: request body limit (413 above it, as the server answers)
    max_body_bytes: int = attrs.field(default=1 << 20, validator=attrs.validators.gt(0))
    #: the whole request body must arrive within this many seconds (408 otherwise), as the
    #: server's ``body_timeout_s``
    body_timeout_s: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    retry_after_s: int = attrs.field(default=1, validator=attrs.validators.ge(0))
    #: a send to the client may wait (the client stopped reading) until the request's deadline
    #: + this, and at least this long: then the client is taken as gone and its response cut,
    #: as the server's ``deadline_slack_s`` cuts a stream whose client stopped reading
    deadline_slack_s: float = attrs.field(default=0.5, validator=attrs.validators.gt(0))
    #: the whole answer of a route forwarded once (/health, /ready, /metrics, /v1/models,
    #: /tokenize, /debug...: a replica answers them at once) must come within this, else 504
    route_timeout_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    #: the same for ``/admin/*``: ``/admin/reload`` runs a model switch, bounded on the replica
    #: by the executor's drain_grace_s + fence_grace_s + golden_timeout_s per golden job,
    #: twice when it rolls back (67 s with the defaults), plus the calbin's open: 120 s
    admin_timeout_s: float = attrs.field(default=120.0, validator=attrs.validators.gt(0))


@attrs.define
class _Client:
    """What the client of one request has been sent, and what a sibling resumes from."""

    started: bool = False  # the response start (and a first body chunk) went out
    opened: bool = False  # a non-empty body chunk went out (a chat stream's opening)
    tokens: list[int] = attrs.Factory(list)  # tokens whose chunks went out
    pending: list[int] = attrs.Factory(list)  # announced, their chunk not forwarded yet
    #: a request of several choices: the events of each choice that went out, and those
    #: announced whose chunk was not forwarded yet
    events: collections.Counter[int] = attrs.Factory(collections.Counter)
    pending_events: list[int] = attrs.Factory(list)
    admitted: dict[str, Any] | None = None  # seed, id, created, prompt_tokens
    final: bool = False  # the next forwarded chunk is the response's last one
    complete: bool = False  # the last chunk went out (only the end-of-body may be missing)
    failed_from: str | None = None  # the first replica that failed this request
    cut_at: float = math.inf  # a send still waiting then (time.monotonic()) cuts the response
    slack_s: float = 0.5  # ...and every send may wait at least this long
    replica: str | None = None  # the replica answering now, once it named itself
    sse: bool = False  # the response that started is an SSE stream (``text/event-stream``)
    #: a Responses API stream (``RESPONSES``): its failure is a Responses ``error`` event
    responses: bool = False
    #: the highest ``sequence_number`` of the Responses events forwarded (-1: none yet)
    sequence: int = -1
    #: the end of the bytes forwarded (an event's number may straddle two chunks)
    tail: bytes = b""

    def forwarded(self, chunk: bytes) -> None:
        """Note the ``sequence_number`` of the Responses events in ``chunk`` (forwarded)."""
        if not self.responses or not chunk:
            return
        seen = self.tail + chunk
        for number in SEQUENCE.findall(seen):
            self.sequence = max(self.sequence, int(number))
        self.tail = seen[-SEQUENCE_TAIL:]

    def resume(self, deadline: float) -> dict[str, Any]:
        admitted = self.admitted or {}
        state = {"tokens": list(self.tokens), "seed": admitted.get("seed"),
                 "id": admitted.get("id"), "created": admitted.get("created"),
                 "opened": self.opened, "timeout": max(1e-3, deadline - time.monotonic())}
        choices = admitted.get("choices")
        if isinstance(choices, int) and not isinstance(choices, bool) and choices > 0:
            state["choices"] = [self.events[k] for k in range(choices)]
        return state

    def drop_pending(self) -> None:
        """What was announced and not forwarded is not the client's."""
        self.pending.clear()
        self.pending_events.clear()


@attrs.define
class _Live:
    """A request admitted by the ingress and not finished."""

    #: its ``x-request-id``: the client's ``X-Request-Id``, else the one its response started
    #: with (None before that: its client was given none)
    request_id: str | None
    #: what its client has been sent, its replica and its response id (the replica's
    #: progress); None until it is forwarded
    client: _Client | None = None


@attrs.define
class _Outcome:
    """How one attempt ended: ``cause`` None when the response reached its end."""

    cause: str | None
    replica: str | None = None
    retryable: bool = True
    held: tuple[Message, bytes] | None = None  # a refused response, not forwarded
    error_chunk: bytes | None = None  # the SSE error event of a failed stream, not forwarded
    #: said after the cause when the client is told (why no sibling continues it)
    note: str | None = None


async def _to_client(send: Send, message: Message, client: _Client) -> None:
    """``send(message)``, bounded by ``client.cut_at`` (at least ``client.slack_s``); a
    failure or a send still waiting then raised as :class:`ClientGone`: a client that left or
    stopped reading is never taken for a replica that died (which would start a sibling for
    nobody and leave the replica generating), and never holds the request for ever."""
    wait = max(client.cut_at - time.monotonic(), client.slack_s)
    try:
        await asyncio.wait_for(send(message), wait)
    except TimeoutError as err:
        raise ClientGone(f"the client read nothing for {wait:.1f} s, past its deadline") from err
    except Exception as err:  # noqa: BLE001 - whatever the server raises for a closed connection
        raise ClientGone(repr(err)) from err


class FleetIngress:
    """ASGI app in front of the device replicas (see the module docstring)."""

    def __init__(self, call: Callable[[Message], Any], settings: FailoverSettings) -> None:
        self.call = call
        self.settings = settings
        self.failovers: collections.Counter[str] = collections.Counter()
        self.reprefilled = 0
        self.exhausted = 0
        #: called with (cause, tokens re-prefilled) at each failover, and when a request's
        #: budget ran out (the host exports them)
        self.on_failover: Callable[[str, int], None] | None = None
        self.on_exhausted: Callable[[], None] | None = None
        #: set by :meth:`drain`: every new request is answered 503 + Retry-After here
        self.draining = False
        #: HTTP requests admitted here and not finished (what :meth:`drain` waits for)
        self.active = 0
        #: each admitted request, in admission order (:class:`_Live`): a drain that leaves
        #: requests names them; a cancel goes to the replica running the request it names
        self._live: dict[object, _Live] = {}

    async def drain(self, grace_s: float, poll_s: float = 0.05) -> dict[str, Any]:
        """Stop admitting (every new request: 503 + ``Retry-After``, "fleet is draining") and
        wait up to ``grace_s`` for the requests already admitted to finish, failovers
        included. ``{"drained": True, "active": 0, "request_ids": []}`` when none is left,
        else ``{"drained": False, "active": n, "request_ids": [...]}`` (they are cut when the
        fleet stops): ``request_ids`` the ``x-request-id`` s of those left that have one (the
        client's, or its response's), in admission order, for the line that cuts them (as
        the single server's drain names them: ``wire.cut_ids``). The fleet's SIGTERM path
        (calexec/serve.py) calls it before Serve shuts down, so no admitted request
        loses its connection to the proxy's shutdown."""
        if not math.isfinite(grace_s) or grace_s < 0:
            raise ValueError(f"grace_s={grace_s}: must be a finite number >= 0")
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        left = self.active
        ids = [live.request_id for live in list(self._live.values())
               if live.request_id is not None]
        if left:
            log.warning("ingress drain: grace %gs over, %d request(s) still running are cut%s",
                        grace_s, left, wire.cut_ids(ids))
        else:
            log.info("ingress drain: every admitted request finished")
        return {"drained": left == 0, "active": left, "request_ids": ids if left else []}

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if self.draining and (scope["method"], route_path(scope)) not in PROBES:
            # its own answers too (a replica's: kept)
            await self._refuse_draining(scope, receive, with_request_id(scope, send))
            return
        key = object()
        live = self._live[key] = _Live(wire.client_request_id(scope.get("headers", [])))

        def sent(request_id: str) -> None:
            live.request_id = request_id
        send = with_request_id(scope, send, sent)
        self.active += 1
        try:
            await self._admitted(scope, receive, send, live)
        finally:
            self.active -= 1
            self._live.pop(key, None)

    async def _refuse_draining(self, scope: Message, receive: Receive, send: Send) -> None:
        """The draining 503 + ``Retry-After`` ("fleet is draining"), once the request's body
        is read (bounded: ``max_body_bytes``, ``body_timeout_s``), as a single server reads
        a refused request's body: answered with the body unread, the connection's close
        found it in the socket and reset the connection, and a client still sending it got
        ECONNRESET, never the 503. A body past the bound, or too slow, is left and the 503
        closes the connection (``Connection: close``); so does the 503 of a request that
        expects ``100-continue``, answered before its body (no ``100 Continue``: the client
        would upload it to be refused); a client gone mid-body gets nothing."""
        close = expects_continue(scope)
        if not close:
            _, read = await read_body(receive, self.settings.max_body_bytes,
                                      self.settings.body_timeout_s)
            if read == BODY_GONE:
                return
            close = read != BODY_WHOLE
        await send_held(send, *refusal(Status.unavailable(Phase.ADMISSION, "fleet is draining"),
                                       503, self.settings.retry_after_s, close=close))

    async def _admitted(self, scope: Message, receive: Receive, send: Send,
                        live: _Live) -> None:
        chunks, read = await read_body(receive, self.settings.max_body_bytes,
                                       self.settings.body_timeout_s)
        if read == BODY_GONE:  # the client left while sending its body
            return
        # the 408 and the 413 close the connection, as the server's (``wire.body_or_refusal``):
        # kept open, the rest of the body was read as the same request's for as long as the
        # client kept sending it (a client trickling a byte at a time held the connection
        # without end, the body timeout notwithstanding)
        if read == BODY_LATE:  # as the server answers a body that trickles in
            size = sum(len(chunk) for chunk in chunks)
            await send_held(send, *refusal(error_bodies.body_timeout(
                f"{size} bytes came", self.settings.body_timeout_s), 408,
                self.settings.retry_after_s, close=True))
            return
        limit = self.settings.max_body_bytes
        if read == BODY_WHOLE and sum(len(chunk) for chunk in chunks) > limit:
            # ``read_body`` judges the size only between chunks: a body that came whole in one
            # message, or whose last chunk crossed the limit, was forwarded until stop 72, and
            # the replica's own 413 gave a single server's advice
            read = BODY_TOO_LARGE
        if read == BODY_TOO_LARGE:
            await send_held(send, *refusal(fleet_body_too_large(limit, route_path(scope)),
                                           413, self.settings.retry_after_s, close=True))
            return
        body = b"".join(chunks)
        route = (scope["method"], route_path(scope))
        pin = None
        if route[0] == "POST" and route[1].startswith(CANCEL_PATH):
            pin = self.cancel_target(route[1][len(CANCEL_PATH):], live)
        await self._serve(scope, body, receive, send, route in RELAY_ROUTES,
                          route in RERUN_ROUTES, live, pin)

    def cancel_target(self, ident: str, asking: _Live | None = None) -> str | None:
        """The replica ``POST /admin/cancel/{ident}`` goes to: the one running the requests
        in progress here whose ``x-request-id`` or response id (their replica's progress
        report) is ``ident``. None (the router's choice, one replica) when no request here is
        known by it yet, its replica is not known yet, or it names requests on two replicas
        or more (the ingress does not answer for the replicas: the one asked refuses an id
        naming two of its own requests, or cancels its one). Until stop 74 every cancel went
        to the router's choice, and answered 404 whenever the request ran on another
        replica. Never the cancel request itself (``asking``)."""
        replicas = {live.client.replica for live in list(self._live.values())
                    if live is not asking and live.client is not None
                    and ident in (live.request_id, (live.client.admitted or {}).get("id"))}
        return replicas.pop() if len(replicas) == 1 else None

    def route_bound(self, scope: Message) -> tuple[float, str]:
        """The bound of a route forwarded once, and the setting's name."""
        if route_path(scope).startswith("/admin/"):
            return self.settings.admin_timeout_s, "admin_timeout_s"
        return self.settings.route_timeout_s, "route_timeout_s"

    async def _serve(self, scope: Message, body: bytes, receive: Receive, send: Send,
                     resumable: bool, rerun: bool = False, live: _Live | None = None,
                     pin: str | None = None) -> None:
        """Forward the request: ``resumable`` (completions, chat) with progress, failed over
        and resumed; ``rerun`` (``RERUN_ROUTES``) failed over only before its first byte;
        neither: once, within its route's bound. ``live``: where it is followed while it
        runs; ``pin``: the replica it goes to (``request["replica"]``, the router's pin)."""
        failover = resumable or rerun  # bounded by the request's deadline, retried
        timeout = (request_timeout(body, self.settings.default_timeout_s) if failover
                   else self.route_bound(scope)[0])
        deadline = time.monotonic() + timeout
        slack = self.settings.deadline_slack_s
        client = _Client(cut_at=deadline + slack, slack_s=slack,
                         responses=(scope.get("method"), route_path(scope)) == RESPONSES)
        if live is not None:
            live.client = client
        avoid: list[str] = []
        watching = asyncio.ensure_future(wait_disconnect(receive))
        forwarding: asyncio.Future[_Outcome] | None = None
        attempts = 0
        try:
            while True:
                request = relay_request(scope, body, INGRESS)
                if pin is not None:
                    request["replica"] = pin
                if failover:
                    request["avoid"] = list(avoid)
                if resumable:
                    request["progress"] = True
                    if client.admitted is not None:
                        request["resume"] = client.resume(deadline)
                forwarding = asyncio.ensure_future(self._attempt(request, client, send))
                # the request's deadline bounds an attempt too (a replica that stopped
                # answering, a call no replica took), past the replica's own answer to it;
                # a route forwarded once: its own bound (a replica that hangs held it for ever)
                until = deadline + (2 * self.settings.deadline_slack_s if failover else 0.0)
                bound = max(0.0, until - time.monotonic())
                done, _ = await asyncio.wait({forwarding, watching}, timeout=bound,
                                             return_when=asyncio.FIRST_COMPLETED)
                if forwarding not in done:  # _attempt stops the replica
                    forwarding.cancel()
                    await asyncio.gather(forwarding, return_exceptions=True)
                    if watching in done:  # the client left
                        return
                    if not failover:
                        await self._route_timeout(scope, client, send)
                        return
                    self.exhausted += 1
                    if self.on_exhausted is not None:
                        self.on_exhausted()
                    log.warning("request past its deadline after %d attempt(s): no answer",
                                attempts + 1)
                    await self._give_up(client, _Outcome(DEADLINE, retryable=False), send)
                    return
                outcome = forwarding.result()
                cause = outcome.cause
                if cause is None:
                    return
                attempts += 1
                if outcome.replica is not None:
                    avoid.append(outcome.replica)
                    client.failed_from = client.failed_from or outcome.replica
                left = deadline - time.monotonic()
                if failover and outcome.retryable and client.started and client.admitted is None:
                    # its response started with no resume state (a replica that reported no
                    # progress): a sibling would send it again from its start, so it ends here
                    outcome = attrs.evolve(outcome, retryable=False, note=NOT_RESUMED if rerun
                                           else (
                        "a response of several choices (n > 1, a list of prompts) that started "
                        "without resume state (its replica reported no progress) is not "
                        "continued on a sibling"))
                if not (failover and outcome.retryable and attempts <= self.settings.max_failovers
                        and left > 0):
                    if failover and outcome.retryable:
                        self.exhausted += 1
                        if self.on_exhausted is not None:
                            self.on_exhausted()
                    log.warning("request failed after %d attempt(s): %s at %s", attempts,
                                outcome.cause, outcome.replica)
                    await self._give_up(client, outcome, send)
                    return
                self._count(cause, client)
                # the first retry after a replica that answered goes at once (the router
                # avoids it); a call that reached nobody, or a later retry, backs off
                if attempts > 1 or outcome.replica is None:
                    delay = min(self.settings.backoff_s * 2 ** (attempts - 1),
                                self.settings.max_backoff_s, left)
                    done, _ = await asyncio.wait({watching}, timeout=delay)
                    if done:
                        return
        finally:
            # this task cancelled (Ray Serve's proxy does that when the client disconnects):
            # the attempt under way is cancelled too, which stops its replica's stream
            if forwarding is not None and not forwarding.done():
                forwarding.cancel()
            watching.cancel()
            await asyncio.gather(watching, *[f for f in (forwarding,) if f is not None],
                                 return_exceptions=True)

    async def _route_timeout(self, scope: Message, client: _Client, send: Send) -> None:
        """A route forwarded once had no whole answer within its bound: 504 (its call is
        cancelled), or, its answer started, nothing more (the server closes the connection)."""
        bound_s, name = self.route_bound(scope)
        route = f"{scope['method']} {route_path(scope)[:200]}"
        log.warning("%s: no answer from replica %s within %s=%g s", route,
                    client.replica or "(unnamed)", name, bound_s)
        try:
            if client.started:  # left unfinished: the server closes the connection (cut)
                return
            admin = name == "admin_timeout_s"
            after = ("the replica may still be running it: see GET /ready and its metrics "
                     "before sending it again" if admin else "another replica may answer a retry")
            status = Status.deadline(Phase.WAIT, (
                f"{route}: no answer from "
                f"{'replica ' + client.replica if client.replica else 'its replica'} within "
                f"{name}={bound_s:g} s (the fleet ingress's bound on a route forwarded once); "
                f"{after}"))
            extra = ((b"x-should-retry", b"false") if admin
                     else (b"retry-after", str(self.settings.retry_after_s).encode()))
            start, payload = refusal(status, 504, self.settings.retry_after_s)
            await send_held(lambda message: _to_client(send, message, client),
                            {**start, "headers": [*start["headers"], extra]}, payload)
        except ClientGone as gone:
            log.info("client left before its 504 could be sent (%s)", gone)

    def _count(self, cause: str, client: _Client) -> None:
        reprefill = 0
        if client.admitted is not None:
            reprefill = int(client.admitted.get("prompt_tokens") or 0) + len(client.tokens)
        self.failovers[cause] += 1
        self.reprefilled += reprefill
        log.info("failover (%s) from %s after %d tokens", cause, client.failed_from,
                 len(client.tokens))
        if self.on_failover is not None:
            self.on_failover(cause, reprefill)

    async def _attempt(self, request: Message, client: _Client, send: Send) -> _Outcome:
        """Forward one replica's answer to the client, as far as it goes."""
        stream: Any = None
        replica: str | None = None
        start: Message | None = None  # a 200 start, sent with the first body chunk
        held: Message | None = None  # a refused start (its body is held too)
        held_body: list[bytes] = []
        error: Message | None = None  # the replica's report of a failed stream
        handed: str | None = None
        ended = False
        try:
            stream = self.call(request)
            async for message in stream:
                kind = message.get("type")
                if kind == PROGRESS_TYPE:
                    replica = message.get("replica", replica)  # the host names its replica
                    client.replica = replica
                    if "seed" in message and client.admitted is None:
                        client.admitted = {k: message.get(k) for k in
                                           ("seed", "id", "created", "prompt_tokens",
                                            "choices")}
                    client.pending.extend(message.get("tokens", ()))
                    client.pending_events.extend(message.get("events", ()))
                    if "error" in message:
                        error = message
                    client.final = bool(message.get("final")) or (
                        error is not None and not error.get("retryable"))
                    handed = message.get("handoff", handed)
                    continue
                if kind == "http.response.start":
                    replica = client.replica = header_of(message, REPLICA_HEADER) or replica
                    status = message["status"]
                    if status == 503 or (client.started and status != 200):
                        held = message
                    elif not client.started:
                        start = message  # the sibling's second start is dropped
                    continue
                if kind != "http.response.body":
                    continue
                if handed is not None:  # what follows a hand-off is only the end of the body
                    ended = True
                    return await self._cut(client, send, _Outcome(handed, replica))
                chunk, more = message.get("body", b""), message.get("more_body", False)
                if held is not None:
                    held_body.append(chunk)
                    if more:
                        continue
                    ended = True
                    client.drop_pending()
                    status = held["status"]
                    return _Outcome(handed or "unavailable", replica,
                                    retryable=status == 503 or (client.started and status == 429),
                                    held=(held, b"".join(held_body)))
                if error is not None and error.get("retryable"):
                    held_body.append(chunk)  # the SSE error event: withheld while we fail over
                    if more:
                        continue
                    ended = True
                    client.drop_pending()
                    return _Outcome(str(error.get("cause") or "unavailable"), replica,
                                    error_chunk=b"".join(held_body))
                if start is not None:
                    headers = list(start.get("headers", []))
                    if client.failed_from is not None:
                        headers.append((RELAYED_FROM, client.failed_from.encode()))
                    await _to_client(send, {**start, "headers": headers}, client)
                    start, client.started = None, True
                    kind_of = header_of({"headers": headers}, b"content-type") or ""
                    client.sse = kind_of.lower().startswith("text/event-stream")
                await _to_client(send, message, client)
                client.forwarded(chunk)
                if chunk:
                    client.opened = True
                    client.complete = client.final
                client.tokens.extend(client.pending)
                client.events.update(client.pending_events)
                client.drop_pending()
                if not more:
                    ended = True
                    return _Outcome(None, replica)
            ended = True  # the stream ended before the response did
            return await self._cut(client, send, _Outcome(handed or "replica_died", replica))
        except ClientGone as gone:  # the client left: its replica stops, nothing is retried
            log.info("client left while replica %s answered (%s)", replica, gone)
            return _Outcome(None, replica)  # (``ended`` unset: the stream is stopped below)
        except Exception as err:  # noqa: BLE001 - the replica's process died or is unreachable
            ended = True
            log.warning("replica %s failed mid-response: %r", replica, err)
            return await self._cut(client, send, _Outcome("replica_died", replica))
        finally:
            if not ended:  # cancelled: the client left
                await stop_stream(stream)

    @staticmethod
    async def _cut(client: _Client, send: Send, outcome: _Outcome) -> _Outcome:
        """A replica's stream broke off: a failover, unless the client already had the
        response's last chunk (then only its end is sent)."""
        client.drop_pending()
        if client.complete:
            try:
                await _to_client(send, {"type": "http.response.body", "body": b"",
                                       "more_body": False}, client)
            except ClientGone as gone:  # it had every chunk
                log.info("client left before the end of its response (%s)", gone)
            return _Outcome(None, outcome.replica)
        return outcome

    async def _give_up(self, client: _Client, outcome: _Outcome, send: Send) -> None:
        """The budget is spent: the client gets what it would have got without the fleet."""
        try:
            await self._tell(client, outcome, lambda message: _to_client(send, message, client))
        except ClientGone as gone:  # the client left meanwhile: nobody to tell
            log.info("client left before its failure could be sent (%s)", gone)

    async def _tell(self, client: _Client, outcome: _Outcome, send: Send) -> None:
        if not client.started:
            if outcome.held is not None:
                await send_held(send, *outcome.held)
            else:
                await send_held(send, *refusal(unavailable(outcome), 503,
                                               self.settings.retry_after_s))
            return
        if not client.sse:  # a JSON or text body cut short: an SSE event in it is garbage,
            return  # and its end would make it look whole: left unfinished, the server
            # closes the connection (the client sees an incomplete body)
        chunk = outcome.error_chunk or sse_error(outcome.held) or wire.sse(
            {"error": error_bodies.error_body(unavailable(outcome))})
        if client.responses:
            chunk = responses_error(chunk, client.sequence + 1)
        await send({"type": "http.response.body", "body": chunk, "more_body": False})


def unavailable(outcome: _Outcome) -> Status:
    if outcome.cause == DEADLINE:
        return Status.unavailable(Phase.ADMISSION, "no replica finished the request within "
                                  "its deadline (its timeout, or the server's default)")
    note = "" if outcome.note is None else f": {outcome.note}"
    return Status.unavailable(Phase.ADMISSION, f"no replica could finish the request (last: "
                              f"{outcome.cause} at {outcome.replica or 'an unknown replica'})"
                              f"{note}")


def refusal(status: Status, code: int, retry_after_s: int,
            close: bool = False) -> tuple[Message, bytes]:
    """A held response (start, body) with the server's error body; ``close``: with
    ``Connection: close`` (the request's body was not read whole)."""
    payload = json.dumps({"error": error_bodies.error_body(status, None, code),
                          "status": status.to_dict()}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    if code in (429, 503):
        headers.append((b"retry-after", str(retry_after_s).encode()))
    if close:
        headers.append((b"connection", b"close"))
    return {"type": "http.response.start", "status": code, "headers": headers}, payload


def sse_error(held: tuple[Message, bytes] | None) -> bytes | None:
    """The SSE error event of a refused response's JSON error body (None if it has none)."""
    if held is None:
        return None
    try:
        error = json.loads(held[1])["error"]
    except (ValueError, KeyError, TypeError):
        return None
    return wire.sse({"error": error})


def responses_error(chunk: bytes, sequence: int) -> bytes:
    """Chat's SSE error event ``chunk`` (``data: {"error": {...}}``) as the Responses API's
    ``error`` event (``event: error``, ``{"type": "error", "code", "message", "param",
    "sequence_number"}``, the SDK's ``ResponseErrorEvent``), numbered ``sequence`` (after the
    last event the client got). Until stop 64 a Responses stream the ingress ended (its
    replica died mid-stream) ended with chat's shape, no ``type``: a client reading the
    Responses' events (the SDK's typed union, the Agents SDK) could not parse it. ``code`` as
    the server's ``response.failed`` says it (``rate_limit_exceeded`` for a rate limit, else
    ``server_error``), chat's own code at the end of the message."""
    try:
        error = json.loads(chunk.removeprefix(b"data: "))["error"]
    except (ValueError, KeyError, TypeError):
        error = None
    if not isinstance(error, dict):
        error = {"message": "the response failed"}
    code = "rate_limit_exceeded" if error.get("type") == "rate_limit_error" else "server_error"
    message = str(error.get("message") or "the response failed")
    if error.get("code") and error["code"] != code:
        message = f"{message} ({error['code']})"
    data = {"type": "error", "sequence_number": sequence, "code": code, "message": message,
            "param": error.get("param")}
    return b"event: error\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def request_timeout(body: bytes, default: float) -> float:
    """The request's deadline in seconds: its body's ``timeout`` when valid, else ``default``
    (the server validates the body; an invalid one is refused there, not here: one nested
    past the parser's recursion limit too, which raised out of the ingress, a plain 500, and
    an integer past the float range, whose ``float()`` raised OverflowError out of it)."""
    try:
        timeout = json.loads(body).get("timeout")
    except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):
        return default
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        return default
    try:
        seconds = float(timeout)
    except OverflowError:  # (an int of hundreds of digits: JSON has no bound)
        return default
    return seconds if math.isfinite(seconds) and seconds > 0 else default


def expects_continue(scope: Message) -> bool:
    """The request waits for ``100 Continue`` before sending its body (``Expect:
    100-continue``, HTTP/1.1 only: ``wire.expects_continue`` on an ASGI scope)."""
    return (scope.get("http_version") == "1.1"
            and (header_of(scope, b"expect") or "").strip().lower() == "100-continue")


def header_of(message: Message, name: bytes) -> str | None:
    value = next((v for k, v in message.get("headers", []) if k.lower() == name), None)
    return None if value is None else bytes(value).decode("latin-1")


async def lifespan(receive: Receive, send: Send) -> None:
    """The ASGI lifespan protocol: nothing to start or stop."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
