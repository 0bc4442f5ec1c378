"""HTTP plumbing of the reference server: bounded request bodies, cancelling work when the
client disconnects, SSE framing, and streamed responses whose every send is bounded (a client
that stops reading cannot hold what its request holds)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import jiter
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from calexec.contracts.fields import shown
from calexec.contracts.status import Phase, Status
from calexec.drivers.serving.error_bodies import body_timeout, body_too_large

#: ASGI scope extension: a callable that aborts the request's connection at once (set by the
#: HTTP protocol ``server.uvicorn_config`` runs; a response cut by its bound calls it, so the
#: connection ends without waiting for a client that reads nothing)
ABORT_EXTENSION = "calexec.abort"


#: headers of an answer given before the request's body was read whole (408, 413): the
#: connection closes after it, so the rest of the body is not awaited at the client's pace
#: (uvicorn would otherwise read it as the same request's, for as long as it trickles in)
CLOSE = {"Connection": "close"}


#: the response header naming the request (as vLLM's ``--enable-request-id-headers`` and
#: OpenAI's API send it; the ``openai`` SDK reads it into its errors' ``request_id``)
REQUEST_ID_HEADER = "x-request-id"
#: a client's ``X-Request-Id`` is sent back when it is 1 to this many printable ASCII
#: characters (a space inside allowed); any other value is ignored, never cut
MAX_REQUEST_ID_CHARS = 128
SANE_REQUEST_ID = re.compile(rb"[\x20-\x7e]{1,%d}" % MAX_REQUEST_ID_CHARS)
#: ASGI scope key: the request's :class:`RequestId` (set by :class:`RequestIds`)
REQUEST_ID = "calexec.request_id"
#: how many ``x-request-id`` s a line cutting requests names (a drain's grace over, a forced
#: exit, the fleet ingress's drain); the rest are counted ("and M more")
CUT_IDS_LOGGED = 8


def cut_ids(ids: list[str], limit: int = CUT_IDS_LOGGED) -> str:
    """``" (x-request-id: a, b and 3 more)"``: the end of a log line that cuts requests, the
    first ``limit`` distinct ``ids`` (in their order) named and the rest counted; ``""`` for
    none. An operator without ``--dump-dir`` matches a client's report to the cut by it; the
    single server's drain and the fleet ingress's say it alike."""
    distinct = list(dict.fromkeys(ids))
    if not distinct:
        return ""
    more = len(distinct) - limit
    named = ", ".join(distinct[:limit])
    return f" (x-request-id: {named}{f' and {more} more' if more > 0 else ''})"


class RequestId:
    """The id of one request: the client's sane ``X-Request-Id``, else the server's own (a
    route names it, :func:`name_request`: the response body's ``id``), else one made when
    the answer starts (a request no route named: 404, 405, ``/health``)."""

    __slots__ = ("client", "server")

    def __init__(self, client: str | None) -> None:
        self.client = client
        self.server: str | None = None

    def value(self) -> str:
        if self.client is not None:
            return self.client
        if self.server is None:
            self.server = uuid4_hex()
        return self.server


def uuid4_hex() -> str:
    """``uuid.uuid4().hex``: 16 bytes of ``os.urandom`` with the version (4) and the variant
    (RFC 4122) bits set, in 32 lowercase hex digits, written out: ``uuid.UUID``'s
    constructor checks and converts in Python (about 8 calls and 15 us of the event loop a
    response id; issue 28, stop 74). ``tests/test_perf_probe74.py`` holds it to
    ``uuid.uuid4().hex`` for the same random bytes."""
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40
    raw[8] = raw[8] & 0x3F | 0x80
    return raw.hex()


def client_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The client's ``X-Request-Id`` when it sent exactly one and it is sane
    (:data:`SANE_REQUEST_ID`), else None (the server's id is sent)."""
    given = [value for name, value in headers if name.lower() == b"x-request-id"]
    if len(given) != 1 or SANE_REQUEST_ID.fullmatch(given[0]) is None:
        return None
    return given[0].decode("ascii")


def name_request(scope: Scope, server_id: str) -> None:
    """Record ``server_id`` (a response body's ``id``) as the request's id, sent in
    ``x-request-id`` unless the client gave its own (a scope :class:`RequestIds` did not
    see, e.g. a test's bare app: nothing to do)."""
    ids = scope.get(REQUEST_ID)
    if isinstance(ids, RequestId):
        ids.server = server_id


def request_id(scope: Scope) -> str:
    """The id the response to ``scope``'s request carries (made now if none was)."""
    ids = scope.get(REQUEST_ID)
    if not isinstance(ids, RequestId):
        ids = scope[REQUEST_ID] = RequestId(client_request_id(scope.get("headers", [])))
    return ids.value()


class RequestIds:
    """ASGI middleware: every HTTP response carries ``x-request-id`` (:class:`RequestId`:
    the client's sane ``X-Request-Id``, else the id a route named, else a new one). Always
    on, where vLLM gates its own behind ``--enable-request-id-headers`` for its cost: here a
    scan of the request's headers, a uuid and one call more per send (docs/server.md
    "Request ids" has the measure); a client cannot know a flag it would need."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ids = scope[REQUEST_ID] = RequestId(client_request_id(scope["headers"]))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", ids.value().encode("ascii")))
                message = {**message, "headers": headers}
            await send(message)
        await self.app(scope, receive, send_with_id)


#: the raw path's prefixes (``scope["raw_path"]``) under which an encoded slash (``%2F``) and
#: an encoded dot segment belong to the path parameter that takes them: a model id
#: (``/v1/models/{model_id:path}``: ``Qwen%2FQwen3-8B``, as vLLM and HF name models) and the
#: id an operator cancels (``/admin/cancel/{id:path}``: an ``X-Request-Id`` is any printable
#: ASCII, ``job/42`` escaped as a path segment is ``job%2F42``; until stop 75 it was looked
#: for as ``job%2F42``, never found, and the request ran on)
SLASH_PARAMETERS = ("/v1/models/", "/admin/cancel/")
_ESCAPES = re.compile(r"(?:%[0-9A-Fa-f]{2})+")


def _escaped(written: str) -> Iterator[tuple[str | None, str]]:
    """The characters a run of percent-escapes (``written``: ``%e2%82%ac%ff``) holds as UTF-8,
    each with the escapes that wrote it; None for a byte no UTF-8 character holds."""
    decoded = bytes.fromhex(written.replace("%", "")).decode("utf-8", "surrogateescape")
    at = 0  # the index of the next escape in ``written``, 3 characters each
    for char in decoded:
        stray = "\udc80" <= char <= "\udcff"  # (surrogateescape's mark of such a byte)
        size = 1 if stray else len(char.encode("utf-8"))
        yield None if stray else char, written[at:at + 3 * size]
        at += 3 * size


def _escapes_decoded(text: str) -> str:
    """``text`` with its percent-escapes decoded as UTF-8, but a byte no UTF-8 character
    holds kept as the client wrote it (``%ff``, its case too): uvicorn's ``unquote`` made
    each such byte U+FFFD, so a message naming the path showed ``"\ufffd"``, never sent."""
    return _ESCAPES.sub(lambda match: "".join(
        escapes if char is None else char for char, escapes in _escaped(match.group(0))),
        text)


def readable_query(query: bytes) -> bytes | None:
    """``query`` (``scope["query_string"]``) with the escape of each byte no UTF-8 character
    holds escaped once more (``%ff`` is ``%25ff``), so the query's parser reads the escape as
    the client wrote it where Starlette's read U+FFFD (``?grace=%ff`` was refused
    ``grace="\ufffd"``); None when no escape is such a byte."""
    try:
        text = query.decode("ascii")
    except UnicodeDecodeError:
        return None
    if "%" not in text:
        return None
    readable = _ESCAPES.sub(lambda match: "".join(
        escapes if char is not None else "%25" + escapes[1:]
        for char, escapes in _escaped(match.group(0))), text)
    return None if readable == text else readable.encode("ascii")


def routed_path(raw_path: bytes) -> str | None:
    """The path the server routes a request of ``raw_path`` on, where it differs from the one
    the HTTP server decoded (``scope["path"]``), else None. Outside a path parameter that
    takes one (:data:`SLASH_PARAMETERS`), a path segment whose escapes decode to a slash or a
    dot segment (``/admin%2Freload``, ``/v1%2Fmodels``, ``%2e%2e``) is kept as the client
    sent it: uvicorn decoded ``%2F`` into a separator, so ``/admin%2Freload`` reached
    ``/admin/reload`` past a proxy that filters the raw path (Apache's ``AllowEncodedSlashes
    NoDecode`` keeps it so too); it now routes nowhere (the 404 naming the path as sent).
    A byte no UTF-8 character holds is kept as written (:func:`_escapes_decoded`)."""
    try:
        raw = raw_path.decode("ascii")
    except UnicodeDecodeError:  # (no escapes to decode: uvicorn refuses such a target)
        return None
    if "%" not in raw:
        return None
    given = raw.split("/")
    segments: list[str] = []
    for at, segment in enumerate(given):
        if "/".join(segments) + "/" in SLASH_PARAMETERS:  # (``/v1/model%73/`` too)
            segments.append(_escapes_decoded("/".join(given[at:])))
            break
        decoded = _escapes_decoded(segment)
        separates = "/" in decoded or (decoded in (".", "..") and decoded != segment)
        segments.append(segment if separates else decoded)
    routed = "/".join(segments)
    return None if routed == urllib.parse.unquote(raw) else routed


class ClientGone(Exception):
    """The client disconnected before its request body arrived whole."""


class BodyTimeout(Exception):
    """The request body did not arrive whole within its time bound (a slowloris client)."""


class BodyCut(Exception):
    """A drain cut the request body's read (:meth:`BodyReads.cut`) before it arrived whole."""


def sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def non_json_media(request: Request) -> str | None:
    """The media type of a body that is declared and not JSON (a JSON route answers it 415),
    else None: ``application/json`` in any case and with parameters (``; charset=utf-8``), an
    ``application/...+json`` type (RFC 6839 section 3.1: the ``+json`` suffix is JSON's
    syntax; FastAPI, and so vLLM's server, reads such a body as JSON), or no content type at
    all (raw clients and relays that send none; the body is read as JSON). Every
    ``Content-Type`` field is judged: a JSON one, then ``text/plain``, was read as JSON (the
    first field alone was looked at)."""
    return _non_json_media(request.headers.getlist("content-type"))


def _non_json_media(values: list[str]) -> str | None:
    """:func:`non_json_media` of the ``Content-Type`` fields' ``values``."""
    for value in values or [""]:
        media = value.split(";", 1)[0].strip().lower()
        if not (media in ("", "application/json") or _JSON_SUFFIXED.fullmatch(media)):
            return media[:80]
    return None


#: an ``application`` media type with the ``+json`` structured syntax suffix (RFC 6839)
_JSON_SUFFIXED = re.compile(r"application/[!#$%&'*.^_`|~0-9a-z-]+\+json")


def expects_continue(request: Request) -> bool:
    """The request waits for ``100 Continue`` before sending its body (``Expect:
    100-continue``, HTTP/1.1: a 1.0 request's expectation is ignored, RFC 9110 section
    10.1.1); uvicorn sends the 100 when the route first reads the body."""
    return (request.scope.get("http_version") == "1.1"
            and request.headers.get("expect", "").strip().lower() == "100-continue")


