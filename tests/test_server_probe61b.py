"""Stop 61's second server probe (docs/traceability.md "Found at stop 61 (server-b)"): the
URL written for an IPv6 ``--host``, a body that holds nothing, vLLM's ``/ping`` and
``/version``, a refused integer field written as a float. Loopback servers on the bundled
emulator; every wait bounded."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from calexec import __version__
from calexec.drivers.serving.server import create_app, listening_url
from calexec.drivers.serving.service import ServerConfig
from test_server_support import ServeLikeServer, started_executor

TIMEOUT_S = 30.0
ADMIN = "probe61b-admin-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    try:
        with ServeLikeServer(create_app(executor, ServerConfig(admin_token=ADMIN))) as live:
            yield live
    finally:
        executor.shutdown(5.0)


def _url(server) -> str:
    return f"http://127.0.0.1:{server.port}"


# ---- the URL of an IPv6 --host ----------------------------------------------------------------
@pytest.mark.parametrize(("host", "reachable", "url"), [
    ("::1", False, "http://[::1]:8000"),
    ("fe80::1%eth0", False, "http://[fe80::1%25eth0]:8000"),
    ("::", True, "http://[::1]:8000"),
    ("::", False, "http://[::]:8000"),
    ("0.0.0.0", True, "http://127.0.0.1:8000"),
    ("127.0.0.1", False, "http://127.0.0.1:8000"),
    ("localhost", True, "http://localhost:8000"),
], ids=["v6-loopback", "v6-zone", "v6-wildcard-reachable", "v6-wildcard", "v4-wildcard",
        "v4", "name"])
def test_the_url_of_a_host_writes_an_ipv6_address_in_brackets(host, reachable, url):
    """``serve --ray`` wrote its URL from ``--host`` as ``http://{host}:{port}``: with
    ``--host ::1`` it printed ``serving http://::1:8000`` and ``--once`` sent its sample to
    that, which no client parses (RFC 3986 section 3.2.2: an IPv6 literal goes in brackets).
    Every URL the command writes from a host now comes from ``listening_url`` (the plain
    server's startup lines, its ``--once`` sample, ``--ray``'s)."""
    assert listening_url(host, 8000, reachable=reachable) == url
    httpx.URL(url)  # a URL a client parses


def test_serve_once_on_ipv6_loopback_logs_and_asks_a_bracketed_url():
    """End to end: ``serve --host ::1 --once`` logs the bound and listening URLs and sends
    its sample to ``http://[::1]:PORT`` (exit 0)."""
    done = subprocess.run([sys.executable, "-m", "calexec", "serve", "--host", "::1", "--once",
                           "--log-level", "info"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert "serving http://[::1]:" in done.stdout, done.stdout[:500]
    assert "bound http://[::1]:" in done.stderr, done.stderr[-2000:]
    assert "listening on http://[::1]:" in done.stderr, done.stderr[-2000:]
    assert "http://::1" not in done.stdout + done.stderr


# ---- a body that holds nothing ----------------------------------------------------------------
@pytest.mark.parametrize(("route", "raw", "said"), [
    ("/admin/reload", b"", 'body: empty: send {"calbin": PATH}'),
    ("/admin/reload", b" \r\n\t", 'body: no JSON value, only whitespace (4 bytes): send '
                                  '{"calbin": PATH}'),
    ("/admin/reload", b"\xef\xbb\xbf", "body: no JSON value, a UTF-8 byte order mark alone"),
    ("/v1/completions", b"", "body: empty: send a JSON object with prompt"),
    ("/v1/chat/completions", b"\n", "body: no JSON value, only whitespace (1 bytes): send a "
                                    "JSON object with messages"),
    ("/tokenize", b"", "body: empty: send a JSON object"),
    ("/detokenize", b"  ", "body: no JSON value, only whitespace (2 bytes): send a JSON "
                           "object with tokens"),
], ids=["reload-empty", "reload-blank", "reload-bom", "completions", "chat", "tokenize",
        "detokenize"])
def test_a_body_that_holds_nothing_is_a_400_saying_so_and_what_to_send(server, route, raw,
                                                                      said):
    """An empty ``/admin/reload`` body (``curl -X POST`` without ``-d``) was told ``body:
    not valid JSON (Expecting value: line 1 column 1 (char 0))``, the API's routes ``body:
    Invalid JSON: EOF while parsing a value at line 1 column 0``: a syntax error in a body
    the client did not send, nothing said of what to send. Now the 400 says the body is
    empty (or whitespace alone) and what it should hold."""
    r = httpx.post(_url(server) + route, content=raw, timeout=TIMEOUT_S,
                   headers={"content-type": "application/json",
                            "authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["message"].startswith(said), error
    assert error["param"] is None
    assert "Expecting value" not in error["message"] and "EOF" not in error["message"]


def test_an_empty_drain_body_is_still_taken(server):
    """(``/admin/drain`` takes no body: an empty one is no refusal; checked with a grace it
    refuses, so nothing drains.)"""
    r = httpx.post(_url(server) + "/admin/drain?grace=-1", content=b"", timeout=TIMEOUT_S,
                   headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "grace", r.text[:300]


# ---- vLLM's /ping and /version ----------------------------------------------------------------
@pytest.mark.parametrize("method", ["GET", "POST", "HEAD"])
def test_ping_answers_as_vllms_a_200_with_no_body_while_serving(server, method):
    """vLLM serves ``/ping`` (GET and POST: SageMaker's health probe, which some load
    balancers and harnesses use) as its ``/health``, 200 with no body; it was a 404 here."""
    r = httpx.request(method, _url(server) + "/ping", timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text[:300]
    assert r.content == b""


def test_version_answers_as_vllms(server):
    """vLLM's ``GET /version`` is ``{"version": ...}``; it was a 404 here."""
    r = httpx.get(_url(server) + "/version", timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text[:300]
    assert r.json() == {"version": __version__}


def test_ping_is_a_503_once_the_server_drains(tmp_path):
    """A draining server will not serve again: ``/ping`` says so (503, ``Retry-After``), so
    a probe routes away, as vLLM's does once its engine is dead."""
    executor = started_executor(tmp_path)
    try:
        with ServeLikeServer(create_app(executor, ServerConfig(admin_token=ADMIN))) as live:
            url = _url(live)
            assert httpx.get(url + "/ping", timeout=TIMEOUT_S).status_code == 200
            drained = httpx.post(url + "/admin/drain?grace=0", timeout=TIMEOUT_S,
                                 headers={"authorization": f"Bearer {ADMIN}"})
            assert drained.status_code == 202, drained.text[:300]
            r = httpx.get(url + "/ping", timeout=TIMEOUT_S)
            assert r.status_code == 503, r.text[:300]
            assert "draining" in r.json()["error"]["message"]
            assert r.headers.get("retry-after")
    finally:
        executor.shutdown(5.0)


# ---- a refused integer field written as a float -----------------------------------------------
@pytest.mark.parametrize(("route", "fields", "told"), [
    ("/v1/completions", '"prompt": "hi", "max_tokens": 1E0', "max_tokens=1E0: "),
    ("/v1/completions", '"prompt": "hi", "n": 2.50', "n=2.50: "),
    ("/v1/completions", '"prompt": "hi", "seed": 1.0e0', "seed=1.0e0: "),
    ("/v1/completions", '"prompt": "hi", "max_tokens": 1e400', "max_tokens=1e400: "),
    ("/v1/completions", '"prompt": [5, 6, 7E0]', "prompt[2]=7E0: "),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "hi"}], '
                             '"top_logprobs": 2E0', "top_logprobs=2E0: "),
], ids=["max_tokens", "n", "seed", "past-a-double", "prompt-id", "chat-top_logprobs"])
def test_a_refused_integer_written_as_a_float_is_shown_as_written(server, route, fields, told):
    """A number the parser made a float of was shown as Python prints it: ``max_tokens:
    1E0`` told ``max_tokens=1.0``, ``n: 2.50`` ``n=2.5``, ``1e400`` ``Infinity``, none of
    which the client wrote (the sampling numbers were already shown as written, stop 60)."""
    r = httpx.post(_url(server) + route, content="{" + fields + "}", timeout=TIMEOUT_S,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert told in message, message
