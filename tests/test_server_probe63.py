"""A client pipelining requests it does not read, found by probing a loopback ``calexec
serve`` at stop 63: one such connection took the server's memory and event loop. Real
executor on the bundled emulator behind ``calexec serve``'s uvicorn configuration; raw
loopback sockets; every wait bounded."""

from __future__ import annotations

import gc
import socket
import threading

import pytest

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    ServeLikeServer,
    send_raw,
    server_idle,
    started_executor,
    wait_for,
)

#: one pipelined request: the smallest answer the server gives (``/ping``: 200, no body)
PING = b"GET /ping HTTP/1.1\r\nhost: x\r\n\r\n"
#: what the event loop reads of a connection at once (uvloop's and asyncio's read size)
READ_BYTES = 256 << 10


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    yield executor
    executor.shutdown(5.0)


@pytest.fixture
def small(executor):
    """``(server, service)``: the executor behind ``calexec serve``'s uvicorn configuration
    with small buffers (a response stalls after ~12 KB its client did not read)."""
    app = create_app(executor, ServerConfig())
    with ServeLikeServer(app, small_buffers=True) as server:
        yield server, app.state.service


def _cycles() -> int:
    """The uvicorn request cycles alive in this process (the server runs in a thread)."""
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, RequestResponseCycle))


def _flood(port: int, total: int) -> tuple[socket.socket, threading.Thread, list[int]]:
    """A client with a 4 KiB receive buffer sending ``total`` bytes of pipelined pings and
    reading nothing, from a thread; its send stops once the server stops reading (a 5 s
    silence). The bytes it sent are in the returned list."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(5.0)
    sock.connect(("127.0.0.1", port))
    sent = [0]
    batch = PING * 2000

    def run() -> None:
        try:
            while sent[0] < total:
                sock.sendall(batch)
                sent[0] += len(batch)
        except OSError:  # the send stalled (the server stopped reading) or was cut
            pass
    thread = threading.Thread(target=run, name="pipelining-client", daemon=True)
    thread.start()
    return sock, thread, sent


def test_a_client_pipelining_requests_it_does_not_read_holds_one_read_of_them(small):
    """uvicorn's httptools protocol parses each read whole (a 256 KiB read of pings is
    ~8,000 requests, queued behind the one being answered) and went back to reading after
    every answer, though the requests it had read were still queued: a client that sent
    pings and read no answer had the server read on for as long as answers still fitted its
    buffers, each answer queueing another read's worth. And the server's protocol rebuilt
    its list of the connection's unanswered requests at each request head, a quadratic
    parse: 6 MB of pings (160,000 requests, sent in a second) held the event loop 10 to 20
    s, every other client's ``/health`` unanswered meanwhile, and the requests held memory
    (tens of MB) until the connection closed. The server now reads a connection again only
    once the requests it read are answered: it holds at most one read of them, and another
    client is served meanwhile."""
    server, service = small
    before = _cycles()
    sock, thread, sent = _flood(server.port, 24 << 20)
    try:
        thread.join(120.0)
        assert not thread.is_alive(), "the pipelining client's send did not stop"
        assert sent[0] < 24 << 20, "the server read every byte of the flood"
        held = _cycles() - before
        assert held <= READ_BYTES // len(PING) + 2, (held, sent[0])
        # another client is served while the flood's connection is open
        data, _ = send_raw(server.port, b"GET /health HTTP/1.1\r\nhost: x\r\n"
                           b"connection: close\r\n\r\n", timeout=30.0)
        assert data.startswith(b"HTTP/1.1 200 "), data[:300]
    finally:
        sock.close()
    wait_for(lambda: _cycles() <= before, 30, "the pipelined requests freed at the close")
    wait_for(lambda: server_idle(service), 10, "the server idle")


@pytest.fixture(scope="module")
def served(executor):
    """``(server, service)``: the executor behind ``calexec serve``'s uvicorn configuration."""
    app = create_app(executor, ServerConfig())
    with ServeLikeServer(app) as server:
        yield server, app.state.service


