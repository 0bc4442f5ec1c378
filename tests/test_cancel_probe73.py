"""Stop 73 (cancel): an operator cancels a request in progress, ``POST /admin/cancel/{id}``
(drivers/serving/admin.py, ``CompletionService.cancel``), on every path a request can be in:
waiting for admission, a non-streamed burst (one choice, ``n`` > 1, a prompt list), a stream,
a resume after a fault, the Responses API. Each request is held at its point by the stepped
emulator (its job on the device), a held sequence id (the waiting queue) or a recovery held in
Warming; the client's answer is ``request.aborted`` (409, ``x-should-retry: false``; a stream
that started: its error event), and every sequence id and the device's slots come back.
Nothing asserts a duration: every wait is a bounded poll of a condition.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402

from calexec.drivers.calrt.runtime import Fault, FaultMode, Stage  # noqa: E402
from calexec.drivers.fleet.edge import serve_relayed  # noqa: E402
from calexec.drivers.fleet.ingress import fleet_body_too_large  # noqa: E402
from calexec.drivers.serving.handoff import PROGRESS_TYPE  # noqa: E402
from test_server_support import (  # noqa: E402
    busy_engine,
    metric_value,
    oracle_tokens,
    stepped_server,
    wait_device_idle,
    wait_for,
)

TOKEN = "cancel73-admin"
AUTH = {"authorization": f"Bearer {TOKEN}"}
PROMPT = [5, 6, 7]
WAIT_S = 30.0


def served(tmp_path, **config) -> contextlib.AbstractContextManager[tuple]:
    """(server, service, executor) of a loopback server with the admin token."""
    return stepped_server(tmp_path, admin_token=TOKEN, **config)


def posted(url: str, path: str, body: dict, out: list, headers: dict | None = None
           ) -> threading.Thread:
    """``body`` posted to ``url + path`` from a thread; its response appended to ``out``."""
    thread = threading.Thread(target=lambda: out.append(httpx.post(
        f"{url}{path}", json=body, headers=headers or {}, timeout=WAIT_S)))
    thread.start()
    return thread


def cancel(url: str, ident: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/admin/cancel/{ident}", headers=kwargs.pop("headers", AUTH),
                      timeout=WAIT_S, **kwargs)


def assert_aborted(response: httpx.Response, ident: str) -> None:
    """The client's answer to a request an operator cancelled by ``ident``."""
    assert response.status_code == 409, response.text
    assert response.headers["x-should-retry"] == "false"
    error = response.json()["error"]
    assert error["code"] == "request.aborted" and error["type"] == "cancelled_error", error
    assert ident in error["message"] and "operator" in error["message"], error
    status = response.json()["status"]
    assert status["http_status"] == 409 and status["grpc_code"] == "ABORTED", status


def assert_all_back(service, executor, device: bool = True) -> None:
    """Every sequence id, the waiting queue and (``device``) the device's slots are back."""
    wait_for(lambda: service.active == 0 and service.sequences.in_use == 0
             and service.releases_pending == 0, WAIT_S, "every sequence id back")
    assert service.sequences.consistent() and service.sequences.withheld == 0
    assert service.admission.waiting == 0
    if not device:
        return
    wait_device_idle(executor, WAIT_S)


# ---- waiting for admission -------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_request_waiting_for_admission_is_cancelled_and_leaves_the_queue(tmp_path, stream):
    """max_sequences=1, its id held: the request waits in the queue; cancelled by its
    ``x-request-id``, it answers 409 ``request.aborted`` (a stream before its first event:
    the plain error response) and the queue is empty; the freed id serves the next one."""
    with served(tmp_path, max_sequences=1) as (server, service, executor):
        held = service.sequences.acquire()
        out: list = []
        thread = posted(server.url, "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 4, "stream": stream}, out,
                        {"x-request-id": "waiting-1"})
        wait_for(lambda: service.admission.waiting == 1, WAIT_S, "the request waiting")
        answer = cancel(server.url, "waiting-1")
        assert answer.status_code == 202, answer.text
        assert answer.json()["cancelled"] is True and answer.json()["x_request_id"] == "waiting-1"
        thread.join(WAIT_S)
        assert_aborted(out[0], "waiting-1")
        assert service.admission.waiting == 0
        service.sequences.release(held)
        assert_all_back(service, executor)
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                        timeout=WAIT_S)
        assert ok.status_code == 200, ok.text
        metrics = httpx.get(f"{server.url}/metrics").text
        assert metric_value(metrics, "calexec_admin_cancels_total", {"outcome": "cancelled"}) == 1
        assert metric_value(metrics, "calexec_request_failures_total",
                            {"code": "request.aborted"}) == 1
        admitted = sum(metric_value(metrics, "calexec_requests_total", {"stream": flag}) or 0
                       for flag in ("true", "false"))
        succeeded = metric_value(metrics, "calexec_request_success_total") or 0
        assert admitted == 2 and succeeded == 1  # the cancelled one, then the one served


