"""Stop 74 (chaos): ``POST /admin/cancel/{id}`` raced against the other state machines a
request meets: a recovery (a device fault mid-decode, the stream's resume), a model switch
(``POST /admin/reload``), a drain, the request's own deadline, its client leaving, Phase B
(two jobs on the device), grammar-constrained requests, ``n`` > 1 streams, two cancels of one
id at once, and a stream whose client stopped reading (its send blocked). Each moment is held
deterministically where it can be (the stepped emulator, a held sequence id, an Event
barrier), then a seeded, bounded schedule mixes them. After each: no 500, no traceback in the
log, the client's answer is one documented shape (409 ``request.aborted`` / its error event,
or the request's own outcome when it ended first: never both, never a hang), every sequence
id, KV block, slot, the queue and the in-progress registry back, and the metrics agree with
what the clients saw. Nothing asserts a duration: every wait is a bounded poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import re
import socket
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402

from calexec.drivers.calrt.runtime import Fault, FaultMode, Stage  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from test_server_support import (  # noqa: E402
    LiveServer,
    ServeLikeServer,
    metric_value,
    oracle_tokens,
    read_until_closed,
    stalled_client,
    started_executor,
    wait_device_idle,
    wait_for,
)

TOKEN = "chaos74-admin"
AUTH = {"authorization": f"Bearer {TOKEN}"}
PROMPT = [5, 6, 7]
WAIT_S = 30.0


def busy_engine(emu) -> int | None:
    return next((e for e in (0, 1) if emu.pending(e)[1] > 0), None)


@contextlib.contextmanager
def served(tmp_path, executor_config: dict | None = None, serve_like: bool = False,
           **config) -> Iterator[tuple]:
    """(server, service, executor) of a loopback server with the admin token; the device
    unstepped and the executor shut down at the end."""
    executor = started_executor(tmp_path, **(executor_config or {}))
    app = create_app(executor, ServerConfig(admin_token=TOKEN, **config))
    try:
        with (ServeLikeServer(app, small_buffers=True) if serve_like
              else LiveServer(app)) as server:
            yield server, app.state.service, executor
    finally:
        executor.device.emu.set_stepped(False)
        executor.device.emu.clear_all_faults()
        executor.shutdown(5.0)


def reloading(url: str, calbin: str) -> tuple[threading.Thread, list]:
    """``POST /admin/reload`` of ``calbin`` from a thread (started): the thread and the list
    its response is appended to."""
    answers: list = []
    thread = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{url}/admin/reload", json={"calbin": calbin}, headers=AUTH, timeout=WAIT_S)))
    thread.start()
    return thread, answers


def cancel(url: str, ident: str) -> httpx.Response:
    return httpx.post(f"{url}/admin/cancel/{ident}", headers=AUTH, timeout=WAIT_S)


def idle(service) -> bool:
    """No request in progress anywhere (the in-progress registry: runs, requests of several
    choices, arrivals) and every sequence id back."""
    return (service.active == 0 and service.sequences.in_use == 0
            and service.releases_pending == 0 and not service.live_requests()
            and service.open_requests == 0 and service.arrivals == 0)


def assert_all_back(service, executor, device: bool = True) -> None:
    """Every sequence id, the waiting queue, the in-progress registry and (``device``) the
    device's slots, KV blocks and jobs are back."""
    wait_for(lambda: idle(service), WAIT_S, "every sequence id back")
    assert service.sequences.consistent() and service.sequences.withheld == 0
    assert service.admission.waiting == 0
    text = service.metrics.exposition().decode()
    assert metric_value(text, "calexec_responses_send_waiting") in (0, None)
    if not device:
        return
    wait_device_idle(executor, WAIT_S)


def no_traceback(caplog) -> None:
    """No traceback in the server's log (an injected fault's ERROR lines are expected)."""
    bad = [r for r in caplog.records
           if r.exc_info or "Traceback" in r.getMessage() or "unexpected" in r.getMessage()]
    assert not bad, [r.getMessage() for r in bad]


def sse_events(raw: bytes) -> list:
    """The ``data:`` payloads of a stream's bytes (``[DONE]`` as the string)."""
    out: list = []
    for data in re.findall(rb"data: (.*?)\n\n", raw, re.S):
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def failures(service) -> float:
    """Every ``calexec_request_failures_total`` series summed."""
    text = service.metrics.exposition().decode()
    return sum(float(m) for m in re.findall(
        r"^calexec_request_failures_total\{[^}]*\} (\S+)$", text, re.M))


