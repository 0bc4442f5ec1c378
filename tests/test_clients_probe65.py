"""Stop 65's probe with real clients: the official ``openai`` SDK's retry policy
(``_base_client._should_retry``: ``x-should-retry`` obeyed first, then 408, 409, 429 and every
5xx retried, ``max_retries`` times after a back-off or the server's ``Retry-After``) against
each failure a loopback server on the synthetic model answers, the emulator's faults armed
for every request (docs/server.md "Retries"; docs/traceability.md "Found at stop 65
(clients)"). Client timeout 10 s, retries on (2, the SDK's default)."""

from __future__ import annotations

import httpx
import pytest

from calexec.drivers.calrt.runtime import Emulator, Fault, FaultMode
from calexec.drivers.serving.server import ServerConfig
from needs import module
from test_server_support import MODEL, openai_server

openai = module("openai", "clients")

TIMEOUT_S = 10.0


def _answers_to_a_completion(tmp_path, fault: Fault, **fault_args) -> tuple[list[httpx.Response],
                                                                             object, str]:
    """Every answer the SDK (``max_retries`` 2) got for one completion with ``fault`` armed
    for every job (no resume: ``max_resumes`` 0), the error it raised and the lifecycle."""
    with openai_server(tmp_path, config=ServerConfig(max_resumes=0), timeout=TIMEOUT_S) as (
            server, _, service):
        answers: list[httpx.Response] = []
        http = httpx.Client(event_hooks={"response": [answers.append]})
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=2,
                            timeout=TIMEOUT_S, http_client=http)
        Emulator(service.executor.device).set_fault(fault, FaultMode.ALWAYS, 1, **fault_args)
        with pytest.raises(openai.APIStatusError) as failed:
            sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        http.close()
        for answer in answers:
            answer.read()
        return answers, failed.value, service.executor.state


@pytest.mark.parametrize("rc", [1, 14, 21, 22])  # MEM_ALLOC, OUT_OF_BOUNDS, DTYPE, SHAPE
def test_the_sdk_tries_a_request_artifact_failure_once(tmp_path, rc):
    """§8's REQUEST_ARTIFACT row (a runtime bound, dtype, shape or allocation failure of a
    request that passed the manifest checks: the generation keeps serving, the manifest
    difference is recorded) was a plain 500, which the SDK retried twice after its back-off:
    the same request met the same difference 3 times and the caller waited for the same
    error. It now says ``x-should-retry: false``: one try."""
    answers, failed, state = _answers_to_a_completion(tmp_path, Fault.SUBMIT_RC, rc=rc)
    assert [(a.status_code, a.json()["status"]["category"]) for a in answers] == [
        (500, "request_artifact")]
    assert answers[0].headers["x-should-retry"] == "false"
    assert failed.status_code == 500 and state == "Ready"


@pytest.mark.parametrize(("fault", "args", "category"), [
    (Fault.SUBMIT_RC, {"rc": 4}, "artifact"),  # INVALID_VALUE: the generation is rolled back
    (Fault.SUBMIT_RC, {"rc": 15}, "unknown"),  # UNEXPECTED: the generation is tainted
    (Fault.OUTPUT_NAN, {}, "internal"),  # a non-finite row
])
def test_a_retried_500_whose_retries_meet_the_failed_lifecycle_names_why_it_failed(
        tmp_path, fault, args, category):
    """A 500 a retry may fix (the device recovers, or rolls back to the last good
    generation) is retried; here the fault is armed for every job, so the recovery fails
    and the lifecycle ends Failed. The SDK raises its last answer, the Failed lifecycle's
    503, which said only ``device lifecycle is Failed``: the cause, in the first answer, was
    lost to the caller. It now names the failure that ended the lifecycle (its code and
    raw CalRT code), and stays retryable (``Retry-After``, no ``x-should-retry``: ``calexec
    serve`` exits for its supervisor to restart it, and behind a balancer another replica
    may serve the retry)."""
    answers, failed, state = _answers_to_a_completion(tmp_path, fault, **args)
    assert state == "Failed"
    first, *retries = answers
    assert first.status_code == 500 and first.json()["status"]["category"] == category
    assert "x-should-retry" not in first.headers
    assert len(retries) == 2, [(a.status_code, a.json()["error"]) for a in answers]
    for retry in retries:
        assert retry.status_code == 503 and retry.headers["retry-after"] == "1"
        assert "x-should-retry" not in retry.headers
    assert failed.status_code == 503
    assert failed.message.startswith("Error code: 503 - device lifecycle is Failed after ")
    why = first.json()["error"]["code"]
    assert why in failed.message and failed.body["code"] == "lifecycle.unavailable"
    if fault is Fault.SUBMIT_RC:
        assert f"raw={args['rc']}" in failed.message, failed.message


def test_the_sdk_tries_each_refusal_of_the_request_once(tmp_path):
    """(Not a defect: pins docs/server.md "Retries".) A 400 (a bad field), 401 (no key), 404
    (a model not served) and 413 (a body over ``max_body_bytes``) are each answered once:
    the SDK retries no 4xx but 408, 409 and 429, and none of these says otherwise."""
    config = ServerConfig(api_key="k", max_body_bytes=4096)
    with openai_server(tmp_path, config=config, timeout=TIMEOUT_S) as (server, _, _):
        answers: list[httpx.Response] = []
        http = httpx.Client(event_hooks={"response": [answers.append]})

        def sdk(key: str) -> object:
            return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=2,
                                 timeout=TIMEOUT_S, http_client=http)
        calls = [(400, "k", {"model": MODEL, "prompt": "hi", "max_tokens": -1}),
                 (401, "wrong", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
                 (404, "k", {"model": "nope", "prompt": "hi", "max_tokens": 1}),
                 (413, "k", {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 1})]
        for code, key, kwargs in calls:
            answers.clear()
            with pytest.raises(openai.APIStatusError) as failed:
                sdk(key).completions.create(**kwargs)
            assert failed.value.status_code == code
            assert [a.status_code for a in answers] == [code], kwargs
        http.close()
