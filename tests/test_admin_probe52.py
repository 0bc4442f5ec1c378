"""Stop 52's probe of adversarial admin input (docs/traceability.md, "Found at stop 52
(cliadmin)"): a drain without ``?grace=`` drains with the server's own grace, and the job page's
``format`` is json or html or a 400 naming it. Real executor on the bundled emulator,
TestClient; every wait bounded."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    executor_fixture,  # noqa: F401 - the fixture ``executor``
    server_idle,
    started_executor,
    wait_for,
)

TOKEN = "probe52-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def client(executor):
    with TestClient(create_app(executor, ServerConfig(admin_token=TOKEN))) as client:
        yield client


@pytest.fixture(scope="module")
def job_id(client, executor) -> int:
    """A finished job of a completion, whose page the tests ask for."""
    r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 200, r.text
    return next(i for i in range(1, 1000) if executor.job_trail(i) is not None)


@pytest.mark.parametrize("grace", [7.5, 0.0])
def test_a_drain_without_a_grace_drains_with_the_servers_own(tmp_path, grace):
    """``calexec serve --grace 5`` and ``POST /admin/drain`` (no ``?grace=``): the drain took
    30 s whatever ``--grace`` said (past a pod's termination period, say); now it takes the
    server's drain grace (``ServerConfig.drain_grace_s``, which ``--grace`` sets)."""
    executor = started_executor(tmp_path)
    try:
        app = create_app(executor, ServerConfig(admin_token=TOKEN, drain_grace_s=grace))
        service = app.state.service
        with TestClient(app) as client:
            r = client.post("/admin/drain", headers=AUTH)
            assert r.status_code == 202, r.text
            assert r.json() == {"draining": True, "grace": grace, "started": True}
            wait_for(lambda: service.drain_status is not None, what="drain")
        assert service.drain_status.ok and executor.state == "Stopped"
    finally:
        executor.shutdown(5.0)


def test_a_drain_grace_in_the_query_still_wins_over_the_servers(tmp_path):
    executor = started_executor(tmp_path)
    try:
        app = create_app(executor, ServerConfig(admin_token=TOKEN, drain_grace_s=7.5))
        with TestClient(app) as client:
            r = client.post("/admin/drain", params={"grace": 2}, headers=AUTH)
            assert r.status_code == 202 and r.json()["grace"] == 2.0, r.text
            wait_for(lambda: app.state.service.drain_status is not None, what="drain")
    finally:
        executor.shutdown(5.0)


def test_a_server_config_refuses_a_drain_grace_that_is_no_seconds():
    for bad in (-1.0, float("nan"), float("inf"), "5", True):
        with pytest.raises((TypeError, ValueError), match="drain_grace_s"):
            ServerConfig(drain_grace_s=bad)


@pytest.mark.parametrize("query, param, said", [
    ({"format": "JSON"}, "format", 'format="JSON": must be one of html, json'),
    ({"format": "xml"}, "format", 'format="xml": must be one of html, json'),
    ([("format", "json"), ("format", "html")], "format",
     'format="json": given 2 times in the query, give it once'),
    ({"fromat": "json"}, "fromat", "fromat: unknown parameter, refused"),
])
def test_a_job_pages_query_it_does_not_take_is_a_400_naming_it(client, job_id, query, param,
                                                               said):
    """``GET /debug/jobs/{id}?format=JSON`` (or ``xml``, a typo of the key, the key twice)
    answered the HTML page, 200, as if the format had been honoured; now a 400 naming the
    parameter and the value, as ``/admin/drain`` does for its query."""
    r = client.get(f"/debug/jobs/{job_id}", params=query, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(said), error


@pytest.mark.parametrize("query, wanted", [
    ({"format": ""}, "text/html"), ({"format": "  "}, "text/html"),
    ([("format", ""), ("format", "json")], "application/json")])
def test_a_job_pages_format_given_empty_is_not_given(client, executor, job_id, query, wanted):
    """Found at stop 58: ``?format=`` (an empty form field, a client's null left out) was a
    400 ``format="": must be one of html, json`` here while the inspector's own ``runs/{id}``
    and every inspector route take a parameter given empty or blank as not given (stop 58's
    toolkit probe): the default page, or the one non-empty value, as there."""
    r = client.get(f"/debug/jobs/{job_id}", params=query, headers=AUTH)
    assert r.status_code in (200, 503), r.text  # (503: the HTML page needs graphviz's dot)
    if r.status_code == 503:
        assert r.json()["error"]["code"] == "debug.graphviz_unavailable", r.text
        assert wanted == "text/html"
        return
    assert r.headers["content-type"].startswith(wanted), r.headers
    if wanted == "application/json":
        assert r.json() == executor.job_trail(job_id)


def test_a_job_pages_json_format_is_still_the_data(client, executor, job_id):
    r = client.get(f"/debug/jobs/{job_id}", params={"format": "json"}, headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    assert r.json() == executor.job_trail(job_id)
    # a refused query is refused before the job is looked up, and behind the admin token
    assert client.get("/debug/jobs/999999", params={"format": "x"}, headers=AUTH
                      ).status_code == 400
    assert client.get(f"/debug/jobs/{job_id}", params={"format": "x"}).status_code == 401
    assert server_idle(client.app.state.service)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32-le"])
def test_a_reload_body_that_is_not_utf8_json_is_refused_as_the_apis_are(client, executor,
                                                                        encoding):
    """``json.loads`` of bytes detects UTF-16 and -32: a reload body in either was read (and
    the path it named checked, 400 ``calbin.not_found`` here) where docs/server.md says a
    body that is not UTF-8 is a 400 ``body: ...``; now it is, naming the encoding, nothing
    checked or moved, and the OpenAI routes answer the same bytes the same way."""
    generation = executor.gen.id
    raw = '{"calbin": "/nonexistent/probe52.calbin"}'.encode(encoding)
    r = client.post("/admin/reload", content=raw, headers={**AUTH,
                                                          "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] is None and error["message"].startswith(
        "body: JSON must be UTF-8"), error
    assert executor.gen.id == generation and executor.state == "Ready"
    api = client.post("/v1/completions", content='{"prompt": [1], "max_tokens": 1}'.encode(
        encoding), headers={"Content-Type": "application/json"})
    assert api.status_code == 400, api.text
    assert api.json()["error"]["message"] == error["message"], api.text


def test_a_reload_body_behind_a_utf8_byte_order_mark_is_read_as_the_apis_are(client, executor):
    """The two helpers of stop 52 each aligned one route with the other's old answer: the
    OpenAI routes came to read a body behind a UTF-8 byte order mark (RFC 8259 section 8.1:
    a parser may ignore it), while ``/admin/reload`` came to refuse it. Both read it now: the
    reload checks the path it names (400 ``calbin``, not a ``body`` refusal)."""
    raw = '{"calbin": "/nonexistent/probe52.calbin"}'.encode("utf-8-sig")
    r = client.post("/admin/reload", content=raw, headers={**AUTH,
                                                          "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "calbin", r.text
    api = client.post("/v1/completions", content='{"prompt": [1], "max_tokens": 1}'.encode(
        "utf-8-sig"), headers={"Content-Type": "application/json"})
    assert api.status_code == 200, api.text
