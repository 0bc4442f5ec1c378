"""Admin endpoints of the reference server (bearer token, ``ServerConfig.admin_token``):
``POST /admin/drain?grace=S`` and ``POST /admin/reload`` (model switch, §9.2). A reload's
calbin passes ``DeviceExecutor.check_calbin`` (the file, the runtime's host-side read, the
manifest) before the lifecycle moves: a bad one is a 400 naming ``calbin``, and serving goes
on undrained. ``POST /admin/cancel/{id}`` ends the request in progress whose response ``id``
or ``x-request-id`` is ``id`` (``CompletionService.cancel``): its client gets 409
``request.aborted`` (a stream: the error event), ``x-should-retry: false``."""

from __future__ import annotations

import functools
import hmac
import json
import logging
import math
import re
from typing import Any

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from calexec.contracts.errors import Category
from calexec.contracts.fields import shown
from calexec.contracts.status import Phase, Status
from calexec.drivers.serving import wire
from calexec.drivers.serving.error_bodies import (
    TOO_DEEP_ADVICE,
    error_response,
    invalid,
    transfer_coding_refused,
)
from calexec.drivers.serving.service import OperatorBusy, RouteService, ServerConfig
from calexec.machines import switch_check

log = logging.getLogger("calexec.admin")

#: longest ``/admin/reload`` path accepted (Linux PATH_MAX; ``DeviceExecutor.check_calbin``)
MAX_PATH_CHARS = switch_check.MAX_PATH_CHARS


def admin_refusal(request: Request, config: ServerConfig) -> JSONResponse | None:
    """None when ``request`` carries the admin bearer token (constant-time compare), else the
    401/403 answer. The token is read as the API key is (``openai_api.auth_refusal``): the
    spaces after ``Bearer`` (RFC 9110 allows more than one) and around the token are not
    part of it."""
    given = request.headers.getlist("authorization")
    header = given[0] if given else ""
    if config.admin_token is None:
        return error_response(Status.failure("admin.disabled", Category.INVALID_REQUEST,
                                             Phase.VALIDATE, "no admin token is configured"),
                              http_status=403)
    if len(given) > 1:  # one credential, as the API key (openai_api.auth_refusal)
        return error_response(Status.failure("admin.unauthenticated", Category.INVALID_REQUEST,
                                             Phase.VALIDATE, f"Authorization given {len(given)} "
                                             "times: send one, Authorization: Bearer <token>"),
                              http_status=401)
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return error_response(Status.failure("admin.unauthenticated", Category.INVALID_REQUEST,
                                             Phase.VALIDATE, "Authorization: Bearer <token> "
                                             "required"), http_status=401)
    if not hmac.compare_digest(token.encode("utf-8"), config.admin_token.encode("utf-8")):
        return error_response(Status.failure("admin.forbidden", Category.INVALID_REQUEST,
                                             Phase.VALIDATE, "admin token does not match"),
                              http_status=403)
    return None



def query_refusal(request: Request, allowed: tuple[str, ...], usage: str
                  ) -> JSONResponse | None:
    """The 400 of a query parameter ``request``'s route does not take (None: every one is
    in ``allowed``), naming each (``param`` the first, sorted) and the route's ``usage``: a
    typo such as ``?limt=5`` or ``?grase=0`` answers as if unsaid otherwise. The rule of every
    ``/admin`` and ``/debug`` route."""
    unknown = sorted({key for key in request.query_params if key not in allowed})
    if not unknown:
        return None
    names = ", ".join(key[:64] for key in unknown[:8]) + (", ..." if len(unknown) > 8 else "")
    said = "unknown parameter" if len(unknown) == 1 else "unknown parameters"
    return error_response(invalid(f"{names}: {said}, refused ({usage})"), unknown[0][:64])


#: the keys of a ``/admin/reload`` body (any other is refused, named, as the OpenAI bodies do)
RELOAD_KEYS = ("calbin", "without_rollback")
#: what the 413 of a ``/admin/reload`` body over ``max_body_bytes`` says (a calbin's bytes
#: sent as the body, ``curl --data-binary @model.calbin``, were told to send fewer or shorter
#: prompts or to raise ``--max-body-bytes`` until stop 71)
RELOAD_TAKES = ("/admin/reload takes {\"calbin\": PATH}, the path of a calbin file the server "
                "reads, not the file's bytes (curl --data-binary @model.calbin sends them)")
