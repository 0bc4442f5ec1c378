"""Issue 24 item 7, the server's small edges found by probing: each a request that used to get
a 500 (or a traceback in the log) and now gets the documented answer naming why. Real executor
on the bundled emulator; TestClient or a loopback uvicorn; every wait bounded."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    executor_fixture,  # noqa: F401 - the fixture ``executor``
    started_executor,
)

TOKEN = "edges-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


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


def _asgi(app, method: str, path: str, headers: list, chunks: list[dict],
          gone: bool) -> list[dict]:
    """Call ``app`` directly as an ASGI server would: the ``receive`` messages are
    ``chunks``, then a disconnect (``gone``) or nothing more (a watcher of it is cancelled by
    the app once it answered); the messages it sent come back. An exception the app lets
    escape (what the server logs as an ASGI traceback) propagates."""
    import anyio

    sent: list[dict] = []
    queue = list(chunks)

    async def receive() -> dict:
        if queue:
            return queue.pop(0)
        if not gone:
            await anyio.sleep(60)  # the client stays; the app cancels this wait when done
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": method, "scheme": "http", "path": path,
             "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    anyio.run(app, scope, receive, send)
    return sent


def test_a_client_dropping_mid_upload_is_a_cancelled_request_not_an_asgi_traceback(executor):
    """Content-Length 1000, 10 bytes, then the client is gone: ``ClientDisconnect`` used to
    escape ``wire.read_body`` (the server logged "Exception in ASGI application"); now the
    request ends as cancelled (499, counted), nothing escapes."""
    from test_server_support import metric_value

    app = create_app(executor, ServerConfig())
    sent = _asgi(app, "POST", "/v1/completions",
                 [(b"content-type", b"application/json"), (b"content-length", b"1000")],
                 [{"type": "http.request", "body": b'{"prompt":', "more_body": True}],
                 gone=True)
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 499
    admin = _asgi(create_app(executor, ServerConfig(admin_token=TOKEN)), "POST",
                  "/admin/reload", [(b"authorization", AUTH["Authorization"].encode()),
                                    (b"content-length", b"1000")],
                  [{"type": "http.request", "body": b'{"calbin":', "more_body": True}],
                  gone=True)
    assert next(m for m in admin if m["type"] == "http.response.start")["status"] == 499
    metrics = app.state.service.metrics.exposition().decode()
    assert metric_value(metrics, "calexec_request_failures_total",
                        {"code": "request.cancelled"}) == 1


def test_a_content_length_of_non_ascii_digits_is_not_a_500(executor):
    """``"²".isdigit()`` is True and ``int("²")`` raises: the declared length is checked only
    when it is ASCII digits (h11 refuses such a header before the app; other servers may
    not)."""
    app = create_app(executor, ServerConfig())
    body = b'{"prompt": [1, 2], "max_tokens": 1}'
    sent = _asgi(app, "POST", "/v1/completions",
                 [(b"content-type", b"application/json"),
                  (b"content-length", "²".encode("latin-1"))],
                 [{"type": "http.request", "body": body, "more_body": False}],
                 gone=False)
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 200, sent


@pytest.mark.parametrize("key", ["caf\u00e9", "tab\tkey", "key ", ""])
def test_a_server_config_refuses_an_api_key_no_request_could_match(key):
    """Issue 24 item 7, for embedders (``calexec serve`` refuses ``--api-key`` the same way,
    tests/test_cli.py): the key is compared with the stripped latin-1 header a client sends
    in ASCII, so these keys would refuse every request."""
    with pytest.raises(ValueError, match="^api_key (has U\\+|starts or ends|is empty)"):
        ServerConfig(api_key=key)
    assert ServerConfig(api_key="sk-ok key~").api_key == "sk-ok key~"


@pytest.mark.parametrize(("settings", "error", "match"), [
    ({"default_timeout_s": 30.0, "max_timeout_s": 1.0}, ValueError,
     r"^default_timeout_s=30\.0 > max_timeout_s=1\.0"),
    ({"default_timeout_s": float("inf"), "max_timeout_s": float("inf")}, ValueError,
     r"^default_timeout_s=inf: must be finite"),
    ({"release_wait_s": float("inf")}, ValueError, r"^release_wait_s=inf: must be finite"),
    ({"lifecycle_poll_s": float("inf")}, ValueError, r"^lifecycle_poll_s=inf"),
    ({"prearm_min_device_ms": float("nan")}, ValueError, r"^prearm_min_device_ms=nan"),
    ({"body_timeout_s": "30"}, TypeError, r"^body_timeout_s='30': expected a number"),
    ({"model_name": ""}, ValueError, r"^model_name='': must be a non-empty str"),
    ({"model_name": 5}, ValueError, r"^model_name=5: must be a non-empty str"),
    # found at stop 52: a name with a newline or a tab was taken (every response carried it)
    ({"model_name": "qwen\n3"}, ValueError, r"^model_name='qwen\\n3': must be printable"),
    ({"model_name": "qwen\t3"}, ValueError, r"^model_name='qwen\\t3': must be printable"),
    ({"end_token_id": "x"}, ValueError, r"^end_token_id='x': must be a token id"),
    ({"end_token_id": -1}, ValueError, r"^end_token_id=-1: must be a token id"),
    ({"cors_origins": "https://app.example"}, TypeError,
     r"^cors_origins='https://app\.example': expected a tuple of origins, not one str"),
    # found at stop 51: a bool or a float count was taken (True as 1 sequence, 2.5 worker
    # threads), a str count failed with "'>=' not supported", a str flag was true
    ({"max_sequences": True}, TypeError, r"^max_sequences=True: expected an int, got bool"),
    ({"worker_threads": 2.5}, TypeError, r"^worker_threads=2\.5: expected an int"),
    ({"max_choices": "16"}, TypeError, r"^max_choices='16': expected an int"),
    ({"max_body_bytes": 0}, ValueError, r"^max_body_bytes=0: must be finite and >= 1"),
    ({"retry_after_s": -1}, ValueError, r"^retry_after_s=-1: must be finite and >= 0"),
    ({"max_waiting": None}, TypeError, r"^max_waiting=None: expected an int"),
    ({"prearm": "no"}, TypeError, r"^prearm='no': must be True or False, got str"),
    ({"greedy_ahead": 1}, TypeError, r"^greedy_ahead=1: must be True or False, got int"),
    ({"tokenizer_path": 5}, TypeError, r"^tokenizer_path=5: expected a str path or None"),
])
def test_a_server_config_refuses_settings_that_would_fail_every_request(settings, error, match):
    """Found at stop 50 by an embedder: ``default_timeout_s`` above ``max_timeout_s`` was
    accepted, and every request without its own ``timeout`` was then answered 400
    ``timeout=30.0 > max_timeout_s=1.0`` for a field the client never sent; an infinite
    default reached the executor as a deadline it refuses (every request 400); an infinite
    ``release_wait_s`` a wait ``release_sequence`` refuses (every id withheld); a str
    ``body_timeout_s`` failed with ``'>' not supported``; one str ``cors_origins`` was split
    into its characters and refused as ``'h'``; an empty or non-str ``model_name`` was taken
    (``--served-model-name`` refuses it); an ``end_token_id`` of ``"x"`` failed every
    request with a 500 (the decode stream refused it as a stop token). Each is refused when
    built, naming it."""
    with pytest.raises(error, match=match):
        ServerConfig(**settings)
    assert ServerConfig(cors_origins=["https://app.example"]).cors_origins == (
        "https://app.example",)
    assert ServerConfig(default_timeout_s=5.0, max_timeout_s=5.0).default_timeout_s == 5.0


def test_create_app_names_a_config_or_executor_that_is_not_one(tmp_path):
    """``create_app(executor, {"api_key": "k"})`` (the settings as a dict) raised
    ``AttributeError: 'dict' object has no attribute 'max_sequences'``, ``create_app(None)``
    ``'NoneType' object has no attribute 'generation'``, and the arguments swapped ``'Device
    Executor' object has no attribute 'max_sequences'`` (found at stop 50 by an embedder).
    Each is a TypeError naming the argument; the right call still builds the app."""
    executor = started_executor(tmp_path)
    try:
        with pytest.raises(TypeError, match=r"^create_app: config=\{'api_key': 'k'\}: expected "
                                            r"a ServerConfig or None, got dict \(build one"):
            create_app(executor, {"api_key": "k"})
        for bad in (None, "executor"):
            with pytest.raises(TypeError, match=rf"^create_app: executor={bad!r}: expected a "
                                                "started DeviceExecutor"):
                create_app(bad, ServerConfig())
        with pytest.raises(TypeError, match=r"^create_app: config=<calexec"):
            create_app(ServerConfig(), executor)  # swapped: the config is checked first
        with TestClient(create_app(executor)) as client:
            assert client.get("/v1/models").status_code == 200
    finally:
        executor.shutdown(5.0)


def test_an_app_whose_sequence_ids_exceed_the_kv_managers_is_refused(tmp_path):
    """Issue 24 item 7, for embedders: max_seqs=3 takes ids 0..2, so a server leasing 1..6
    would answer 4 of 6 concurrent requests 400 kv.seq_id_out_of_range; refused when the
    app is built (``calexec serve`` names --max-sequences, tests/test_cli.py)."""
    executor = started_executor(tmp_path, "max_seqs=3")
    try:
        with pytest.raises(ValueError, match=r"^max_sequences=6: .* ids 0\.\.2 \(max_seqs=3"):
            create_app(executor, ServerConfig(max_sequences=6))
        service = create_app(executor, ServerConfig(max_sequences=2)).state.service
        assert service.sequences.counts()["capacity"] == 2
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("key", ["9" * 5000, "0" * 4999 + "1"], ids=["5000-nines", "5000-digit-one"])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_logit_bias_key_of_thousands_of_digits_is_a_400_naming_it(client, route, key):
    """``int()`` refuses a string of more than 4300 digits (Python's int_max_str_digits): such
    a ``logit_bias`` key was parsed with ``int(key)`` after an ``isdigit()`` check and the
    ValueError escaped as a 500 ("Internal Server Error", not JSON). A token id is at most
    a few digits: the key is refused as not a token id, naming ``logit_bias``."""
    body = {"max_tokens": 1, "logit_bias": {key: 1}}
    body.update({"prompt": [1, 2]} if route == "/v1/completions"
                else {"messages": [{"role": "user", "content": "hi"}]})
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "logit_bias" and error["message"].startswith("logit_bias["), error
    assert len(error["message"]) < 300, error  # the key is shown cut, not whole
    assert client.post(route, json={**body, "logit_bias": {"0001": 1}}).status_code == 200


def test_a_content_length_of_thousands_of_digits_is_a_413_not_a_500(executor):
    """The declared length was compared with ``int(declared)``, which raises for more than
    4300 digits (h11 and httptools refuse such a header before the app; other ASGI servers
    may not): a length that long exceeds any limit, so it is a 413 without parsing it."""
    app = create_app(executor, ServerConfig())
    sent = _asgi(app, "POST", "/v1/completions",
                 [(b"content-type", b"application/json"), (b"content-length", b"9" * 5000)],
                 [{"type": "http.request", "body": b'{"prompt": [1]}', "more_body": False}],
                 gone=False)
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 413, sent
    zeros = _asgi(app, "POST", "/v1/completions",  # leading zeros: the length is what counts
                  [(b"content-type", b"application/json"),
                   (b"content-length", b"0" * 5000 + b"36")],
                  [{"type": "http.request", "body": b'{"prompt": [1, 2], "max_tokens": 1}',
                    "more_body": False}], gone=False)
    assert next(m for m in zeros if m["type"] == "http.response.start")["status"] == 200, zeros


def _slow_body_client(port: int, path: str, headers: str, stop: threading.Event
                      ) -> socket.socket:
    """A raw loopback client that sends a request head declaring 10000 bytes of body, then
    one byte of it every 0.1 s until ``stop`` is set or the connection breaks (at most 600
    bytes: a minute), never the whole body (slowloris)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10.0)
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json"
                 f"\r\ncontent-length: 10000\r\n{headers}\r\n{{".encode())

    def trickle() -> None:
        for _ in range(600):
            if stop.wait(0.1):
                return
            try:
                sock.sendall(b" ")
            except OSError:
                return
    threading.Thread(target=trickle, name="slowloris", daemon=True).start()
    return sock