# ---- 2: a cancel of a stream whose client stopped reading ------------------------------------
@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": [1, 2, 3]}),
    ("/v1/completions", {"prompt": [1, 2, 3], "n": 2}),
    ("/v1/completions", {"prompt": [1, 2, 3], "stop": ["never said"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
    ("/v1/responses", {"input": "hello"})],
    ids=["completions", "n2", "plain_path", "chat", "responses"])
def test_a_cancel_of_a_stream_blocked_on_its_send_cuts_it_and_frees_it_at_once(tmp_path, caplog,
                                                                               path, body):
    """A raw client with a small receive buffer that never reads: the server's send waits for
    it (long before the request's 600 s deadline). A cancel by its ``x-request-id`` closes the
    connection (no ``[DONE]``) and gives back its sequence ids, KV blocks and slots now; the
    request counted ``request.aborted``, not ``request.client_stalled``. Before stop 74 the
    cancel answered 202 and the stream held everything until its deadline + slack."""
    caplog.set_level(logging.INFO)
    tokens = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    with served(tmp_path, serve_like=True) as (server, service, executor):
        sock = stalled_client(server.port, {**body, tokens: 30000, "stream": True,
                                            "timeout": 600}, path)
        try:
            wait_for(lambda: metric_value(service.metrics.exposition().decode(),
                                          "calexec_responses_send_waiting") == 1,
                     WAIT_S, "the server's send waiting for the client")
            (ident,) = {run.response_id for run in service.live_requests()}
            answer = cancel(server.url, ident)
            assert answer.status_code == 202, answer.text
            wait_for(lambda: idle(service), WAIT_S,
                     "the stalled stream cut and freed by the cancel (not at its deadline)")
            assert_all_back(service, executor)
            raw, ended = read_until_closed(sock)
            assert ended in ("eof", "reset"), (ended, len(raw))
            assert b"data: [DONE]" not in raw
        finally:
            sock.close()
        text = service.metrics.exposition().decode()
        assert metric_value(text, "calexec_request_failures_total",
                            {"code": "request.aborted"}) >= 1
        assert metric_value(text, "calexec_request_failures_total",
                            {"code": "request.client_stalled"}) is None
        assert metric_value(text, "calexec_admin_cancels_total", {"outcome": "cancelled"}) == 1
        ok = httpx.post(f"{server.url}/v1/completions",
                        json={"prompt": PROMPT, "max_tokens": 3}, timeout=WAIT_S)
        assert ok.json()["choices"][0]["token_ids"] == oracle_tokens(PROMPT, 3)
    no_traceback(caplog)


# ---- 1: the cancel raced against each state machine, deterministically -----------------------
def aborted(response: httpx.Response) -> bool:
    """The 409 ``request.aborted`` of a request an operator cancelled."""
    if response.status_code != 409:
        return False
    error = response.json()["error"]
    assert error["code"] == "request.aborted" and error["type"] == "cancelled_error", error
    assert response.headers["x-should-retry"] == "false"
    return True


class Streamer:
    """A streamed request read from a thread: its status, its ``data:`` events."""

    def __init__(self, url: str, path: str, body: dict, ident: str) -> None:
        self.status: int | None = None
        self.events: list = []
        self.first = threading.Event()
        self.failure: BaseException | None = None

        def read() -> None:
            try:
                with httpx.stream("POST", f"{url}{path}", timeout=WAIT_S, json=body,
                                  headers={"x-request-id": ident}) as response:
                    self.status = response.status_code
                    if response.status_code != 200:
                        response.read()
                        self.events.append(response.json())
                        return
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            data = line[6:]
                            self.events.append("[DONE]" if data == "[DONE]" else json.loads(data))
                            self.first.set()
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                self.failure = exc
            finally:
                self.first.set()
        self.thread = threading.Thread(target=read)
        self.thread.start()

    def join(self) -> None:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the stream never ended"
        assert self.failure is None, self.failure

    def outcome(self) -> str:
        """``aborted`` (its error event or 409), ``done`` (``[DONE]``) or the error code; a
        stream is exactly one of them (never an error event and ``[DONE]``)."""
        if self.status != 200:
            return self.events[0]["error"]["code"]
        errors = [e for e in self.events if isinstance(e, dict) and "error" in e]
        done = "[DONE]" in self.events
        assert not (errors and done), self.events
        assert len(errors) <= 1, errors
        if errors:
            assert self.events[-1] is errors[0], self.events  # the error event is the last
            code = errors[0]["error"]["code"]
            return "aborted" if code == "request.aborted" else code
        assert done and self.events[-1] == "[DONE]", self.events
        return "done"


def step_until_first_event(emu, stream: Streamer) -> None:
    for _ in range(8):  # (bounded: a prefill or two, then the first event)
        wait_for(lambda: busy_engine(emu) is not None or stream.first.is_set(), WAIT_S,
                 "a job on the device or the first event")
        if stream.first.is_set():
            return
        assert emu.step(busy_engine(emu), Stage.JOB)[0] == 0
    assert stream.first.wait(WAIT_S)


def test_a_stream_cancelled_in_its_resume_after_a_fault_mid_decode(tmp_path, caplog):
    """A stream's first token sent, then its next decode job faults (a CCU exception): the
    recovery's golden held in Warming, the stream waits in its resume; cancelled, its last
    event is the ``request.aborted`` error event (not the fault's, no ``[DONE]``), nothing
    is resumed after Ready, and everything comes back."""
    caplog.set_level(logging.INFO)
    with served(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 2, 0, 0) == 0  # 1st decode
        assert emu.set_stepped(True) == 0
        stream = Streamer(server.url, "/v1/completions",
                          {"prompt": PROMPT, "max_tokens": 40, "stream": True}, "resume-74")
        step_until_first_event(emu, stream)
        wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "the next decode job held")
        assert emu.step(busy_engine(emu), Stage.JOB)[0] == 0  # the fault -> a recovery
        wait_for(lambda: executor.state == "Warming" and service.admission.waiting == 1,
                 WAIT_S, "the stream's resume waiting behind the recovery")
        assert cancel(server.url, "resume-74").status_code == 202
        stream.join()
        assert stream.outcome() == "aborted", stream.events
        assert emu.set_stepped(False) == 0
        emu.clear_all_faults()
        wait_for(lambda: executor.state == "Ready", WAIT_S, "Ready after the recovery")
        assert_all_back(service, executor)
        text = httpx.get(f"{server.url}/metrics").text
        assert metric_value(text, "calexec_request_failures_total",
                            {"code": "request.aborted"}) == 1
        assert metric_value(text, "calexec_request_success_total") is None
    no_traceback(caplog)


