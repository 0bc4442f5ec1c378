"""Adversarial HTTP and admin input found by probing a loopback ``calexec serve`` at stop 70
(branch probe-http): two clients sending one ``X-Request-Id`` at once, and what the admin API
and a request caught by a model switch are told. Real executor on the bundled emulator;
loopback only; every wait bounded."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from calexec.drivers.serving.dumpsink import DumpSink
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    LiveServer,
    admin_test_client,
    executor_fixture,  # noqa: F401 - the fixture ``executor``
    server_idle,
    started_executor,
    wait_for,
)


def held_switch():
    """``(held, release, held_open)``: ``held_open`` stands for
    ``device_lifecycle.open_generation`` (the test patches it in): a switch whose old
    generation is retired sets ``held`` and waits there (bounded) until ``release`` is set."""
    from calexec.machines import device_lifecycle

    real_open = device_lifecycle.open_generation
    held, release = threading.Event(), threading.Event()

    def held_open(*args, **kwargs):
        held.set()
        release.wait(30.0)
        return real_open(*args, **kwargs)
    return held, release, held_open


def test_two_requests_sending_one_x_request_id_have_dump_records_told_apart(tmp_path):
    """Two clients sending one ``X-Request-Id`` at once (a retried call, a client reusing a
    trace id) are both answered, each with its own body ``id``; but the dump record of each
    named only the shared ``x_request_id`` and the server's internal integer id, so a client
    quoting what it got (the body's ``id``, which stays unique: docs/server.md "Request
    ids") could not find its record among the others. Each record now names its response's
    ``id`` too: a whole answer, a stream, each choice of ``n`` 2 (one id), a Responses call."""
    executor = started_executor(tmp_path)
    sink = DumpSink(tmp_path / "dump", max_bytes=1_000_000)
    try:
        app = create_app(executor, ServerConfig(), sink)
        with LiveServer(app) as server:
            sends = [
                ("/v1/completions", {"prompt": "a", "max_tokens": 4}),
                ("/v1/completions", {"prompt": "a", "max_tokens": 4, "stream": True}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b"}],
                                          "max_tokens": 3, "n": 2}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b"}],
                                          "max_tokens": 3, "stream": True}),
                ("/v1/responses", {"input": "c", "max_output_tokens": 16}),
            ]
            barrier = threading.Barrier(len(sends), timeout=30.0)
            got: dict[int, tuple[int, str, str]] = {}

            def send(k: int, path: str, body: dict) -> None:
                with httpx.Client(base_url=server.url, timeout=60.0) as client:
                    barrier.wait()
                    r = client.post(path, json=body, headers={"X-Request-Id": "shared-7"})
                    if body.get("stream"):
                        first = next(line for line in r.text.splitlines()
                                     if line.startswith("data: {"))
                        body_id = json.loads(first[len("data: "):])["id"]
                    else:
                        body_id = r.json()["id"]
                    got[k] = (r.status_code, r.headers["x-request-id"], body_id)

            threads = [threading.Thread(target=send, args=(k, path, body))
                       for k, (path, body) in enumerate(sends)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60.0)
            assert sorted(got) == list(range(len(sends))), got
            assert all(status == 200 and header == "shared-7"
                       for status, header, _ in got.values()), got
            ids = [body_id for _, _, body_id in got.values()]
            assert len(set(ids)) == len(sends), ids  # the bodies' ids stay unique
            service = app.state.service
            wait_for(lambda: server_idle(service), what="the requests to finish")
        assert sink.flush(10.0), sink.counts()
        records = [json.loads(line) for line in sink.path.read_text().splitlines()]
        assert {record["x_request_id"] for record in records} == {"shared-7"}
        # one record per choice: the n=2 chat's two records carry its one id
        assert sorted(record["response_id"] for record in records) == sorted(
            ids + [got[2][2]]), records
    finally:
        executor.shutdown(5.0)


def test_a_request_whose_generation_a_switch_retired_is_not_told_replaced_by_none(
        tmp_path, monkeypatch):
    """``--max-resumes 0`` (or a request whose resumes were spent by earlier switches: 16
    clients streaming through back-to-back ``POST /admin/reload`` met it): a job of the
    request refused while a model switch had retired its generation and not yet opened
    the next one answered 503 "the request's generation 1 was replaced by None (recovery
    or model switch); retry", Python's None for the generation not open yet. It now says
    the generation was retired and the next one is not open yet."""
    from calexec.machines import device_lifecycle

    executor = started_executor(tmp_path)
    copy = tmp_path / "copy.calbin"
    copy.write_bytes((tmp_path / "synthetic.calbin").read_bytes())
    held, release, held_open = held_switch()

    enqueue, calls, switches = executor.enqueue, [], []

    def switching_enqueue(request, *args, **kwargs):
        calls.append(request.past_len)
        if len(calls) == 3:  # after two tokens: a switch retires the generation, then the job
            monkeypatch.setattr(device_lifecycle, "open_generation", held_open)
            switch = threading.Thread(target=lambda: switches.append(
                executor.switch_model(str(copy))))
            switch.start()
            switches.append(switch)
            assert held.wait(30.0), "the switch never retired the generation"
            assert executor.generation is None
        return enqueue(request, *args, **kwargs)

    monkeypatch.setattr(executor, "enqueue", switching_enqueue)
    app = create_app(executor, ServerConfig(max_resumes=0, prearm=False, decode_bursts=False))
    try:
        with TestClient(app) as client:
            try:
                r = client.post("/v1/completions", json={"prompt": [3, 1, 4, 1, 5],
                                                         "max_tokens": 6})
            finally:
                release.set()
                if switches:
                    switches[0].join(30.0)
            assert r.status_code == 503, r.text
            status = r.json()["status"]
            assert status["code"] == "lifecycle.unavailable", status
            assert "None" not in status["message"], status
            assert status["message"] == ("the request's generation 1 was retired; the next "
                                         "one is not open yet (recovery or model switch); "
                                         "retry"), status
            assert switches[1].ok, switches  # the switch itself went through
            assert server_idle(app.state.service)
    finally:
        release.set()
        executor.shutdown(5.0)


def test_a_reload_while_a_switch_has_moved_the_lifecycle_names_the_switch(tmp_path, monkeypatch):
    """A second ``POST /admin/reload`` while the first one's switch runs (two operators, a
    retried call) is a 503 naming the switch under way, as docs/operations.md says: but
    once the switch had moved the lifecycle (its drain, its teardown, the next generation's
    configure and golden: most of a switch's time) the 503 said
    ``reload refused, lifecycle unchanged: lifecycle is Draining, not admitting`` (or
    ``Recovering``...), the health reasons the switch itself caused, naming a drain no one
    started. It names the switch under way there too."""
    from calexec.machines import device_lifecycle

    executor = started_executor(tmp_path)
    calbin = executor.config.calbin_path
    held, release, held_open = held_switch()

    monkeypatch.setattr(device_lifecycle, "open_generation", held_open)
    answers: list[httpx.Response] = []
    auth = {"Authorization": "Bearer probe70-admin"}
    try:
        app = create_app(executor, ServerConfig(admin_token="probe70-admin"))
        with LiveServer(app) as server:
            first = threading.Thread(target=lambda: answers.append(httpx.post(
                f"{server.url}/admin/reload", json={"calbin": calbin}, headers=auth,
                timeout=60.0)))
            first.start()
            try:
                assert held.wait(30.0), "the first reload's switch never retired the generation"
                assert app.state.service.health(), "the switch gives no health reason"
                r = httpx.post(f"{server.url}/admin/reload", json={"calbin": calbin},
                               headers=auth, timeout=60.0)
            finally:
                release.set()
                first.join(60.0)
            assert r.status_code == 503 and r.headers["retry-after"], r.text
            error = r.json()["error"]
            assert error["param"] == "calbin" and error["code"] == "lifecycle.unavailable"
            assert error["message"] == (f"reload refused, lifecycle unchanged: a switch to "
                                        f"calbin {json.dumps(calbin)} is under way; send it "
                                        "again once that one answered"), error
            assert len(answers) == 1 and answers[0].status_code == 200, answers
            assert answers[0].json()["generation"] == 2, answers[0].text
    finally:
        release.set()
        executor.shutdown(5.0)


def _bounded(call, fifo: str) -> list:
    """``call()`` in a thread, waited for at most 30 s: what it returned (empty: still
    running, then unblocked by opening ``fifo``'s writing end, so no thread is left behind)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(30.0)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the loader's open returns
        thread.join(30.0)
        return []
    return out


def test_a_switch_or_start_given_a_fifo_is_refused_not_held_in_the_loader(tmp_path):
    """``DeviceExecutor.switch_model(FIFO)`` (an embedder's call, docs/embedding.md; or the
    file behind a ``POST /admin/reload`` path replaced by a FIFO after the route's check)
    drained, tore the serving generation down and then waited in the runtime's loader,
    whose open of a FIFO no one writes to never returns: the lifecycle stayed Configuring,
    nothing served, the call never answered. ``start()`` of an executor configured with one
    waited the same way. The load is now refused before the loader is called (a FIFO, a
    character device, a socket: not a regular file), so the switch rolls back and the
    previous calbin serves again, and the start ends Failed, each saying why."""
    from calexec.contracts.manifest import default_manifest_path, load_manifest
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig

    fifo = str(tmp_path / "model.calbin")
    os.mkfifo(fifo)
    executor = started_executor(tmp_path)
    try:
        answered = _bounded(lambda: executor.switch_model(fifo), fifo)
        assert answered, "switch_model(FIFO) waited in the loader (unblocked by the test)"
        status = answered[0]
        assert status.code == "recovery.rolled_back", status
        assert "not a regular file (mode prw" in status.message, status
        assert executor.state == "Ready" and executor.gen is not None
        assert executor.gen.calbin_path == executor.config.calbin_path
    finally:
        executor.shutdown(5.0)
    fresh = DeviceExecutor(CalRT.load(), load_manifest(default_manifest_path()),
                           ExecutorConfig(calbin_path=fifo))
    try:
        started = _bounded(fresh.start, fifo)
        assert started, "start() of a FIFO waited in the loader (unblocked by the test)"
        assert started[0].code == "calrt.calbin_load_failed", started[0]
        assert "not a regular file (mode prw" in started[0].message, started[0]
        assert fresh.state == "Failed"
    finally:
        fresh.shutdown(5.0)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _json_schema_bodies(schema: object) -> list[tuple[str, dict, str]]:
    """(route, body, param) of ``schema`` given as the json_schema of a chat, a completion,
    a chat with tools beside it, and a Responses call."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return [
        ("/v1/chat/completions", {**CHAT, "response_format": fmt},
         "response_format.json_schema.schema"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 6, "response_format": fmt},
         "response_format.json_schema.schema"),
        ("/v1/chat/completions", {**CHAT, "response_format": fmt, "tools": [TOOL]},
         "response_format.json_schema.schema"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 16, "text": {"format": {
            "type": "json_schema", "name": "x", "schema": schema}}}, "text.format.schema"),
    ]


@pytest.mark.parametrize("schema, written", [("x", '"x"'), ([], "[]"), (5, "5"),
                                             (True, "true")])
def test_a_json_schema_or_tool_parameters_that_is_no_object_is_named_as_sent(
        client, schema, written):
    """A ``response_format`` json_schema ``schema`` (or a Responses ``text.format.schema``)
    that is no JSON object was refused ``...schema: must be a JSON Schema object, got str``
    (``list``, ``int``, ``bool``): Python's type names, not the value sent; a tool's
    ``parameters`` was refused without naming it at all. Each refusal now names the value as
    JSON wrote it and what to send."""
    for route, body, param in _json_schema_bodies(schema):
        r = client.post(route, json=body)
        assert r.status_code == 400, (route, r.text)
        error = r.json()["error"]
        assert error["param"] == param, (route, error)
        assert error["message"] == (f"{param}={written}: must be a JSON Schema, a JSON object "
                                    '(such as {"type": "object"})'), (route, error)
    r = client.post("/v1/chat/completions", json={**CHAT, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": schema}}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools.0.function.parameters", error
    assert error["message"] == (f"tools.0.function.parameters={written}: must be a JSON "
                                'Schema, a JSON object (such as {"type": "object"}), or left '
                                "out"), error


def test_a_json_schema_given_as_null_is_its_default_as_when_left_out(client):
    """``"schema": null`` in a json_schema ``response_format`` was a 400 ``must be a JSON
    Schema object, got NoneType``, though docs/server.md says ``null`` for an optional field
    means its default, the SDK types ``schema`` as optional, and a json_schema without it is
    served (any JSON value), as a tool's ``parameters: null`` is. It is now served as when
    left out: the answer is one JSON value, the same with null as without."""
    for (route, with_null, _), (_, without, _) in zip(
            _json_schema_bodies(None), _json_schema_bodies({}), strict=True):
        spec = (without.get("response_format") or without["text"]["format"])
        spec = spec.get("json_schema", spec)
        spec.pop("schema", None)  # (the first three bodies share one dict)
        answers = []
        for body in (with_null, without):
            r = client.post(route, json=body)
            assert r.status_code == 200, (route, r.text)
            answers.append(r.json())
        texts = [_text(route, answer) for answer in answers]
        assert texts[0] == texts[1], (route, texts)
        if answers[0].get("choices", [{}])[0].get("finish_reason") == "stop":
            json.loads(texts[0])  # a whole JSON value


def _text(route: str, answer: dict) -> str:
    if route == "/v1/responses":
        return "".join(part["text"] for item in answer["output"] if item["type"] == "message"
                       for part in item["content"])
    choice = answer["choices"][0]
    return choice["text"] if route == "/v1/completions" else choice["message"]["content"]


@pytest.fixture
def client(executor):
    with admin_test_client(executor, "probe70-admin") as client:
        yield client


def _several_choices_stream(url: str, request_id: str, n: int) -> tuple[threading.Thread,
                                                                       threading.Event]:
    """A streamed chat of ``n`` choices (1000 tokens each) from a worker thread, sent with
    ``X-Request-Id: request_id``: (thread, its first event seen)."""
    first = threading.Event()

    def run() -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                              headers={"X-Request-Id": request_id},
                              json={"messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 1000, "n": n, "stream": True}) as r:
                for _ in r.iter_lines():
                    first.set()
        except httpx.HTTPError:
            pass  # cut
        finally:
            first.set()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return worker, first


@pytest.mark.parametrize("forced", [False, True], ids=["grace_over", "second_signal"])
def test_a_cut_counts_a_request_of_several_choices_once(tmp_path, forced):
    """``calexec serve`` draining with a request of 3 choices (``n`` 3) and one of 1 still
    streaming: the WARNING line said ``drain: grace 0.5s over, 4 request(s) still running are
    cut (x-request-id: multi-1, single-2)``, four "requests" beside two ids, the count of
    choices (a second signal's ``forced exit, 4 request(s) cut`` and the exit line the same),
    though docs/server.md names a request of several choices once. Both count requests."""
    from test_ops_sweep import killed, serve_process, stopped

    proc, url = serve_process(tmp_path, "--grace", "30" if forced else "0.5",
                              "--device-config", "decode_us=20000")
    try:
        workers = []
        for request_id, n in (("multi-1", 3), ("single-2", 1)):  # admitted in this order
            worker, first = _several_choices_stream(url, request_id, n)
            assert first.wait(10)
            workers.append(worker)
        proc.send_signal(signal.SIGTERM)
        if forced:
            wait_for(lambda: httpx.get(f"{url}/ready", timeout=2).status_code == 503,
                     what="/ready to report draining")
            proc.send_signal(signal.SIGINT)
        code, err = stopped(proc)
        for worker in workers:
            worker.join(10)
    finally:
        killed(proc)
    if forced:
        assert code == 3, err
        assert ("signal SIGINT again: forced exit, 2 request(s) cut "
                "(x-request-id: multi-1, single-2)") in err, err
        assert "forced exit by a second signal: 2 request(s) still running" in err, err
    else:
        assert code == 0, err
        assert ("drain: grace 0.5s over, 2 request(s) still running are cut "
                "(x-request-id: multi-1, single-2)") in err, err


def test_a_request_a_switch_ended_as_a_drain_began_is_not_told_the_grace_ran_out(
        tmp_path, monkeypatch):
    """``POST /admin/drain?grace=30`` sent while a model switch had retired the serving
    generation (a drain racing a reload), with a request whose next job the switch refused
    and no resume left (``--max-resumes 0``): it was answered 503 ``server drained: its grace
    (30 s) ran out before the request finished; retry`` within a second of the drain's start,
    the grace far from over (any generation missing while draining was taken for the drain's
    own shutdown). It is told the generation was retired, as without the drain; the drain's
    message stays for a grace that ran out."""
    from calexec.machines import device_lifecycle

    executor = started_executor(tmp_path)
    copy = tmp_path / "copy.calbin"
    copy.write_bytes((tmp_path / "synthetic.calbin").read_bytes())
    held, release, held_open = held_switch()

    app = create_app(executor, ServerConfig(max_resumes=0, prearm=False, decode_bursts=False,
                                            admin_token="probe70-admin"))
    enqueue, calls, threads, drains = executor.enqueue, [], [], []

    def switching_enqueue(request, *args, **kwargs):
        calls.append(request.past_len)
        if len(calls) == 3:  # after two tokens: a switch retires the generation, a drain begins
            monkeypatch.setattr(device_lifecycle, "open_generation", held_open)
            threads.append(threading.Thread(target=lambda: executor.switch_model(str(copy))))
            threads[-1].start()
            assert held.wait(30.0), "the switch never retired the generation"
            drain = threading.Thread(target=lambda: drains.append(client.post(
                "/admin/drain?grace=30", headers={"Authorization": "Bearer probe70-admin"})))
            drain.start()
            drain.join(30.0)  # (the switch is released once the request answered)
        return enqueue(request, *args, **kwargs)

    monkeypatch.setattr(executor, "enqueue", switching_enqueue)
    try:
        with TestClient(app) as client:
            try:
                r = client.post("/v1/completions", json={"prompt": [3, 1, 4, 1, 5],
                                                         "max_tokens": 6})
            finally:
                release.set()
                for thread in threads:
                    thread.join(30.0)
            assert len(drains) == 1 and drains[0].status_code == 202, drains
            assert drains[0].json()["grace"] == 30.0
            assert r.status_code == 503, r.text
            message = r.json()["status"]["message"]
            assert "grace" not in message, message
            assert message == ("the request's generation 1 was retired; the next one is not "
                               "open yet (recovery or model switch); retry"), message
    finally:
        release.set()
        executor.shutdown(5.0)
