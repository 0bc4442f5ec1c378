"""Error bodies of the reference server: a §8 Status rendered with ``Status.http_status`` in
the OpenAI shape ``{"error": {"message", "type", "code", "param"}}`` plus ``"status":
Status.to_dict()``; 429 and 503 carry ``Retry-After``, a failure no retry fixes
``x-should-retry: false``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from fastapi.responses import JSONResponse

from calexec.contracts.errors import Category
from calexec.contracts.fields import shown
from calexec.contracts.status import Phase, Status

#: the request field a refusal by the executor is about (the error body's ``param``)
PARAM_OF_CODE = {"kv.exceeds_capacity": "max_tokens"}

ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "invalid_request_error",
               405: "invalid_request_error", 408: "timeout_error", 409: "cancelled_error",
               413: "invalid_request_error", 414: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_error",
               431: "invalid_request_error",
               501: "invalid_request_error", 505: "invalid_request_error",
               499: "cancelled_error", 503: "unavailable_error", 504: "timeout_error"}


#: categories no retry of the same request fixes (contracts/errors.py's table: COMPATIBILITY
#: "needs a manual fix", PROGRAMMING "a calexec bug or configuration error", REQUEST_ARTIFACT
#: a runtime bound/dtype/shape/allocation failure of a request that passed the manifest
#: checks: the generation keeps serving, §8 "record the manifest difference", and the same
#: request meets the same difference again): their answers carry ``x-should-retry: false``,
#: which the OpenAI SDKs obey over their own rule (every 5xx retried, ``max_retries`` times
#: after a back-off). The other 500s are retried: ARTIFACT rolls back to the last good
#: generation, UNKNOWN and INTERNAL (bad output) recover the device, after which a retry may
#: be served (docs/server.md "Retries")
NOT_RETRYABLE = frozenset({Category.COMPATIBILITY, Category.PROGRAMMING,
                           Category.REQUEST_ARTIFACT})
#: 5xx answers no retry of the same request changes: 501, a transfer coding this server does
#: not implement; 505, an HTTP version it does not speak (the SDKs retry every 5xx they are
#: not told not to)
NOT_RETRYABLE_HTTP = frozenset({501, 505})
#: Status codes answered with another HTTP status than their category's. ``request.aborted``
#: (an operator's ``POST /admin/cancel/{id}``; category CANCELLED, whose 499 says the client
#: closed the request, which this one's did not: it reads the answer) is 409, gRPC's
#: ABORTED: "the operation was aborted", the request is no longer served; a 5xx would say
#: the server failed (and every SDK retries one), a 499 that nobody reads the answer
HTTP_OF_CODE = {"request.aborted": 409,
                # (a reload refused, nothing moved: the serving calbin was written over in
                # place, a refused switch could not roll back: the server's state, not the
                # request, is in the way)
                "calbin.rollback_changed": 409}
#: Status codes whose error ``type`` is not their HTTP status's: a reload refused as the
#: other ``calbin.*`` refusals of the reload are (``invalid_request_error``), though a 409 (a
#: cancel's ``cancelled_error``)
TYPE_OF_CODE = {"calbin.rollback_changed": "invalid_request_error"}
#: Status codes no retry of the same request should follow (``x-should-retry: false``): an
#: operator cancelled it (the OpenAI SDKs retry a 409 unless told not to)
NOT_RETRYABLE_CODES = frozenset({"request.aborted", "calbin.rollback_changed"})


def http_status_of(status: Status) -> int:
    """The HTTP status ``status`` is answered with (:data:`HTTP_OF_CODE`, else its
    category's, ``Status.http_status``)."""
    return HTTP_OF_CODE.get(status.code) or status.http_status


def own_deadline(status: Status, http_status: int | None = None) -> bool:
    """``status`` is the 504 of a request's own deadline (its ``timeout``, or the server's
    default), which a completion route answers ``x-should-retry: false`` while the server
    serves (server.py ``fail``): a 408 (the body's ``body_timeout_s``) is not one."""
    code = status.http_status if http_status is None else http_status
    return status.category is Category.DEADLINE and code == 504


#: Status codes whose OpenAI error ``code`` is OpenAI's own name (``status.code`` keeps calexec's)
OPENAI_CODE = {"request.model_not_found": "model_not_found",
                "request.invalid_api_key": "invalid_api_key",
                "request.not_found": "not_found",
                "request.context_length_exceeded": "context_length_exceeded",
                "request.method_not_allowed": "method_not_allowed"}


#: gRPC code of an HTTP status a route answers in place of its Status's own (the status dict
#: of the body says the same as the response: a 401 is UNAUTHENTICATED, not a 400)
GRPC_OF_HTTP = {401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                405: "UNIMPLEMENTED", 408: "DEADLINE_EXCEEDED", 409: "ABORTED",
                413: "INVALID_ARGUMENT", 415: "INVALID_ARGUMENT",
                499: "CANCELLED", 501: "UNIMPLEMENTED", 505: "UNIMPLEMENTED"}


def error_response(status: Status, param: str | None = None, retry_after: int = 1,
                   http_status: int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The JSON error body of a failure Status (OpenAI shape + calexec's status dict, whose
    ``http_status``/``grpc_code`` are the response's when ``http_status`` overrides the
    Status's own)."""
    code = http_status_of(status) if http_status is None else http_status
    described = status.to_dict()
    if code != described["http_status"]:
        described["http_status"] = code
        described["grpc_code"] = GRPC_OF_HTTP.get(code, described["grpc_code"])
    body = {"error": error_body(status, param, code), "status": described}
    headers = dict(headers or {})
    if code in (429, 503):
        headers["Retry-After"] = str(retry_after)
    if (status.category in NOT_RETRYABLE or code in NOT_RETRYABLE_HTTP
            or status.code in NOT_RETRYABLE_CODES):
        headers["x-should-retry"] = "false"
    if code == 401:  # RFC 9110 section 11.6.1: a 401 MUST carry a challenge (RFC 6750's)
        headers.setdefault("WWW-Authenticate", "Bearer")
    return JSONResponse(body, status_code=code, headers=headers or None)


def error_body(status: Status, param: str | None = None,
               http_status: int | None = None) -> dict[str, Any]:
    """The OpenAI-shaped ``error`` object of a failure (also the SSE error event's)."""
    code = http_status_of(status) if http_status is None else http_status
    return {"message": status.message or status.code,
            "type": TYPE_OF_CODE.get(status.code) or ERROR_TYPE.get(code, "server_error"),
            "code": OPENAI_CODE.get(status.code, status.code), "param": param}


#: the OpenAI (and vLLM) endpoints this server does not serve -> why, in the 404 a client
#: calling one gets (a path equal to one, or under it): "no such route" alone left a user of
#: the SDK's ``embeddings.create`` (LangChain's ``OpenAIEmbeddings``, llama-index's
#: ``OpenAIEmbedding``) to guess whether the path, the server or the model was wrong
NOT_SERVED: dict[str, str] = {
    **dict.fromkeys(("/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank",
                     "/v2/rerank", "/classify", "/v1/classify"),
                    "the served model generates text: embeddings, scores and classifications "
                    "(pooling) are not served"),
    "/v1/moderations": "moderation is not performed by this server",
    **dict.fromkeys(("/v1/audio", "/v1/images", "/v1/realtime", "/v1/videos", "/v1/live",
                     "/v1/content_provenance_checks"),
                    "the served model reads and writes text only"),
    # (the openai npm package 7.60's agents, skills, chatkit sessions and threads: until
    # stop 75 "no such route" alone, as every path of its resources below)
    **dict.fromkeys(("/v1/files", "/v1/uploads", "/v1/batches", "/v1/fine_tuning",
                     "/v1/vector_stores", "/v1/assistants", "/v1/threads", "/v1/conversations",
                     "/v1/containers", "/v1/evals", "/v1/chat/completions/", "/v1/agents",
                     "/v1/skills", "/v1/chatkit"),
                    "this server stores nothing (files, batches, stored completions, "
                    "conversations, assistants): send each request whole"),
    **dict.fromkeys(("/v1/webhook_endpoints", "/v1/webhook_event_types"),
                    "no webhooks are sent: nothing runs in the background to notify of "
                    "(background responses and batches are not served)"),
    **dict.fromkeys(("/v1/organization", "/v1/safety"),
                    "OpenAI's organization administration (keys, usage, costs, safety alerts "
                    "and cases) is not served: this server's operator routes are under /admin"),
    "/v1/decisions": "decisions (classification and scoring questions) are not served: ask "
                     "them through /v1/chat/completions or /v1/responses with a response_format",
    # the SDK's responses.compact: under the stored-response route /v1/responses/{id}, which
    # takes GET and DELETE, so a POST was that route's 405 naming them (as if "compact" were
    # a response's id) until stop 72
    "/v1/responses/compact": "compaction is not performed by this server (a compacted "
                             "conversation is made of OpenAI's encrypted items, which no model "
                             "here reads): send the whole conversation in input",
}

#: (method, path) of an OpenAI endpoint that shares its path with a route served here for
#: another method -> why it is not served, said after the 405's ``method not allowed``
#: (its ``Allow`` stays: the path is served, for those methods). ``WEBSOCKET``: the
#: request asks to upgrade to a WebSocket (``calexec serve`` speaks none: the handshake is
#: served as a plain request)
WEBSOCKET = "websocket"
NOT_ALLOWED_WHY: dict[tuple[str, str], str] = {
    # the SDK's chat.completions.list (its retrieve, update, delete: NOT_SERVED's 404)
    ("GET", "/v1/chat/completions"): "the stored chat completions are not listed: this "
                                     "server stores nothing (store is accepted, nothing is "
                                     "kept)",
    # the SDK's responses.connect(): the Responses WebSocket mode
    (WEBSOCKET, "/v1/responses"): "the Responses WebSocket mode (the SDK's "
                                  "responses.connect()) is not served: POST /v1/responses, "
                                  "with stream: true for its events as server-sent events",
}


def not_allowed_why(method: str, path: str, websocket: bool = False) -> str | None:
    """Why the OpenAI endpoint ``method path`` (a path served for other methods) is not
    served here, or None (:data:`NOT_ALLOWED_WHY`)."""
    return NOT_ALLOWED_WHY.get((WEBSOCKET if websocket else method, path))


def not_served(path: str) -> str | None:
    """Why ``path`` (no route here) is an endpoint this server does not serve, or None: the
    path itself or one under it (a key ending in ``/``: one under it only, the stored
    completions' ``/v1/chat/completions/{id}``, not the chat route with a stray slash)."""
    for prefix, why in NOT_SERVED.items():
        if prefix.endswith("/"):
            hit = path.startswith(prefix) and len(path) > len(prefix)
        else:
            hit = path == prefix or path.startswith(prefix + "/")
        if hit:
            return why
    return None


def encoded_separator(path: str) -> str | None:
    """Why ``path`` (no route here) holding an encoded slash or dot segment, kept as sent
    (``wire.routed_path``), routes nowhere; None for any other path."""
    lowered = path.lower()
    if "%2f" in lowered or any(segment.replace("%2e", ".") in (".", "..")
                               for segment in lowered.split("/") if "%2e" in segment):
        return ("an encoded slash (%2F) or dot segment (%2E) separates no path segments "
                "here (only in a model id, /v1/models/{model}, and the id of /admin/cancel/{id})")
    return None


def under_v1(path: str) -> str | None:
    """The path a client whose base URL misses ``/v1``, or has it twice, meant by ``path``
    (``/chat/completions`` -> ``/v1/chat/completions``, ``/v1/v1/models`` -> ``/v1/models``);
    None for a path under ``/v1`` once. Whether a route takes it is the caller's to ask."""
    if path.startswith("/v1/v1/"):
        return path[len("/v1"):]
    if path == "/v1" or path.startswith("/v1/") or path in ("", "/"):
        return None
    return "/v1" + path


def slash_slip(path: str, routes: Iterable[str]) -> str | None:
    """The route among ``routes`` (paths without parameters) that ``path`` names but for its
    slashes (one doubled, ``//v1/completions``: a base URL ending in ``/`` joined to a path
    starting with one; one trailing, ``/v1/completions/``, which no longer redirects), else
    None."""
    if "//" not in path and not (path.endswith("/") and len(path) > 1):
        return None
    tidy = "/" + "/".join(part for part in path.split("/") if part)
    return tidy if tidy != path and tidy in set(routes) else None


def route_error(method: str, path: str, http_status: int,
                headers: dict[str, str] | None = None,
                meant: tuple[str, bool] | None = None,
                routes: Iterable[str] = (), websocket: bool = False) -> JSONResponse:
    """The OpenAI-shaped answer to a request no route takes: 404 (no such path) or 405 (the
    path, not this method; ``headers`` carry ``Allow``), never the framework's ``{"detail"}``.
    ``meant``: (the route the path reaches with ``/v1`` once, :func:`under_v1`; whether it
    takes ``method``), which the 404 names (a client's base URL without ``/v1`` was told only
    "no such route"). Otherwise a 404 whose path is one of ``routes`` but for a doubled or
    trailing slash says which (:func:`slash_slip`): until stop 71 ``POST //v1/completions:
    no such route`` alone. A 405 of an OpenAI endpoint not served here (the path served for
    other methods) says why (:func:`not_allowed_why`; ``websocket``: the request asked to
    upgrade to one); a 405 whose path is an endpoint not served (:func:`not_served`: a path a
    parameter route takes for other methods, ``POST /v1/responses/compact``) is that
    endpoint's 404, without the parameter route's ``Allow``."""
    if http_status == 405 and not_served(path) is not None:
        http_status = 404
        headers = {k: v for k, v in (headers or {}).items() if k.lower() != "allow"}
    near = slash_slip(path, routes) if http_status == 404 and meant is None else None
    why_not = not_allowed_why(method, path, websocket) if http_status == 405 else None
    path = path[:200]
    if http_status == 405:
        allowed = (headers or {}).get("allow") or (headers or {}).get("Allow") or "?"
        status = Status.failure("request.method_not_allowed", Category.INVALID_REQUEST,
                                Phase.VALIDATE, f"{method} {path}: method not allowed "
                                f"(allowed: {allowed})" + (f": {why_not}" if why_not else ""))
    elif meant is not None:
        status = Status.failure("request.not_found", Category.INVALID_REQUEST, Phase.VALIDATE,
                                f"{method} {path}: no such route: "
                                + (f"{method} {meant[0][:200]} is one" if meant[1] else
                                   f"{meant[0][:200]} is one, for another method than {method}")
                                + " (the OpenAI routes are under /v1: a client's base URL ends "
                                "with /v1 once, http://HOST:PORT/v1)")
    else:
        why = not_served(path) or encoded_separator(path) or (
            None if near is None else f"did you mean {near[:200]}? (the path differs from it by a "
            "slash: a base URL ending in / joined to a path starting with /, or a trailing /)")
        status = Status.failure("request.not_found", Category.INVALID_REQUEST, Phase.VALIDATE,
                                f"{method} {path}: no such route"
                                + (f": {why}" if why else "") + " (docs/server.md lists them)")
    return error_response(status, None, http_status=http_status, headers=headers)


#: what a refusal of a body nested past the parser's depth says the server did and what to do
TOO_DEEP_ADVICE = ("the server reads no deeper and checked nothing past that point; send "
                   "the body less deeply nested")


def invalid(message: str) -> Status:
    """A 400 INVALID_REQUEST failure naming what was wrong."""
    return Status.failure("request.invalid", Category.INVALID_REQUEST, Phase.VALIDATE, message)


def transfer_coding_refused(coding: str) -> Status:
    """The failure of a request whose body comes in a transfer coding other than chunked
    (``wire.unsupported_transfer_coding``; answered 501). ``identity`` is named as what it
    is: no transfer coding since RFC 7230 (the registry keeps the name reserved)."""
    if coding == "identity":
        return invalid("transfer-encoding \"identity\": no transfer coding (RFC 9112 section "
                       "6.1 has none of that name since RFC 7230): send the body with chunked "
                       "alone or a Content-Length")
    return invalid(f"transfer-encoding {shown(coding)}: not supported (RFC 9112 section 6.1): "
                   f"send the body with chunked alone or a Content-Length, uncompressed")


def framing_refused(parser_error: str, transfer_encodings: list[str]) -> str | None:
    """The message of the 400 refusing a request whose body the HTTP parser cannot frame
    for its ``Transfer-Encoding`` (RFC 9112 section 6.3), from the parser's own words
    (``parser_error``, kept in parentheses) and the field's values it read
    (``transfer_encodings``); None when the parser's error is about something else. The
    connection answered every one "Invalid HTTP request received.", naming neither the
    field nor the rule."""
    said = parser_error.strip() or "refused"
    if "transfer-encoding" not in said.lower():
        return None
    given = ", ".join(shown(v, 60) for v in transfer_encodings[:4])
    field = f"Transfer-Encoding {given}" if given else "Transfer-Encoding"
    empty = next((v for v in transfer_encodings if _empty_element_after_chunked(v)), None)
    if "content-length" not in said.lower() and empty is not None:
        why = (f"Transfer-Encoding {shown(empty, 60)}: an empty list element after chunked, "
               "which RFC 9110 section 5.6.1 says a recipient ignores, but this server's "
               "HTTP parser (llhttp) refuses in a request: send chunked alone")
    elif "content-length" in said.lower():
        why = (f"{field} with a Content-Length: the body's length cannot be told (RFC 9112 "
               "section 6.3): send one of them")
    elif said.lower().startswith("empty"):
        why = f"{field} is empty: a request body's transfer codings must end with chunked"
    else:
        why = (f"{field}: a request body's transfer codings must end with chunked, given once "
               "(RFC 9112 sections 6.1 and 6.3): send the body with chunked alone or a "
               "Content-Length")
    return f"{why} (the HTTP parser: {said[:120]})"


#: the parser's reasons (llhttp's) that are about a header field line: the refusal names the
#: line (``field_line_refused``)
_FIELD_REASONS = ("header", "content-length")
#: how many characters of a refused field line's name are shown (never its value)
FIELD_SHOWN_CHARS = 40


#: a field line as RFC 9110 section 5 writes it: a token, a colon, a value of visible
#: characters, spaces and tabs (obs-text allowed), no leading whitespace (an obs-fold)
_FIELD_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*\Z")


def field_line_refused(parser_error: str, data: bytes, url: bytes, fields: int) -> str | None:
    """Where in a request head the field line the HTTP parser refused (``parser_error``:
    "Invalid header token", "Invalid header value char", "Duplicate Content-Length", ...)
    is: `` at header field line N ("name: ...")``, N counted from the line after the request
    line; None when the error is about something else, the head is not in ``data`` (it
    came in several reads) or the target's request line is there twice (pipelined requests:
    which one the parser stopped in is not known). ``data`` holds what the connection
    received; ``url`` the target of the request being parsed; ``fields`` the field lines the
    parser delivered before it stopped (the line after them, when no line is malformed by
    itself). The line is the
    first that is no ``name: value`` line, else (a Content-Length refused) the last
    Content-Length line. Shown: its name up to the colon, or, a line without one, up to its
    first space (at most :data:`FIELD_SHOWN_CHARS` characters, escaped as JSON writes them);
    never a value, which may be a credential: a line of one word and no colon is not shown
    (a value broken onto a line of its own by a CR LF inside it, ``sk-live-...``, was shown
    whole, in the 400 and the server's WARNING line). Until stop 68 the 400 said only the
    parser's reason, so a client sending many fields could not tell which line was wrong."""
    said = parser_error.lower()
    if not url or not any(reason in said for reason in _FIELD_REASONS):
        return None
    marker = b" " + url + b" HTTP/"
    at = data.find(marker)
    if at < 0 or data.find(marker, at + 1) >= 0:
        # (twice: pipelined requests to one target, and which one the parser stopped in is
        # not known here: the second's lines were named for the first's error)
        return None
    lines = []
    for line in data[data.rfind(b"\n", 0, at) + 1:].split(b"\n")[1:]:
        line = line.removesuffix(b"\r")
        if not line:
            break
        lines.append(line)
    bad = next((i for i, line in enumerate(lines) if not _FIELD_LINE.match(line)), None)
    if bad is None and "content-length" in said:
        bad = next((i for i in reversed(range(len(lines)))
                    if lines[i].lower().startswith(b"content-length:")), None)
    if bad is None and fields < len(lines):
        bad = fields
    if bad is None:
        return None
    if lines[bad][:1] in (b" ", b"\t"):
        return (f" at header field line {bad + 1} (it begins with a space or tab: an obs-fold "
                "continuation of the line before, which RFC 9112 section 5.2 lets a server "
                "refuse: write the value on one line)")
    name, colon, _ = lines[bad].partition(b":")
    if not colon:
        words = lines[bad].split(None, 1)
        if len(words) < 2:  # no name before a value: the line may be all value
            return (f" at header field line {bad + 1} (no colon: a field line is name: value; "
                    "a line of one word is not shown: it may be a value broken onto a line of "
                    "its own)")
        name = words[0]
    text = name.decode("latin-1")
    cut = text[:FIELD_SHOWN_CHARS] + ("..." if len(text) > FIELD_SHOWN_CHARS else "")
    what = (json.dumps(cut + ": ...") if colon
            else f"{json.dumps(cut)}, no colon: a field line is name: value")
    return f" at header field line {bad + 1} ({what})"


#: a Transfer-Encoding field line in a request's bytes (its value, up to the line's end)
_TE_LINE = re.compile(rb"(?:^|\n)transfer-encoding:([^\r\n]*)", re.IGNORECASE)


def _items(value: str) -> list[str]:
    return [item.strip(" \t").lower() for item in value.split(",")]


def _empty_element_after_chunked(value: str) -> bool:
    """``value`` (a Transfer-Encoding field value) ends with chunked, given once, followed
    by an empty list element (``chunked ,``): what llhttp refuses in a request though RFC
    9110 section 5.6.1 says to ignore empty elements."""
    items = _items(value)
    named = [item for item in items if item]
    return (bool(named) and named[-1] == "chunked" and named.count("chunked") == 1
            and items[-1] == "")


def refused_transfer_encoding(data: bytes, read: list[str]) -> str | None:
    """The value of the Transfer-Encoding field the HTTP parser refused while it read
    ``data`` (the bytes it was fed), when the field is in ``data`` and not among the values
    it delivered already (``read``): llhttp stops inside the field's value and never
    delivers it, so the 400 could not name it. The first such value a request body cannot
    be framed by (RFC 9112 section 6.3: not ending with chunked, chunked twice, an empty
    element after it)."""
    for match in _TE_LINE.finditer(data):
        value = match.group(1).decode("latin-1").strip(" \t")
        if not value or value in read:  # empty: the parser's "Empty" refusal says it
            continue
        named = [item for item in _items(value) if item]
        if (not named or named[-1] != "chunked" or named.count("chunked") > 1
                or _empty_element_after_chunked(value)):
            return value
    return None


def body_timeout(came: str, timeout_s: float) -> Status:
    """The failure of a request whose body did not arrive whole within ``timeout_s``
    (``ServerConfig.body_timeout_s``; answered 408, the connection closed); ``came``: how
    much of it did (``wire.BodyTimeout``)."""
    return Status.failure("request.body_timeout", Category.DEADLINE, Phase.VALIDATE,
                          f"the request body did not arrive whole within body_timeout_s="
                          f"{timeout_s:g} s: {came}")


def body_too_large(limit: int, takes: str | None = None) -> Status:
    """The failure of a request whose body is over ``limit`` bytes
    (``ServerConfig.max_body_bytes``; answered 413, the connection closed), saying what to do:
    the limit is the server's setting, which a client (lm-eval's batches of long windows) could
    not tell from the name alone. ``takes``: what a route whose body is small by its nature
    takes instead (an admin route: a larger limit would not help it, nor fewer prompts)."""
    if takes is not None:
        return invalid(f"request body exceeds max_body_bytes={limit}: {takes}")
    return invalid(f"request body exceeds max_body_bytes={limit}: send a smaller body (fewer "
                   "or shorter prompts), or start the server with a larger --max-body-bytes")


def malformed_http(message: str, request_id: str) -> bytes:
    """The whole HTTP/1.1 response to bytes that are not an HTTP request (the HTTP parser's
    ``message``, e.g. "Invalid HTTP request received."): a 400 with the OpenAI-shaped JSON
    body every other error has (code ``request.malformed_http``), ``connection: close``,
    written by the connection itself before any ASGI app is called."""
    return raw_refusal(400, "Bad Request", "request.malformed_http",
                       message or "malformed HTTP request", request_id)


def head_too_large(limit: int, request_id: str) -> bytes:
    """The whole HTTP/1.1 response to a request head (request line and header fields) over
    ``limit`` bytes: 431 (RFC 6585), code ``request.head_too_large``, ``connection: close``,
    written by the connection itself (the head is never read whole)."""
    return raw_refusal(431, "Request Header Fields Too Large", "request.head_too_large",
                       f"the request head (request line and header fields) exceeds "
                       f"{limit} bytes", request_id)


def trailers_too_large(limit: int, request_id: str) -> bytes:
    """The whole HTTP/1.1 response to a chunked request body whose trailer section (the
    fields after its last chunk) is over ``limit`` bytes: 431 (RFC 6585: trailer fields are
    fields too), code ``request.head_too_large``, ``connection: close``, written by the
    connection itself (the section is never read whole)."""
    return raw_refusal(431, "Request Header Fields Too Large", "request.head_too_large",
                       f"the request's trailer section (the fields after the last chunk of "
                       f"its chunked body) exceeds {limit} bytes: send no trailer fields "
                       f"(they are discarded)", request_id)


def target_too_long(length: int, limit: int, request_id: str,
                    at_least: bool = False) -> bytes:
    """The whole HTTP/1.1 response to a request line whose target (path and query) is
    ``length`` bytes (``at_least``: ``length`` arrived, the rest was never read), over the
    ``limit`` the server parses: 414 (RFC 9112 section 3), code ``request.uri_too_long``,
    ``connection: close``, written by the connection itself."""
    size = f"at least {length}" if at_least else f"{length}"
    return raw_refusal(414, "URI Too Long", "request.uri_too_long",
                       f"the request target (path and query) is {size} bytes, longer than "
                       f"the {limit} the server parses: send the data in a JSON body",
                       request_id)


def version_not_supported(version: str, request_id: str) -> bytes:
    """The whole HTTP/1.1 response to a request line whose HTTP version has a major version
    other than 1 (``HTTP/2.0``, ``HTTP/3.0``, ``HTTP/0.9``; ``version`` as "M.m", or
    "2.0 preface" for HTTP/2's connection preface, ``PRI * HTTP/2.0``): 505 (RFC 9110
    section 15.6.6; RFC 9112 section 2.3), code ``request.http_version_not_supported``,
    ``x-should-retry: false``, ``connection: close``, written by the connection itself."""
    if version.endswith("preface"):
        said = ("the HTTP/2 connection preface (PRI * HTTP/2.0, HTTP/2 with prior knowledge): "
                "HTTP/2 is not supported")
    else:
        said = f"HTTP/{version} is not supported"
    return raw_refusal(505, "HTTP Version Not Supported", "request.http_version_not_supported",
                       f"{said}: this server speaks HTTP/1.1 and HTTP/1.0 (RFC 9110 section "
                       f"15.6.6): send the request as HTTP/1.1", request_id,
                       {"x-should-retry": "false"})


def raw_refusal(http_status: int, reason: str, code: str, message: str,
                request_id: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response refusing what the connection received before any ASGI app
    was called: the OpenAI-shaped JSON body of an invalid request with ``code`` and
    ``message``, the ``x-request-id`` every response carries (``request_id``, ASCII),
    ``headers`` (ASCII), ``connection: close``."""
    status = Status.failure(code, Category.INVALID_REQUEST, Phase.VALIDATE, message)
    described = status.to_dict()
    described["http_status"] = http_status
    described["grpc_code"] = GRPC_OF_HTTP.get(http_status, described["grpc_code"])
    body = json.dumps({"error": error_body(status, None, http_status), "status": described},
                      separators=(",", ":")).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    return (f"HTTP/1.1 {http_status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-request-id: {request_id}\r\n{extra}"
            f"connection: close\r\n\r\n").encode("ascii") + body
