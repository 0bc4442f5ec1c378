"""Stop 52, real clients and hostile HTTP: defects found by probing a loopback ``calexec serve``
on the bundled emulator with real clients (the ``openai`` SDK, LangChain, curl) and raw
sockets, each pinned here (docs/traceability.md "Found at stop 52 (clients)"). Real executor,
``calexec serve``'s uvicorn configuration on an ephemeral loopback port; every wait bounded."""

from __future__ import annotations

import json
import socket

import pytest

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    ServeLikeServer,
    executor_fixture,  # noqa: F401 - the fixture ``executor``
    oracle_tokens,
    read_until_closed,
    responses,
    send_raw,
    server_idle,
    wait_for,
)

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def served(executor):
    """``(server, service)``: the module's executor behind ``calexec serve``'s uvicorn
    configuration (``server.uvicorn_config``) on an ephemeral loopback port."""
    app = create_app(executor, ServerConfig())
    with ServeLikeServer(app) as server:
        yield server, app.state.service


COMPLETION = json.dumps({"prompt": PROMPT, "max_tokens": 3}).encode()
HEALTH_AFTER = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"


def _upgrade_request(upgrade: str, connection: str, chunked: bool) -> bytes:
    framing = (f"transfer-encoding: chunked\r\n\r\n{len(COMPLETION):x}\r\n".encode()
               + COMPLETION + b"\r\n0\r\n\r\n") if chunked else (
        f"content-length: {len(COMPLETION)}\r\n\r\n".encode() + COMPLETION)
    return (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nuser-agent: curl/7.88.1\r\n"
            f"connection: {connection}\r\n{upgrade}content-type: application/json\r\n"
            ).encode() + framing


@pytest.mark.parametrize("upgrade, connection, chunked", [
    # what `curl --http2 http://...` sends (an h2c upgrade, HTTP/2 over cleartext)
    ("upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n",
     "Upgrade, HTTP2-Settings", False),
    ("upgrade: websocket\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
     "sec-websocket-version: 13\r\n", "upgrade", False),
    ("upgrade: h2c\r\n", "keep-alive, Upgrade", True),
], ids=["curl-http2-h2c", "websocket", "chunked-body"])
def test_a_request_asking_to_upgrade_is_served_as_a_plain_one_with_its_body(
        served, upgrade, connection, chunked):
    """A request asking to switch protocols (``Connection: upgrade`` + ``Upgrade``, as
    ``curl --http2`` sends to every http:// URL) was served without its body: uvicorn's
    httptools protocol lets the parser skip the body of an upgrade, so a valid completion got
    400 ``body: Invalid JSON: EOF while parsing a value``; the bytes after its head (the body,
    a pipelined request) were dropped, and a WebSocket handshake went to uvicorn's WebSocket
    protocol. RFC 9110 section 7.8 lets a server ignore ``Upgrade``: the request is answered as
    a plain one, its body read, and the request pipelined behind it answered too."""
    server, service = served
    data, ended = send_raw(server.port, _upgrade_request(upgrade, connection, chunked)
                           + HEALTH_AFTER)
    answers = responses(data)
    assert [a[0][:12] for a in answers] == [b"HTTP/1.1 200", b"HTTP/1.1 200"], data[:600]
    body = json.loads(answers[0][2])
    assert body["choices"][0]["token_ids"] == oracle_tokens(PROMPT, 3), body
    assert answers[0][1]["x-request-id"] == body["id"], answers[0][1]
    assert json.loads(answers[1][2])["status"] == "ok", answers[1]
    assert ended == "eof", ended
    wait_for(lambda: server_idle(service), 10, "the server idle")


