"""Stop 66 (faults): seeded fault schedules under load with ``max_recoveries`` exhausted.

A fault past the escalation budget ends the lifecycle ``Failed`` (§8 STOP). The jobs still
queued then (admitted, not yet on the device: another client's request behind the faulted
one, Phase B's second job) were failed with the fault's own Status as if each had met it:
``device.ccu_exception`` (or the hung job's ``execution.deadline`` with its raw CalRT code
13, a 500/504 to the client) naming the queued job's id, and each reported to the fault
controller as a fault of its own, logged ``fault ... -> stop`` once per queued job, counted
in ``FaultController.reported()`` and in the failure metrics by code and raw code: one
injected fault was logged three times under load (Phase B, seed 6701). A queued job never
ran: it is refused ``lifecycle.unavailable`` (503) naming the failure that ended the
lifecycle, what a request sent a moment later is told.
"""

from __future__ import annotations

import logging

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Status
from calexec.machines.faults import RecoveryPolicy
from executor_harness import (
    arm,
    deadline,
    jobs_on_device,
    make_executor,
    prefill,
    until,
    write_calbin,
)


def _answers(ex, caplog, code, run):
    """Enqueue two jobs, the first meeting the armed fault while the second is queued;
    ``run(first)`` drives them. The second's answer, once the lifecycle is Failed."""
    first = ex.enqueue(prefill(1, [11, 12, 13]))
    second = ex.enqueue(prefill(2, [21, 22, 23]))
    with caplog.at_level(logging.WARNING, logger="calexec.faults"):
        run(first)
        failed = first.wait_until(deadline())
        assert isinstance(failed, Status) and failed.code == code, failed
        refused = second.wait_until(deadline())
    assert ex.state == "Failed"
    assert isinstance(refused, Status), refused
    assert (refused.code, refused.category, refused.raw) == (
        "lifecycle.unavailable", Category.UNAVAILABLE, None), refused
    assert f"device lifecycle is Failed after {code}" in refused.message, refused
    assert refused.job_id == second.job_id and refused.seq_id == 2, refused
    assert [n for _cat, c, _raw, n in ex.faults.reported() if c == code] == [1], \
        ex.faults.reported()
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().removeprefix("INJECTED ").startswith(f"fault {code} ")]
    assert len(lines) == 1, lines


def test_a_job_queued_behind_a_hung_one_is_refused_unavailable_when_the_lifecycle_fails(
        tmp_path, caplog):
    """Threads, Phase A, ``max_recoveries=0``: the first job hangs on the device (it holds
    the one in-flight permit, so the second stays queued: checked) until its execution
    deadline, whose STOP ends the lifecycle Failed. The second never ran: it was answered
    ``execution.deadline`` raw 13 under its own job id and logged as a second fault."""
    ex = make_executor(write_calbin(tmp_path), execution_timeout_s=1.0, timeout_grace_s=0.1,
                       recovery=RecoveryPolicy(max_recoveries=0, drain_grace_s=0.3))
    try:
        until(lambda: jobs_on_device(ex, 0), what="the start's golden job to leave")
        arm(ex, "HANG")

        def run(first) -> None:
            until(lambda: jobs_on_device(ex, 1), what="the first job on the device")
            assert ex.snapshot()["queued"] == 1, ex.snapshot()  # the second waits

        _answers(ex, caplog, "execution.deadline", run)
    finally:
        ex.shutdown(5.0)


@pytest.mark.parametrize("point, code", [("CCU_EXCEPTION", "device.ccu_exception"),
                                         ("OUTPUT_NAN", "internal.output_not_finite")])
def test_a_queued_job_is_refused_unavailable_naming_the_failure_stepped(
        tmp_path, caplog, point, code):
    """The same on the stepped executor, where the queued job is failed at once by the
    refusal the STOP sets first (``escalation: 0 recoveries ...``, not naming the failure)."""
    ex = make_executor(write_calbin(tmp_path), threads=False,
                       recovery=RecoveryPolicy(max_recoveries=0))
    try:
        arm(ex, point)

        def run(first) -> None:
            assert ex.submit_one()  # the first on the device; the second stays queued
            assert ex.snapshot()["queued"] == 1
            for _ in range(100):  # bounded: the emulator ends the job on its own thread
                if first.done:
                    break
                ex.complete_one(block=True)

        _answers(ex, caplog, code, run)
    finally:
        ex.shutdown(5.0)