def test_a_cancel_raced_with_a_model_switch(tmp_path, caplog):
    """A request's job held on the stepped device while ``POST /admin/reload`` switches the
    model (its golden waits for the device too): the cancel ends the request with 409, the
    switch then completes (200), and the new generation serves the greedy tokens."""
    caplog.set_level(logging.INFO)
    with served(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_stepped(True) == 0
        out: list = []
        thread = threading.Thread(target=lambda: out.append(httpx.post(
            f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 40},
            headers={"x-request-id": "switch-74"}, timeout=WAIT_S)))
        thread.start()
        wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "the request's job held")
        switch, reload = reloading(server.url, executor.gen.calbin_path)
        answer = cancel(server.url, "switch-74")
        assert answer.status_code in (202, 404), answer.text
        assert emu.set_stepped(False) == 0
        thread.join(WAIT_S)
        switch.join(WAIT_S)
        assert not thread.is_alive() and not switch.is_alive()
        response = out[0]
        if answer.status_code == 202:
            assert aborted(response), response.text
        else:  # the switch ended it first: its own answer
            assert response.status_code == 503, response.text
        assert reload[0].status_code == 200, reload[0].text
        wait_for(lambda: executor.state == "Ready", WAIT_S, "Ready on the new model")
        assert_all_back(service, executor)
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3},
                        timeout=WAIT_S)
        assert ok.json()["choices"][0]["token_ids"] == oracle_tokens(PROMPT, 3)
    no_traceback(caplog)


@pytest.mark.parametrize("stream", [False, True])
def test_a_cancel_during_a_drain_lets_the_drain_end(tmp_path, caplog, stream):
    """A request held on the device, the server draining (grace 60 s): the cancel ends it
    (409 or its error event), and the drain, waiting for it, ends at once (the executor
    Stopped), everything back."""
    caplog.set_level(logging.INFO)
    with served(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_stepped(True) == 0
        body = {"prompt": PROMPT, "max_tokens": 40, "stream": stream}
        reader = Streamer(server.url, "/v1/completions", body, "drain-74")
        wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "the request's job held")
        drain = httpx.post(f"{server.url}/admin/drain?grace=60", headers=AUTH, timeout=WAIT_S)
        assert drain.status_code == 202, drain.text
        assert cancel(server.url, "drain-74").status_code == 202
        reader.join()
        assert reader.outcome() in ("aborted", "request.aborted"), reader.events
        assert emu.set_stepped(False) == 0
        wait_for(lambda: executor.state == "Stopped", WAIT_S, "the drain ended")
        assert_all_back(service, executor, device=False)
        text = service.metrics.exposition().decode()
        assert metric_value(text, "calexec_request_failures_total",
                            {"code": "request.aborted"}) == 1
    no_traceback(caplog)