# ---- a running non-streamed burst: every choice ends ---------------------------------------
@pytest.mark.parametrize("shape", [{"prompt": PROMPT}, {"prompt": PROMPT, "n": 3},
                                   {"prompt": [PROMPT, [9, 10]]},
                                   {"prompt": PROMPT, "stop": ["never said"]}],
                         ids=["one", "n3", "prompt_list", "plain_path"])
@pytest.mark.parametrize("config", [{}, {"inline_waits": False, "decode_bursts": False,
                                         "prearm": False}], ids=["default", "worker_waits"])
def test_a_running_request_is_cancelled_by_its_response_id_and_every_choice_ends(tmp_path,
                                                                                   shape,
                                                                                   config):
    """Its job held on the stepped device: cancelled by its response id (read from the
    server's live requests), every choice ends, the client gets 409 ``request.aborted``; once
    the device runs again (the cancel never freed what it held, §7) every id comes back.
    Also with the waits on worker threads, no burst and no pre-armed decode stream."""
    with served(tmp_path, **config) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_stepped(True) == 0
        out: list = []
        thread = posted(server.url, "/v1/completions", {**shape, "max_tokens": 40}, out)
        wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "a job held on the device")
        ids = {run.response_id for run in service.live_requests()}
        assert len(ids) == 1, ids
        ident = ids.pop()
        answer = cancel(server.url, ident)
        assert answer.status_code == 202, answer.text
        assert answer.json()["response_ids"] == [ident]
        thread.join(WAIT_S)
        assert_aborted(out[0], ident)
        assert emu.set_stepped(False) == 0
        assert_all_back(service, executor)
        metrics = httpx.get(f"{server.url}/metrics").text
        admitted = metric_value(metrics, "calexec_requests_total", {"stream": "false"}) or 0
        failed = metric_value(metrics, "calexec_request_failures_total",
                              {"code": "request.aborted"}) or 0
        others = sum(metric_value(metrics, "calexec_request_failures_total",
                                  {"code": code}) or 0
                     for code in ("request.choice_cancelled", "request.cancelled"))
        # every admitted choice ended counted once, none of them a success
        assert admitted >= 1 and failed >= 1 and failed + others == admitted, metrics
        assert metric_value(metrics, "calexec_request_success_total") is None
        again = cancel(server.url, ident)  # it ended: nothing in progress has the id
        assert again.status_code == 404 and again.json()["error"]["param"] == "id"
        assert again.json()["error"]["code"] == "not_found"


