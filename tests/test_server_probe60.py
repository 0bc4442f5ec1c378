"""Stop 60's server probe (docs/traceability.md "Found at stop 60 (server)"): the retries a
client's SDK makes of answers no retry changes, the transfer codings of a request, a lone
surrogate escape in a JSON body, the lifecycle's messages quoting as JSON does. Loopback
servers on the bundled emulator; every wait bounded."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from calexec.drivers.calrt.runtime import Emulator
from test_server_support import MODEL, metric_value, openai_server, send_raw, wait_for

TIMEOUT_S = 20.0


def _sdk(url: str, answers: list[httpx.Response]) -> tuple[openai.OpenAI, httpx.Client]:
    """The official SDK with its default retries (2), seeing every answer it gets."""
    http = httpx.Client(event_hooks={"response": [answers.append]})
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2,
                         timeout=TIMEOUT_S, http_client=http), http


def _admitted(server) -> float:
    """Completion requests the server admitted (``calexec_requests_total``, not streamed)."""
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT_S).text
    return metric_value(text, "calexec_requests_total", {"stream": "false"}) or 0.0


def test_the_sdk_does_not_retry_a_504_of_the_requests_own_deadline(tmp_path):
    """A request whose own ``timeout`` passed (504 ``wait.deadline``) was answered without
    ``x-should-retry``: the OpenAI SDK retries every 5xx (``max_retries``, 2 by default,
    after a back-off), so the server ran it 3 times, each with the same budget on the same
    server, and the client got the same 504 seconds later. It now says
    ``x-should-retry: false``: the server sees it once."""
    with openai_server(tmp_path, timeout=TIMEOUT_S) as (server, _, service):
        Emulator(service.executor.device).set_latency(decode_us=300_000)
        answers: list[httpx.Response] = []
        sdk, http = _sdk(server.url, answers)
        before = _admitted(server)
        with pytest.raises(openai.APIStatusError) as failed:
            sdk.completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                   extra_body={"timeout": 0.2})
        http.close()
        seen = _admitted(server) - before
        Emulator(service.executor.device).set_latency()
    assert failed.value.status_code == 504, failed.value
    assert answers[0].json()["status"]["category"] == "deadline"
    assert answers[0].headers.get("x-should-retry") == "false"
    assert (len(answers), seen) == (1, 1), [(a.status_code, a.json()["error"]) for a in answers]


def test_a_504_met_while_the_model_switches_stays_retryable(tmp_path):
    """The other side of the rule: a request whose deadline passed while it waited for a
    model switch (the lifecycle Warming the new calbin's golden) may be served once the
    switch is done, so its 504 carries no ``x-should-retry``: the SDK retries it as any
    5xx."""
    with openai_server(tmp_path, timeout=TIMEOUT_S) as (server, _, service):
        executor = service.executor
        Emulator(executor.device).set_latency(decode_us=500_000)
        switched: list = []
        worker = threading.Thread(target=lambda: switched.append(
            executor.switch_model(executor.config.calbin_path)))
        worker.start()
        try:
            wait_for(lambda: executor.state != "Ready", what="the switch to begin")
            answer = httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT_S, json={
                "model": MODEL, "prompt": "hi", "max_tokens": 1, "timeout": 0.2})
            state = executor.state
        finally:
            worker.join(TIMEOUT_S)
            Emulator(executor.device).set_latency()
    assert switched and switched[0].ok, switched
    assert state != "Ready"
    assert answer.status_code == 504, answer.text
    assert answer.json()["error"]["code"] == "admission.deadline"
    assert "x-should-retry" not in answer.headers
