"""Adversarial HTTP input found by probing a loopback ``calexec serve`` at stop 67 (branch
probe-http): the trailer fields of a chunked request body. Real executor on the bundled
emulator behind ``calexec serve``'s uvicorn configuration; raw loopback sockets; every wait
bounded."""

from __future__ import annotations

import json
import socket

import pytest

from calexec.drivers.serving.server import MAX_HEAD_BYTES, ServerConfig, create_app
from test_server_support import (
    ServeLikeServer,
    read_until_closed,
    responses,
    send_raw,
    server_idle,
    split_head,
    started_executor,
    wait_for,
)

KEY = "k-probe67"
BODY = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(server, service)``: an executor behind ``calexec serve``'s uvicorn configuration,
    the OpenAI routes guarded by ``--api-key KEY``."""
    executor = started_executor(tmp_path_factory.mktemp("probe67"))
    try:
        app = create_app(executor, ServerConfig(api_key=KEY))
        with ServeLikeServer(app) as server:
            yield server, app.state.service
    finally:
        executor.shutdown(5.0)


def chunked(trailer: bytes, path: str = "/v1/completions") -> bytes:
    """A completion whose body is sent chunked (one chunk), ``trailer`` after its last
    chunk (field lines, each ending CRLF)."""
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {KEY}\r\n"
            "content-type: application/json\r\nx-request-id: from-the-head\r\n"
            "transfer-encoding: chunked\r\n\r\n").encode() + (
        b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(BODY), BODY, trailer))


@pytest.mark.parametrize("trailer", [
    b"authorization: Bearer wrong\r\n",
    b"content-type: text/plain\r\n",
    b"x-request-id: from-the-trailer\r\n",
], ids=["authorization", "content-type", "x-request-id"])
def test_a_trailer_field_is_not_taken_for_a_header(served, trailer):
    """uvicorn's httptools protocol appended a chunked body's trailer fields to the
    request's headers (the list the route reads), so a trailer ``Authorization`` made a
    request with the right key in its head a 401 (``Authorization given 2 times``), a
    trailer ``Content-Type: text/plain`` a 415, and a trailer ``X-Request-Id`` replaced the
    head's in the answer (RFC 9110 section 6.5.1: a recipient MUST NOT merge a trailer field
    into the header section). Trailer fields are discarded: the request is answered by its
    head's fields."""
    server, service = served
    data, _ = send_raw(server.port, chunked(trailer) + b"GET /ping HTTP/1.1\r\nhost: x\r\n"
                       b"connection: close\r\n\r\n")
    (status, headers, body), (ping, _, _) = responses(data)
    assert status == b"HTTP/1.1 200 OK", data[:400]
    assert json.loads(body)["usage"]["completion_tokens"] == 2, body[:300]
    assert headers["x-request-id"] == "from-the-head", headers
    assert ping == b"HTTP/1.1 200 OK", data[-300:]  # the connection parsed on
    wait_for(lambda: server_idle(service), what="the server to be idle")


def test_a_trailer_section_over_max_head_bytes_is_a_431(served):
    """A chunked body's trailer section had no bound: uvicorn kept every trailer field (in
    the request's headers) while the route waited for the end of the body, so one client
    sending trailer fields grew the server's memory by 200 MB in 3 s, up to ``body_timeout_s``
    (30 s) of them. A section over ``server.MAX_HEAD_BYTES`` (what a head may be) is the
    request's answer, 431 ``request.head_too_large`` naming the trailer section, the
    connection closed; the request holds nothing, and the server serves on."""
    server, service = served
    line = b"x-t: " + b"a" * 1000 + b"\r\n"
    sent = chunked(line * (2 * MAX_HEAD_BYTES // len(line)))
    with socket.create_connection(("127.0.0.1", server.port), timeout=30.0) as sock:
        sock.sendall(sent[:len(sent) - 2])  # the section not ended: the route still waits
        data, ended = read_until_closed(sock)
    status, headers, body = split_head(data)
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large", data[:400]
    error = json.loads(body)["error"]
    assert error["code"] == "request.head_too_large", error
    assert error["message"] == (
        f"the request's trailer section (the fields after the last chunk of its chunked "
        f"body) exceeds {MAX_HEAD_BYTES} bytes: send no trailer fields (they are "
        f"discarded)"), error
    assert headers.get("connection") == "close" and headers.get("x-request-id"), headers
    assert ended in ("eof", "reset"), ended
    wait_for(lambda: server_idle(service), what="the server to be idle")
    data, _ = send_raw(server.port, chunked(line * 100))  # a section under the bound: served
    assert data.startswith(b"HTTP/1.1 200 OK"), data[:300]
