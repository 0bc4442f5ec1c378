"""Stop 72's probe with real clients (docs/traceability.md "Found at stop 72 (clients)"): the
official ``openai`` SDK (3.51, the pinned one), unmodified, against a loopback server on the
synthetic model with the uvicorn configuration ``calexec serve`` runs (``serve_like``), as a
team adopting the server calls it. Client timeout 30 s, no retries."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import needs
from test_server_support import MODEL, serve_like_fixture  # noqa: F401 - the fixture

openai = needs.module("openai", "clients")

TIMEOUT_S = 30.0


@pytest.fixture(scope="module", name="sdk")
def sdk_fixture(serve_like) -> Iterator:
    client = openai.OpenAI(base_url=f"{serve_like.url}/v1", api_key="unused", max_retries=0,
                           timeout=TIMEOUT_S)
    yield client
    client.close()


# ---- SDK methods of endpoints this server does not serve ---------------------------------------
def test_the_sdks_responses_compact_is_told_compaction_is_not_served(sdk):
    """``client.responses.compact(model=..., input=...)`` (``POST /v1/responses/compact``,
    the SDK's compaction pass an agent runs when its conversation grows) reached the
    stored-response route ``/v1/responses/{response_id}`` and was a 405 ``POST
    /v1/responses/compact: method not allowed (allowed: DELETE, HEAD, GET)``, as if
    ``compact`` were the id of a stored response and another method would do: the user was
    sent the wrong way. It is now the 404 of an endpoint not served, saying why and what to
    send instead, as the other such endpoints say (tests/test_clients_probe64.py)."""
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.responses.compact(model=MODEL, input="hello")
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "not_found", error
    message = error["message"]
    assert message.startswith("POST /v1/responses/compact: no such route: "), message
    assert "compaction" in message and "send the whole conversation in input" in message
    assert "method not allowed" not in message
    assert caught.value.response.headers.get("allow") is None


def test_a_stored_response_named_compact_is_still_looked_up_as_one(sdk):
    """``GET``/``DELETE /v1/responses/compact`` are the stored-response routes' own answer
    (the id ``compact`` is not found: nothing is stored), unchanged."""
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.responses.retrieve("compact")
    assert caught.value.body["param"] == "response_id"
    assert "response \"compact\" not found" in caught.value.body["message"]


def test_the_sdks_chat_completions_list_is_told_nothing_is_stored(sdk):
    """``client.chat.completions.list()`` (``GET /v1/chat/completions``: the stored chat
    completions) was a 405 ``method not allowed (allowed: POST)`` and nothing more, where the
    SDK's other stored-completion methods (``retrieve``, ``update``, ``delete``,
    ``messages.list``) are told that this server stores nothing (stop 64). The 405 and its
    ``Allow: POST`` stay (the path is the chat route, for POST), and its message says why."""
    with pytest.raises(openai.APIStatusError) as caught:
        sdk.chat.completions.list()
    assert caught.value.status_code == 405
    assert caught.value.response.headers.get("allow") == "POST"
    message = caught.value.body["message"]
    assert message.startswith("GET /v1/chat/completions: method not allowed (allowed: POST)")
    assert "this server stores nothing" in message, message


def test_the_sdks_responses_websocket_mode_is_told_it_is_not_served(serve_like, sdk):
    """``client.responses.connect()`` (the Responses WebSocket mode: ``GET /v1/responses``
    asking to upgrade to a WebSocket) was refused with the 405 of a plain ``GET``, ``method
    not allowed (allowed: POST)``: nothing said the mode is not served nor what to use. The
    405 stays (``calexec serve`` speaks no WebSocket: the handshake is served as a plain
    request) and its message now says so and names ``POST /v1/responses`` with ``stream``."""
    httpx = needs.module("httpx", "server")
    head = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    answer = httpx.get(f"{serve_like.url}/v1/responses", headers=head, timeout=TIMEOUT_S)
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    message = answer.json()["error"]["message"]
    assert message.startswith("GET /v1/responses: method not allowed (allowed: POST)")
    assert "WebSocket" in message and "POST /v1/responses" in message and "stream" in message
    plain = httpx.get(f"{serve_like.url}/v1/responses", timeout=TIMEOUT_S).json()
    assert plain["error"]["message"] == ("GET /v1/responses: method not allowed "
                                         "(allowed: POST)")
    websockets = needs.module("websockets", "clients")
    with pytest.raises(websockets.exceptions.InvalidStatus) as caught:
        with sdk.responses.connect():
            pass
    assert caught.value.response.status_code == 405
    assert b"WebSocket" in bytes(caught.value.response.body)
