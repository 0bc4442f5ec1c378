"""Stop 55 (faults): the control core's fault handling and lifecycle, each defect replayed with
its interleaving forced (the stepped emulator holds jobs on the device; gates hold a thread at
the point a race needs it) rather than hoped for. Real executor on the bundled emulator,
loopback servers only; every wait is a bounded poll of a condition; nothing asserts a
duration.
"""

from __future__ import annotations

import threading

import pytest

import needs

needs.module("httpx", "server")
import httpx  # noqa: E402

from calexec.contracts.errors import Category  # noqa: E402
from calexec.contracts.status import Phase, Status  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from calexec.machines.faults import Action, RecoveryPolicy  # noqa: E402
from executor_harness import prefill, running_executor, until, write_calbin  # noqa: E402
from test_server_support import LiveServer, started_executor, wait_for  # noqa: E402

DEVICE_FAULT = Status.failure("device.ccu_exception", Category.DEVICE, Phase.RECOVERY,
                              "the test's reason")


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("probe55"))


def _recover_in_thread(ex, reason: Status = DEVICE_FAULT, **kw) -> tuple[threading.Thread,
                                                                          list[Status]]:
    out: list[Status] = []
    thread = threading.Thread(target=lambda: out.append(ex.recover(reason, **kw)),
                              name="probe55-recover", daemon=True)
    thread.start()
    return thread, out


# ---- 1. a job the executor's own reset aborts --------------------------------------------------
def test_a_job_the_recovery_s_own_reset_aborts_ends_retryable_and_downgrades_nothing(calbin):
    """Phase B, two jobs on a device that finishes nothing (stepped): a recovery's drain grace
    runs out and its reset aborts both. Each ended ``device.status_not_done`` (UNKNOWN, 500:
    "an unknown outcome"), the fault controller was told two more tainted generations, and
    the two counted as Phase B failures after submit: capacity downgraded to 1 for good by one
    recovery. The executor aborted them itself: ``recovery.job_aborted``, UNAVAILABLE (503,
    retry), nothing for the fault controller to act on, no downgrade (the pool their
    quarantine exhausts is reported as before: a knock-on the controller does not count)."""
    with running_executor(calbin, inflight_capacity=2, execution_timeout_s=60.0,
                          timeout_grace_s=60.0,
                          recovery=RecoveryPolicy(drain_grace_s=0.2)) as ex:
        emu = ex.device.emu
        assert emu.set_stepped(True) == 0  # the device finishes nothing from now
        try:
            handles = [ex.enqueue(prefill(seq, [1, 2, 3])) for seq in (1, 2)]
            until(lambda: ex.snapshot()["completing"] == 2, 20, "both jobs on the device")
            decided = len(ex.faults.decisions)
            thread, out = _recover_in_thread(ex)
            until(lambda: all(h.done for h in handles), 30, "the reset to abort both jobs")
        finally:
            emu.set_stepped(False)  # the recovery's golden run goes on
        thread.join(30)
        statuses = [h.wait_until(None) for h in handles]
        for status in statuses:
            assert isinstance(status, Status), status
            assert status.code == "recovery.job_aborted", status
            assert status.category is Category.UNAVAILABLE and status.http_status == 503
            assert status.generation == 1 and "reset" in status.message
        assert out and out[0].ok, out
        assert ex.state == "Ready" and ex.gen.id == 2
        assert ex.recoveries[-1]["reset_kind"] == "reset"
        jobs = {status.job_id for status in statuses}
        told = [(d.status.code, d.action) for d in list(ex.faults.decisions)[decided:]
                if d.status.job_id in jobs]
        assert told == [("recovery.job_aborted", Action.NONE)] * 2, told
        assert list(ex.downgrades) == [] and ex.snapshot()["inflight_capacity"] == 2


def test_a_request_whose_job_the_recovery_s_reset_aborted_gets_503_without_resumes(tmp_path):
    """``max_resumes`` 0: a request whose job is on the device when a recovery's reset aborts
    it got 500 ``device.status_not_done`` (an unknown outcome, not to be retried); it gets 503
    ``recovery.job_aborted`` with Retry-After, as the recovery's other knock-ons."""
    executor = started_executor(tmp_path, execution_timeout_s=60.0, timeout_grace_s=60.0,
                                recovery=RecoveryPolicy(drain_grace_s=0.2))
    app = create_app(executor, ServerConfig(max_resumes=0))
    emu = executor.device.emu
    responses: list[httpx.Response] = []
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            assert emu.set_stepped(True) == 0
            try:
                request = threading.Thread(target=lambda: responses.append(http.post(
                    "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})),
                    daemon=True)
                request.start()
                wait_for(lambda: executor.snapshot()["completing"] == 1, 30,
                         "the request's job on the device")
                thread, out = _recover_in_thread(executor)
                request.join(30)
            finally:
                emu.set_stepped(False)
            thread.join(30)
            assert responses, "no answer"
            response = responses[0]
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "recovery.job_aborted", response.text
            assert response.headers.get("Retry-After"), response.headers
            assert out and out[0].ok, out
            wait_for(lambda: http.get("/ready").status_code == 200, 30, "ready again")
    finally:
        executor.shutdown(5.0)