def test_a_websocket_handshake_on_a_get_route_is_answered_as_the_get(served):
    """``GET /health`` with a WebSocket handshake (a load balancer's or a browser's probe
    that asks for one) got uvicorn's WebSocket protocol's bodiless ``403 Forbidden`` without
    an ``x-request-id`` (no route takes a WebSocket): the one answer of the server that is no
    JSON and carries no request id (docs/server.md "Request ids"). It is answered as the
    ``GET``, with the id."""
    server, _ = served
    data, ended = send_raw(server.port, (
        b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nupgrade: websocket\r\n"
        b"connection: Upgrade, close\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"sec-websocket-version: 13\r\n\r\n"))
    [(status, headers, body)] = responses(data)
    assert status.startswith(b"HTTP/1.1 200 "), data[:300]
    assert json.loads(body)["status"] == "ok" and len(headers["x-request-id"]) == 32, data
    assert ended == "eof", ended


@pytest.mark.parametrize("route, body, field", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3}, "choices"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "héllo"}],
                              "max_tokens": 2}, "choices"),
    ("/tokenize", {"prompt": "héllo"}, "tokens"),
], ids=["completions", "chat", "tokenize"])
def test_a_body_with_a_utf8_byte_order_mark_is_read_as_without_it(served, route, body, field):
    """A JSON body starting with a UTF-8 byte order mark (an editor's, sent by ``curl
    --data-binary @request.json``) was a 400 ``body: Invalid JSON: expected value at line 1
    column 1``, a riddle to a client whose JSON is valid; Python's ``json.loads`` (vLLM's
    server, this one's ``/admin/reload``) ignores it, as RFC 8259 section 8.1 allows. It is
    answered as the same body without it."""
    import httpx

    server, service = served
    payload = json.dumps(body).encode()
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        plain = http.post(route, content=payload, headers={"content-type": "application/json"})
        marked = http.post(route, content=b"\xef\xbb\xbf" + payload,
                           headers={"content-type": "application/json"})
    assert plain.status_code == 200, plain.text
    assert marked.status_code == 200, marked.text
    assert marked.json()[field] == plain.json()[field], (marked.json(), plain.json())
    wait_for(lambda: server_idle(service), 10, "the server idle")


@pytest.mark.parametrize("encoding, named", [
    ("utf-16", "UTF-16"), ("utf-16-le", "UTF-16-LE"), ("utf-32", "UTF-32"),
])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_that_is_not_utf8_is_a_400_naming_its_encoding(served, route, encoding, named):
    """A UTF-16 or UTF-32 JSON body (PowerShell's ``Out-File``, .NET's ``Encoding.Unicode``)
    was a 400 ``body: Invalid JSON: expected value at line 1 column 1`` (or ``...column 2``)
    that named neither the body's encoding nor what to send; RFC 8259 section 8.1 asks for
    UTF-8 between systems. Now the 400 says the body is UTF-16 (UTF-32) and to send UTF-8."""
    import httpx

    server, _ = served
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    body.pop("messages" if route == "/v1/completions" else "prompt")
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        answer = http.post(route, content=json.dumps(body).encode(encoding),
                           headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] is None and error["type"] == "invalid_request_error", error
    assert f"this body is {named}" in error["message"], error
    assert "send it encoded as UTF-8" in error["message"], error


