"""Stop 53 (faults): slow and vanishing clients, and seeded fault schedules under load, each
test replaying a defect found by probing a loopback server (raw sockets, httpx) on the
bundled emulator. Every wait is a bounded poll of a condition; nothing asserts a duration.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time

import needs

needs.module("httpx", "server")
import httpx  # noqa: E402
import numpy as np  # noqa: E402

from calexec.contracts.errors import Category  # noqa: E402
from calexec.contracts.manifest import default_manifest_path, load_manifest  # noqa: E402
from calexec.contracts.prepare import InferenceRequest  # noqa: E402
from calexec.contracts.status import Phase, Status  # noqa: E402
from calexec.contracts.types import TaskKind  # noqa: E402
from calexec.drivers.calrt.runtime import CalRT, Fault, FaultMode  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from calexec.drivers.synthetic import calbin  # noqa: E402
from calexec.machines.clock import Clock  # noqa: E402
from calexec.machines.executor import DeviceExecutor, ExecutorConfig  # noqa: E402
from calexec.machines.faults import RecoveryPolicy  # noqa: E402
from test_ops_sweep import serve_process, stopped  # noqa: E402
from test_server_support import (  # noqa: E402
    LiveServer,
    server_idle,
    started_executor,
    wait_for,
)

TOKEN = "probe53-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_a_drain_that_meets_a_recovery_warming_up_ends_stopped(tmp_path):
    """A request's job meets a CCU exception; the fault controller's recovery is warming up
    (its golden prefill waits for KV: the KvManager said no once) when ``POST /admin/drain``
    arrives. The shutdown stops the golden run, nothing is left on the device, and the
    lifecycle ended ``Failed`` all the same (``calexec serve``: exit 3, as for a broken
    device, for a deploy that met a recovery); now it ends ``Stopped`` and the drain is OK."""
    # no retry of a refusal: one refusal leaves the golden waiting for a release
    executor = started_executor(tmp_path, recovery=RecoveryPolicy(kv_refusal_retries=0))
    app = create_app(executor, ServerConfig(admin_token=TOKEN))
    service = app.state.service
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
            emu = executor.device.emu
            assert emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 1, 0, 0) == 0
            # the request's prefill asks first, the recovery's golden prefill second
            assert emu.set_fault(Fault.CAN_ALLOCATE_FALSE, FaultMode.NTH, 2, 0, 0) == 0
            answers: list[httpx.Response] = []
            client = threading.Thread(target=lambda: answers.append(http.post(
                "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1,
                                         "timeout": 20})), daemon=True)
            client.start()
            wait_for(lambda: executor.state == "Warming" and executor.kvc is not None
                     and executor.kvc.waiting == 1, 20, "the recovery's golden waiting for KV")
            r = http.post("/admin/drain", params={"grace": 1}, headers=AUTH)
            assert r.status_code == 202, r.text
            wait_for(lambda: service.drain_status is not None, 30, "the drain's end")
            client.join(30)
            assert executor.state == "Stopped", (executor.state, executor.lifecycle.failure)
            assert service.drain_status.ok, service.drain_status
            assert executor.recoveries and not executor.recoveries[-1]["ok"]
            assert answers and answers[0].status_code == 503, answers
            wait_for(lambda: server_idle(service), 10, "the server to go idle")
            counts = service.sequences.counts()
            assert counts["free"] == counts["capacity"] and counts["withheld"] == 0
    finally:
        executor.device.emu.clear_all_faults()
        if executor.state != "Stopped":
            executor.shutdown(5.0)


def test_a_shutdown_that_stops_a_recovery_with_a_golden_job_on_the_device_ends_failed(tmp_path):
    """The bound of the fix above (the guard of ``Warming -> Stopped``): the recovery's golden
    prefill hangs on the device; the shutdown stops the recovery, whose golden ends at its
    own timeout with the job still on the device, so nothing drained: ``Failed`` (FI13:
    Stopped only once everything submitted returned), never ``Stopped``."""
    executor = started_executor(tmp_path, golden_timeout_s=2.0, execution_timeout_s=60.0)
    out: list[Status] = []
    try:
        assert executor.device.emu.set_fault(Fault.HANG, FaultMode.NTH, 1, 0, 0) == 0
        recovery = threading.Thread(target=lambda: out.append(executor.recover(Status.failure(
            "device.ccu_exception", Category.DEVICE, Phase.RECOVERY, "before the schedule"))),
            daemon=True)
        recovery.start()
        wait_for(lambda: executor.state == "Warming" and executor.snapshot()["inflight"] == 1,
                 20, "the golden prefill on the device")
        status = executor.shutdown(0.4)
        assert not status.ok, status
        recovery.join(20)
        assert not recovery.is_alive() and out and not out[0].ok
        assert executor.lifecycle.final and executor.state == "Failed", executor.state
    finally:
        executor.device.emu.clear_all_faults()


class _ShiftedClock(Clock):
    """The host's clock plus ``shift`` seconds the test adds: the executor's threads and
    ``health()`` see time jump while a native ``Wait()`` (host time) still runs."""

    __slots__ = ("shift",)
    real = False  # not the host's time: no native wait stands in for one of its waits

    def __init__(self) -> None:
        self.shift = 0.0

    def monotonic(self) -> float:
        return super().monotonic() + self.shift

    def now_us(self) -> int:
        return super().now_us() + int(self.shift * 1e6)


def test_a_hung_job_is_named_past_its_execution_deadline_not_a_negative_time(tmp_path):
    """A request's job hangs on the device and its ``Wait()`` runs on past the job's
    execution deadline (10 s here), long before its request's deadline (60 s): ``health()``
    (and so ``/health``, ``/ready`` and a waiter's ``admission.deadline``) said ``job 5 (seq
    1) is on the device -48.9s past its deadline``; now it names the execution deadline and
    how long ago it passed. The clock jumps 11 s while the completion thread is still in its
    (host-time) ``Wait()``, so the window is held open, not raced (it was a poll of a window
    of a few milliseconds, and a busy CI host missed it)."""
    path = str(tmp_path / "synthetic.calbin")
    calbin.write(path, calbin.default_spec())
    clock = _ShiftedClock()
    executor = DeviceExecutor(CalRT.load(), load_manifest(default_manifest_path()),
                              ExecutorConfig(calbin_path=path, execution_timeout_s=10.0,
                                             timeout_grace_s=30.0), clock=clock)
    assert executor.start().ok
    try:
        assert executor.device.emu.set_fault(Fault.HANG, FaultMode.NTH, 1, 0, 0) == 0
        handle = executor.enqueue(InferenceRequest(
            seq_id=1, kind=TaskKind.PREFILL_IDS, tokens=np.asarray([5, 6, 7], dtype=np.int32),
            positions=np.arange(3, dtype=np.int32), past_len=0,
            deadline=clock.monotonic() + 60.0))

        def waiting_on_it() -> bool:
            # start() returns once the golden's last job resolved, maybe before the completion
            # thread let go of it: that done job is not the one this test waits for
            job = executor.completion.waiting_on
            return job is not None and job.request.seq_id == 1 and not job.done
        wait_for(waiting_on_it, 20, "the completion thread waiting on the hung job")
        assert not [r for r in executor.health() if "is on the device" in r]
        clock.shift = 11.0  # 1 s past the execution deadline; the Wait() runs 10 s of host time
        reasons = [r for r in executor.health() if "is on the device" in r]
        assert waiting_on_it()  # still in the Wait(): not raced
        assert len(reasons) == 1, executor.health()
        assert "past its execution deadline" in reasons[0], reasons
        assert not re.search(r" -\d", reasons[0]), reasons
        handle.cancel()
    finally:
        executor.device.emu.clear_all_faults()
        executor.shutdown(1.0)


def test_a_drain_that_cuts_a_client_still_sending_its_body_logs_no_traceback(tmp_path):
    """``calexec serve``, a client that sent its request head and part of its body, SIGTERM:
    the drain ends at once (nothing admitted), and uvicorn cut the connection after
    ``SHUTDOWN_WAIT_S``, logging ``ERROR Cancel 1 running task(s)`` and an ``ERROR Exception
    in ASGI application`` traceback (``CancelledError``) per such client on every deploy;
    now one WARNING line and no traceback, exit 0."""
    proc, url = serve_process(tmp_path, "--grace", "1")
    port = int(url.rsplit(":", 1)[1])
    sock = None
    try:
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode()
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body[:-4])
        time.sleep(0.3)  # the route reads the body
        proc.send_signal(signal.SIGTERM)
        code, stderr = stopped(proc)
        assert code == 0, stderr[-3000:]
        assert "Traceback" not in stderr and "ERROR" not in stderr, stderr[-3000:]
    finally:
        if sock is not None:
            sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