# ---- a stream -------------------------------------------------------------------------------
@pytest.mark.parametrize(("route", "body"), [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/completions", {"prompt": PROMPT, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]})],
    ids=["completions", "completions_n2", "chat"])
def test_a_stream_cancelled_after_its_first_token_ends_with_the_error_event(tmp_path, route,
                                                                            body):
    """Jobs stepped through one at a time until the first token's event is sent, the next
    job held (a streamed burst's; ``n`` 2: one choice's): cancelled, the stream's last event
    is the error event ``request.aborted`` (no ``[DONE]``, as every failure after a stream
    started), and everything comes back."""
    with served(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_stepped(True) == 0
        lines: list[str] = []
        first = threading.Event()

        def read() -> None:
            with httpx.stream("POST", f"{server.url}{route}", timeout=WAIT_S,
                              headers={"x-request-id": "stream-1"},
                              json={**body, "max_tokens": 40, "stream": True}) as response:
                lines.append(str(response.status_code))
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        first.set()
        thread = threading.Thread(target=read)
        thread.start()
        for _ in range(8):  # (bounded: a prefill or two, then the first event)
            wait_for(lambda: busy_engine(emu) is not None or first.is_set(), WAIT_S,
                     "a job on the device or the first event")
            if first.is_set():
                break
            assert emu.step(busy_engine(emu), Stage.JOB)[0] == 0
        assert first.wait(WAIT_S)
        wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "the next job on the device")
        assert cancel(server.url, "stream-1").status_code == 202
        thread.join(WAIT_S)
        assert lines[0] == "200" and "[DONE]" not in lines, lines
        last = json.loads(lines[-1])
        assert last["error"]["code"] == "request.aborted", last
        assert last["error"]["type"] == "cancelled_error"
        assert emu.set_stepped(False) == 0
        assert_all_back(service, executor)


# ---- a resume after a fault ------------------------------------------------------------------
def test_a_request_resuming_after_a_fault_is_cancelled_while_it_waits_for_ready(tmp_path):
    """A CCU exception sets off a recovery whose golden is held in Warming: the request waits
    in its resume; cancelled, it answers 409 ``request.aborted`` (not the fault's 503, not
    resumed further) and leaves the queue; once Ready everything is back and a request is
    served."""
    with served(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 1, 0, 0) == 0
        assert emu.set_stepped(True) == 0
        out: list = []
        thread = posted(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4},
                        out, {"x-request-id": "resume-1"})
        wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "the prefill on the device")
        assert emu.step(busy_engine(emu), Stage.JOB)[0] == 0  # CCU exception -> recovery
        wait_for(lambda: executor.state == "Warming" and service.admission.waiting == 1,
                 WAIT_S, "the resume waiting behind the recovery")
        assert cancel(server.url, "resume-1").status_code == 202
        thread.join(WAIT_S)
        assert_aborted(out[0], "resume-1")
        assert service.admission.waiting == 0
        assert emu.set_stepped(False) == 0
        emu.clear_all_faults()
        wait_for(lambda: executor.state == "Ready", WAIT_S, "Ready after the recovery")
        assert_all_back(service, executor)
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3},
                        timeout=WAIT_S)
        assert ok.json()["choices"][0]["token_ids"] == oracle_tokens(PROMPT, 3)


# ---- the Responses API ----------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_request_is_cancelled_by_its_resp_id(tmp_path, stream):
    """``POST /v1/responses`` held on the device (its prefill), cancelled by its ``resp_``
    id: the 409 ``request.aborted``, streamed or not (a stream whose first token never came
    answers with the plain error response, as chat's)."""
    with served(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_stepped(True) == 0
        out: list = []
        thread = posted(server.url, "/v1/responses",
                        {"input": "hello", "max_output_tokens": 40, "stream": stream}, out)
        wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "the prefill on the device")
        (ident,) = {run.response_id for run in service.live_requests()}
        assert ident.startswith("resp_")
        assert cancel(server.url, ident).status_code == 202
        thread.join(WAIT_S)
        # (a stream cancelled before its first token: the plain error response, as chat's)
        assert out[0].json()["error"]["param"] is None
        assert_aborted(out[0], ident)
        assert emu.set_stepped(False) == 0
        assert_all_back(service, executor)


# ---- the route's own rules -------------------------------------------------------------------
def test_the_cancel_route_follows_the_admin_routes_rules(tmp_path):
    """Admin token, no query, no body, a request id's shape (400 naming ``id``), an unknown
    id (404 ``not_found`` naming it); behind the fleet ingress the 404 says the ingress asked
    one replica. Every answer counted by outcome."""
    with served(tmp_path) as (server, _service, _executor):
        url = server.url
        assert cancel(url, "x", headers={}).status_code == 401
        assert cancel(url, "x", headers={"authorization": "Bearer nope"}).status_code == 403
        query = cancel(url, "x", params={"force": "1"})
        assert query.status_code == 400 and query.json()["error"]["param"] == "force"
        body = cancel(url, "x", json={"id": "x"})
        assert body.status_code == 400 and "takes no body" in body.json()["error"]["message"]
        assert cancel(url, "x", json={}).status_code == 404  # ({}: says nothing)
        large = cancel(url, "x", content=b"x" * (2 << 20))  # over max_body_bytes: what it takes
        assert large.status_code == 413 and "takes no body" in large.json()["error"]["message"]
        fleet_large = fleet_body_too_large(128, "/admin/cancel/cmpl-1")  # the ingress's 413
        assert "takes no body" in fleet_large.message and "--max-body-bytes" not in \
            fleet_large.message
        for bad in ("", "%C3%A9t%C3%A9", "a" * 129):
            shape = cancel(url, bad)
            assert shape.status_code == 400, (bad, shape.text)
            assert shape.json()["error"]["param"] == "id", shape.text
        unknown = cancel(url, "cmpl-nothing")
        assert unknown.status_code == 404
        error = unknown.json()["error"]
        assert error["code"] == "not_found" and error["param"] == "id"
        assert "cmpl-nothing" in error["message"], error
        fleet = cancel(url, "cmpl-nothing", headers={**AUTH, "x-calexec-relayed-from": "ingress"})
        assert fleet.status_code == 404 and "another" in fleet.json()["error"]["message"]
        metrics = httpx.get(f"{url}/metrics").text
        assert metric_value(metrics, "calexec_admin_cancels_total", {"outcome": "not_found"}) == 3


