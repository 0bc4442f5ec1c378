"""Request ids as clients read them (branch httpleft): every response of the OpenAI routes,
whole or streamed, answer or error, carries an ``x-request-id`` header (what the ``openai``
SDK reads into ``APIStatusError.request_id`` and its responses' request id; what vLLM sends
with ``--enable-request-id-headers``). It is the client's own ``X-Request-Id`` when the
client sent a sane one (1 to 128 printable ASCII characters), else the server's id of the
request: the response body's ``id`` (every chunk's, for a stream). Raw HTTP (``httpx``) and
the SDK's ``with_raw_response`` on a loopback server; client timeout 10 s, no retries."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from test_server_support import MODEL, openai_server

TIMEOUT_S = 10.0

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "id?"}], "max_tokens": 3}
COMPLETION = {"model": MODEL, "prompt": "id?", "max_tokens": 3}
ROUTES = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as (server, sdk,
                                                                                _):
        yield server, sdk


def _chunk_ids(response: httpx.Response) -> set[str]:
    return {json.loads(line[len("data: "):])["id"] for line in response.text.splitlines()
            if line.startswith("data: {")}


@pytest.mark.parametrize(("path", "body"), ROUTES)
@pytest.mark.parametrize("n", [1, 2])
def test_an_answer_s_x_request_id_is_its_body_s_id(served, path, body, n):
    """Without a client id, the header is the server's id of the request: the answer's
    ``id``, and every chunk's when streamed (one choice or several)."""
    server, _ = served
    whole = httpx.post(f"{server.url}{path}", json={**body, "n": n}, timeout=TIMEOUT_S)
    assert whole.status_code == 200, whole.text
    assert whole.headers["x-request-id"] == whole.json()["id"]
    streamed = httpx.post(f"{server.url}{path}", json={**body, "n": n, "stream": True},
                          timeout=TIMEOUT_S)
    assert streamed.status_code == 200, streamed.text
    assert _chunk_ids(streamed) == {streamed.headers["x-request-id"]}
    assert whole.headers["x-request-id"] != streamed.headers["x-request-id"]


@pytest.mark.parametrize(("path", "body"), ROUTES)
@pytest.mark.parametrize("refused", [
    {"best_of": 3},  # refused by the route
    {"model": "no-such-model"},  # 404
    {"max_tokens": 1 << 20},  # refused by the admission (context length)
])
def test_an_error_of_an_openai_route_carries_an_x_request_id(served, path, body, refused):
    server, _ = served
    for stream in (False, True):
        r = httpx.post(f"{server.url}{path}", json={**body, **refused, "stream": stream},
                       timeout=TIMEOUT_S)
        assert r.status_code in (400, 404), r.text
        assert r.headers.get("x-request-id"), r.headers
    wrong_method = httpx.get(f"{server.url}{path}", timeout=TIMEOUT_S)
    assert wrong_method.status_code == 405
    assert wrong_method.headers.get("x-request-id")


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_a_sane_client_request_id_is_echoed_whole_streamed_and_on_errors(served, path, body):
    server, _ = served
    mine = "trace-7f3a/b:c=d e"  # printable ASCII, a space inside
    for extra in ({}, {"stream": True}, {"n": 2, "stream": True}, {"best_of": 3}):
        r = httpx.post(f"{server.url}{path}", json={**body, **extra},
                       headers={"X-Request-Id": mine}, timeout=TIMEOUT_S)
        assert r.headers["x-request-id"] == mine, (extra, r.headers)


@pytest.mark.parametrize("bad", ["x" * 129, "caf\u00e9", "tab\there"])
def test_a_client_request_id_that_is_too_long_or_not_printable_ascii_is_replaced(served, bad):
    """Too long, not ASCII or with a control character: ignored, the server's own id sent
    (never the client's bytes, nor a cut of them)."""
    server, _ = served
    r = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT,
                   headers={"X-Request-Id": bad.encode("latin-1")}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == r.json()["id"]
    assert r.json()["id"].startswith("chatcmpl-")


def test_the_sdk_reads_the_request_id_of_answers_and_errors(served):
    """The ``openai`` SDK's ``with_raw_response`` headers, its errors' ``request_id``."""
    _, sdk = served
    raw = sdk.chat.completions.with_raw_response.create(**CHAT)
    assert raw.headers["x-request-id"] == raw.parse().id
    raw = sdk.completions.with_raw_response.create(**COMPLETION,
                                                   extra_headers={"X-Request-Id": "job-42"})
    assert raw.headers["x-request-id"] == "job-42"
    assert raw.parse().choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.completions.create(**COMPLETION, best_of=3, extra_headers={"X-Request-Id": "job-43"})
    assert refused.value.request_id == "job-43"
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.chat.completions.create(**{**CHAT, "model": "nope"})
    assert missing.value.request_id


def test_two_client_request_ids_are_ignored_for_the_servers_own(served):
    """Which of two ``X-Request-Id`` headers was meant is not the server's to guess: neither
    is echoed, the response names the request by the server's id."""
    server, _ = served
    r = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=TIMEOUT_S,
                   headers=[("X-Request-Id", "first-1"), ("X-Request-Id", "second-2")])
    assert r.status_code == 200, r.text
    assert r.headers.get_list("x-request-id") == [r.json()["id"]]
