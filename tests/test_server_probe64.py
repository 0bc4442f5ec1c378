"""Adversarial HTTP and admin input found by probing a loopback ``calexec serve`` at stop 64
(branch probe-http): a number longer than the JSON parsers read, and two model switches at
once, and a client still sending its body when a drain ended. Real executor on the bundled
emulator; every wait bounded."""

from __future__ import annotations

import json
import signal
import socket
import threading

import httpx
import pytest

from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.machines.executor import DeviceExecutor
from test_ops_sweep import serve_process, stopped
from test_server_support import (
    ServeLikeServer,
    admin_test_client,
    executor_fixture,  # noqa: F401 - the fixture ``executor``
    read_until_closed,
    server_idle,
    split_head,
    started_executor,
)

TOKEN = "probe64-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: an integer of 5000 digits: valid JSON (RFC 8259 sets no bound), past the 4300 digits both
#: of the server's JSON parsers read
HUGE = "9" * 5000


@pytest.fixture
def client(executor):
    with admin_test_client(executor, TOKEN) as client:
        yield client


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", '{"prompt": "hi", "max_tokens": %s}', "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "temperature": -%s.5}', "temperature"),
    ("/v1/completions", '{"prompt": [1, %s]}', "prompt.1"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "x"}], "seed": %se3}', "seed"),
    ("/v1/responses", '{"input": "x", "max_output_tokens": %s}', "max_output_tokens"),
    ("/tokenize", '{"prompt": [%s]}', "prompt.0"),
    ("/admin/reload", '{"calbin": %s}', "calbin"),
], ids=["max_tokens", "float", "prompt-id", "chat-exponent", "responses", "tokenize", "reload"])
def test_a_number_longer_than_the_parser_reads_is_a_400_naming_its_field(client, route, body,
                                                                         param):
    """A number of more than 4300 digits was refused in the parser's words: ``body: Invalid
    JSON: number out of range at line 1 column 4330`` (a syntax error the client did not
    make, no field named) on the API's routes, and on ``/admin/reload`` Python's, cut
    mid-word: ``body: not valid JSON (Exceeds the limit (4300 digits) for integer string
    conversion: ... use sys.set_int_max_str_digits() t)``. Now the field and the number's
    length are named."""
    r = client.post(route, content=(body % HUGE).encode(),
                    headers={"content-type": "application/json", **AUTH})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}=")
    assert "5000 digits" in error["message"] and "(4300;" in error["message"], error
    assert "Invalid JSON" not in error["message"] and "sys." not in error["message"], error
    assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}
                       ).status_code == 200  # the server serves on


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2}),
], ids=["completion", "chat"])
@pytest.mark.parametrize("option, value, written", [
    ("include_usage", "yes", '"yes"'), ("continuous_usage_stats", 1, "1"),
    ("include_obfuscation", [], "[]")])