def test_an_id_two_requests_share_cancels_neither(tmp_path):
    """Two requests in progress sent with one ``X-Request-Id``: a cancel by it is 400 naming
    both response ids, and neither is cancelled; each is then cancelled by its own id."""
    with served(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_stepped(True) == 0
        out: list = []
        threads = [posted(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 40},
                          out, {"x-request-id": "shared"}) for _ in range(2)]
        wait_for(lambda: len({run.response_id for run in service.live_requests()}) == 2,
                 WAIT_S, "both requests in progress")
        both = cancel(server.url, "shared")
        assert both.status_code == 400, both.text
        ids = sorted(run.response_id for run in service.live_requests())
        assert both.json()["error"]["param"] == "id"
        assert all(i in both.json()["error"]["message"] for i in ids)
        assert all(run.cancelled is None for run in service.live_requests())
        for ident in ids:
            assert cancel(server.url, ident).status_code == 202
        for thread in threads:
            thread.join(WAIT_S)
        for response in out:
            assert response.status_code == 409, response.text
        assert emu.set_stepped(False) == 0
        assert_all_back(service, executor)
        metrics = httpx.get(f"{server.url}/metrics").text
        assert metric_value(metrics, "calexec_admin_cancels_total", {"outcome": "ambiguous"}) == 1


def test_a_second_cancel_of_a_request_still_ending_answers_the_same(tmp_path, monkeypatch):
    """A cancelled request held before its ``finish`` (an Event barrier around the service's
    public ``finish``): a second cancel answers the same 202 body and tells nothing more
    (counted ``repeated``); once it finished, a third is 404."""
    with served(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        gate = asyncio.Event()
        reached = threading.Event()
        finish = service.finish

        async def held_finish(run, abandoned=False):
            if run.cancelled is not None:
                reached.set()
                await gate.wait()
            await finish(run, abandoned)
        monkeypatch.setattr(service, "finish", held_finish)
        assert emu.set_stepped(True) == 0
        out: list = []
        thread = posted(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 40},
                        out, {"x-request-id": "twice"})
        wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "a job held on the device")
        first = cancel(server.url, "twice")
        assert reached.wait(WAIT_S)
        second = cancel(server.url, "twice")
        assert first.status_code == second.status_code == 202, second.text
        assert first.json() == second.json()
        server.loop.call_soon_threadsafe(gate.set)
        thread.join(WAIT_S)
        assert_aborted(out[0], "twice")
        assert cancel(server.url, "twice").status_code == 404
        assert emu.set_stepped(False) == 0
        assert_all_back(service, executor)
        metrics = httpx.get(f"{server.url}/metrics").text
        for outcome, count in (("cancelled", 1), ("repeated", 1), ("not_found", 1)):
            assert metric_value(metrics, "calexec_admin_cancels_total",
                                {"outcome": outcome}) == count, outcome
        assert metric_value(metrics, "calexec_request_failures_total",
                            {"code": "request.aborted"}) == 1


