"""Found at stop 57 (server): each test names what a user hit before its fix (docs/traceability.md,
"Found at stop 57 (server)"). Real executor on the bundled emulator; every wait bounded."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import started_executor

TOKEN = "probe57-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("probe57"))
    try:
        with TestClient(create_app(executor, ServerConfig(admin_token=TOKEN))) as client:
            yield client
    finally:
        executor.shutdown(5.0)


# ---- /debug and /admin: a query parameter a route does not take -----------------------------
@pytest.mark.parametrize("path", [
    "/debug/jobs", "/debug/statecharts", "/debug/statecharts/live.json",
])
def test_a_debug_route_refuses_a_query_parameter_it_does_not_take_naming_it(client, path):
    """``GET /debug/jobs?limt=5`` (and the statecharts' redirect and ``live.json``) answered
    200 as if the parameter had been honoured, where ``/debug/jobs/{id}``, ``runs/{id}``
    and the ``/admin`` routes answer a 400 naming it; now every ``/debug`` route does."""
    r = client.get(path, params={"limt": "5"}, follow_redirects=False)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith("limt: unknown parameter"), error
    assert error["type"] == "invalid_request_error"
    assert client.get(path, follow_redirects=False).status_code in (200, 307)


@pytest.mark.parametrize("method, path, query, headers", [
    ("GET", "/debug/jobs", "zeta=1&alpha=2", {}),
    ("POST", "/admin/drain", "zeta=1&alpha=2&grace=0", AUTH),
    ("POST", "/admin/reload", "zeta=1&alpha=2", AUTH),
    ("GET", "/debug/jobs/1", "zeta=1&alpha=2&format=json", AUTH),
])
def test_every_unknown_query_parameter_is_named_not_only_the_first(client, method, path, query,
                                                                  headers):
    """Two mistyped parameters: the 400 named one of them, and the client fixing it met the
    other on its next try; the message names both now (``param`` the first, sorted)."""
    r = client.request(method, f"{path}?{query}", headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "alpha", error
    assert error["message"].startswith("alpha, zeta: unknown parameters, refused"), error