@pytest.mark.parametrize("stream", [False, True])
def test_a_cancel_after_the_client_left_counts_the_request_once(tmp_path, caplog, stream):
    """A stream's client leaves while its job is held; a cancel of it right after answers
    202 (still ending) or 404 (ended): either way the request is counted once, everything
    comes back."""
    caplog.set_level(logging.INFO)
    with served(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_stepped(True) == 0
        sock = stalled_client(server.port, {"prompt": PROMPT, "max_tokens": 40,
                                            "stream": stream})
        wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "the request's job held")
        (ident,) = {run.response_id for run in service.live_requests()}
        sock.close()  # the client leaves; the cancel follows at once
        answer = cancel(server.url, ident)
        assert answer.status_code in (202, 404), answer.text
        assert emu.set_stepped(False) == 0
        assert_all_back(service, executor)
        assert failures(service) == 1
    no_traceback(caplog)


def test_a_cancel_raced_with_the_requests_deadline(tmp_path, caplog):
    """A request whose 1 s timeout passes while its job is held: cancelled then, its answer is
    exactly one of 409 ``request.aborted`` or its deadline's 504; counted once."""
    caplog.set_level(logging.INFO)
    with served(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_stepped(True) == 0
        out: list = []
        thread = threading.Thread(target=lambda: out.append(httpx.post(
            f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 40,
                                                  "timeout": 1},
            headers={"x-request-id": "late-74"}, timeout=WAIT_S)))
        thread.start()
        wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "the request's job held")
        wait_for(lambda: all(run.status is not None for run in service.live_requests()),
                 WAIT_S, "the request's deadline passed")
        answer = cancel(server.url, "late-74")
        assert answer.status_code in (202, 404), answer.text
        thread.join(WAIT_S)
        response = out[0]
        assert response.status_code == 504 or aborted(response), response.text
        assert emu.set_stepped(False) == 0
        assert_all_back(service, executor)
        assert failures(service) == 1
    no_traceback(caplog)


def test_a_cancel_with_two_jobs_on_the_device_leaves_the_other(tmp_path, caplog):
    """Phase B (``inflight_capacity`` 2): two requests' jobs on the device at once; one
    cancelled, the other ends whole with the greedy tokens; everything back."""
    caplog.set_level(logging.INFO)
    with served(tmp_path, executor_config={"inflight_capacity": 2}) as (server, service,
                                                                         executor):
        emu = executor.device.emu
        assert emu.set_stepped(True) == 0
        out: dict = {}
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, httpx.post(
            f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 6},
            headers={"x-request-id": f"phase-b-{i}"}, timeout=WAIT_S))) for i in range(2)]
        for thread in threads:
            thread.start()
        wait_for(lambda: len(service.live_requests()) == 2
                 and all(run.handle is not None for run in service.live_requests()),
                 WAIT_S, "both requests' jobs submitted")
        assert cancel(server.url, "phase-b-0").status_code == 202
        assert emu.set_stepped(False) == 0
        for thread in threads:
            thread.join(WAIT_S)
        assert aborted(out[0]), out[0].text
        assert out[1].status_code == 200, out[1].text
        assert out[1].json()["choices"][0]["token_ids"] == oracle_tokens(PROMPT, 6)
        assert_all_back(service, executor)
    no_traceback(caplog)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


GRAMMARS = {"json_schema": {"response_format": {"type": "json_schema", "json_schema": {
                 "name": "s", "schema": SCHEMA}}},
            "tools": {"tools": [{"type": "function", "function": {"name": "f",
                                                                  "parameters": SCHEMA}}],
                      "tool_choice": "required"}}


@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_constrained_request_is_cancelled(tmp_path, caplog, stream, grammar):
    """A chat with ``response_format`` json_schema or required ``tools``, its job held:
    cancelled, 409 (or its error event), everything back, and a grammar request after it is
    served."""
    caplog.set_level(logging.INFO)
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 40,
            "stream": stream, **GRAMMARS[grammar]}
    with served(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_stepped(True) == 0
        reader = Streamer(server.url, "/v1/chat/completions", body, "grammar-74")
        wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "the request's job held")
        assert cancel(server.url, "grammar-74").status_code == 202
        reader.join()
        assert reader.outcome() in ("aborted", "request.aborted"), reader.events
        assert emu.set_stepped(False) == 0
        assert_all_back(service, executor)
        again = httpx.post(f"{server.url}/v1/chat/completions",
                           json={**body, "stream": False, "max_tokens": 20}, timeout=WAIT_S)
        assert again.status_code == 200, again.text
    no_traceback(caplog)