#: the answer's headers to a body in a content coding this server does not decode (RFC 9110
#: section 15.5.16: a 415 whose Accept-Encoding says which codings would be accepted)
IDENTITY_ONLY = {"Accept-Encoding": "identity"}


def unsupported_coding(request: Request) -> str | None:
    """The content coding of a body this server cannot read (any but ``identity``: it
    decompresses nothing), else None; a route answers it 415 with :data:`IDENTITY_ONLY`. The
    codings of every ``Content-Encoding`` field (a list: two fields are one list, RFC 9110
    section 5.3): ``identity`` then ``gzip`` in two fields was read as if uncompressed."""
    return _unsupported_coding(request.headers.getlist("content-encoding"))


def _unsupported_coding(values: list[str]) -> str | None:
    """:func:`unsupported_coding` of the ``Content-Encoding`` fields' ``values``."""
    codings = [c.strip().lower() for value in values for c in value.split(",")]
    return next((c[:40] for c in reversed(codings) if c and c != "identity"), None)


def no_json_value(raw: bytes, shape: str) -> str | None:
    """The message refusing a JSON body that holds no value, empty or JSON's whitespace alone
    (RFC 8259 section 2; a UTF-8 byte order mark aside), saying so and what it should hold
    (``shape``: ``{"calbin": PATH}``), or None. The parsers' own words, ``Expecting value:
    line 1 column 1 (char 0)`` and ``EOF while parsing a value at line 1 column 0``, read as
    a syntax error in a body the client did not send (a ``curl -X POST`` without ``-d``, a
    client whose serializer wrote nothing)."""
    if raw.removeprefix(b"\xef\xbb\xbf").strip(b" \t\r\n"):
        return None
    if not raw:
        said = "empty"
    elif raw == b"\xef\xbb\xbf":
        said = "no JSON value, a UTF-8 byte order mark alone"
    else:
        said = f"no JSON value, only whitespace ({len(raw)} bytes)"
    return f"body: {said}: send {shape}"


