"""A body over ``max_body_bytes`` is answered 413 and the connection closed; what the client
already sent is read and dropped first (at most ``wire.DISCARD_MAX_BYTES`` past the limit), so
the close does not reset the connection under the answer: Linux drops what a socket received
when a reset arrives, and the client saw ECONNRESET (or a broken pipe while still sending),
never the 413. Declared (Content-Length) and undeclared (chunked) bodies; a body announced
with ``Expect: 100-continue`` is still refused before it is sent."""

from __future__ import annotations

import socket

import pytest

from calexec.drivers.serving import wire
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.tools.chaos import LiveServer
from test_server_support import read_until_closed, split_head, started_executor

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    try:
        with LiveServer(create_app(executor, ServerConfig(max_body_bytes=LIMIT))) as server:
            yield server.port
    finally:
        executor.shutdown(5.0)


def _post(port: int, head: str, body: bytes) -> tuple[bytes, str, BaseException | None]:
    """``head`` and ``body`` on a fresh connection, then everything until the server closed
    it and how; a send the server's reset broke is returned, not raised."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        failed: BaseException | None = None
        try:
            sock.sendall(head.encode() + body)
        except (BrokenPipeError, ConnectionResetError) as exc:
            failed = exc
        data, how = read_until_closed(sock)
        return data, how, failed


@pytest.mark.parametrize("size", [LIMIT + 1, 3 * LIMIT, LIMIT + (2 << 20)])
def test_a_declared_body_over_the_limit_gets_its_413_not_a_reset(port, size):
    body = b'{"prompt": "' + b"a" * (size - 14) + b'"}'
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
            f"application/json\r\ncontent-length: {len(body)}\r\n\r\n")
    data, how, failed = _post(port, head, body)
    assert failed is None and how == "eof", (how, failed, data[:200])
    status, headers, rest = split_head(data)
    assert status.startswith(b"HTTP/1.1 413"), data[:200]
    assert headers.get("connection") == "close" and b"max_body_bytes=65536" in rest


def test_a_chunked_body_over_the_limit_gets_its_413_not_a_reset(port):
    chunk = b"a" * 4096
    body = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(64)) + b"0\r\n\r\n"
    head = ("POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
            "application/json\r\ntransfer-encoding: chunked\r\n\r\n")
    data, how, failed = _post(port, head, body)
    assert failed is None and how == "eof", (how, failed, data[:200])
    assert split_head(data)[0].startswith(b"HTTP/1.1 413"), data[:200]


def test_a_body_announced_with_expect_is_refused_before_it_is_sent(port):
    head = ("POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
            f"application/json\r\nexpect: 100-continue\r\ncontent-length: {3 * LIMIT}\r\n\r\n")
    data, how, failed = _post(port, head, b"")
    assert failed is None and how == "eof", (how, data[:200])
    assert data.startswith(b"HTTP/1.1 413"), data[:200]  # no 100 Continue asked the body


def test_a_body_announced_past_the_discard_bound_is_answered_without_reading_it(port):
    """A Content-Length more than ``DISCARD_MAX_BYTES`` past the limit (1 GB here, none of
    it sent) is answered at once: the server does not wait to drop a body that size."""
    head = ("POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
            f"application/json\r\ncontent-length: {LIMIT + wire.DISCARD_MAX_BYTES + 1}\r\n\r\n")
    data, how, failed = _post(port, head, b"")
    assert failed is None and how == "eof", (how, data[:200])
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