def test_options_asterisk_asks_about_the_server_and_is_answered_200_with_allow(served):
    """``OPTIONS *`` (RFC 9110 section 9.3.7: the asterisk-form target asks about the
    server in general, a ping some proxies and clients send) was answered 404 ``OPTIONS
    /*: no such route``, naming a path the client never sent. It is a 200 with ``Allow``
    (the methods the server's routes take), no body, as Go's net/http answers it."""
    from test_server_support import split_head

    server, _ = served
    data, _ = send_raw(server.port, b"OPTIONS * HTTP/1.1\r\nhost: x\r\nconnection: close"
                       b"\r\n\r\n")
    status, headers, rest = split_head(data)
    assert status.startswith(b"HTTP/1.1 200 "), data[:400]
    assert headers.get("allow") == "GET, HEAD, POST, OPTIONS", headers
    assert headers.get("content-length") == "0" and rest == b"", data[:400]
    assert headers.get("x-request-id"), headers


@pytest.mark.parametrize("method", ["GET", "POST", "HEAD"])
def test_another_method_with_the_asterisk_target_is_a_400_naming_it(served, method):
    """The asterisk-form target is only for ``OPTIONS`` (RFC 9112 section 3.2.4): ``GET *``
    was a 404 ``GET /*: no such route`` (a path the client never sent); now the 400 of a
    request target no request may have, naming it."""
    import json

    from test_server_support import split_head

    server, _ = served
    body = b'{"prompt": [1], "max_tokens": 1}' if method == "POST" else b""
    data, _ = send_raw(server.port, f"{method} * HTTP/1.1\r\nhost: x\r\nconnection: close"
                       f"\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
                       "\r\n\r\n".encode() + body)
    status, headers, rest = split_head(data)
    assert status.startswith(b"HTTP/1.1 400 "), data[:400]
    if method != "HEAD":
        error = json.loads(rest)["error"]
        assert error["code"] == "request.invalid_target", error
        assert error["message"].startswith(f"{method} *: "), error
        assert "/*" not in error["message"], error


@pytest.mark.parametrize("line,named", [
    (b"CONNECT x:443 HTTP/1.1", '"x:443"'),
    (b"CONNECT example.com:80 HTTP/1.1", '"example.com:80"'),
], ids=["short", "host-and-port"])
def test_a_request_target_the_url_parser_refuses_is_a_400_naming_it(served, line, named):
    """A request target the HTTP parser takes and uvicorn's URL parser refuses (the
    authority-form ``host:port`` of a ``CONNECT``, which a client configured to use this
    server as its proxy sends) was answered the bare ``Invalid HTTP request received.``,
    saying nothing of what was refused. The 400 names the target now (still
    ``request.malformed_http``, the connection closed)."""
    import json

    from test_server_support import split_head

    server, _ = served
    data, ended = send_raw(server.port, line + b"\r\nhost: x\r\n\r\n")
    status, headers, rest = split_head(data)
    assert status.startswith(b"HTTP/1.1 400 "), data[:400]
    error = json.loads(rest)["error"]
    assert error["code"] == "request.malformed_http", error
    assert named in error["message"], error
    assert headers.get("connection") == "close" and ended in ("eof", "reset"), (headers, ended)


@pytest.mark.parametrize("target", [b"/health?" + b"a" * (1 << 20),
                                    b"/v1/models/" + b"m" * (2 << 20)],
                         ids=["1-MiB-query", "2-MiB-path"])
def test_a_request_target_over_the_head_bound_is_a_414_as_a_shorter_long_one(served, target):
    """A request target over ``MAX_TARGET_BYTES`` is a 414 ``request.uri_too_long``
    (docs/server.md), but one of 1 MiB (a GET carrying its data in the query) reached the
    head's bound first, counted while the request line was still arriving, and was answered
    431 ``request.head_too_large``, blaming header fields the request did not have. The 414
    is the answer for any target over the limit now, its length given as at least what
    arrived."""
    import json

    from test_server_support import split_head

    server, _ = served
    data, ended = send_raw(server.port, b"GET " + target + b" HTTP/1.1\r\nhost: x\r\n\r\n")
    status, headers, rest = split_head(data)
    assert status.startswith(b"HTTP/1.1 414 "), data[:400]
    error = json.loads(rest)["error"]
    assert error["code"] == "request.uri_too_long", error
    assert "at least" in error["message"], error
    assert headers.get("x-request-id") and ended in ("eof", "reset"), (headers, ended)