@pytest.mark.parametrize("path", ["/v1/completions", "/admin/reload"])
def test_a_body_sent_slowly_is_a_408_within_body_timeout_and_the_connection_closes(
        executor, path):
    """Slowloris: a client sending its body a byte at a time, never the whole of it, held its
    connection (and the route's task) for as long as it kept sending: nothing bounded the
    body's read, so enough such clients exhaust the server's file descriptors. The body must
    now arrive within ``ServerConfig.body_timeout_s`` of the first read: else 408 (OpenAI
    shape, counted), the connection closed, and the server serves on."""
    from test_server_support import ServeLikeServer, metric_value, read_until_closed

    app = create_app(executor, ServerConfig(admin_token=TOKEN, body_timeout_s=0.5))
    stop = threading.Event()
    with ServeLikeServer(app) as server:
        auth = f"authorization: {AUTH['Authorization']}\r\n" if path.startswith("/admin") else ""
        sock = _slow_body_client(server.port, path, auth, stop)
        sock.settimeout(30.0)  # bound of the wait: far past body_timeout_s, short of the trickle
        try:
            data, ended = read_until_closed(sock)
        finally:
            stop.set()
            sock.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), (head[:200], ended)
        error = json.loads(body)["error"]
        assert error["code"] == "request.body_timeout" and "body_timeout_s=0.5" in \
            error["message"], error
        assert ended in ("eof", "reset"), ended  # closed: the rest of the body is not awaited
        ok = httpx.post(f"{server.url}/v1/completions",
                        json={"prompt": [1, 2], "max_tokens": 1}, timeout=30)
        assert ok.status_code == 200, ok.text
        if path == "/v1/completions":
            text = app.state.service.metrics.exposition().decode()
            assert metric_value(text, "calexec_request_failures_total",
                                {"code": "request.body_timeout"}) == 1


