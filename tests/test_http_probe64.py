"""Request targets and bodies found by probing a loopback ``calexec serve`` at stop 64 (branch
probe-http2): an encoded slash routed as a separator, a body nested past the parser's depth
called valid JSON when it was not, percent-escapes of no UTF-8 character shown as U+FFFD, and
two ``Origin`` fields of which the first alone was judged. Real uvicorn on loopback, raw
sockets (an HTTP client may normalise the target); real executor on the bundled emulator."""

from __future__ import annotations

import json

import pytest

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
