"""Issue 24 item 7, the server's small edges found by probing: each a request that used to get
a 500 (or a traceback in the log) and now gets the documented answer naming why. Real executor
on the bundled emulator; TestClient or a loopback uvicorn; every wait bounded."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import started_executor

TOKEN = "edges-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    yield executor
    executor.shutdown(5.0)


@pytest.fixture
def client(executor):
    with TestClient(create_app(executor, ServerConfig(admin_token=TOKEN))) as client:
        yield client


@pytest.mark.parametrize("job_id", ["%C2%B2", "%D9%A3", pytest.param("1" * 5000, id="5000-digits"),
                                    "-1", "0x1"])
def test_a_job_id_that_is_not_ascii_digits_is_a_400_naming_it(client, job_id):
    """``"²".isdigit()`` is True and ``int("²")`` raises: a 500 before the fix; so did 5000
    digits (past Python's int() digit limit)."""
    r = client.get(f"/debug/jobs/{job_id}", headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "job_id" and error["message"].startswith("job_id=")


def test_the_statecharts_without_graphviz_are_a_503_naming_why(client, executor, tmp_path,
                                                              monkeypatch):
    """Graphviz's ``dot`` absent (PATH emptied, the SVG cache cleared): every route that draws
    a chart answers 503 naming graphviz (it was a 500 with a traceback on every hit); the data
    routes still answer."""
    from calexec.drivers.serving import debug

    monkeypatch.setenv("PATH", str(tmp_path))
    debug.chart_svg_cached.cache_clear()
    assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}
                       ).status_code == 200
    job_id = next(i for i in range(1, 1000) if executor.job_trail(i) is not None)
    for route in ("/debug/statecharts", "/debug/statecharts/lifecycle.svg",
                  f"/debug/jobs/{job_id}"):
        r = client.get(route, headers=AUTH)
        assert r.status_code == 503, (route, r.status_code, r.text[:200])
        error = r.json()["error"]
        assert error["code"] == "debug.graphviz_unavailable" and "graphviz" in error["message"]
        assert "not on PATH" in error["message"], error
    assert client.get("/debug/statecharts/live.json").status_code == 200
    assert client.get(f"/debug/jobs/{job_id}?format=json", headers=AUTH).status_code == 200
    debug.chart_svg_cached.cache_clear()  # nothing rendered without dot stays cached
