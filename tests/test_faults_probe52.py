"""Stop 52 (faults): fault schedules the tools do not drive, each replaying a defect found by
seeded schedules against a loaded server (faults armed during a recovery, during a drain,
...). Real executor on the bundled emulator, loopback servers only; every wait is a bounded
poll of a condition; nothing asserts a duration.
"""

from __future__ import annotations

import threading

import pytest

import needs

needs.module("httpx", "server")
import httpx  # noqa: E402

from calexec.contracts.errors import Category  # noqa: E402
from calexec.contracts.status import Phase, Status  # noqa: E402
from calexec.drivers.calrt.runtime import Fault, FaultMode  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from test_server_support import (  # noqa: E402
    LiveServer,
    metric_value,
    oracle_tokens,
    server_idle,
    started_executor,
    wait_for,
)

#: faults on the golden runs of one recovery, one after the other: each point counts the jobs
#: the device accepts from its arming on, so NTH k fires on the k-th job of the schedule
GOLDEN_FAULTS = {
    "nan_then_inf": [("OUTPUT_NAN", 1), ("OUTPUT_INF", 2)],
    "inf_then_ccu": [("OUTPUT_INF", 1), ("CCU_EXCEPTION", 2)],
    "nan_and_a_failed_csr_write": [("OUTPUT_NAN", 1), ("UNKNOWN_CSR", 2)],
    "nan_inf_ccu_hang": [("OUTPUT_NAN", 1), ("OUTPUT_INF", 2), ("CCU_EXCEPTION", 3),
                         ("HANG", 4)],
}


def _arm(emu, schedule) -> None:
    for point, nth in schedule:
        assert emu.set_fault(Fault[point], FaultMode.NTH, nth, 0, 0) == 0


@pytest.mark.parametrize("name", sorted(GOLDEN_FAULTS))
def test_a_recovery_whose_goldens_meet_faults_one_after_another_ends_ready(tmp_path, name):
    """Two (or four) faults on the jobs of the golden runs of one recovery, with the default
    policy (escalation past 5 recoveries within 60 s): the lifecycle ended Failed at the
    second one (the recovery configured its calbin again only once), a dead server for two
    NaN rows; now the golden is run again while the budget allows, and the executor serves."""
    # 2 s: the hung golden job (nan_inf_ccu_hang) misses it by far; the other golden runs,
    # which had to pass inside the same 0.5 s, have seconds of margin on a loaded host
    executor = started_executor(tmp_path, execution_timeout_s=2.0, timeout_grace_s=0.1)
    try:
        emu = executor.device.emu
        _arm(emu, GOLDEN_FAULTS[name])
        status = executor.recover(Status.failure("device.ccu_exception", Category.DEVICE,
                                                 Phase.RECOVERY, "a fault before the schedule"))
        emu.clear_all_faults()
        assert status.ok, status
        assert executor.state == "Ready" and not executor.health()
        record = executor.recoveries[-1]
        assert len(record["refused"]) == len(GOLDEN_FAULTS[name]), record
        assert record["ok"] and record["lifecycle"] == "Ready"
    finally:
        executor.shutdown(5.0)
    assert executor.state == "Stopped"


def test_past_the_budget_goldens_that_keep_failing_still_end_failed(tmp_path):
    """The bound: a golden that fails on every run ends Failed once the controller's
    escalation threshold is passed (never a recovery without end)."""
    executor = started_executor(tmp_path)
    try:
        emu = executor.device.emu
        assert emu.set_fault(Fault.OUTPUT_NAN, FaultMode.ALWAYS, 1, 0, 0) == 0
        status = executor.recover(Status.failure("device.ccu_exception", Category.DEVICE,
                                                 Phase.RECOVERY, "a fault before the schedule"))
        emu.clear_all_faults()
        assert not status.ok and status.code == "internal.output_not_finite"
        assert executor.state == "Failed"
        refused = executor.recoveries[-1]["refused"]
        assert 2 <= len(refused) <= executor.config.recovery.max_recoveries + 1, refused
    finally:
        executor.shutdown(5.0)


def test_a_request_whose_fault_meets_faulty_goldens_gets_its_tokens(tmp_path):
    """Through the server: a request's prefill meets a NaN row (a recovery), the recovery's
    goldens an Inf row and a CCU exception; the request is resumed with the oracle's tokens,
    /ready is 200 again, every sequence id is free and the recovery is counted."""
    # 2 s: no job here is meant to miss it (NaN, Inf, CCU faults); the goldens and the resumed
    # request, which had to finish inside 0.5 s, have seconds of margin on a loaded host
    executor = started_executor(tmp_path, execution_timeout_s=2.0, timeout_grace_s=0.1)
    try:
        app = create_app(executor, ServerConfig())
        service = app.state.service
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
            _arm(executor.device.emu, [("OUTPUT_NAN", 1), ("OUTPUT_INF", 2),
                                       ("CCU_EXCEPTION", 3)])
            r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1,
                                                   "timeout": 20})
            executor.device.emu.clear_all_faults()
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == oracle_tokens([5, 6, 7], 1)
            wait_for(lambda: http.get("/ready").status_code == 200, 20, "/ready 200")
            wait_for(lambda: server_idle(service), 20, "the server to go idle")
            counts = service.sequences.counts()
            assert counts["free"] == counts["capacity"] and counts["withheld"] == 0
            assert executor.state == "Ready"
            metrics = http.get("/metrics").text
            assert metric_value(metrics, "calexec_recoveries_total") >= 1
            again = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3})
            assert again.json()["choices"][0]["token_ids"] == oracle_tokens([1, 2, 3], 3)
    finally:
        executor.shutdown(5.0)


def test_a_shutdown_ends_a_recovery_whose_golden_waits_for_kv_within_its_grace(tmp_path):
    """A drain's shutdown meeting a recovery whose golden job waits for KV (the KvManager
    said no once: a fault armed while the lifecycle warmed) stopped nothing: golden jobs were
    exempt from the stop, so the shutdown answered ``shutdown.recovery_busy`` after its grace,
    the lifecycle still Warming and nothing torn down, and the recovery went on until the
    golden's own timeout; now the golden's wait ends with the shutdown and the lifecycle is
    final: Stopped, nothing being left on the device (stop 53; it ended Failed)."""
    executor = started_executor(tmp_path, golden_timeout_s=60.0)
    out: list[Status] = []
    try:
        assert executor.device.emu.set_fault(Fault.CAN_ALLOCATE_FALSE, FaultMode.ALWAYS, 1, 0,
                                             0) == 0
        recovery = threading.Thread(target=lambda: out.append(executor.recover(Status.failure(
            "device.ccu_exception", Category.DEVICE, Phase.RECOVERY, "before the schedule"))),
            daemon=True)
        recovery.start()
        wait_for(lambda: executor.state == "Warming" and executor.kvc is not None
                 and executor.kvc.waiting == 1, 20, "the golden waiting for KV")
        status = executor.shutdown(1.0)
        recovery.join(20)
        assert not recovery.is_alive(), "the recovery outlived the shutdown"
        assert status.ok, status
        assert executor.lifecycle.final and executor.state == "Stopped"
        assert out and not out[0].ok
    finally:
        executor.device.emu.clear_all_faults()
        executor.shutdown(5.0)