def test_two_cancels_of_one_id_at_once_tell_it_once(tmp_path, caplog):
    """Two clients cancel one request at the same moment (a barrier): both 202 with one
    body, counted ``cancelled`` once and ``repeated`` once; the request ends once."""
    caplog.set_level(logging.INFO)
    with served(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_stepped(True) == 0
        reader = Streamer(server.url, "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "hello"}], "n": 2,
                           "max_tokens": 40, "stream": True}, "twice-74")
        wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "the request's job held")
        barrier = threading.Barrier(2)
        answers: list = []

        def one() -> None:
            barrier.wait(WAIT_S)
            answers.append(cancel(server.url, "twice-74"))
        threads = [threading.Thread(target=one) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        # one told it; the other found it still ending (the same 202) or ended (404)
        codes = sorted(a.status_code for a in answers)
        assert codes in ([202, 202], [202, 404]), [a.text for a in answers]
        if codes == [202, 202]:
            assert answers[0].json() == answers[1].json()
        reader.join()
        assert reader.outcome() in ("aborted", "request.aborted"), reader.events
        assert emu.set_stepped(False) == 0
        assert_all_back(service, executor)
        text = service.metrics.exposition().decode()
        assert metric_value(text, "calexec_admin_cancels_total", {"outcome": "cancelled"}) == 1
        second = "repeated" if codes == [202, 202] else "not_found"
        assert metric_value(text, "calexec_admin_cancels_total", {"outcome": second}) == 1
        assert metric_value(text, "calexec_request_failures_total",
                            {"code": "request.aborted"}) >= 1
        assert metric_value(text, "calexec_request_success_total") is None
    no_traceback(caplog)


# ---- 1: a seeded schedule of everything at once ----------------------------------------------
KINDS = {
    "completion": ("/v1/completions", {"prompt": PROMPT}),
    "completion_stream": ("/v1/completions", {"prompt": PROMPT, "stream": True}),
    "chat_n2_stream": ("/v1/chat/completions", {"messages": [{"role": "user",
                                                              "content": "hello"}],
                                                "n": 2, "stream": True}),
    "grammar": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                         "response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "s",
                                                                             "schema": SCHEMA}}}),
    "prompt_list": ("/v1/completions", {"prompt": [PROMPT, [9, 10]]}),
    "chat_tools_stream": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello"}], "stream": True,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}],
        "tool_choice": "required"}),
}


def outcome_of(status: int, events: list) -> str:
    """A client's answer as one shape: ``done`` (200 whole / ``[DONE]``), ``aborted`` (409 or
    the error event) or ``error:<code>`` (another documented failure, never a 500)."""
    assert status != 500, events
    if status != 200:
        code = events[0]["error"]["code"]
        return "aborted" if code == "request.aborted" else f"error:{code}"
    if not events or not isinstance(events[0], dict) or "choices" not in events[0] or \
            len(events) > 1:  # a stream
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        done = "[DONE]" in events
        assert errors or done, events[-3:]
        assert not (errors and done) and len(errors) <= 1, events[-3:]
        if errors:
            assert events[-1] is errors[0]
            code = errors[0]["error"]["code"]
            return "aborted" if code == "request.aborted" else f"error:{code}"
        assert events[-1] == "[DONE]"
    return "done"


#: the schedules' seeds; CHAOS74_SEEDS=1,2,3... runs more
SEEDS = [int(x) for x in os.environ.get("CHAOS74_SEEDS", "74,740").split(",")]


