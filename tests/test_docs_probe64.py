"""Stop 64's operator pass over the docs (README, docs/deployment.md, operations.md, server.md,
manifest.md, emulator.md), each command, option, endpoint and error typed as written against a
loopback ``calexec serve`` on the bundled emulator: each test here pins a defect found so.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import started_executor

TOKEN = "probe64-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("docs64"))
    try:
        with TestClient(create_app(executor, ServerConfig(admin_token=TOKEN))) as client:
            yield client
    finally:
        executor.shutdown(5.0)


#: every 404 docs/server.md's error table lists (a model not served, an unknown chart or job,
#: a path no route serves) and the stored-responses routes' 404 ("Endpoints")
NOT_FOUND = [
    ("GET", "/debug/jobs/999999", AUTH, None, "job_id"),
    ("GET", "/debug/jobs/999999?format=json", AUTH, None, "job_id"),
    ("GET", "/debug/statecharts/nochart.svg", {}, None, None),
    ("GET", "/no/such/route", {}, None, None),
    ("GET", "/v1/responses/resp_1", {}, None, "response_id"),
    ("GET", "/v1/models/no-such-model", {}, None, "model"),
    ("POST", "/v1/completions", {}, {"model": "no-such-model", "prompt": "x", "max_tokens": 1},
     "model"),
]


@pytest.mark.parametrize(("method", "path", "headers", "body", "param"), NOT_FOUND,
                         ids=[f"{m} {p}" for m, p, *_ in NOT_FOUND])
def test_every_404_carries_a_not_found_code(client, method, path, headers, body, param):
    """``GET /debug/jobs/{id}`` of an unknown, running or forgotten job (an operator following
    a failed request's ``job_id``, docs/server.md) answered 404 with ``code:
    request.invalid``, the code of the 400 for a malformed id, where every other 404 of the
    server says ``not_found`` (``model_not_found`` for a model): a script telling "no such
    job" from "bad request" by the body's code could not. Every 404 now carries one."""
    r = client.request(method, path, headers=headers, json=body)
    assert r.status_code == 404, r.text
    error, status = r.json()["error"], r.json()["status"]
    assert error["code"] in ("not_found", "model_not_found"), r.text
    assert status["code"] in ("request.not_found", "request.model_not_found"), r.text
    assert status["http_status"] == 404 and status["grpc_code"] == "NOT_FOUND", r.text
    assert error["param"] == param, r.text