@pytest.mark.parametrize("path", ["/v1/completions", "/admin/reload"])
def test_a_413_closes_the_connection_so_a_trickled_body_does_not_hold_it(executor, path):
    """The same slowloris through the 413: a declared length over ``max_body_bytes`` is
    answered at once, but the connection stayed open while uvicorn read the rest of the body
    as that request's, for as long as the client trickled it. The 413 now closes it."""
    from test_server_support import ServeLikeServer, read_until_closed

    app = create_app(executor, ServerConfig(admin_token=TOKEN, max_body_bytes=1000))
    stop = threading.Event()
    with ServeLikeServer(app) as server:
        auth = f"authorization: {AUTH['Authorization']}\r\n" if path.startswith("/admin") else ""
        sock = _slow_body_client(server.port, path, auth, stop)  # declares 10000 bytes
        sock.settimeout(30.0)  # bound of the wait: the trickle lasts a minute
        try:
            data, ended = read_until_closed(sock)
        finally:
            stop.set()
            sock.close()
        assert data.startswith(b"HTTP/1.1 413 "), data[:200]
        assert ended in ("eof", "reset"), (ended, data[:200])


@pytest.mark.parametrize("method, route, code, status", [
    ("GET", "/debug/statecharts/nochart.svg", "not_found", 404),
    ("GET", "/debug/statecharts/runs/nobody", "not_found", 404),
    ("GET", "/debug/statecharts/no/such/page", "not_found", 404),
    ("POST", "/debug/statecharts/live.json", "method_not_allowed", 405),
])
def test_errors_of_the_mounted_statecharts_inspector_are_openai_shaped(client, method, route,
                                                                       code, status):
    """The inspector mounted at /debug/statecharts answered its own errors: an unknown chart
    or run as ``{"error": "<text>"}``, an unknown path as plain-text "Not Found", a wrong
    method as plain-text "Method Not Allowed" (its Starlette app's defaults: the server's
    handlers do not reach a mounted app). Every error of the server is the OpenAI object
    (docs/server.md: 404 unknown chart, 405 + Allow)."""
    r = client.request(method, route)
    assert r.status_code == status, r.text[:200]
    assert r.headers["content-type"] == "application/json", (r.headers, r.text[:200])
    error = r.json()["error"]
    assert isinstance(error, dict) and error["code"] == code, r.text[:300]
    assert error["type"] == "invalid_request_error" and error["message"], error
    if status == 405:
        allowed = r.headers["allow"]  # (Starlette lists a set: either order)
        assert set(allowed.split(", ")) == {"GET", "HEAD"}, allowed
        assert f"allowed: {allowed}" in error["message"], error
    if route.endswith("nochart.svg"):
        assert 'chart="nochart"' in error["message"] and "lifecycle" in error["message"]


