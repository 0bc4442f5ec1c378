"""Request targets and bodies found by probing a loopback ``calexec serve`` at stop 64 (branch
probe-http2): an encoded slash routed as a separator, a body nested past the parser's depth
called valid JSON when it was not, percent-escapes of no UTF-8 character shown as U+FFFD, and
two ``Origin`` fields of which the first alone was judged. Real uvicorn on loopback, raw
sockets (an HTTP client may normalise the target); real executor on the bundled emulator."""

from __future__ import annotations

import json

import pytest

from calexec.drivers.serving import wire
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import ServeLikeServer, send_raw, split_head, started_executor

TOKEN = "probe64-http2-token"
MODEL = "org/model-8B"  # a served name with a slash, as vLLM/HF ids (Qwen/Qwen3-8B)
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    config = ServerConfig(admin_token=TOKEN, model_name=MODEL, cors_origins=(ORIGIN,))
    try:
        with ServeLikeServer(create_app(executor, config)) as live:
            yield int(live.url.rsplit(":", 1)[1])
    finally:
        executor.shutdown(5.0)


def ask(port: int, method: str, target: str, body: bytes = b"",
        headers: tuple[str, ...] = ()) -> tuple[int, dict[str, str], dict]:
    """``method target`` sent as written on a fresh connection: the status, headers, JSON."""
    head = [f"{method} {target} HTTP/1.1", "host: 127.0.0.1", "connection: close",
            f"authorization: Bearer {TOKEN}", *headers]
    if body or method == "POST":
        head += ["content-type: application/json", f"content-length: {len(body)}"]
    data, _ = send_raw(port, "\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + body)
    status, fields, rest = split_head(data)
    return int(status.split()[1]), fields, json.loads(rest) if rest else {}


@pytest.mark.parametrize("method, target, body", [
    ("GET", "/v1%2Fmodels", b""),
    ("GET", "/v1%2fmodels", b""),
    ("GET", "/debug%2Fstatecharts", b""),
    ("POST", "/admin%2Freload", b'{"calbin": "/nonexistent/m.calbin"}'),
    ("POST", "/v1/chat%2Fcompletions", b'{"messages": [{"role": "user", "content": "x"}]}'),
    ("GET", "/v1/%2e%2e/health", b""),
    ("GET", "/v1/%2E/models", b""),
], ids=["v1-models", "lowercase", "debug", "admin-reload", "chat", "dot-dot", "dot"])
def test_an_encoded_slash_or_dot_segment_outside_a_model_id_routes_nowhere(server, method,
                                                                             target, body):
    """``/v1%2Fmodels`` and ``/admin%2Freload`` reached those routes (uvicorn decodes ``%2F``
    into a separator and the server routed on the decoded path), past a proxy filtering the
    raw path (blocking ``/admin/``); ``%2e%2e`` was named decoded (``/v1/../health``), a path
    never sent. Each is now the 404 naming the path as the client sent it and why."""
    status, _, answer = ask(server, method, target, body)
    assert status == 404, answer
    message = answer["error"]["message"]
    assert message.startswith(f"{method} {target}: no such route: an encoded slash"), message


def test_a_model_id_with_an_encoded_slash_is_still_served(server):
    """The one path parameter taking a slash, the model id: ``/v1/models/org%2Fmodel-8B`` (the
    SDK's ``models.retrieve("org/model-8B")``) and the slash as written both answer the card."""
    for target in ("/v1/models/org%2Fmodel-8B", "/v1/models/org%2fmodel-8B",
                   "/v1/models/org/model-8B", "/v1/models/org%2Fmodel%2D8B",
                   "/v1/model%73/org%2Fmodel-8B"):
        status, _, answer = ask(server, "GET", target)
        assert (status, answer.get("id")) == (200, MODEL), (target, answer)
    status, _, answer = ask(server, "GET", "/v1/models/org%2F..%2Fother")
    assert status == 404 and 'model="org/../other"' in answer["error"]["message"], answer


@pytest.mark.parametrize("target, named", [
    ("/v1/models/%ff%fe", 'model="%ff%fe" does not exist'),
    ("/v1/models/caf%C3%A9%FF", 'model="caf\u00e9%FF" does not exist'),
    ("/nope%FFx", "GET /nope%FFx: no such route"),
    ("/v1/responses/resp%fe", "resp%fe"),
], ids=["model", "model-mixed", "unknown-path", "response-id"])
def test_escapes_of_no_utf8_character_are_named_as_sent(server, target, named):
    """``GET /v1/models/%ff%fe`` was told ``model="\\ufffd\\ufffd" does not exist``: uvicorn
    decodes a byte no UTF-8 character holds as U+FFFD, so the message named characters the
    client never sent (and two different ids alike). The escapes are now named as written;
    an escaped character that is UTF-8 (``%C3%A9``) is still decoded."""
    status, _, answer = ask(server, "GET", target)
    assert status == 404, answer
    message = answer["error"]["message"]
    assert named in message and "\ufffd" not in message, message


#: a body opened 100,000 levels deep and never closed: no JSON at all
UNCLOSED = "[" * 100_000


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", '{"prompt": "hi", "stop": ' + UNCLOSED),
    ("/v1/chat/completions", UNCLOSED),
    ("/v1/responses", '{"input": "x", "metadata": ' + UNCLOSED),
    ("/tokenize", UNCLOSED),
    ("/detokenize", '{"tokens": ' + UNCLOSED),
    ("/admin/reload", '{"calbin": ' + UNCLOSED),
], ids=["completions", "chat", "responses", "tokenize", "detokenize", "admin-reload"])
def test_a_body_nested_past_the_parsers_depth_is_not_called_valid(server, route, body):
    """``[`` * 100000, never closed, was told ``the JSON is valid, send it less deeply nested``:
    the parser stops at its depth and checks nothing after, so that was untrue. The 400 now
    says the server reads no deeper and checked nothing past that point, claiming no
    validity, on every body route."""
    status, _, answer = ask(server, "POST", route, body.encode())
    assert status == 400, answer
    message = answer["error"]["message"]
    assert message.startswith("body: nested deeper than the server's JSON parser reads"), message
    assert "is valid" not in message and "Invalid JSON" not in message, message
    assert "checked nothing past that point" in message, message