def json_type_name(value: object) -> str:
    """The JSON name of a parsed JSON value's type, as a client wrote it (not Python's): what
    a refusal of a body that is no JSON object says it was (``/admin/reload``'s and the API's
    routes')."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, list):
        return "array"
    return "string" if isinstance(value, str) else "object"


def utf8_json(raw: bytes) -> bytes | str:
    """A request's JSON body as its parser reads it, UTF-8 without a byte order mark, or the
    message refusing it (a ``str``). RFC 8259 section 8.1 lets a parser ignore a UTF-8 BOM, as
    Python's ``json.loads`` does (and vLLM's server), so a body saved by an editor that writes
    one (``curl --data-binary @request.json``) is read; JSON between systems must be UTF-8
    (same section): a UTF-16 or UTF-32 body (a BOM, or NUL bytes around its first characters)
    is refused naming its encoding. The OpenAI routes and ``/admin/reload`` both read bodies
    through this."""
    if raw.startswith(b"\xef\xbb\xbf"):
        return raw[3:]
    # a body opening with "{" and no NUL in its first two bytes has no BOM and is UTF-8 to
    # ``json.detect_encoding`` at every length: it is not asked (5 of the event loop's
    # Python calls a request; issue 28, stop 75)
    head = raw[:2]
    encoding = ("utf-8" if head[:1] == b"{" and b"\x00" not in head
                else json.detect_encoding(raw))
    if encoding != "utf-8":
        return (f"body: JSON must be UTF-8 (RFC 8259 section 8.1); this body is "
                f"{encoding.upper()}: send it encoded as UTF-8")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        # the parser's own words ("invalid unicode code point at line 1 column 16", "EOF
        # while parsing a string") named neither the encoding nor the byte: a Latin-1 or
        # cp1252 body (é as 0xE9) reads as a JSON syntax error
        return (f"body: JSON must be UTF-8 (RFC 8259 section 8.1); byte {err.start} "
                f"(0x{raw[err.start]:02X}) is not UTF-8 (a Latin-1 or Windows-1252 body?): "
                "send it encoded as UTF-8")
    return raw


#: a lone surrogate in a str Python's JSON parser read (``"\\ud800"`` escapes)
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(raw: bytes) -> tuple[str, str | None] | None:
    """The message (and its ``param``: the path, None for the body or a key) refusing a
    UTF-8 JSON body that holds a ``\\ud800``-``\\udfff`` escape of a lone surrogate (no
    Unicode character: RFC 8259 section 8.2), naming where (the path of the first string
    holding one, ``messages.0.content``; a key's object and the key) and the escape; None
    when the body is no JSON Python's parser reads or holds none. The API's parser refuses
    such a body in its own words ("unexpected end of hex escape", "lone leading surrogate"
    for a trailing one), which say neither where nor what is wrong."""
    try:
        value = json.loads(raw)  # (Python's parser takes lone surrogates)
    except (ValueError, RecursionError):
        return None
    # (path, a value, or the key of an object at path): depth first, in document order,
    # no recursion (the body may be as deep as the parser took)
    todo: list[tuple[list[str], Any, str | None]] = [([], value, None)]
    while todo:
        path, item, key = todo.pop()
        if key is not None:
            hit = _SURROGATE.search(key)
            if hit is not None:
                return _surrogate_message(f"a key of {'.'.join(path) or 'the body'}",
                                          hit.group(), key), None
            continue
        if isinstance(item, str):
            hit = _SURROGATE.search(item)
            if hit is not None:
                where = ".".join(path)[:80]
                return _surrogate_message(where or "body", hit.group(), None), where or None
        elif isinstance(item, dict):
            for name, child in reversed(list(item.items())):
                todo.append(([*path, name], child, None))
                todo.append((path, None, name))
        elif isinstance(item, list):
            todo.extend(([*path, str(i)], child, None) for i, child in reversed(list(
                enumerate(item))))
    return None


#: the most digits before its decimal point a JSON number may have for the servers' parsers:
#: pydantic's (the API's bodies: "number out of range") and Python's ``json`` (``/admin/reload``:
#: "Exceeds the limit (4300 digits) for integer string conversion") both stop at 4300
MAX_NUMBER_DIGITS = 4300


class _Number(str):
    """A JSON number as the body wrote it (``json.loads``' ``parse_int``/``parse_float``:
    no conversion, so no digit limit)."""


def overlong_number(raw: bytes) -> tuple[str, str | None] | None:
    """The message (and its ``param``: the path of the field, None for the body itself)
    refusing a UTF-8 JSON body holding a number with more than :data:`MAX_NUMBER_DIGITS`
    digits before its decimal point, naming where it is and how long it is; None when it
    holds none (or is no JSON Python's parser reads). JSON sets no bound on a number (RFC
    8259 section 6 lets an implementation set one); the parsers refused such a body in their
    own words, ``body: Invalid JSON: number out of range at line 1 column 4330``, a syntax
    error the client did not make, or (``/admin/reload``) Python's, cut short, advising
    ``sys.set_int_max_str_digits()``; no field named."""
    try:
        value = json.loads(raw, parse_int=_Number, parse_float=_Number)
    except (ValueError, RecursionError):
        return None
    todo: list[tuple[list[str], Any]] = [([], value)]  # depth first, in document order
    while todo:
        path, item = todo.pop()
        if isinstance(item, _Number):
            digits = len(re.split(r"[.eE]", item.lstrip("-"), maxsplit=1)[0])
            if digits > MAX_NUMBER_DIGITS:
                where = ".".join(path)[:80]
                return (f"{where or 'body'}={item[:40]}...: a number of {digits} digits "
                        f"before its decimal point, more than the server's JSON parser reads "
                        f"({MAX_NUMBER_DIGITS}; RFC 8259 section 6 lets a parser bound "
                        "numbers): no field takes a value this large, send one in the "
                        "field's range"), where or None
        elif isinstance(item, dict):
            todo.extend(([*path, str(name)], child)
                        for name, child in reversed(list(item.items())))
        elif isinstance(item, list):
            todo.extend(([*path, str(i)], child) for i, child in reversed(list(
                enumerate(item))))
    return None


class _Pairs(dict[str, Any]):
    """A JSON object as :func:`repeated_key` reads it: ``twice`` is its first key given
    more than once (None: each once)."""

    twice: str | None = None


def _pairs(pairs: list[tuple[str, Any]]) -> _Pairs:
    obj = _Pairs()
    for key, value in pairs:
        if key in obj and obj.twice is None:
            obj.twice = key
        obj[key] = value
    return obj


#: what follows an object key's closing quote: JSON whitespace, then the colon
_KEY_COLON = re.compile(rb"[ \t\r\n]*:")
#: a body whose strings hold more than this many strings and escapes is parsed at once (the
#: scan's work is one step for each)
SCAN_MAX_STEPS = 4096
#: a body shorter than this is parsed at once (jiter takes a few us for it: less than the scan)
SCAN_MIN_BYTES = 16 << 10


def repeated_key(raw: bytes, scan_from: int = SCAN_MIN_BYTES) -> tuple[str, str] | None:
    """The message (and its ``param``: the key's path, ``messages.0.role``) refusing a UTF-8
    JSON body the API's parser read that gives a key twice in one object, else None. The
    parser keeps the last of them silently (RFC 8259 section 4: names SHOULD be unique; what
    a receiver does with a repeated one is not said), so ``{"max_tokens": 16, ...,
    "max_tokens": 4096}`` was served the second while a proxy or log that reads the first saw
    the other, and the client heard nothing; ``/admin/reload`` refuses a repeated key as this
    does.

    A body none of whose keys is written twice anywhere in it, none with an escape, repeats
    none, and a scan of its strings (``bytes.find``, one step per string and per escape)
    says so without parsing it again: until stop 67 every body was parsed a second time by
    jiter, whose Python values cost the event loop about 15 ms for a 1 MiB list of token
    ids (a string costs it little). Any other body (a key written twice, in two objects or
    one; an escape in a key; more than :data:`SCAN_MAX_STEPS` strings and escapes; one
    shorter than ``scan_from``, :data:`SCAN_MIN_BYTES`) is read as
    :func:`repeated_key_parsed` reads it, and this answers as it does for every body
    (``tests/test_wire_repeated_key.py``, a differential test). The scan splits strings
    exactly: outside a string a quote opens one, inside it a backslash escapes the character
    after it, and a key is a string followed by JSON whitespace and a colon; a body invalid
    past some point was read up to it by jiter too."""
    if len(raw) < scan_from:
        return repeated_key_parsed(raw)
    keys: set[bytes] = set()
    steps = 0
    opened = raw.find(b'"')
    while opened != -1:  # a string's opening quote (outside strings every quote opens one)
        after = opened + 1
        while True:  # to the string's closing quote, past each escape
            closed = raw.find(b'"', after)
            if closed == -1:
                return None  # (a string never closed: invalid, which the parse answers None)
            escape = raw.find(b"\\", after, closed)
            steps += 1
            if steps > SCAN_MAX_STEPS:
                return repeated_key_parsed(raw)
            if escape == -1:
                break
            after = escape + 2  # (the escaped character, a quote or a backslash, skipped)
        if _KEY_COLON.match(raw, closed + 1):
            key = raw[opened + 1:closed]
            if after != opened + 1 or key in keys:  # (an escape may spell another's key)
                return repeated_key_parsed(raw)
            keys.add(key)
        opened = raw.find(b'"', closed + 1)
    return None


def repeated_key_parsed(raw: bytes) -> tuple[str, str] | None:
    """:func:`repeated_key` by parsing the body: jiter (the parser of pydantic's, as a
    package) checks the keys as it reads, about 5 us for a chat body of 500 bytes; only a
    body with a repeated key is read again, to name where it is."""
    try:
        jiter.from_json(raw, catch_duplicate_keys=True)
        return None
    except ValueError as err:  # (the API's parser read it: only a repeated key is ours)
        if not str(err).startswith("Detected duplicate key"):
            return None
    try:
        value = json.loads(raw, object_pairs_hook=_pairs)
    except (ValueError, RecursionError):
        return None
    todo: list[tuple[list[str], Any]] = [([], value)]  # depth first, in document order
    while todo:
        path, item = todo.pop()
        if isinstance(item, _Pairs):
            if item.twice is not None:
                where = ".".join([*path, item.twice])[:80]
                return (f"{where}: given more than once in its object (the last one would "
                        "silently win), give it once"), where
            todo.extend(([*path, name], child) for name, child in reversed(list(
                item.items())))
        elif isinstance(item, list):
            todo.extend(([*path, str(i)], child) for i, child in reversed(list(
                enumerate(item))))
    return None


def _surrogate_message(where: str, char: str, key: str | None) -> str:
    escape = f"\\u{ord(char):04x}"
    said = "" if key is None else f" ({shown(key, 60)})"
    return (f"{where[:120]}{said}: the escape {escape} is a lone surrogate, no Unicode "
            "character (RFC 8259 section 8.2): a character past U+FFFF is escaped as a "
            "surrogate pair (\\ud83d\\ude00), or sent as UTF-8")


def unsupported_transfer_coding(request: Request) -> str | None:
    """A transfer coding of the request's body other than ``chunked``, else None: the HTTP
    parser frames a ``Transfer-Encoding: gzip, chunked`` body by its final ``chunked`` and
    hands the route the gzip bytes as they came, which it cannot read (it decodes nothing);
    a route answers it 501 (RFC 9112 section 6.1). ``identity`` is one too: no transfer
    coding since RFC 7230 (``identity, chunked``, or two fields, was served until stop 60)."""
    return _unsupported_transfer_coding(request.headers.getlist("transfer-encoding"))


def _unsupported_transfer_coding(values: list[str]) -> str | None:
    """:func:`unsupported_transfer_coding` of the ``Transfer-Encoding`` fields' ``values``."""
    codings = [c.strip().lower() for value in values for c in value.split(",")]
    return next((c[:40] for c in codings if c and c != "chunked"), None)


#: what :func:`body_framing` found, in the order a route answers them: the media type of a
#: body not JSON (415), a content coding not read (415), a transfer coding not read (501)
BODY_FRAMING = ("content-type", "content-encoding", "transfer-encoding")


def body_framing(request: Request) -> tuple[str, str] | None:
    """The first of :func:`non_json_media`, :func:`unsupported_coding` and
    :func:`unsupported_transfer_coding` that refuses the request's body, as (its field, in
    :data:`BODY_FRAMING`, the value that function answers), else None: the three in one
    pass over the request's header fields, where each took a pass and a ``getlist`` of its
    own (31 Python calls a request, 13 now; issue 28, stop 74;
    ``tests/test_perf_probe74.py`` holds it to the three over generated headers)."""
    media: list[str] = []
    codings: list[str] = []
    transfers: list[str] = []
    for key, value in request.headers.raw:
        if key == b"content-type":
            media.append(value.decode("latin-1"))
        elif key == b"content-encoding":
            codings.append(value.decode("latin-1"))
        elif key == b"transfer-encoding":
            transfers.append(value.decode("latin-1"))
    found = _non_json_media(media)
    if found is not None:
        return BODY_FRAMING[0], found
    if codings:
        found = _unsupported_coding(codings)
        if found is not None:
            return BODY_FRAMING[1], found
    if transfers:
        found = _unsupported_transfer_coding(transfers)
        if found is not None:
            return BODY_FRAMING[2], found
    return None


#: how many bytes past ``max_body_bytes`` a refused body is read and dropped before its 413
#: (:func:`read_body`): what a client already sent must be read, or the close that follows
#: the answer resets the connection and the client never sees the 413 (Linux drops what it
#: received when a reset arrives); past this a reset is the cheaper answer (nginx's
#: lingering close has a bound too)
DISCARD_MAX_BYTES = 8 << 20
#: and for at most this long (s; less when ``body_timeout_s`` is): a client that sent its
#: body is read out at once, one trickling it is not waited for (it is answered, then cut)
DISCARD_MAX_S = 2.0


async def read_body(request: Request, limit: int, timeout: float,
                    reads: BodyReads | None = None) -> bytes | None:
    """The body, or None when it exceeds ``limit`` bytes (declared or actual); raises
    :class:`ClientGone` when the client disconnects mid-upload (the route answers it as a
    cancelled request, never with an ASGI traceback), :class:`BodyTimeout` when the whole
    body has not arrived ``timeout`` seconds after this call (a client sending it a byte at a
    time would hold its connection and this task for as long as it keeps sending), and
    :class:`BodyCut` when ``reads`` cut it (a drain; before it began too). A route
    answering None or BodyTimeout closes the connection (:data:`CLOSE`). Before None, the
    rest of the body is read and dropped (:func:`_discard`), so the answer reaches a client
    that sent it all. The time bound and the cut are one ``asyncio.timeout`` (``reads`` holds
    it while the read runs and cuts it by :func:`expire`): a scope of its own per read was
    about 6 us of the event loop's CPU per request (issue 28, stop 65), and anyio's
    ``move_on_after`` 42 Python calls a read where the timeout takes 12 (stop 74; nothing in
    the read is shielded, so anyio's shields lose nothing)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit():
        digits = declared.lstrip("0")  # int() raises past 4300 digits: more than ``limit``'s
        if len(digits) > len(str(limit)) or int(digits or "0") > limit:
            if (len(digits) <= len(str(limit + DISCARD_MAX_BYTES))
                    and int(digits) <= limit + DISCARD_MAX_BYTES):
                await _discard(request, timeout, reads=reads)
            return None
    chunks, size = [], 0
    late = asyncio.timeout(timeout)
    try:
        async with late:
            if reads is not None:
                reads.hold(late)
            try:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        break
                    chunks.append(chunk)
                else:
                    return b"".join(chunks)
            except ClientDisconnect:
                raise ClientGone(f"the client disconnected after {size} bytes of its body"
                                 ) from None
            finally:
                if reads is not None:
                    reads.release(late)
    except TimeoutError:
        if not late.expired():  # (not the bound's: raised by the read itself)
            raise
        # (the cut wins over the time bound when both came, as the cut's outer scope did)
        if reads is not None and reads.cut_done:
            raise BodyCut() from None
        raise BodyTimeout(f"{size} bytes of {(declared or 'an undeclared length')[:20]} came"
                          ) from None
    await _discard(request, timeout, size - limit, reads)
    return None


async def _discard(request: Request, timeout: float, past: int = 0,
                   reads: BodyReads | None = None) -> None:
    """Read and drop what is left of a body refused for its size, at most
    :data:`DISCARD_MAX_BYTES` past the limit (``past``: read past it already) and for at most
    :data:`DISCARD_MAX_S` (or ``timeout``) seconds; not one announced with ``Expect:
    100-continue`` and not read yet (reading it would ask the client for the body it is
    refused). A client gone meanwhile ends it; ``reads`` cutting it raises
    :class:`BodyCut`."""
    if past == 0 and expects_continue(request):
        return
    late = asyncio.timeout(min(timeout, DISCARD_MAX_S))
    try:
        async with late:
            if reads is not None:
                reads.hold(late)
            try:
                async for chunk in request.stream():
                    past += len(chunk)
                    if past > DISCARD_MAX_BYTES:
                        return
            except (ClientDisconnect, RuntimeError):  # (RuntimeError: the stream was consumed)
                return
            finally:
                if reads is not None:
                    reads.release(late)
    except TimeoutError:
        if not late.expired():
            raise
        if reads is not None and reads.cut_done:
            raise BodyCut() from None


@dataclass(frozen=True)
class BodyRefusal:
    """The answer to a body that did not arrive (:func:`body_or_refusal`): its failure, the
    HTTP status and the response's headers (:data:`CLOSE` when the rest is not awaited)."""

    status: Status
    http_status: int
    headers: dict[str, str] | None = None


def expire(bound: asyncio.Timeout) -> None:
    """End the wait ``bound`` (an entered ``asyncio.timeout``) bounds now, as its time had
    come: the task waiting in it is cancelled at the loop's next turn, and leaving the bound
    raises ``TimeoutError`` (what anyio's ``CancelScope.cancel`` did to a ``move_on_after``,
    the scope then swallowing it). One already expired or left is left as it is."""
    if bound.expired() or bound.when() == -math.inf:
        return
    try:
        bound.reschedule(-math.inf)
    except RuntimeError:  # (left already: nothing waits in it)
        pass


class BodyReads:
    """The request bodies being read now (:func:`body_or_refusal`): :meth:`cut` ends every
    one of them, and any read after it at once (a drain that stopped waiting for requests,
    its grace over or none running: a client still sending its body then was cut by
    uvicorn's shutdown, and got its plain-text ``500 Internal Server Error``). Event-loop
    only."""

    def __init__(self) -> None:
        self._bounds: set[asyncio.Timeout] = set()
        self.cut_done = False
        #: why the drain stopped waiting (:meth:`cut`), for the 503 of a body it cut
        self.why = ""

    def cut(self, why: str = "its grace ran out") -> None:
        """End every body read under way now, and every later one at once; ``why`` the drain
        stopped waiting for requests (its grace over, or none left running), as the 503 of
        such a body says it."""
        self.why = why
        self.cut_done = True
        for bound in list(self._bounds):
            expire(bound)

    def hold(self, bound: asyncio.Timeout) -> None:
        """``bound`` (one body's read, :func:`read_body`, entered) is expired by :meth:`cut`,
        at once when it came after it; :meth:`release` it when the read ends."""
        if self.cut_done:
            expire(bound)
        self._bounds.add(bound)

    def release(self, bound: asyncio.Timeout) -> None:
        """The read of ``bound`` ended: a later :meth:`cut` leaves it."""
        self._bounds.discard(bound)


async def body_or_refusal(request: Request, limit: int, timeout: float,
                          reads: BodyReads | None = None,
                          takes: str | None = None) -> bytes | BodyRefusal:
    """:func:`read_body`, its failures mapped to their answer, one mapping for every route
    that reads a body (the API's and the admin's): the client gone mid-upload is a 499
    (a cancelled request, which nobody reads), a body not whole within ``timeout`` a 408
    and one over ``limit`` bytes a 413, both closing the connection; a read ``reads`` cut
    (a drain's grace over) the draining 503, closing it too: "server is draining", as
    admission refuses one whose body was read, for a read that began after the cut (its
    request came after the drain ended: it was told its body had not arrived in the grace,
    or admission's 503, depending on whether its bytes were already in the server's buffer
    when the route asked). ``takes``: the 413's advice of a route whose body is small by its
    nature (``error_bodies.body_too_large``)."""
    after_cut = reads is not None and reads.cut_done
    try:
        raw = await read_body(request, limit, timeout, reads)
    except ClientGone as gone:
        return BodyRefusal(Status.cancelled(Phase.VALIDATE, str(gone)), 499)
    except BodyTimeout as late:
        return BodyRefusal(body_timeout(str(late), timeout), 408, CLOSE)
    except BodyCut:
        return BodyRefusal(Status.unavailable(
            Phase.ADMISSION, "server is draining" if after_cut or reads is None
            else f"server drained: {reads.why} before the request's body arrived whole; "
            "retry"), 503, CLOSE)
    if raw is None:
        return BodyRefusal(body_too_large(limit, takes), 413, CLOSE)
    return raw


async def until_disconnect(request: Request, work: Callable[[], Awaitable[None]]) -> None:
    """Run ``await work()``; cancel it if the client disconnects first.

    A cancel scope around the work and one plain task watching ``receive()``, cancelled when
    the work ends: what a task group of the two did, at a sixth of its cost per request
    (issue 28: about 59 -> 11 us on the 2-core VM; anyio's task group names its task and
    formats the cancelled task's repr). An exception of the watcher reaches the caller, as
    it did through the task group."""
    failure: list[BaseException] = []
    with anyio.CancelScope() as scope:
        async def watch() -> None:
            try:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
            except Exception as exc:  # noqa: BLE001 - re-raised in the caller below
                failure.append(exc)
            scope.cancel()
        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await work()
        finally:
            watcher.cancel()
    if failure:
        raise failure[0]


class SendBounds:
    """The bounds of the sends of the responses it guards (:class:`BoundedStreamingResponse`):
    a send may wait at most until its response's bound; :meth:`cut` lowers every bound, sends
    already waiting included, to a time (a drain's end). Event-loop only."""

    def __init__(self) -> None:
        self._guards: set[SendGuard] = set()
        self.cut_at = math.inf  # time.monotonic(); inf until a drain cuts

    def cut(self, at: float) -> None:
        """From now on no send waits past ``at`` (``time.monotonic()``)."""
        self.cut_at = min(self.cut_at, at)
        for guard in list(self._guards):
            guard.bound(at)

    def guard(self, scope: anyio.CancelScope, until: float) -> SendGuard:
        """The guard of one response's sends (``until``: its bound, ``time.monotonic()``);
        ``scope`` is cancelled when a send is still waiting at the bound. Close it when the
        response ends."""
        guard = SendGuard(self, scope, min(until, self.cut_at))
        self._guards.add(guard)
        return guard

    @property
    def waiting(self) -> int:
        """Responses whose send waits for its client now (a client reading nothing keeps its
        response here until the bound cuts it)."""
        return sum(1 for guard in list(self._guards) if guard.sending)

    def discard(self, guard: SendGuard) -> None:
        """``guard``'s response ended: a cut no longer concerns it."""
        self._guards.discard(guard)


class SendGuard:
    """One response's send bound (:meth:`SendBounds.guard`). A single timer per response, not
    one per send: when it fires while a send waits, the response's scope is cancelled (the
    cancellation lands in that send); a send starting after it may not wait at all."""

    def __init__(self, bounds: SendBounds, scope: anyio.CancelScope, until: float) -> None:
        self._bounds, self._scope = bounds, scope
        self.sending = False  # a send is in progress (the timer cancels only then)
        self.expired = False  # the bound passed
        self._at = math.inf
        self._timer: asyncio.TimerHandle | None = None
        self.bound(until)

    def bound(self, at: float) -> None:
        """Lower the bound to ``at`` (``time.monotonic()``); a later one changes nothing."""
        if self.expired or at >= self._at:
            return
        self._at = at
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + max(0.0, at - time.monotonic()), self._expire)

    def _expire(self) -> None:
        self._timer = None
        self.expired = True
        if self.sending:
            self._scope.cancel()

    async def send(self, send: Send, message: Message) -> None:
        """``await send(message)``; the response's scope is cancelled (and the cancellation
        raised here) when it is still waiting at the bound, or would wait after it."""
        if self.expired:
            with anyio.move_on_after(0) as late:  # completes only if it need not wait
                await send(message)
            if late.cancelled_caught:
                self._scope.cancel()
                await anyio.lowlevel.checkpoint()
            return
        self.sending = True
        try:
            await send(message)
        finally:
            self.sending = False

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._bounds.discard(self)


class SendCut:
    """A handle on one streamed response's sends, held by its requests (``RequestRun.send_cut``)
    so that an operator's cancel (``CompletionService.cancel``) reaches a response blocked in a
    send to a client that stopped reading: :meth:`cut` cuts a send waiting now at once (the
    response's ``on_cut`` gives back what the request holds, the connection is aborted), and
    bounds every later send by ``slack`` seconds from now (a client that reads gets the error
    event; one that does not is cut then). Until stop 74 the cancel reached only the request's
    wait for its next token: a stream blocked in its send held its sequence until its own
    deadline + ``deadline_slack_s``. A response relaying another's body (the Responses API)
    takes the handle of the one it relays. ``streams``: the set it is in while its response's
    sends run (``CompletionService.streams``: a cancel finds a response there once its
    generation ended and its requests are done, stop 75), ``names`` the ids a cancel names it
    by (its response ``id``, its ``x-request-id``). Event-loop only."""

    def __init__(self, streams: set[SendCut] | None = None,
                 names: tuple[str | None, str | None] = (None, None)) -> None:
        self._guard: SendGuard | None = None
        self._slack: float | None = None  # cut asked before the response's sends began
        self._streams = streams
        self.names = names
        #: the response's sends ended (its last went out, or it was cut)
        self.ended = False
        #: what a cancel that found the response after its generation ended cut it with
        #: (``CompletionService.cancel``: the ``request.aborted`` Status): the response sends
        #: that error event instead of its tail
        self.why: Any = None

    @property
    def asked(self) -> bool:
        """A cut was asked (a cancel reached it)."""
        return self._slack is not None

    def attach(self, guard: SendGuard) -> None:
        """(``BoundedStreamingResponse``) The response's sends began under ``guard``."""
        self._guard = guard
        if self._streams is not None and not self.ended:
            self._streams.add(self)
        if self._slack is not None:
            self.cut(self._slack)

    def detach(self) -> None:
        self._guard = None
        self.ended = True
        if self._streams is not None:
            self._streams.discard(self)

    def cut(self, slack: float) -> None:
        """Cut the send waiting now; no later send waits past ``slack`` seconds from now."""
        self._slack = slack if self._slack is None else min(self._slack, slack)
        guard = self._guard
        if guard is not None:
            now = time.monotonic()
            guard.bound(now if guard.sending else now + slack)


class BoundedStreamingResponse(StreamingResponse):
    """A streamed response whose every send must complete by ``until()`` (absolute
    ``time.monotonic()``; a request's deadline + ``deadline_slack_s``) or the ``bounds``' cut.
    A server blocks in a send once a client stops reading and the socket buffers are full;
    past the bound the response is cut instead: ``on_cut()`` runs (it gives back what the
    request holds), the body iterator is closed, and the connection is aborted when the
    server offers it (:data:`ABORT_EXTENSION`; else the server closes it as a response the
    application did not complete)."""

    def __init__(self, content: Any, bounds: SendBounds, until: Callable[[], float],
                 on_cut: Callable[[], Awaitable[None]], sending: SendCut | None = None,
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.bounds, self.until, self.on_cut = bounds, until, on_cut
        #: the handle a cancel cuts its sends by (``SendCut``; a relay passes its source's)
        self.sending = SendCut() if sending is None else sending
        self.abort: Callable[[], None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.abort = (scope.get("extensions") or {}).get(ABORT_EXTENSION)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        with anyio.CancelScope() as stalled:  # cancelled only by the guard, only in a send
            guard = self.bounds.guard(stalled, self.until())
            self.sending.attach(guard)
            try:
                await guard.send(send, {"type": "http.response.start",
                                        "status": self.status_code,
                                        "headers": self.raw_headers})
                async for chunk in self.body_iterator:
                    if not isinstance(chunk, bytes | memoryview):
                        chunk = chunk.encode(self.charset)
                    await guard.send(send, {"type": "http.response.body", "body": chunk,
                                            "more_body": True})
                await guard.send(send, {"type": "http.response.body", "body": b"",
                                        "more_body": False})
            except BaseException:
                if not stalled.cancel_called:  # (a cut closes it below)
                    await self._close_body()
                raise
            finally:
                self.sending.detach()
                guard.close()
        if stalled.cancelled_caught:
            await self._cut()

    async def _close_body(self) -> None:
        """A send that failed (the connection is gone: the server raises) or the response's
        task cancelled (its client left) ends the body iterator now: its ``finally`` gives
        back what the request holds. Left suspended, it would hold it until the iterator is
        garbage-collected, which a reference cycle through the exception delays to the next
        full collection."""
        close = getattr(self.body_iterator, "aclose", None)
        if close is not None:
            with anyio.CancelScope(shield=True):
                await close()

    async def _cut(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.on_cut()
        await self._close_body()
        if self.abort is not None:
            self.abort()
