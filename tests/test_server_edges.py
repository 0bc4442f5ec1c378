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
