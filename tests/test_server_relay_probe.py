"""Stop 51's adversarial probe of ``calexec serve --native-relay`` over HTTP (docs/traceability.md
"Found at stop 51 (relayprobe)"): what the probe found, pinned on a loopback uvicorn server,
each run with and without the native relay (``ExecutorConfig.native_relay``), which must
answer identically. Every wait is bounded; nothing leaves 127.0.0.1."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import LiveServer, started_executor, wait_for

TOKEN = "relay-probe-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: a slow decode step: when the drain's grace ends, every stream has one step on the device
#: and its next one pre-armed behind it, which the executor's shutdown cancels
DEVICE = "decode_us=200000"
STREAMS = 4


def _stream(url: str, index: int, out: dict, first: threading.Event) -> None:
    """A streamed completion far longer than the drain lets run: its SSE events in ``out``."""
    body = {"prompt": [7, 8, 9, index + 1], "max_tokens": 500, "stream": True, "timeout": 60}
    events: list[dict | str] = []
    out[index] = events
    with httpx.Client(timeout=30) as http, \
            http.stream("POST", f"{url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                first.set()


def _plain(url: str, index: int, out: dict) -> None:
    """The same completion, not streamed: its HTTP status and JSON body in ``out``."""
    body = {"prompt": [7, 8, 9, index + 1], "max_tokens": 500, "timeout": 60}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    out[index] = (r.status_code, r.json())


@pytest.mark.parametrize("native_relay", [False, True], ids=["plain", "native_relay"])
def test_a_request_the_drain_cuts_is_told_the_server_drained_never_cancelled(tmp_path,
                                                                            native_relay):
    """A client still waiting for its completion (streamed or not) when the drain's grace
    runs out gets the documented 503 ``lifecycle.unavailable`` (docs/server.md "Drain":
    "requests the shutdown ends get their error event (503 ``lifecycle.unavailable``"), never
    ``request.cancelled`` (499: the client is gone). The executor's shutdown cancels the step
    queued or pre-armed behind the one on the device; that cancellation was handed to the
    client as the request's own (``cancel requested``): one stream in 16 under SIGTERM."""
    executor = started_executor(tmp_path, DEVICE, native_relay=native_relay)
    app = create_app(executor, ServerConfig(admin_token=TOKEN))
    service = app.state.service
    out: dict[int, list] = {}
    answers: dict[int, tuple] = {}
    try:
        with LiveServer(app) as server:
            started = [threading.Event() for _ in range(STREAMS)]
            threads = [threading.Thread(target=_stream, args=(server.url, i, out, started[i]),
                                        daemon=True) for i in range(STREAMS)]
            threads += [threading.Thread(target=_plain, args=(server.url, STREAMS + i, answers),
                                         daemon=True) for i in range(STREAMS)]
            for thread in threads:
                thread.start()
            for event in started:
                assert event.wait(30), "a stream sent no first token"
            wait_for(lambda: service.sequences.in_use == 2 * STREAMS, 30,
                     "every request holding its sequence")
            r = httpx.post(f"{server.url}/admin/drain", params={"grace": 0}, headers=AUTH,
                           timeout=10)
            assert r.status_code == 202, r.text
            wait_for(lambda: service.drain_status is not None, 30, "the drain")
            for thread in threads:
                thread.join(30)
            assert not any(thread.is_alive() for thread in threads)
    finally:
        executor.shutdown(5.0)
    ends = {}
    for index, events in out.items():
        errors = [event["error"] for event in events if isinstance(event, dict) and "error" in event]
        assert len(errors) == 1 and events[-1] != "[DONE]", (index, events[-3:])
        ends[index] = (errors[0]["code"], errors[0]["type"], errors[0]["message"])
    assert sorted(ends) == list(range(STREAMS))
    for index, (code, kind, _) in ends.items():
        assert (code, kind) == ("lifecycle.unavailable", "unavailable_error"), (index, ends)
    assert sorted(answers) == list(range(STREAMS, 2 * STREAMS))
    for index, (http_status, body) in answers.items():
        assert http_status == 503, (index, http_status, body)
        assert body["error"]["code"] == "lifecycle.unavailable", (index, body)