def test_the_mounted_inspectors_400_is_request_invalid_not_not_found():
    """The inspector answers a query its run page does not take with a 400 (found at stop
    52); through the server's hook every message was ``request.not_found``, whatever the
    status. A 400 is ``request.invalid``; a 404 stays ``request.not_found``."""
    from starlette.requests import Request

    from calexec.drivers.serving.debug import inspector_error

    request = Request({"type": "http", "method": "GET", "path": "/debug/statecharts/runs/r",
                       "headers": [], "query_string": b"format=xml"})
    for status, code in ((400, "request.invalid"), (404, "not_found")):
        r = inspector_error(request, status, 'format="xml": must be json or html', {})
        body = json.loads(bytes(r.body))
        assert r.status_code == status and body["error"]["code"] == code, body
        assert body["error"]["message"].startswith('format="xml"'), body


@pytest.mark.parametrize("token", ["caf\u00e9", "\u2603-token", " token", ""])
def test_a_server_config_refuses_an_admin_token_no_request_could_match(executor, token):
    """The admin token was taken as given (the api key has been checked since issue 24): a
    non-ASCII token can never match (a client's UTF-8 bytes arrive as latin-1 text and are
    compared re-encoded), nor a token with outer whitespace (header values are stripped),
    nor an empty one (``Bearer`` with nothing after it is a 401): every admin request was
    refused with 401/403 blaming the client. Refused when the config is built, as the api
    key is; a printable ASCII token still works."""
    with pytest.raises(ValueError, match="^admin_token (has U\\+|starts or ends|is empty)"):
        ServerConfig(admin_token=token)
    good = "adm1n token~"
    with TestClient(create_app(executor, ServerConfig(admin_token=good))) as client:
        r = client.post("/admin/drain?grace=x", headers={"Authorization": f"Bearer {good}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "grace", r.text


@pytest.mark.parametrize("penalty", [1e-46, 1e-45, 1e-40, 1e39, 1e300])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_an_extreme_repetition_penalty_never_picks_a_token_outside_the_allowed_ones(
        client, penalty, sampled):
    """Any ``repetition_penalty`` > 0 is accepted, and it is applied in float32: 1e-46
    rounds to 0 and 1e39 to inf, and a logit divided (multiplied) by a tiny (huge) one
    overflows. A masked token's -inf times 0, and a 0 logit times inf, gave NaN, which
    ``argmax`` takes as the largest; two +inf entries made the sampler's probabilities NaN
    and its search fall off the end of the vocabulary: the answers held tokens outside
    ``allowed_token_ids`` (1, or the last id 151935). A penalised logit now stays finite
    (the largest float32 at most; 0 stays 0; a masked token stays masked)."""
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "repetition_penalty": penalty,
            "allowed_token_ids": [5, 6], **({"temperature": 1.0, "seed": 7} if sampled else {})}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text[:300]
    tokens = r.json()["choices"][0]["token_ids"]
    assert tokens and set(tokens) <= {5, 6}, tokens
    if penalty < 1:  # a tiny penalty lifts the seen tokens: one of the prompt's, not the end
        free = client.post("/v1/completions", json={**body, "allowed_token_ids": None})
        assert set(free.json()["choices"][0]["token_ids"]) <= {1, 2, 3}, free.text[:300]


@pytest.mark.parametrize("route", ["/health", "/ready", "/metrics", "/v1/models",
                                   "/v1/models/calexec-qwen3-synthetic", "/tokenizer_info",
                                   "/debug/jobs"])
def test_head_on_a_get_route_answers_as_get_without_a_body(executor, route):
    """RFC 9110 section 9.1: a general-purpose server MUST support HEAD wherever it supports
    GET (load balancers and uptime checks probe with it); FastAPI's ``@app.get`` routes took
    GET alone, so ``HEAD /health`` was a 405. Real uvicorn: same status and content type as
    GET, no body; a POST route's HEAD is still a 405."""
    from test_server_support import ServeLikeServer

    app = create_app(executor, ServerConfig(admin_token=TOKEN))
    with ServeLikeServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        got, head = http.get(route), http.head(route)
        assert head.status_code == got.status_code == 200, (head.status_code, head.text)
        assert head.headers["content-type"] == got.headers["content-type"]
        assert head.content == b""
        refused = http.head("/v1/completions")
        assert refused.status_code == 405 and refused.headers["allow"] == "POST"


def test_a_second_drain_answers_the_grace_of_the_drain_that_runs(tmp_path):
    """``start_drain`` is idempotent: the first drain runs with its grace, a later call
    changes nothing; but ``/admin/drain?grace=1`` after ``?grace=30`` answered 202
    ``{"grace": 1}``, telling the operator the server would be down in a second. It now
    answers the running drain's grace and that it did not start it."""
    executor = started_executor(tmp_path)
    try:
        with TestClient(create_app(executor, ServerConfig(admin_token=TOKEN))) as client:
            first = client.post("/admin/drain", params={"grace": 30}, headers=AUTH)
            assert first.status_code == 202, first.text
            assert first.json() == {"draining": True, "grace": 30.0, "started": True}
            again = client.post("/admin/drain", params={"grace": 1}, headers=AUTH)
            assert again.status_code == 202, again.text
            assert again.json() == {"draining": True, "grace": 30.0, "started": False}
    finally:
        executor.shutdown(5.0)


def _trickle(sock: socket.socket, data: bytes, stop: threading.Event) -> None:
    """Send ``data`` a byte every 0.1 s (in a thread) until ``stop`` or a broken connection."""
    def run() -> None:
        for byte in data:
            if stop.wait(0.1):
                return
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                return
    threading.Thread(target=run, name="slow-head", daemon=True).start()


def test_a_request_head_sent_slowly_or_never_is_cut_at_head_timeout(executor, monkeypatch):
    """Slowloris on the request head: uvicorn bounds neither a new connection that sends
    nothing nor a head that trickles in (its keep-alive timer runs only after a response,
    and the next request's first byte cancels it), so such connections stayed open for as
    long as their clients liked. The server's HTTP protocol (``server.uvicorn_config``) now
    closes a connection whose next request head has not arrived whole within
    ``HEAD_TIMEOUT_S`` of the connection or of its last response; it serves on."""
    from calexec.drivers.serving import server as server_module
    from test_server_support import ServeLikeServer, read_until_closed

    monkeypatch.setattr(server_module, "HEAD_TIMEOUT_S", 0.5, raising=False)
    stop = threading.Event()
    with ServeLikeServer(create_app(executor, ServerConfig())) as server:
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=30.0)
        slow = socket.create_connection(("127.0.0.1", server.port), timeout=30.0)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        _trickle(slow, b"x-slow: " + b"a" * 600, stop)  # a minute of header bytes
        again = socket.create_connection(("127.0.0.1", server.port), timeout=30.0)
        body = b'{"prompt": [1, 2], "max_tokens": 1}'
        again.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
                      b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        first = again.recv(1 << 16)  # the answer to the first request (kept alive)
        assert first.startswith(b"HTTP/1.1 200 "), first[:200]
        again.sendall(b"GET /health HTTP/1.1\r\n")  # then the next head, never finished
        _trickle(again, b"x-slow: " + b"a" * 600, stop)
        try:
            for sock in (silent, slow, again):  # each bounded by its 30 s socket timeout
                data, ended = read_until_closed(sock)
                assert ended in ("eof", "reset") and b"HTTP/1.1 200" not in data, (ended, data)
        finally:
            stop.set()
            for sock in (silent, slow, again):
                sock.close()
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize("route, field, value", [
    ("/v1/completions", "best_of", True), ("/v1/completions", "priority", False),
    ("/v1/completions", "length_penalty", True), ("/v1/completions", "use_beam_search", 0),
    ("/v1/completions", "skip_special_tokens", 1),
    ("/v1/completions", "spaces_between_special_tokens", 1.0),
    ("/v1/completions", "return_tokens_as_token_ids", 0),
    ("/v1/chat/completions", "echo", 0), ("/v1/chat/completions", "priority", 0.0),
])
def test_a_refused_parameter_of_the_wrong_type_is_refused_even_when_equal_to_neutral(
        client, route, field, value):
    """Refused parameters are accepted at their neutral value (``best_of: 1``,
    ``use_beam_search: false``): compared with ``==``, so ``true == 1`` and ``0 == false``
    passed, and ``best_of: true`` was a 200, though a known field of the wrong type is a
    400 naming it (docs/server.md). The neutral value must have its type too."""
    body = {"max_tokens": 1, field: value}
    body.update({"prompt": [1, 2]} if route == "/v1/completions"
                else {"messages": [{"role": "user", "content": "hi"}]})
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}="), error
    neutral = {"best_of": 1, "priority": 0, "length_penalty": 1.0, "use_beam_search": False,
               "skip_special_tokens": True, "spaces_between_special_tokens": True,
               "return_tokens_as_token_ids": False, "echo": False}[field]
    assert client.post(route, json={**body, field: neutral}).status_code == 200