@pytest.mark.parametrize("target", [
    b"/health?" + b"x" * (1 << 16),
    b"/v1/models/" + b"m" * 70000,
], ids=["long-query", "long-path"])
def test_a_request_target_longer_than_the_server_parses_is_a_414_naming_it(served, target):
    """A request target (path and query) over 65,535 bytes, which uvicorn's URL parser
    (``httptools.parse_url``) refuses, was answered the bare 400 ``Invalid HTTP request
    received.``: neither the target nor its length named, where RFC 9112 section 3 asks for
    414 (URI Too Long). Now a 414 ``request.uri_too_long`` (OpenAI-shaped, with an
    ``x-request-id``) saying how long it was and the limit, after the answer to the request
    pipelined before it; a target of 65,535 bytes is still served."""
    from calexec.drivers.serving.server import MAX_TARGET_BYTES

    server, _ = served
    data, ended = send_raw(server.port, HEALTH_AFTER.replace(b"connection: close\r\n", b"")
                           + b"GET " + target + b" HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
    answers = responses(data)
    assert [a[0][:12] for a in answers] == [b"HTTP/1.1 200", b"HTTP/1.1 414"], data[:600]
    _, headers, body = answers[1]
    error = json.loads(body)["error"]
    assert error["code"] == "request.uri_too_long", error
    assert error["type"] == "invalid_request_error", error
    assert f"is {len(target)} bytes" in error["message"], error
    assert str(MAX_TARGET_BYTES) in error["message"] and len(headers["x-request-id"]) == 32
    assert ended == "eof", ended
    longest = b"/health?" + b"x" * (MAX_TARGET_BYTES - len(b"/health?"))
    data, _ = send_raw(server.port, b"GET " + longest + b" HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                       b"connection: close\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 200 "), data[:300]


@pytest.mark.parametrize("target", [b"http://[::1/health", b"http://127.0.0.1:99999999/health"],
                         ids=["unclosed-ipv6", "port-out-of-range"])
def test_a_target_the_url_parser_refuses_is_answered_after_the_request_before_it(served,
                                                                               target):
    """A request line whose target the URL parser refuses (an absolute URI with an unclosed
    IPv6 literal or a port out of range) was taken for a refusal of the body of the request
    pipelined before it: that request (a ``GET /health``) was told its client is gone and got
    no answer, the connection's one answer was the 400. Now the request before it is
    answered, then the 400 ``request.malformed_http`` (RFC 9112 section 9.3.2: in order)."""
    server, _ = served
    data, ended = send_raw(server.port, HEALTH_AFTER.replace(b"connection: close\r\n", b"")
                           + b"GET " + target + b" HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
    answers = responses(data)
    assert [a[0][:12] for a in answers] == [b"HTTP/1.1 200", b"HTTP/1.1 400"], data[:600]
    assert json.loads(answers[0][2])["status"] == "ok", answers[0]
    assert json.loads(answers[1][2])["error"]["code"] == "request.malformed_http", answers[1]
    assert ended == "eof", ended


def test_upgrade_requests_pipelined_by_the_thousand_are_each_answered(served):
    """The head of a request asking to upgrade is parsed again (the test above); 2,000 such
    requests pipelined in one write are each answered in order, the connection's last one
    closing it: parsing them again is a loop, never a recursion the interpreter's limit
    (1,000 frames) would end in the middle of a read."""
    server, service = served
    one = (b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nupgrade: h2c\r\n"
           b"connection: Upgrade\r\n\r\n")
    data, ended = send_raw(server.port, one * 2000 + HEALTH_AFTER)
    answers = responses(data)
    assert len(answers) == 2001 and ended == "eof", (len(answers), ended, data[-300:])
    assert all(a[0].startswith(b"HTTP/1.1 200 ") for a in answers), data[:300]
    assert len({a[1]["x-request-id"] for a in answers}) == 2001
    wait_for(lambda: server_idle(service), 10, "the server idle")


def test_an_upgrade_request_whose_body_comes_in_later_writes_is_read_whole(served):
    """A request asking to upgrade whose head and body arrive in separate writes (the body
    a byte at a time): the body is read whole across them, then answered."""
    import time

    server, _ = served
    request = _upgrade_request("upgrade: h2c\r\n", "Upgrade, close", False)
    head, _, body = request.partition(b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30.0) as sock:
        sock.sendall(head + b"\r\n\r\n")
        time.sleep(0.05)  # the head is parsed alone (no bound on a test's result: ordering)
        for i in range(len(body)):
            sock.sendall(body[i:i + 1])
        data, ended = read_until_closed(sock)
    [(status, _, answer)] = responses(data)
    assert status.startswith(b"HTTP/1.1 200 "), data[:300]
    assert json.loads(answer)["choices"][0]["token_ids"] == oracle_tokens(PROMPT, 3)
    assert ended == "eof", ended


def test_an_upgrade_request_closing_its_connection_is_its_last_answer(served):
    """A request asking to upgrade with ``Connection: Upgrade, close`` and bytes behind it:
    its answer closes the connection and is the only one, as for any request that closes it
    (nothing behind it is read as a request, nor answered 400)."""
    server, _ = served
    request = _upgrade_request("upgrade: h2c\r\n", "Upgrade, close", False)
    data, ended = send_raw(server.port, request + HEALTH_AFTER + b"garbage\r\n\r\n")
    [(status, headers, body)] = responses(data)
    assert status.startswith(b"HTTP/1.1 200 ") and headers.get("connection") == "close", data
    assert json.loads(body)["choices"][0]["token_ids"] == oracle_tokens(PROMPT, 3)
    assert ended == "eof", ended


@pytest.mark.parametrize("compressed", [True, False], ids=["gzip-body", "plain-body"])
@pytest.mark.parametrize("route, coding", [
    ("/v1/completions", "gzip, chunked"), ("/tokenize", "deflate, chunked"),
    ("/v1/chat/completions", "br, chunked"),
])
def test_a_body_in_a_transfer_coding_besides_chunked_is_a_501_naming_it(served, route,
                                                                        coding, compressed):
    """``Transfer-Encoding: gzip, chunked``: the HTTP parser frames the body by its final
    ``chunked`` and the route got the gzip bytes as they came: a gzip body was a 400
    ``body: Invalid JSON: expected value at line 1 column 1``, a plain body labelled gzip was
    taken as if the coding were not there (stop 50 refused the same for Content-Encoding,
    415). RFC 9112 section 6.1: a transfer coding the server does not understand is a 501,
    here naming the coding; the connection goes on (the chunked framing is intact)."""
    import gzip

    server, _ = served
    payload = json.dumps({"prompt": "hi", "max_tokens": 1} if route != "/v1/chat/completions"
                         else {"messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 1}).encode()
    if route == "/tokenize":
        payload = b'{"prompt": "hi"}'
    body = gzip.compress(payload) if compressed else payload
    request = (f"POST {route} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json"
               f"\r\ntransfer-encoding: {coding}\r\n\r\n{len(body):x}\r\n").encode() + body \
        + b"\r\n0\r\n\r\n"
    data, ended = send_raw(server.port, request + HEALTH_AFTER)
    answers = responses(data)
    assert [a[0][:12] for a in answers] == [b"HTTP/1.1 501", b"HTTP/1.1 200"], data[:600]
    error = json.loads(answers[0][2])["error"]
    named = coding.split(",")[0]
    assert error["message"].startswith(f"transfer-encoding {json.dumps(named)}: not supported"), error
    assert error["type"] == "invalid_request_error" and error["param"] is None, error
    assert ended == "eof", ended


def test_a_reload_body_in_a_transfer_coding_besides_chunked_is_a_501_naming_it(executor):
    """``POST /admin/reload`` takes a JSON body as the OpenAI routes do: the same 501 naming
    the transfer coding, nothing checked or switched (the generation stays)."""
    from fastapi.testclient import TestClient

    token = "probe52-admin-token"
    app = create_app(executor, ServerConfig(admin_token=token))
    generation = executor.generation
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post("/admin/reload", content=b'{"calbin": "x"}', headers={
            "authorization": f"Bearer {token}", "content-type": "application/json",
            "transfer-encoding": "gzip, chunked"})
    assert answer.status_code == 501, answer.text
    assert answer.json()["error"]["message"].startswith('transfer-encoding "gzip"'), answer.text
    assert executor.generation == generation


@pytest.mark.parametrize("field, value", [
    ("guided_json", {"type": "object"}), ("guided_choice", ["a", "b"]),
    ("structured_outputs", {"json": {"type": "object"}}),
])
def test_a_vllm_guided_decoding_field_is_refused_pointing_at_response_format(served, field,
                                                                             value):
    """vLLM's ``guided_json`` (a client written for vLLM's server sends it in ``extra_body``)
    was refused "structured outputs (guided decoding) are not supported": wrong, since
    ``response_format`` json_schema and ``tools`` are constrained by the grammar here; a user
    reading it gave up on JSON output. The 400 still names the field, and says what to send."""
    import openai

    server, _ = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=30.0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(messages=[{"role": "user", "content": "hi"}],
                                       model="calexec-qwen3-synthetic", max_tokens=2,
                                       extra_body={field: value})
    error = refused.value.body
    assert error["param"] == field, error
    assert "response_format" in error["message"] and "json_schema" in error["message"], error


TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def test_tokenize_counts_a_tool_using_chat_as_the_chat_does(served):
    """vLLM's ``/tokenize`` takes a chat's ``tools`` (``TokenizeChatRequest.tools``: the
    chat template writes them into the prompt), so a client can count a tool-using chat's
    prompt before sending it; here ``tools`` was refused as an unknown parameter, and the
    count without them was not the chat's. Now ``/tokenize`` of the messages and tools is
    the chat's ``usage.prompt_tokens`` and its prompt; ``tools`` without ``messages`` and a
    malformed tool are 400s naming them."""
    import httpx

    server, service = served
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "weather in Paris?"}]
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        counted = http.post("/tokenize", json={"messages": messages, "tools": TOOLS})
        plain = http.post("/tokenize", json={"messages": messages})
        chat = http.post("/v1/chat/completions", json={
            "messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1})
        alone = http.post("/tokenize", json={"prompt": "hi", "tools": TOOLS})
        bad = http.post("/tokenize", json={"messages": messages, "tools": [{"type": "x"}]})
    assert counted.status_code == 200 and chat.status_code == 200, (counted.text, chat.text)
    assert counted.json()["count"] == chat.json()["usage"]["prompt_tokens"], \
        (counted.json()["count"], chat.json()["usage"])
    assert counted.json()["count"] > plain.json()["count"], (counted.json(), plain.json())
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "tools", alone.text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools.0.type", bad.text
    wait_for(lambda: server_idle(service), 10, "the server idle")


def test_a_head_over_max_head_bytes_is_typed_a_client_error(served):
    """The 431 of a request head over ``MAX_HEAD_BYTES`` said ``"type": "server_error"`` (its
    status had no entry in the error types, whose default is the server's), while its
    category is ``invalid_request`` and docs/server.md's error table says
    ``invalid_request_error``: a client sorting errors by type blamed the server for its
    own header. Now ``invalid_request_error``, as the 414 of a target too long."""
    from calexec.drivers.serving.server import MAX_HEAD_BYTES

    server, _ = served
    data, ended = send_raw(server.port, b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nx-big: "
                           + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n")
    [(status, _, body)] = responses(data)
    assert status.startswith(b"HTTP/1.1 431 "), data[:300]
    error = json.loads(body)["error"]
    assert (error["code"], error["type"]) == ("request.head_too_large",
                                              "invalid_request_error"), error
    assert ended in ("eof", "reset"), ended