@pytest.mark.parametrize("capacity", [1, 2], ids=["phase_a", "phase_b"])
@pytest.mark.parametrize("seed", SEEDS)
def test_a_seeded_schedule_of_cancels_faults_and_kinds(tmp_path, caplog, seed, capacity):
    """Requests of every kind (streams, ``n`` 2 streams, grammar, tools, prompt lists) on a
    free running device (one job on it, or two: Phase B) whose jobs fault at a seeded rate
    (recoveries, resumes), cancelled at seeded moments (some twice, from two clients):
    every answer one documented shape; a 202
    ``cancelled`` ends its request ``request.aborted``; the cancel and request counters say
    what the clients saw; everything back."""
    caplog.set_level(logging.INFO)
    rng = random.Random(seed)
    count = 14
    with served(tmp_path, {"inflight_capacity": capacity}, max_sequences=4) as (
            server, service, executor):
        emu = executor.device.emu
        # a fault every k-th job (a few recoveries, under the escalation's 5 a minute)
        every = rng.randint(300, 420)
        assert emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.EVERY_K, every, seed, 0) == 0
        plan = [(f"chaos-{seed}-{i}", rng.choice(sorted(KINDS)), rng.randint(20, 120),
                 rng.random() < 0.6, rng.uniform(0.0, 0.4), rng.random() < 0.3)
                for i in range(count)]
        results: dict = {}
        cancels: dict = {}

        def client(ident: str, kind: str, tokens: int) -> None:
            path, body = KINDS[kind]
            events: list = []
            with httpx.stream("POST", f"{server.url}{path}", timeout=WAIT_S,
                              json={**body, "max_tokens": tokens},
                              headers={"x-request-id": ident}) as response:
                if body.get("stream") and response.status_code == 200:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            data = line[6:]
                            events.append("[DONE]" if data == "[DONE]" else json.loads(data))
                else:
                    response.read()
                    events.append(response.json())
            results[ident] = (response.status_code, events)

        def canceller(ident: str, delay: float, twice: bool) -> None:
            time.sleep(delay)  # (a seeded moment; nothing asserts on it)
            answers = [cancel(server.url, ident)]
            if twice:
                answers.append(cancel(server.url, ident))
            cancels[ident] = [a.status_code for a in answers]

        threads = []
        for ident, kind, tokens, cut, delay, twice in plan:
            threads.append(threading.Thread(target=client, args=(ident, kind, tokens)))
            if cut:
                threads.append(threading.Thread(target=canceller, args=(ident, delay, twice)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S * 2)
        assert not any(thread.is_alive() for thread in threads), "a client or cancel hung"
        emu.clear_all_faults()
        wait_for(lambda: executor.state == "Ready", WAIT_S, "Ready after the recoveries")
        assert_all_back(service, executor)

        outcomes = {ident: outcome_of(*results[ident]) for ident, *_ in plan}
        for ident, codes in cancels.items():
            assert set(codes) <= {202, 404}, (ident, codes)
            if 202 in codes:  # told: it ends aborted, whatever its job answered
                assert outcomes[ident] == "aborted", (ident, codes, results[ident])
            if 202 not in codes:  # not in progress (not arrived yet, or ended): its own
                assert outcomes[ident] != "aborted", (ident, codes)
        for ident, *_ in plan:
            if ident not in cancels:
                assert outcomes[ident] != "aborted", ident
        text = service.metrics.exposition().decode()
        told = sum(1 for codes in cancels.values() if 202 in codes)
        said = {outcome: metric_value(text, "calexec_admin_cancels_total",
                                      {"outcome": outcome}) or 0
                for outcome in ("cancelled", "repeated", "not_found", "ambiguous")}
        assert said["ambiguous"] == 0
        assert said["cancelled"] == told, (said, cancels)
        assert said["cancelled"] + said["repeated"] == sum(
            codes.count(202) for codes in cancels.values()), (said, cancels)
        assert said["not_found"] == sum(codes.count(404) for codes in cancels.values())
        succeeded = sum(metric_value(text, "calexec_api_requests_total",
                                     {"outcome": "success", "route": route}) or 0
                        for route in ("completions", "chat_completions"))
        assert succeeded == sum(1 for o in outcomes.values() if o == "done"), outcomes
        aborted_choices = metric_value(text, "calexec_request_failures_total",
                                       {"code": "request.aborted"}) or 0
        assert aborted_choices >= sum(1 for o in outcomes.values() if o == "aborted")
    no_traceback(caplog)


# ---- 3: a cancel of a request still reading its body sticks ---------------------------------
def read_response(sock: socket.socket) -> tuple[int, dict]:
    """One HTTP/1.1 response with a ``content-length`` read off ``sock``: (status, JSON)."""
    data = bytearray()
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 16)
        assert chunk, bytes(data)
        data += chunk
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    body = bytearray(rest)
    while len(body) < length:
        chunk = sock.recv(1 << 16)
        assert chunk, bytes(body)
        body += chunk
    return int(head.split()[1]), json.loads(bytes(body))


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/completions", {"prompt": PROMPT, "n": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "s", "schema": SCHEMA}}}),
    ("/v1/responses", {"input": "hello"})], ids=["completions", "n2_stream", "grammar",
                                                  "responses"])
