"""Stop 64's probe with the official ``openai`` SDK (its own retries on: ``max_retries=2``, as
its users run it) and langchain-openai against a loopback server under seeded emulator
faults, KV exhaustion, deadlines and drains: what the client raised and what it sent again,
each pinned here (docs/traceability.md "Found at stop 64 (sdkload)")."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

import needs

openai = needs.module("openai", "clients")
httpx = needs.module("httpx", "server")

from calexec.drivers.calrt.runtime import Emulator, Fault, FaultMode  # noqa: E402
from calexec.drivers.serving.server import ServerConfig  # noqa: E402
from test_server_support import (  # noqa: E402
    MODEL,
    openai_server,
    read_until_closed,
    server_idle,
    split_head,
    wait_for,
)

TOKEN = "sdkload-admin-token"
TIMEOUT_S = 10.0


def _sdk(url: str, answers: list) -> openai.OpenAI:
    """The SDK as its users run it (2 retries), every answer it got kept in ``answers``."""
    http = httpx.Client(event_hooks={"response": [answers.append]})
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2,
                         timeout=TIMEOUT_S, http_client=http)


def _drained(server, service) -> None:
    """``POST /admin/drain`` on an idle server, and wait until the drain is over (its reads
    cut: ``service.drain_status`` is set last)."""
    r = httpx.post(f"{server.url}/admin/drain", params={"grace": 1},
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=TIMEOUT_S)
    assert r.status_code == 202, r.text
    wait_for(lambda: service.drain_status is not None, 30.0, "the drain to end")


def test_a_request_after_a_drain_ended_is_told_the_server_is_draining(tmp_path: Path):
    """A drain (``POST /admin/drain``, SIGTERM) cuts the body reads still under way when it
    stops waiting for requests, and every read after it at once. A request that came after
    the drain ended was told ``server drained: its grace ran out before the request's body
    arrived whole`` when its body's bytes were not yet in the server's buffer as the route
    asked for them, and admission's ``server is draining`` when they were: the same SDK call
    (langchain's ``ChatOpenAI.stream`` after a drain, seed 6501) got either, by timing. It
    is now ``server is draining`` whichever: a 503 with ``Retry-After`` (the SDK retries it,
    ``max_retries`` times after the server's 1 s) and ``Connection: close`` when its body
    was not read."""
    config = ServerConfig(admin_token=TOKEN)
    with openai_server(tmp_path, config, timeout=TIMEOUT_S) as (server, _, service):
        _drained(server, service)
        body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}).encode()
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
            # the head and all but the body's last bytes: the read begins after the cut
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                         b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
                         + body[:-4])
            data, how = read_until_closed(sock)
        status, headers, rest = split_head(data)
        assert status == b"HTTP/1.1 503 Service Unavailable", (data[:400], how)
        assert headers["retry-after"] == "1" and headers["connection"] == "close", headers
        error = json.loads(rest)["error"]
        assert (error["code"], error["message"]) == ("lifecycle.unavailable",
                                                     "server is draining"), error
        answers: list = []
        sdk = _sdk(server.url, answers)
        with pytest.raises(openai.InternalServerError) as raised:
            sdk.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4)
        sdk.close()
        assert raised.value.status_code == 503 and raised.value.code == "lifecycle.unavailable"
        assert raised.value.message == "Error code: 503 - server is draining", raised.value
        assert [a.status_code for a in answers] == [503] * 3
        assert {a.headers["retry-after"] for a in answers} == {"1"}


def test_sdk_errors_and_retries_under_faults_and_deadlines(tmp_path: Path):
    """(Not a defect: pins what held, seeds 6501-6503.) With ``max_resumes`` 0 a NaN row in
    the middle of a stream raises ``openai.APIError`` whose ``code`` is the server's
    (``internal.output_not_finite``), not a JSON decode error, and the same fault on a
    non-streamed request is a 500 the SDK retries and then served; the request's own
    deadline is a 504 with ``x-should-retry: false`` (one try); a 400 is not retried; every
    sequence comes back."""
    config = ServerConfig(admin_token=TOKEN, max_resumes=0)
    with openai_server(tmp_path, config, timeout=TIMEOUT_S) as (server, _, service):
        emu = Emulator(service.executor.device)
        answers: list = []
        sdk = _sdk(server.url, answers)
        whole = sdk.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8).choices[0]
        assert emu.set_fault(Fault.OUTPUT_NAN, FaultMode.NTH, 4, 6501) == 0
        with pytest.raises(openai.APIError) as raised:
            for _ in sdk.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8,
                                            stream=True):
                pass
        assert not isinstance(raised.value, openai.APIStatusError), raised.value
        assert raised.value.code == "internal.output_not_finite", raised.value.body
        emu.clear_all_faults()
        wait_for(lambda: service.ready, 30.0, "the recovery")
        answers.clear()
        assert emu.set_fault(Fault.OUTPUT_NAN, FaultMode.NTH, 1, 6502) == 0
        again = sdk.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8).choices[0]
        emu.clear_all_faults()
        assert [a.status_code for a in answers] == [500, 200], answers
        assert again.text == whole.text
        wait_for(lambda: service.ready, 30.0, "the recovery")
        answers.clear()
        with pytest.raises(openai.InternalServerError) as late:
            sdk.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=64,
                                   extra_body={"timeout": 0.001})
        assert late.value.status_code == 504 and len(answers) == 1, answers
        assert answers[0].headers["x-should-retry"] == "false"
        answers.clear()
        with pytest.raises(openai.BadRequestError) as bad:
            sdk.completions.create(model=MODEL, prompt=[1, 2, 3], temperature=-1)
        assert (bad.value.code, bad.value.param, len(answers)) == ("request.invalid",
                                                                    "temperature", 1)
        sdk.close()
        wait_for(lambda: server_idle(service), 30.0, "the server to be idle")
