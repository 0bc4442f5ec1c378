"""Stop 53, hostile HTTP found by the lead: each defect pinned here (docs/traceability.md
"Found at stop 53 (lead)"). Real executor, ``calexec serve``'s uvicorn configuration on an
ephemeral loopback port; every wait bounded."""

from __future__ import annotations

import json

import pytest

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    ServeLikeServer,
    executor_fixture,  # noqa: F401 - the fixture ``executor``
    responses,
    send_raw,
    split_head,
)


@pytest.fixture(scope="module")
def served(executor):
    app = create_app(executor, ServerConfig())
    with ServeLikeServer(app) as server:
        yield server


HEALTH = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
COMPLETION = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()


def completion_head(hosts: list[bytes], version: bytes = b"1.1") -> bytes:
    fields = b"".join(b"host: " + host + b"\r\n" for host in hosts)
    return (b"POST /v1/completions HTTP/" + version + b"\r\n" + fields
            + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(COMPLETION)
            + COMPLETION)


@pytest.mark.parametrize(("hosts", "named"), [
    ([], "no Host header"),
    ([b"127.0.0.1", b"evil.example"], "2 Host headers"),
], ids=["none", "two"])
def test_an_http_1_1_request_without_exactly_one_host_is_a_400_after_the_one_before(
        served, hosts, named):
    """RFC 9112 section 3.2: a server MUST answer 400 to an HTTP/1.1 request without a Host
    header field, or with more than one (two Hosts are how a request reaches one virtual host
    while a proxy in front checked another). uvicorn's httptools protocol, the one ``calexec
    serve`` runs, served both (its h11 protocol refuses both); the completion ran. Now an
    OpenAI-shaped 400 ``request.malformed_http`` naming what was wrong, after the answer to
    the request pipelined before it; nothing of it runs."""
    data, ended = send_raw(served.port, HEALTH + completion_head(hosts))
    answers = responses(data)
    assert [a[0][:12] for a in answers] == [b"HTTP/1.1 200", b"HTTP/1.1 400"], data[:800]
    error = json.loads(answers[1][2])["error"]
    assert error["code"] == "request.malformed_http", error
    assert named in error["message"] and "RFC 9112" in error["message"], error
    assert ended == "eof", ended


def test_an_http_1_0_request_without_host_and_one_with_one_host_are_served(served):
    """HTTP/1.0 has no Host requirement; the refusal is only for 1.1 heads."""
    for raw in (completion_head([], b"1.0"), completion_head([b"127.0.0.1"])
                .replace(b"content-type", b"connection: close\r\ncontent-type")):
        data, _ = send_raw(served.port, raw)
        status, _, body = split_head(data)
        assert status.startswith(b"HTTP/1.1 200 "), data[:500]
        assert len(json.loads(body)["choices"][0]["token_ids"]) == 2


def test_every_401_carries_a_bearer_challenge(executor):
    """RFC 9110 section 11.6.1: a 401 MUST carry ``WWW-Authenticate`` with a challenge; the
    API key's 401 (a /v1 route, an unknown /v1 path, ``/tokenize``) and the admin token's came
    without one (found by the CLI and admin probe). Now ``Bearer`` (RFC 6750), the scheme
    both take; a 403 (a wrong admin token) needs none."""
    from fastapi.testclient import TestClient

    app = create_app(executor, ServerConfig(api_key="k3y", admin_token="t0ken"))
    with TestClient(app) as client:
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"),
                             ("GET", "/v1/nope"), ("POST", "/tokenize"),
                             ("POST", "/admin/drain"), ("POST", "/admin/reload")):
            answer = client.request(method, path)
            assert answer.status_code == 401, (method, path, answer.text)
            assert answer.headers.get("www-authenticate") == "Bearer", (method, path,
                                                                       answer.headers)
        wrong = client.post("/admin/drain", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 403 and "www-authenticate" not in wrong.headers
        keyed = client.get("/v1/models", headers={"authorization": "Bearer k3y"})
        assert keyed.status_code == 200 and "www-authenticate" not in keyed.headers