def test_a_cancel_of_a_request_still_reading_its_body_sticks(tmp_path, caplog, path, body):
    """A client sends its headers (its ``X-Request-Id``) and half its body, then waits: a
    cancel by that id answers 202 (it was 404: not in progress yet, and the request then ran
    to its end), and once the body is whole the request answers 409 ``request.aborted``,
    never admitted; counted once; a second cancel of it then is 404."""
    caplog.set_level(logging.INFO)
    with served(tmp_path) as (server, service, executor):
        tokens = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
        payload = json.dumps({**body, tokens: 4}).encode()
        half = len(payload) // 2
        with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
                         f"application/json\r\nx-request-id: arriving-74\r\n"
                         f"content-length: {len(payload)}\r\n\r\n".encode() + payload[:half])
            answer = None
            for _ in range(200):  # (bounded: until the route is reading the body)
                answer = cancel(server.url, "arriving-74")
                if answer.status_code != 404:
                    break
                time.sleep(0.05)
            assert answer is not None and answer.status_code == 202, answer.text
            assert answer.json()["x_request_id"] == "arriving-74"
            sock.sendall(payload[half:])
            status, answer_body = read_response(sock)
        assert status == 409, answer_body
        assert answer_body["error"]["code"] == "request.aborted", answer_body
        assert "arriving-74" in answer_body["error"]["message"]
        assert cancel(server.url, "arriving-74").status_code == 404
        assert_all_back(service, executor)
        text = service.metrics.exposition().decode()
        assert metric_value(text, "calexec_request_failures_total",
                            {"code": "request.aborted"}) == 1
        assert metric_value(text, "calexec_requests_total", {"stream": "false"}) in (0, None)
        assert metric_value(text, "calexec_requests_total", {"stream": "true"}) in (0, None)
    no_traceback(caplog)


# ---- the soak with an operator's cancels --------------------------------------------------------
def test_a_ci_sized_soak_with_cancels_passes_every_check(capsys):
    """``calexec bench soak --cancels 0.3``: a third of the requests are streams an operator
    cancels by their response id mid-stream, among every fault kind, disconnects and slow
    readers; every check passes, ``cancels`` among them (each 202 ended its stream
    ``request.aborted``, the server's counters match what the clients saw)."""
    from calexec.drivers.tools.bench import soak
    from calexec.drivers.tools.chaos import FAULTS

    code = soak.run_cli(["bench", "soak", "--json", "--requests", "160", "--faults",
                         str(len(FAULTS) + 1), "--clients", "6", "--seed", "74",
                         "--decode-us", "0,2000", "--max-tokens", "3-10", "--progress-s", "600",
                         "--max-seconds", "300", "--rss-bound-mib", "4096", "--cancels", "0.3"])
    out, _err = capsys.readouterr()
    report = json.loads(out)
    failed = {name: c["detail"] for name, c in report["checks"].items() if not c["ok"]}
    assert code == 0 and report["ok"], failed
    assert "cancels" in report["checks"]
    assert report["by_mode"].get("cancel", 0) >= 1 and report["cancels"].get("202", 0) >= 1
    assert report["cancelled_streams"] == report["cancels"]["202"]


@pytest.mark.parametrize("value", ["-0.1", "1.5", "nan", "x"])
def test_a_bad_cancels_share_is_refused_naming_the_flag(capsys, value):
    from calexec.drivers.tools.bench import soak

    with pytest.raises(SystemExit) as exc:
        soak.run_cli(["bench", "soak", "--cancels", value])
    assert exc.value.code == 2
    assert "--cancels" in capsys.readouterr().err


def test_a_stream_cancelled_while_a_model_switch_replaces_its_generation(tmp_path, caplog):
    """A stream past its first token, its next job held, a model switch under way (its golden
    waits for the device): the cancel ends the stream with the ``request.aborted`` error
    event (not the switch's knock-on, never resumed on the new generation), the switch
    completes, everything comes back and the new model serves."""
    caplog.set_level(logging.INFO)
    with served(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_stepped(True) == 0
        stream = Streamer(server.url, "/v1/completions",
                          {"prompt": PROMPT, "max_tokens": 40, "stream": True}, "switch-s-74")
        step_until_first_event(emu, stream)
        wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "the next job held")
        switch, reload = reloading(server.url, executor.gen.calbin_path)
        answer = cancel(server.url, "switch-s-74")
        assert answer.status_code == 202, answer.text
        stream.join()
        assert stream.outcome() == "aborted", stream.events
        assert emu.set_stepped(False) == 0
        switch.join(WAIT_S)
        assert not switch.is_alive() and reload[0].status_code == 200, reload[0].text
        wait_for(lambda: executor.state == "Ready", WAIT_S, "Ready on the new model")
        assert_all_back(service, executor)
        text = service.metrics.exposition().decode()
        assert metric_value(text, "calexec_request_failures_total",
                            {"code": "request.aborted"}) == 1
        assert failures(service) == 1
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3},
                        timeout=WAIT_S)
        assert ok.json()["choices"][0]["token_ids"] == oracle_tokens(PROMPT, 3)
    no_traceback(caplog)


