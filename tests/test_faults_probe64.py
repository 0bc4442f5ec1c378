"""Stop 64 (faults, operator view): ``calexec_api_requests_total`` is told each outcome by
the route, never read from the answer's bytes.

``RequestTally`` (drivers/serving/metrics.py) decided whether a stream was answered whole by
sniffing what it sent: the last 14 bytes ``data: [DONE]\\n\\n``, or a body holding
``event: response.completed`` (``.incomplete``) for the Responses route. The answer's text is
the model's: whether a byte pattern of it could be taken for the end depended on every
route's framing staying as it is. The routes now say it (``metrics.mark_whole``, as
``observe_refusal`` and ``mark_handed_off`` already did): a stream that sends the end's bytes
without its route saying so is ``failed``, and an answer whose text is those bytes is counted
by how it ended.
"""

from __future__ import annotations

import asyncio
import json

import pytest

import needs

needs.module("httpx", "server")
import httpx  # noqa: E402

from calexec.drivers.serving import metrics  # noqa: E402
from calexec.drivers.serving.metrics import RequestTally, ServerMetrics  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from test_server_support import (  # noqa: E402
    ServeLikeServer,
    server_idle,
    started_executor,
    wait_for,
)

#: what the tally used to take for an answered stream, by route
SNIFFED = {"/v1/completions": b"data: [DONE]\n\n",
           "/v1/chat/completions": b"data: [DONE]\n\n",
           "/v1/responses": b"event: response.completed\ndata: {}\n\n"}
ROUTE = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions",
         "/v1/responses": "responses"}


def outcomes(tallied: ServerMetrics) -> dict[str, float]:
    """``route/outcome`` -> count, of the series of ``calexec_api_requests_total`` counted."""
    return {f"{s.labels['route']}/{s.labels['outcome']}": s.value
            for family in tallied.api_requests.metric.collect() for s in family.samples
            if s.name == "calexec_api_requests_total" and s.value}


def streamed(path: str, said: bool):
    """An app streaming the bytes the tally used to sniff as its last event; ``said``: its
    route says the stream was answered whole (``metrics.mark_whole``)."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {\"a\":1}\n\n",
                    "more_body": True})
        if said:
            metrics.mark_whole()
        await send({"type": "http.response.body", "body": SNIFFED[path], "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


async def one(app, path: str) -> None:
    scope = {"type": "http", "method": "POST", "path": path, "headers": []}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass
    await app(scope, receive, send)


@pytest.mark.parametrize("path", sorted(SNIFFED))
@pytest.mark.parametrize("said", [False, True])
def test_a_stream_is_answered_whole_when_its_route_says_so_not_by_its_bytes(path, said):
    """The end's bytes alone count nothing: the old tally counted these ``success`` whether
    the route said so or not."""
    tallied = ServerMetrics(lambda: {}, dict)
    asyncio.run(one(RequestTally(streamed(path, said), tallied), path))
    assert outcomes(tallied) == {f"{ROUTE[path]}/{'success' if said else 'failed'}": 1.0}


def test_a_relay_that_answered_otherwise_after_all_has_the_last_word():
    """The Responses route relays a chat stream that said it was whole: a translation that
    fails afterwards says otherwise (``mark_whole(False)``), and the request is ``failed``."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        metrics.mark_whole()  # the chat stream's [DONE]
        metrics.mark_whole(False)  # the Responses' translation of it failed
        await send({"type": "http.response.body", "body": b"event: response.failed\n\n",
                    "more_body": False})
    tallied = ServerMetrics(lambda: {}, dict)
    asyncio.run(one(RequestTally(app, tallied), "/v1/responses"))
    assert outcomes(tallied) == {"responses/failed": 1.0}