#: what the 413 of a ``/admin/drain`` body says
DRAIN_TAKES = "/admin/drain takes no body: the grace is the query parameter ?grace=S"
#: the query parameters of ``/admin/drain``
DRAIN_PARAMS = ("grace",)
#: what the 413 of a ``/admin/cancel/{id}`` body says
CANCEL_TAKES = ("/admin/cancel/{id} takes no body: the request's response id or x-request-id "
                "is the path's last segment")
#: the header the fleet ingress marks the requests it forwards with (drivers/fleet/edge.py
#: ``RELAYED_FROM``; its value ``ingress``): a cancel it forwarded reached the replica running
#: the request it names, or, when the ingress could not place it, one replica
RELAYED_FROM = "x-calexec-relayed-from"
#: a drain's ``grace``: an ASCII decimal number (``float()`` alone also reads "٣" as 3,
#: "1_0" as 10 and " 5" as 5)
GRACE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _object(pairs: list[tuple[str, Any]], repeated: list[str]) -> dict[str, Any]:
    """A JSON object's pairs as a dict (``json.loads``' ``object_pairs_hook``); a key given
    more than once is added to ``repeated``."""
    body: dict[str, Any] = {}
    for key, value in pairs:
        if key in body:
            repeated.append(key)
        body[key] = value
    return body


def reload_body(raw: bytes) -> dict[str, Any] | tuple[Status, str | None]:
    """The ``/admin/reload`` body as a JSON object, or the 400 failure saying why it is not
    one and its ``param``: empty (or whitespace alone), not UTF-8 (UTF-16 or -32 too), not JSON (a byte order mark
    included; a ``\\ud800``-``\\udfff`` escape of a lone surrogate, which the API's parser
    refuses too: a key of one was answered 500), nested past the parser's recursion limit,
    not an object (``param`` None: the body as a whole), a key given twice in an object
    (that key: ``{"calbin": A, "calbin": B}`` switched to B, the first one unsaid), a key
    other than ``calbin`` (that key)."""
    nothing = wire.no_json_value(raw, "{\"calbin\": PATH} (application/json)")
    if nothing is not None:  # (the parser's words: "Expecting value: line 1 column 1")
        return invalid(nothing), None
    utf8 = wire.utf8_json(raw)  # (as the API's bodies: a UTF-8 BOM skipped, UTF-16/32 refused)
    if isinstance(utf8, str):
        return invalid(utf8), None
    try:
        text = utf8.decode("utf-8")
    except UnicodeDecodeError as err:
        return invalid(f"body: not UTF-8 ({err.reason} at byte {err.start}); send "
                       "{\"calbin\": PATH} as UTF-8 JSON"), None
    too_deep = invalid("body: nested deeper than the server's JSON parser reads (Python's "
                       "recursion limit; RFC 8259 section 9 lets a parser bound the nesting): "
                       f"{TOO_DEEP_ADVICE}: {{\"calbin\": PATH}}")
    repeated: list[str] = []  # keys given twice in one object (JSON's last one would win)
    try:
        body = json.loads(text, object_pairs_hook=lambda pairs: _object(pairs, repeated))
    except RecursionError:  # nested past the parser's depth: valid or not, it read no further
        return too_deep, None
    except ValueError as err:
        overlong = wire.overlong_number(utf8)  # (Python's words, cut: "use sys.set_int_...")
        if overlong is not None:
            return invalid(overlong[0]), overlong[1]
        return invalid(f"body: not valid JSON ({str(err)[:120]}); send "
                       "{\"calbin\": PATH}"), None
    try:  # (Python's parser takes "\udcff"; the API's bodies are refused for it, as here)
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        surrogate = wire.lone_surrogate(utf8)
        if surrogate is not None:  # named as the API's bodies name it: where, and why
            return invalid(surrogate[0]), surrogate[1]
        return invalid("body: not valid JSON (a lone surrogate escape: not a Unicode "
                       "character); send {\"calbin\": PATH}"), None
    except RecursionError:  # (valid JSON as deep as the parser took, past the encoder's)
        return too_deep, None
    if repeated:
        name = repeated[0][:80]
        return invalid(f"{name}: given more than once in the body (the last one would "
                       "silently win), give it once"), name
    if not isinstance(body, dict):
        return invalid(f"body: must be a JSON object {{\"calbin\": PATH}}, not "
                       f"{wire.json_type_name(body)}"), None
    unknown = sorted(key for key in body if key not in RELOAD_KEYS)
    if unknown:
        name = unknown[0][:80]
        return invalid(f"{name}: unknown parameter, refused (the body is "
                       "{\"calbin\": PATH})"), name
    without = body.get("without_rollback", False)
    if not isinstance(without, bool):  # (JSON's true or false, as the API's StrictBool)
        return invalid(f"without_rollback={shown(without, 80)}: must be true or false (true: "
                       "switch even when a refusal could not roll back)"), "without_rollback"
    return body


