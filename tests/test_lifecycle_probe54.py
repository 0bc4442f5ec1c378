"""Stop 54, the device lifecycle under a device that stops finishing jobs, seen from
``calexec serve`` (docs/traceability.md "Found at stop 54 (lifecycle)"). Real executor on
the bundled emulator in stepped mode; every wait bounded."""

from __future__ import annotations

import http.client
import json
import socket
import threading

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.calrt.runtime import Did, Stage
from calexec.drivers.serving.server import (
    DrainingServer,
    ServerConfig,
    create_app,
    uvicorn_config,
)
from calexec.machines.faults import Action, Decision, RecoveryPolicy
from test_server_support import MODEL, started_executor, wait_for


def _listener() -> socket.socket:
    """A loopback socket bound to a free port of 18800-18899."""
    for port in range(18899, 18799, -1):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        return sock
    raise AssertionError("no free port in 18800-18899")


def test_serve_drains_when_the_lifecycle_ends_failed_with_a_request_on_the_device(tmp_path):
    """``calexec serve``'s server when the lifecycle ends Failed (here the fault controller's
    escalation) while the device holds a request's job: it stopped the loop at once, and
    uvicorn cut that request after ``SHUTDOWN_WAIT_S``: a plain-text ``500 Internal Server
    Error`` (and an ERROR traceback in the log), with no drain (``drain_status`` None). It
    now drains as after a signal: the job ends by its execution deadline, the client gets
    its OpenAI-shaped error, the executor is shut down within the grace, and the drain's
    status is the failure (``serve`` exits 3 on it). (The execution deadline, 3 s, lies past
    ``SHUTDOWN_WAIT_S``, 2 s: the old code cut the request before its job ended.)"""
    executor = started_executor(tmp_path, recovery=RecoveryPolicy(reset_kind="none"),
                                execution_timeout_s=3.0, timeout_grace_s=0.2)
    emu = executor.device.emu
    app = create_app(executor, ServerConfig())
    service = app.state.service
    listener = _listener()
    port = listener.getsockname()[1]
    server = DrainingServer(uvicorn_config(app, host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False,
                                           log_config=None), service, 20.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]},
                              name="uvicorn-life54", daemon=True)
    answer: list[object] = []

    def complete() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            connection.request("POST", "/v1/completions", json.dumps(
                {"model": MODEL, "prompt": "hello", "max_tokens": 3}),
                {"content-type": "application/json"})
            response = connection.getresponse()
            answer.append((response.status, response.read()))
        except OSError as exc:
            answer.append(exc)
        finally:
            connection.close()

    client = threading.Thread(target=complete, name="client-life54", daemon=True)
    try:
        thread.start()
        wait_for(lambda: server.started, 30, "the server listening")
        assert emu.set_stepped(True) == 0  # the device finishes nothing from now
        client.start()
        wait_for(lambda: executor.snapshot()["inflight"] == 1, 30, "the request's job on the "
                 "device")
        executor.request_recovery(Decision(Action.STOP, Status.failure(
            "device.test", Category.DEVICE, Phase.RECOVERY, "the test's escalation"),
            "escalation: the test's"))
        assert executor.state == "Failed"
        client.join(60)
        assert answer, "the client got no answer"
        assert isinstance(answer[0], tuple), answer
        code, body = answer[0]
        assert code == 503, (code, body[:200])
        # its job's execution deadline (a device fault) is resumed; the resume meets the
        # Failed lifecycle and answers what a request sent then is told (stop 66, faults2:
        # it was the ``execution.deadline`` resumed from)
        error = json.loads(body)["error"]
        assert error["code"] == "lifecycle.unavailable", error
        assert error["message"].startswith("device lifecycle is Failed after device.test"), error
        assert emu.step(0, Stage.JOB) == (0, Did.SIGNAL)  # the device lets go: drained
        thread.join(60)
        assert not thread.is_alive(), "the server did not exit"
        assert service.drain_status is not None, "the server exited without a drain"
        assert service.drain_status.code == "device.test"
        assert executor.state == "Failed"
    finally:
        emu.set_stepped(False)
        server.should_exit = True
        thread.join(30)
        executor.shutdown(5.0)