def test_two_origin_fields_are_refused_naming_both(server):
    """With ``--cors-origin``, two ``Origin`` fields (which no browser sends: RFC 6454 section
    7) had the first judged alone: ``Origin: https://app.example`` then ``Origin: https://
    evil.example`` was answered with ``access-control-allow-origin: https://app.example``,
    where a proxy in front may have judged the second. Now a 400 naming both."""
    target = "/v1/models"
    status, fields, answer = ask(server, "GET", target, headers=(
        f"origin: {ORIGIN}", "origin: https://evil.example"))
    assert status == 400, answer
    assert "access-control-allow-origin" not in fields, fields
    assert answer["error"]["param"] == "origin", answer
    assert answer["error"]["message"].startswith(
        f'origin: given 2 times ("{ORIGIN}", "https://evil.example")'), answer
    status, fields, _ = ask(server, "GET", target, headers=(f"origin: {ORIGIN}",))
    assert (status, fields.get("access-control-allow-origin")) == (200, ORIGIN), fields


@pytest.mark.parametrize("raw, routed", [
    (b"/v1/models", None),
    (b"/v1/models/a%2Fb", None),
    (b"/a%20b", None),
    (b"/admin%2Freload", "/admin%2Freload"),
    (b"/x/%2e%2E/y", "/x/%2e%2E/y"),
    (b"/x/%2e%2Ex/y", None),
    (b"/x/%FF%41", "/x/%FFA"),
    (b"/v1/models/%e2%82%ac%e2%82", "/v1/models/\u20ac%e2%82"),
    (b"/v1/model%73/org%2Fmodel", None),
    (b"/v1/models/org/m%FF/x%2F", "/v1/models/org/m%FF/x/"),
    (b"/v1/models%2Forg", "/v1/models%2Forg"),
])
def test_routed_path(raw, routed):
    """``wire.routed_path``: None where uvicorn's decoded path is the one routed on."""
    assert wire.routed_path(raw) == routed


def test_behind_the_fleet_ingress_an_encoded_slash_routes_nowhere_too(tmp_path):
    """The fleet ingress hands a request to a replica as its decoded path (``relay_request``),
    so ``POST /admin%2Freload`` sent to the ingress reached the replica's ``/admin/reload``
    whatever the replica made of an encoded slash; the path as sent now goes along, and the
    replica answers the 404 naming it, as a single server does. A model id keeps its slash."""
    from calexec.drivers.fleet.edge import serve_relayed
    from calexec.drivers.fleet.ingress import FailoverSettings, FleetIngress

    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(admin_token=TOKEN, model_name=MODEL))
    ingress = FleetIngress(lambda request: serve_relayed(app, request), FailoverSettings())
    try:
        with ServeLikeServer(ingress) as live:
            port = int(live.url.rsplit(":", 1)[1])
            status, _, answer = ask(port, "POST", "/admin%2Freload",
                                    b'{"calbin": "/nonexistent/m.calbin"}')
            assert status == 404, answer
            assert answer["error"]["message"].startswith(
                "POST /admin%2Freload: no such route: an encoded slash"), answer
            status, _, answer = ask(port, "GET", "/v1/models/org%2Fmodel-8B")
            assert (status, answer.get("id")) == (200, MODEL), answer
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("target, named", [
    ("/admin/drain?grace=%ff", 'grace="%ff": must be a finite number'),
    ("/admin/drain?grace=%C3%A9%FE", 'grace="\u00e9%FE": must be a finite number'),
    ("/admin/drain?gr%e9ce=1", "gr%e9ce: unknown parameter"),
], ids=["value", "value-mixed", "key"])
def test_query_escapes_of_no_utf8_character_are_named_as_sent(server, target, named):
    """``POST /admin/drain?grace=%ff`` was refused ``grace="\\ufffd": must be a finite number``
    (Starlette's query parser reads such a byte as U+FFFD): the query's escapes are now named
    as written, as the path's are. Nothing drains: each is refused."""
    status, _, answer = ask(server, "POST", target)
    assert status == 400, answer
    message = answer["error"]["message"]
    assert named in message and "\ufffd" not in message, message


@pytest.mark.parametrize("query, readable", [
    (b"", None), (b"a=1&b=%20", None), (b"grace=%ff", b"grace=%25ff"),
    (b"k=%e2%82%ac%e2%82&x=%2F", b"k=%e2%82%ac%25e2%2582&x=%2F"),
])
def test_readable_query(query, readable):
    """``wire.readable_query``: None where the query's parser reads every escape as sent."""
    assert wire.readable_query(query) == readable