def test_a_cancel_between_two_choices_admits_no_more(tmp_path, monkeypatch):
    """``n`` 3 one choice at a time (max_sequences 2: ``choice_concurrency`` 1), held after
    its first choice finished (an Event barrier after the service's public ``finish``) and
    before the second's admission: no run of it is in progress, yet the cancel finds the
    request (202), no choice more is admitted and the client gets 409 ``request.aborted``;
    counted as a later choice's refusal is."""
    with served(tmp_path, max_sequences=2) as (server, service, executor):
        gate = asyncio.Event()
        reached = threading.Event()
        finish = service.finish

        async def held_finish(run, abandoned=False):
            await finish(run, abandoned)
            if run.status is None and not reached.is_set():  # the first choice, whole
                reached.set()
                await gate.wait()
        monkeypatch.setattr(service, "finish", held_finish)
        out: list = []
        thread = posted(server.url, "/v1/completions",
                        {"prompt": PROMPT, "n": 3, "max_tokens": 2}, out,
                        {"x-request-id": "between"})
        assert reached.wait(WAIT_S)
        assert not service.live_requests()
        answer = cancel(server.url, "between")
        assert answer.status_code == 202, answer.text
        assert answer.json()["response_ids"] and answer.json()["x_request_id"] == "between"
        server.loop.call_soon_threadsafe(gate.set)
        thread.join(WAIT_S)
        assert_aborted(out[0], "between")
        assert_all_back(service, executor)
        metrics = httpx.get(f"{server.url}/metrics").text
        assert metric_value(metrics, "calexec_request_success_total") == 1
        assert metric_value(metrics, "calexec_request_failures_total",
                            {"code": "request.aborted"}) == 1
        assert metric_value(metrics, "calexec_requests_total", {"stream": "false"}) == 1
        assert metric_value(metrics, "calexec_api_requests_total",
                            {"outcome": "refused"}) == 1


def test_a_fleet_stream_cancelled_on_a_draining_replica_is_not_resumed_elsewhere(tmp_path):
    """A fleet stream (the progress channel the ingress asks for, ``serve_relayed``) on a
    replica that then drains: cancelled, its progress report before the error event says
    ``retryable: false``, so the ingress does not run it again on a sibling (a stream that
    ends while its replica does not serve is otherwise reported retryable)."""
    with served(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_stepped(True) == 0
        messages: list[dict] = []
        request = {"method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                   "query_string": b"", "http_version": "1.1", "progress": True,
                   "headers": [(b"content-type", b"application/json"),
                               (b"x-request-id", b"fleet-1")],
                   "body": json.dumps({"prompt": PROMPT, "max_tokens": 40,
                                       "stream": True}).encode()}

        async def relay() -> None:
            async for message in serve_relayed(server.server.config.app, request):
                messages.append(message)
        done = asyncio.run_coroutine_threadsafe(relay(), server.loop)

        def token_sent() -> bool:
            return any(m.get("type") == "http.response.body" and b'"choices"' in m.get("body", b"")
                       for m in list(messages))
        for _ in range(8):  # (bounded: the prefill, then the first token's event)
            wait_for(lambda: busy_engine(emu) is not None or token_sent(), WAIT_S,
                     "a job on the device or the first event")
            if token_sent():
                break
            assert emu.step(busy_engine(emu), Stage.JOB)[0] == 0
        wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "the next job on the device")
        drain = httpx.post(f"{server.url}/admin/drain?grace=60", headers=AUTH, timeout=WAIT_S)
        assert drain.status_code == 202, drain.text
        assert cancel(server.url, "fleet-1").status_code == 202
        done.result(WAIT_S)
        errors = [m for m in messages if m.get("type") == PROGRESS_TYPE and "error" in m]
        assert errors and errors[-1]["error"] == "request.aborted", messages
        assert errors[-1]["retryable"] is False
        assert emu.set_stepped(False) == 0
        assert_all_back(service, executor, device=False)  # (the drain's end stops the executor)


def test_a_cancelled_request_is_vllms_abort(tmp_path):
    """With vLLM's metric names, a request an operator cancelled is counted
    ``vllm:request_success_total{finished_reason="abort"}``, as vLLM counts a request its
    engine aborted (it was shown 0 whatever happened)."""
    with served(tmp_path, max_sequences=1, metrics_names="vllm") as (server, service, executor):
        held = service.sequences.acquire()
        out: list = []
        thread = posted(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, out,
                        {"x-request-id": "vllm-abort"})
        wait_for(lambda: service.admission.waiting == 1, WAIT_S, "the request waiting")
        assert cancel(server.url, "vllm-abort").status_code == 202
        thread.join(WAIT_S)
        assert_aborted(out[0], "vllm-abort")
        service.sequences.release(held)
        assert_all_back(service, executor)
        metrics = httpx.get(f"{server.url}/metrics").text
        assert metric_value(metrics, "vllm:request_success_total",
                            {"finished_reason": "abort"}) == 1
        assert metric_value(metrics, "vllm:request_success_total",
                            {"finished_reason": "stop"}) == 0