def test_a_cancel_of_a_stalled_stream_as_the_drains_grace_ends(tmp_path, caplog):
    """A client that stopped reading, a drain with a short grace: the cancel and the grace's
    cut of the stalled send race; the request ends once (counted once), the connection
    closes, the drain ends Stopped."""
    caplog.set_level(logging.INFO)
    with served(tmp_path, serve_like=True) as (server, service, executor):
        sock = stalled_client(server.port, {"prompt": [1, 2, 3], "max_tokens": 30000,
                                            "stream": True, "timeout": 600})
        try:
            wait_for(lambda: metric_value(service.metrics.exposition().decode(),
                                          "calexec_responses_send_waiting") == 1,
                     WAIT_S, "the server's send waiting for the client")
            (ident,) = {run.response_id for run in service.live_requests()}
            drain = httpx.post(f"{server.url}/admin/drain?grace=0", headers=AUTH,
                               timeout=WAIT_S)
            assert drain.status_code == 202, drain.text
            answer = cancel(server.url, ident)
            assert answer.status_code in (202, 404), answer.text
            wait_for(lambda: executor.state == "Stopped", WAIT_S, "the drain ended")
            assert_all_back(service, executor, device=False)
            _raw, ended = read_until_closed(sock)
            assert ended in ("eof", "reset")
        finally:
            sock.close()
        assert failures(service) == 1
    no_traceback(caplog)


def test_a_cancel_of_a_waiting_request_raced_with_a_drain(tmp_path, caplog):
    """max_sequences 1, its id held: a request waits in the queue; a drain starts (it
    refuses the requests still waiting) and a cancel follows at once: the client gets one
    answer, the drain's 503 or the cancel's 409, counted once; the queue is empty."""
    caplog.set_level(logging.INFO)
    with served(tmp_path, max_sequences=1) as (server, service, executor):
        held = service.sequences.acquire()
        out: list = []
        thread = threading.Thread(target=lambda: out.append(httpx.post(
            f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4},
            headers={"x-request-id": "queued-74"}, timeout=WAIT_S)))
        thread.start()
        wait_for(lambda: service.admission.waiting == 1, WAIT_S, "the request waiting")
        drain = httpx.post(f"{server.url}/admin/drain?grace=30", headers=AUTH, timeout=WAIT_S)
        assert drain.status_code == 202, drain.text
        answer = cancel(server.url, "queued-74")
        assert answer.status_code in (202, 404), answer.text
        thread.join(WAIT_S)
        response = out[0]
        if answer.status_code == 202:
            assert aborted(response), response.text
        else:
            assert response.status_code == 503, response.text
        assert service.admission.waiting == 0
        service.sequences.release(held)
        wait_for(lambda: executor.state == "Stopped", WAIT_S, "the drain ended")
        assert_all_back(service, executor, device=False)
        assert failures(service) == 1
    no_traceback(caplog)


# ---- wire.SendCut on its own ------------------------------------------------------------------
def test_send_cut_cuts_a_waiting_send_at_once_and_bounds_later_ones():
    """``wire.SendCut.cut``: a send waiting for its client is cancelled at once; with no send
    waiting the bound drops to ``slack`` from now and nothing is cut yet; a cut asked before
    the response's sends began applies when they begin."""
    import anyio

    from calexec.drivers.serving import wire

    async def main() -> None:
        never = asyncio.Event()

        async def blocked_send(_message) -> None:  # a client that stopped reading
            await never.wait()

        bounds = wire.SendBounds()
        # no send waiting: bounded, not cut
        with anyio.CancelScope() as idle_scope:
            guard = bounds.guard(idle_scope, time.monotonic() + 600)
            handle = wire.SendCut()
            handle.attach(guard)
            handle.cut(600.0)
            for _ in range(3):
                await asyncio.sleep(0)
            assert not idle_scope.cancel_called and not guard.expired
            guard.close()
        # a send waiting: cut at once
        with anyio.CancelScope() as scope:
            guard = bounds.guard(scope, time.monotonic() + 600)
            handle = wire.SendCut()
            handle.attach(guard)
            asyncio.get_running_loop().call_soon(handle.cut, 600.0)
            await guard.send(blocked_send, {"type": "http.response.body"})
        assert scope.cancelled_caught
        guard.close()
        # asked before the sends began: applied at attach (a waiting send is then bounded)
        with anyio.CancelScope() as early:
            handle = wire.SendCut()
            handle.cut(0.0)
            guard = bounds.guard(early, time.monotonic() + 600)
            handle.attach(guard)
            await guard.send(blocked_send, {"type": "http.response.body"})
        assert early.cancelled_caught
        guard.close()
    asyncio.run(main())