def test_a_whole_answer_its_client_never_reads_is_dropped_after_head_timeout(executor,
                                                                            monkeypatch):
    """A non-streamed answer is written whole into the connection's buffer at once (the
    app's send never waits), so a client that never reads it held it there for good:
    uvicorn's keep-alive close waits for the buffer to drain, and a stream's send bound
    does not apply. 177 KB here (logprobs; an answer of 16 choices can be megabytes), per
    such client, for ever. Now a connection whose answer has not been read at all
    ``HEAD_TIMEOUT_S`` after it was sent is aborted, the buffer dropped."""
    from calexec.drivers.serving import server as server_module
    from test_server_support import ServeLikeServer, stalled_client, wait_for

    monkeypatch.setattr(server_module, "HEAD_TIMEOUT_S", 0.5)
    with ServeLikeServer(create_app(executor, ServerConfig()), small_buffers=True) as server:
        connections = server.server.server_state.connections
        for close in (False, True):  # kept alive, or closed after the answer (HTTP/1.0 too)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
            sock.settimeout(10.0)
            sock.connect(("127.0.0.1", server.port))
            payload = json.dumps({"prompt": [1, 2, 3], "max_tokens": 300, "logprobs": 20})
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                         f"{'connection: close' if close else 'x-kept: alive'}\r\n"
                         f"content-type: application/json\r\ncontent-length: {len(payload)}"
                         f"\r\n\r\n{payload}".encode())  # then never reads
            try:
                wait_for(lambda: len(connections) == 1, 30, "the stalled connection")
                wait_for(lambda: not connections, 30, f"the unread answer's connection to "
                         f"end (connection: close {close})")
            finally:
                sock.close()
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        # a client that reads, slowly (8 KiB every 0.1 s: more than HEAD_TIMEOUT_S in all),
        # gets its whole answer
        slow = stalled_client(server.port, {"prompt": [1, 2, 3], "max_tokens": 300,
                                            "logprobs": 20})
        try:
            data, pause = b"", threading.Event()
            for _ in range(2000):  # bounded: the answer is some 25 reads
                head, _, body = data.partition(b"\r\n\r\n")
                if body and len(body) >= int(head.split(b"content-length: ")[1]
                                             .split(b"\r\n")[0]):
                    break
                pause.wait(0.1)
                chunk = slow.recv(8192)  # (the socket's 10 s timeout bounds each read)
                assert chunk, ("closed before the whole answer", len(data))
                data += chunk
        finally:
            slow.close()
        answer = json.loads(data.partition(b"\r\n\r\n")[2])
        assert len(answer["choices"][0]["token_ids"]) == 300