def test_an_answer_whose_text_is_the_ends_bytes_is_counted_by_how_it_ended(tmp_path):
    """Through the server: a completion whose text is ``data: [DONE]\\n\\n`` (its prompt,
    echoed) is ``success`` streamed whole and ``failed`` when its client leaves after the
    event holding that text."""
    executor = started_executor(tmp_path, "decode_us=20000")
    app = create_app(executor, ServerConfig())
    service = app.state.service
    body = {"prompt": "data: [DONE]\n\n", "echo": True, "stream": True}
    try:
        with ServeLikeServer(app) as server, httpx.Client(base_url=server.url,
                                                          timeout=30) as http:
            whole = http.post("/v1/completions", json={**body, "max_tokens": 2})
            assert whole.status_code == 200 and whole.text.endswith("data: [DONE]\n\n")
            first = json.loads(whole.text.split("\n\n")[0].removeprefix("data: "))
            assert first["choices"][0]["text"].startswith("data: [DONE]\n\n"), first
            wait_for(lambda: server_idle(service), 20, "the server idle")
            assert outcomes(service.metrics) == {"completions/success": 1.0}
            with http.stream("POST", "/v1/completions",
                             json={**body, "max_tokens": 500}) as left:
                for line in left.iter_lines():  # leave after the event holding the text
                    if line.startswith("data: {"):
                        text = json.loads(line.removeprefix("data: "))["choices"][0]["text"]
                        assert text.startswith("data: [DONE]\n\n"), text
                        break
            wait_for(lambda: server_idle(service), 20, "the server idle")
            assert outcomes(service.metrics) == {"completions/success": 1.0,
                                                 "completions/failed": 1.0}
    finally:
        executor.shutdown(5.0)


def test_a_soak_whose_executor_did_not_start_says_so_once(monkeypatch, capsys):
    """``calexec bench soak`` on a host too busy for the start's golden job (its 0.4 s
    execution deadline) printed ``calexec bench soak: executor did not start: executor did not
    start: execution.deadline ...``: the bench's executor error already says it."""
    from calexec.drivers.tools.bench import fault_cost, soak

    def refused(*args, **kwargs):
        raise fault_cost.BenchError("executor did not start: execution.deadline [device/wait] "
                                    "execution deadline passed (job_id=1 seq_id=0 generation=1)")
    monkeypatch.setattr(fault_cost, "bench_executor", refused)
    assert soak.main(["--requests", "6", "--faults", "1", "--clients", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("executor did not start") == 1, err
    assert ("calexec bench soak: executor did not start: execution.deadline [device/wait] "
            "execution deadline passed (job_id=1 seq_id=0 generation=1)\n") in err, err


def test_a_bench_executor_whose_golden_ran_past_its_deadline_says_what_to_do(monkeypatch,
                                                                             tmp_path):
    """The start's golden job past the bench's 0.4 s execution deadline (a busy host): the
    line says that deadline is the bench's and to run it again, not only the device's code."""
    from calexec.contracts.errors import Category
    from calexec.contracts.status import Phase, Status
    from calexec.drivers.tools.bench import fault_cost
    from calexec.machines.executor import DeviceExecutor

    late = Status.failure("execution.deadline", Category.DEVICE, Phase.WAIT,
                          "execution deadline passed", job_id=1, seq_id=0, generation=1)
    monkeypatch.setattr(DeviceExecutor, "start", lambda self: late)
    with pytest.raises(fault_cost.BenchError) as err:
        fault_cost.bench_executor(tmp_path)
    message = str(err.value)
    assert message.startswith("executor did not start: execution.deadline"), message
    assert ("its golden job ran past this bench's execution deadline (0.4 s, short so that a "
            "hung job costs little): the host is too busy for it, run the bench again when "
            "it is quieter") in message, message


def test_a_soak_of_long_requests_gives_them_a_deadline_their_tokens_fit(tmp_path):
    """``calexec bench soak --max-tokens 2000-6000`` (accepted: up to ``MAX_TOKENS``) ended at
    its first fault-free reference, ``HTTP 504 admission.deadline request timeout=60 s passed
    after 4325 generated tokens``: every request had 60 s, where a slow reader alone takes up
    to 10 ms a token. The deadline now grows with the tokens asked for, and the soak's server
    takes it (past its default ``max_timeout_s``, 600 s)."""
    from calexec.drivers.tools.bench import soak
    from test_server_support import started_executor as start

    longest = soak.request_timeout(soak.MAX_TOKENS)
    assert longest >= soak.REQUEST_TIMEOUT_S + soak.MAX_TOKENS * soak.SLOW_READ_S[1]
    assert soak.request_timeout(8) < soak.REQUEST_TIMEOUT_S + 1  # a short request: as before
    config = soak.soak_server_config(longest)
    assert config.max_timeout_s >= longest > ServerConfig().max_timeout_s
    executor = start(tmp_path)
    try:
        with ServeLikeServer(create_app(executor, config)) as server:
            answer = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
                "prompt": [1, 2], "max_tokens": 2, "timeout": longest})
        assert answer.status_code == 200, answer.text
    finally:
        executor.shutdown(5.0)
