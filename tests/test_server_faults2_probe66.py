"""Stop 66 (faults2): a resumed request whose lifecycle ends ``Failed`` meanwhile.

A request whose job meets a device fault resumes on the next generation (docs/server.md
"Resumable generations"). With the escalation budget spent (``max_recoveries``) that fault ends
the lifecycle ``Failed`` (§8 STOP) and the resume gives up. It answered the failure it resumed
from: 503 ``device.ccu_exception`` (or "generation 2 retired ...; retry" for a job of a
generation a recovery had replaced), 500 ``internal.output_not_finite`` in a stream's error
event, where a request sent at that moment is told 503 ``lifecycle.unavailable`` ``device
lifecycle is Failed after <the fault>``: the client was told to retry a fault the device
recovers from, by a server that will not serve again without an operator. It now gets what a
new request gets, through the HTTP server (uvicorn on loopback, httpx).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402

from calexec.drivers.calrt.runtime import Fault, FaultMode  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from calexec.machines.faults import RecoveryPolicy  # noqa: E402
from test_server_support import LiveServer, started_executor, wait_for  # noqa: E402

PROMPT = [5, 6, 7]


def _new_request(client: httpx.Client) -> httpx.Response:
    return client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})


@pytest.mark.parametrize("fault, nth, stream", [
    (Fault.CCU_EXCEPTION, 1, False),  # the prefill: 503 device.ccu_exception of old
    (Fault.OUTPUT_NAN, 3, True),  # a decode after tokens streamed: 500 output_not_finite
], ids=["ccu_exception-prefill", "output_nan-stream"])
def test_a_resume_the_failed_lifecycle_ends_answers_what_a_new_request_gets(
        tmp_path, fault, nth, stream):
    executor = started_executor(tmp_path, recovery=RecoveryPolicy(max_recoveries=0))
    app = create_app(executor, ServerConfig(prearm=False, decode_bursts=False))
    service = app.state.service
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
            assert executor.device.emu.set_fault(fault, FaultMode.NTH, nth, 0, 0) == 0
            body = {"prompt": PROMPT, "max_tokens": 8, "timeout": 20, "stream": stream}
            if stream:
                events = []
                with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            events.append(json.loads(line[len("data: "):]))
                assert any("choices" in e for e in events), events  # tokens went out first
                error = events[-1]["error"]
            else:
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 503, r.text
                assert "x-should-retry" not in r.headers and r.headers["retry-after"]
                error = r.json()["error"]
            executor.device.emu.clear_all_faults()
            assert executor.state == "Failed"
            new = _new_request(client)
            assert new.status_code == 503 and new.headers["retry-after"], new.text
            assert "x-should-retry" not in new.headers
            expected = new.json()["error"]
            assert expected["code"] == "lifecycle.unavailable", expected
            assert expected["message"].startswith(
                f"device lifecycle is Failed after {executor.failure.code}"), expected
            assert (error["code"], error["message"], error["type"]) == (
                expected["code"], expected["message"], expected["type"]), (error, expected)
            wait_for(lambda: service.sequences.in_use == 0, what="every id back")
    finally:
        executor.device.emu.clear_all_faults()
        executor.shutdown(5.0)