def test_an_unexpected_error_in_a_route_is_an_openai_shaped_500_and_counted(executor,
                                                                           monkeypatch):
    """A bug no input was found to trigger (the sweep's fuzzing found none): the answer is
    still the documented error shape, not Starlette's plain-text page, and it is counted."""
    from calexec.drivers.serving import openai_api

    def broken(model, raw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(openai_api, "parse", broken)
    app = create_app(executor, ServerConfig(admin_token=TOKEN))
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "server.unexpected_error"
        assert "RuntimeError" in error["message"] and "a bug" not in error["message"]
        # the id the answer would have had (docs/server.md "Request ids"), or the client's
        assert r.headers["x-request-id"].startswith("cmpl-")
        mine = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1},
                           headers={"X-Request-Id": "bug-1"})
        assert (mine.status_code, mine.headers["x-request-id"]) == (500, "bug-1")
        metrics = client.get("/metrics").text
    assert 'code="server.unexpected_error"' in metrics


@pytest.mark.parametrize("garbage", [
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,  # a TLS ClientHello
    b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\nbad header line\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\ncontent-length: 5\r\ncontent-length: 7\r\n\r\nabcde",
])
def test_bytes_that_are_not_an_http_request_get_an_openai_shaped_400(executor, garbage):
    """uvicorn's own answer to bytes its HTTP parser refuses was a plain-text 400 ("Invalid
    HTTP request received."): the one error of this server that was not OpenAI-shaped JSON.
    It is now the JSON body every other error has, code ``request.malformed_http``, and the
    connection closes; the server serves on."""
    from test_server_support import ServeLikeServer, read_until_closed

    with ServeLikeServer(create_app(executor, ServerConfig())) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30.0)
        try:
            sock.sendall(garbage)
            data, ended = read_until_closed(sock)
        finally:
            sock.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), data[:300]
        assert b"content-type: application/json" in head.lower(), head
        error = json.loads(body)["error"]
        assert error["code"] == "request.malformed_http" and error["message"], error
        assert error["type"] == "invalid_request_error"
        assert ended in ("eof", "reset")
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_an_embedders_tokenizer_path_that_cannot_be_loaded_is_named_as_its_setting(tmp_path):
    """``create_app(executor, ServerConfig(tokenizer_path=...))`` with a path that is no
    tokenizer.json said ``--tokenizer='...': ...``, a flag the embedder never gave (found at
    stop 50). The error names ``tokenizer_path``; ``calexec serve`` still names its flag
    (tests/test_cli.py)."""
    from calexec.drivers.serving.hf_tokenizer import TokenizerLoadError

    not_json = tmp_path / "tokenizer.json"
    not_json.write_text("not a tokenizer")
    executor = started_executor(tmp_path)
    try:
        for bad in (str(tmp_path), str(not_json)):
            with pytest.raises(TokenizerLoadError, match=rf"^tokenizer_path={bad!r}: "):
                create_app(executor, ServerConfig(tokenizer_path=bad))
    finally:
        executor.shutdown(5.0)