def test_a_stream_option_that_is_no_boolean_is_refused_naming_its_value(
        client, route, body, option, value, written):
    """``stream_options: {"include_usage": "yes"}`` was refused ``stream_options.include_usage:
    must be a boolean``, the one refusal of a value that did not name it (docs/server.md: the
    bad field and its value); now ``stream_options.include_usage="yes": ...``."""
    r = client.post(route, json={**body, "stream": True, "stream_options": {option: value}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "stream_options", error
    assert error["message"] == (f"stream_options.{option}={written}: must be a boolean, true "
                                "or false"), error


class HeldSwitch(DeviceExecutor):
    """An executor whose first ``switch_model`` waits (bounded) for ``release`` before it
    starts: a switch caught between the admin's checks and the lifecycle's first move."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []
        self.entered, self.release = threading.Event(), threading.Event()

    def switch_model(self, calbin_path):
        self.calls.append(str(calbin_path))
        if len(self.calls) == 1:
            self.entered.set()
            self.release.wait(30.0)
        return super().switch_model(calbin_path)


def test_a_reload_while_another_has_not_moved_the_lifecycle_yet_is_refused(tmp_path):
    """Two ``POST /admin/reload`` at once (two operators, a retried call) both found the
    lifecycle Ready and both switched: the executor ran the second after the first (two
    drains, two generations), and the first's 200 said ``"lifecycle": "Recovering"`` (read
    after the second switch began) though docs/operations.md says a reload while another
    switch runs is a 503. The second is now that 503 naming the switch under way; the
    first answers its own generation, Ready."""
    executor = started_executor(tmp_path, executor_class=HeldSwitch)
    assert isinstance(executor, HeldSwitch)
    calbin = executor.config.calbin_path
    answers: list[httpx.Response] = []
    try:
        app = create_app(executor, ServerConfig(admin_token=TOKEN))
        with ServeLikeServer(app) as server:
            first = threading.Thread(target=lambda: answers.append(httpx.post(
                f"{server.url}/admin/reload", json={"calbin": calbin}, headers=AUTH,
                timeout=60.0)))
            first.start()
            try:
                assert executor.entered.wait(30.0), "the first reload never reached the switch"
                r = httpx.post(f"{server.url}/admin/reload", json={"calbin": calbin},
                               headers=AUTH, timeout=60.0)
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"], r.headers
                error = r.json()["error"]
                assert error["param"] == "calbin" and error["code"] == "lifecycle.unavailable"
                assert "under way" in error["message"] and calbin in error["message"], error
                assert executor.calls == [calbin], executor.calls  # nothing else moved
            finally:
                executor.release.set()
                first.join(60.0)
            assert len(answers) == 1 and answers[0].status_code == 200, answers
            assert answers[0].json() == {"reloaded": True, "calbin": calbin,
                                         "generation": 2, "lifecycle": "Ready"}
            # the next reload, once the first answered, switches
            r = httpx.post(f"{server.url}/admin/reload", json={"calbin": calbin},
                           headers=AUTH, timeout=60.0)
            assert r.status_code == 200 and r.json()["generation"] == 3, r.text
            assert server_idle(app.state.service)
    finally:
        executor.release.set()
        executor.shutdown(5.0)


def _body_cut_by_sigterm(tmp_path, route: str, head: bytes, body: bytes, *serve_args: str
                         ) -> tuple[bytes, str, int, str]:
    """A ``calexec serve`` process (``serve_args``) and one loopback connection: a whole
    ``GET /health`` first (the connection is the server's before the partial request), then
    ``POST route`` with ``head``'s extra header lines and all of ``body`` but 4 bytes, then
    SIGTERM. What came back until the server closed, how (``read_until_closed``), and the
    process's exit code and stderr (``stopped``); the process is killed if it is still up."""
    proc, url = serve_process(tmp_path, *serve_args)
    port = int(url.rsplit(":", 1)[1])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = b""
            while b"}" not in answer:  # (the /health answer is one JSON object)
                chunk = sock.recv(4096)
                assert chunk, f"the connection closed after {answer!r}"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            sock.sendall(f"POST {route} HTTP/1.1\r\nhost: x\r\n".encode() + head
                         + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n"
                         % len(body) + body[:-4])
            proc.send_signal(signal.SIGTERM)
            data, how = read_until_closed(sock)
        code, stderr = stopped(proc)
        return data, how, code, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


@pytest.mark.parametrize("route, head", [
    ("/v1/completions", b""),
    ("/admin/reload", b"authorization: Bearer " + TOKEN.encode() + b"\r\n"),
], ids=["completion", "reload"])
def test_a_client_still_sending_its_body_when_a_drain_ends_gets_the_draining_503(
        tmp_path, route, head):
    """``calexec serve``, a client that sent its request head and part of its body, SIGTERM:
    once the drain ended, uvicorn cut the connection after ``SHUTDOWN_WAIT_S`` and its client
    got uvicorn's plain-text ``500 Internal Server Error`` (no JSON, no ``x-request-id``: a
    bug to its client, which the forced exit's cut no longer answers either). It now gets the
    draining 503 (OpenAI-shaped, ``Retry-After``, ``Connection: close``) when the drain stops
    waiting for requests (here at once: none was admitted), and the server exits 0 without an
    ERROR line."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode()
    data, how, code, stderr = _body_cut_by_sigterm(tmp_path, route, head, body, "--grace", "1",
                                                   "--admin-token-file", str(token))
    status, headers, rest = split_head(data)
    assert status == b"HTTP/1.1 503 Service Unavailable", (data[:400], how)
    assert headers["content-type"] == "application/json" and headers["x-request-id"], headers
    assert headers["retry-after"] and headers["connection"] == "close", headers
    error = json.loads(rest)["error"]
    assert error["code"] == "lifecycle.unavailable", error
    assert error["message"].startswith("server drained: no admitted request was left "
                                       "running, and it stopped waiting, before the "
                                       "request's body arrived whole"), error
    assert how == "eof", how
    assert code == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr[-3000:]


def test_a_body_a_drain_cut_before_its_grace_was_over_is_not_told_the_grace_ran_out(tmp_path):
    """The draining 503 of a body still arriving said "its grace ran out" whenever the drain
    stopped waiting for requests, also at once with none admitted: ``--grace 30``, the body's
    client was told the 30 s had run out a moment after SIGTERM. It says why the drain
    stopped waiting: no admitted request left (the grace's end says the grace)."""
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode()
    data, how, code, stderr = _body_cut_by_sigterm(tmp_path, "/v1/completions", b"", body,
                                                   "--grace", "30")
    status, _, rest = split_head(data)
    assert status == b"HTTP/1.1 503 Service Unavailable", (data[:400], how)
    message = json.loads(rest)["error"]["message"]
    assert "grace" not in message, message
    assert "no admitted request was left running" in message, message
    assert code == 0, stderr[-3000:]