def draining_refusal(retry_after: int, headers: dict[str, str] | None = None) -> JSONResponse:
    """The 503 of a reload while the server drains (``param: calbin``, ``Retry-After``):
    ``headers`` ``wire.CLOSE`` for one refused before the body it announced with ``Expect:
    100-continue`` was read."""
    return error_response(Status.unavailable(
        Phase.RECOVERY, "reload refused, lifecycle unchanged: server is draining"),
        "calbin", retry_after=retry_after, headers=headers)


def add_admin_routes(app: FastAPI, owner: RouteService) -> None:
    """``/admin/drain``, ``/admin/cancel/{id}`` and ``/admin/reload`` on ``app``."""
    config = owner.service.config
    retry = config.retry_after_s
    #: the calbin of the switch this app's ``/admin/reload`` runs now (at most one): checked
    #: and set with no ``await`` between them and the health check, so a second reload is
    #: refused while the first has not yet moved the lifecycle (both found it Ready, and the
    #: executor ran the second switch after the first: two drains, and the first's answer
    #: read the lifecycle of the second, ``"lifecycle": "Recovering"``)
    switching: list[str] = []

    async def read_body(request: Request, takes: str, drained: str | None = None
                        ) -> bytes | JSONResponse:
        """An admin request's body, or the answer to one that did not arrive (499), came too
        slowly (408), is too large (413, saying what the route ``takes``: not the API's
        "fewer or shorter prompts, or a larger --max-body-bytes") or was cut by a drain (503,
        ``param`` ``drained``: a reload's ``calbin``, as its other refusals while draining):
        ``wire.body_or_refusal``, as the API's."""
        service = owner.service
        raw = await wire.body_or_refusal(request, config.max_body_bytes, config.body_timeout_s,
                                         service.bodies, takes)
        if isinstance(raw, wire.BodyRefusal):
            return error_response(raw.status, drained if raw.http_status == 503 else None,
                                  http_status=raw.http_status, headers=raw.headers)
        return raw

    async def no_body(request: Request, route: str, takes: str, instead: str
                      ) -> Response | None:
        """None when the admin ``route``, which takes no body, got none (or ``{}``, a
        client's ``json={}``, saying nothing); else the answer: :func:`read_body`'s (its 413
        saying what the route ``takes``), or a 400 naming the bytes sent and where what they
        meant goes (``instead``)."""
        raw = await read_body(request, takes)
        if not isinstance(raw, bytes):
            return raw
        if raw.strip() and raw.strip() != b"{}":
            return error_response(invalid(f"body: {route} takes no body ({len(raw)} bytes "
                                          f"sent): {instead}"), None)
        return None

    @app.post("/admin/drain")
    async def admin_drain(request: Request) -> Response:
        service = owner.service
        refused = admin_refusal(request, config)
        if refused is not None:
            return refused
        unknown = query_refusal(request, DRAIN_PARAMS, "POST /admin/drain?grace=S")
        if unknown is not None:
            return unknown
        bodied = await no_body(request, "/admin/drain", DRAIN_TAKES,
                               "the grace is the query parameter ?grace=S")
        if bodied is not None:
            return bodied
        given = request.query_params.getlist("grace")
        if len(given) > 1:  # (the last would win: which one was meant is the client's)
            return error_response(invalid(f"grace={shown(given[0], 64)}: given {len(given)} times "
                                          "in the query, give it once"), "grace")
        raw_grace = request.query_params.get("grace")
        if raw_grace is None:  # the server's own drain grace (`--grace`), as its signals'
            grace = config.drain_grace_s
        elif GRACE.fullmatch(raw_grace):
            grace = float(raw_grace) + 0.0  # (-0 is 0: the answer said "grace": -0.0)
        else:
            grace = math.nan
        if raw_grace is not None and not (
                math.isfinite(grace) and 0 <= grace <= config.max_drain_grace_s):
            return error_response(invalid(f"grace={shown(raw_grace, 64)}: must be a finite number "
                                           f"of seconds in [0, {config.max_drain_grace_s:g}]"),
                                  "grace")
        started = service.drain_grace is None
        service.start_drain(grace)  # idempotent: a drain under way keeps its own grace
        if started:  # (a signal's drain logs its own line)
            log.info("admin: draining (grace %gs), x-request-id %s", grace,
                     wire.request_id(request.scope))
        return JSONResponse({"draining": True, "grace": service.drain_grace,
                             "started": started}, status_code=202)

    @app.post("/admin/cancel/{ident:path}")
    async def admin_cancel(ident: str, request: Request) -> Response:
        """Cancel the request in progress whose response ``id`` (``cmpl-``, ``chatcmpl-``,
        ``resp_``...) or ``x-request-id`` is ``ident`` (docs/server.md "Cancel"): 202 once
        told (again for a repeat, nothing more done), 404 ``not_found`` when none in
        progress has it, 400 when ``ident`` is no request id or names several requests."""
        service = owner.service
        refused = admin_refusal(request, config)
        if refused is not None:
            return refused
        unknown = query_refusal(request, (), "POST /admin/cancel/{id} takes no query")
        if unknown is not None:
            return unknown
        bodied = await no_body(request, "/admin/cancel/{id}", CANCEL_TAKES,
                               "the id is the path's last segment")
        if bodied is not None:
            return bodied
        if wire.SANE_REQUEST_ID.fullmatch(ident.encode("utf-8", "replace")) is None:
            return error_response(invalid(
                f"id={shown(ident, 64)}: not a request id (a response id such as "
                f"cmpl-..., chatcmpl-... or resp_..., or an x-request-id: 1 to "
                f"{wire.MAX_REQUEST_ID_CHARS} printable ASCII characters)"), "id")
        done = service.cancel(ident)
        said = shown(ident, 128)
        if done.outcome == "ambiguous":
            return error_response(invalid(
                f"id={said}: names {len(done.response_ids) or 'several'} requests in progress "
                f"({', '.join(done.response_ids[:8])}): none cancelled; cancel one by its "
                "response id"), "id")
        if done.outcome == "not_found":
            where = ("no request in progress on the replica the fleet ingress sent this to "
                     "(it sends a cancel to the replica running the request it names when it can "
                     "place it, else to one replica: the request may run on another)"
                     if request.headers.get(RELAYED_FROM) == "ingress"
                     else "no request in progress")
            return error_response(Status.failure(
                "request.not_found", Category.INVALID_REQUEST, Phase.VALIDATE,
                f"id={said}: {where} has this response id or x-request-id (unknown, or it "
                "already ended)"), "id", http_status=404)
        log.info("admin: cancel of %s (%s), x-request-id %s", said, done.outcome,
                 wire.request_id(request.scope))
        return JSONResponse({"cancelled": True, "id": ident,
                             "response_ids": list(done.response_ids),
                             "x_request_id": done.x_request_id}, status_code=202)

    @app.post("/admin/reload")
    async def admin_reload(request: Request) -> Response:
        """Model switch through the lifecycle (§9.2): body {"calbin": PATH}. The new calbin
        serves only after its golden passes; otherwise the previous one serves again."""
        service = owner.service
        refused = admin_refusal(request, config)
        if refused is not None:
            return refused
        if service.draining and wire.expects_continue(request):
            # refused before its body is read: no ``100 Continue`` (uvicorn sends it when the
            # route first reads the body, and the client uploads it to be refused); the
            # body it announced never comes on this connection, which closes
            return draining_refusal(retry, wire.CLOSE)
        media = wire.non_json_media(request)
        if media is not None:
            return error_response(invalid(f"content-type {shown(media)}: the body must be JSON "
                                          "(application/json)"), None, http_status=415)
        coding = wire.unsupported_coding(request)
        if coding is not None:
            return error_response(invalid(f"content-encoding {shown(coding)}: not supported, send "
                                          "the body uncompressed"), None, http_status=415,
                                  headers=wire.IDENTITY_ONLY)
        transfer = wire.unsupported_transfer_coding(request)
        if transfer is not None:
            return error_response(transfer_coding_refused(transfer), None,
                                  http_status=501)
        unknown = query_refusal(request, (), "POST /admin/reload takes the body "
                                "{\"calbin\": PATH} and no query")
        if unknown is not None:
            return unknown
        # (a drain that cut the body's read: its 503 names ``calbin``, as the reload's other
        # refusals while draining; ``param: null`` until stop 73)
        raw = await read_body(request, RELOAD_TAKES, "calbin")
        if not isinstance(raw, bytes):
            return raw
        body = reload_body(raw)
        if isinstance(body, tuple):
            return error_response(body[0], body[1], http_status=400)
        path = body.get("calbin")
        if not isinstance(path, str) or not path:  # named as the client wrote it (JSON),
            # as the executor's check names it (switch_check.named), without calling it
            return error_response(switch_check.refused(
                "path_required", shown(path, 200), "a calbin file path (a non-empty string) "
                "is required"), "calbin", http_status=400)
        # the calbin is checked before anything moves (no drain, no switch): a path that is
        # not a calbin this manifest describes is the client's error, answered 400
        checked = await service.operator_call(
            f"POST /admin/reload: the check of calbin {shown(path, 300)}",
            service.executor.check_calbin, path, config.max_calbin_bytes)
        if isinstance(checked, OperatorBusy):  # nothing checked or moved
            return error_response(checked.status, "calbin", retry_after=retry)
        if not checked.ok or not isinstance(path, str):  # (checked ok: a str)
            return error_response(checked if not checked.ok else invalid(f"calbin={shown(path)}"),
                                  "calbin", http_status=400)
        # the lifecycle moves only when it can: not while draining, recovering or unhealthy
        if service.draining:
            return draining_refusal(retry)
        # a switch under way is named before the health reasons its own drain and warm-up
        # give ("lifecycle is Draining, not admitting": no drain the operator started)
        if switching:
            return error_response(Status.unavailable(
                Phase.RECOVERY, "reload refused, lifecycle unchanged: a switch to calbin "
                f"{shown(switching[0], 300)} is under way; send it again once that one "
                "answered"), "calbin", retry_after=retry)
        reasons = service.health()
        if reasons:
            return error_response(Status.unavailable(
                Phase.RECOVERY, f"reload refused, lifecycle unchanged: {'; '.join(reasons)}"),
                "calbin", retry_after=retry)
        switching.append(path)
        try:
            log.info("admin: switching to calbin %s, x-request-id %s", shown(path, 300),
                     wire.request_id(request.scope))
            switch = (functools.partial(service.executor.switch_model, without_rollback=True)
                      if body.get("without_rollback") else service.executor.switch_model)
            status = await service.operator_call(
                f"POST /admin/reload: the model switch to calbin {shown(path, 300)}",
                switch, path)
            if isinstance(status, OperatorBusy):  # nothing moved
                return error_response(status.status, "calbin", retry_after=retry)
            executor = service.executor
            gen, state = executor.gen, executor.state  # (read before another switch starts)
        finally:
            switching.clear()
        if not status.ok:
            if "golden.unpinned" in status.message:
                # the core names its config field; a `calexec serve` operator has the flag
                status = attrs.evolve(status, message=status.message.replace(
                    "set allow_unpinned_golden", "set allow_unpinned_golden (calexec serve: "
                    "--allow-unpinned-golden)", 1))
            log.warning("admin: switch to calbin %s failed, lifecycle %s: %s", shown(path, 300),
                        service.executor.state, status)
            return error_response(status, "calbin")
        log.info("admin: calbin %s serves, generation %s", shown(path, 300),
                 None if gen is None else gen.id)
        return JSONResponse({"reloaded": True, "calbin": path,
                             "generation": None if gen is None else gen.id,
                             "lifecycle": state})
