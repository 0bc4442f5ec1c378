"""Stop 66 (faults2): follow-ups of the fault probe.

A hung job is reported twice: ``execution.deadline`` at its deadline, ``device.hung`` once
``timeout_grace_s`` passed. With the escalation budget spent (``max_recoveries``) the first
report ends the lifecycle ``Failed`` (§8 STOP); the second was decided again against the
same budget, escalated again and logged a second ``fault device.hung ... -> stop
(escalation: ...)`` line for one incident (nothing more happened: the lifecycle was final).
A report against a final lifecycle is now part of the incident that ended it: counted in
``reported()``, decided ``none``, logged at INFO, never a second escalation.
"""

from __future__ import annotations

import logging

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.machines.faults import Action, RecoveryPolicy
from executor_harness import (
    arm,
    deadline,
    jobs_on_device,
    make_executor,
    prefill,
    until,
    write_calbin,
)


def _reported(ex, code: str) -> int:
    return sum(n for _cat, c, _raw, n in ex.faults.reported() if c == code)


def test_a_hung_jobs_second_report_after_its_escalation_is_logged_once(tmp_path, caplog):
    """Threads, ``max_recoveries=0``: the hung job's ``execution.deadline`` escalates (STOP,
    Failed); its ``device.hung`` after the grace is the same incident: one ``-> stop`` line,
    one escalation decision."""
    ex = make_executor(write_calbin(tmp_path), execution_timeout_s=1.0, timeout_grace_s=0.1,
                       recovery=RecoveryPolicy(max_recoveries=0, drain_grace_s=0.3))
    try:
        until(lambda: jobs_on_device(ex, 0), what="the start's golden job to leave")
        arm(ex, "HANG")
        with caplog.at_level(logging.INFO, logger="calexec.faults"):
            job = ex.enqueue(prefill(1, [11, 12, 13]))
            failed = job.wait_until(deadline())
            assert isinstance(failed, Status) and failed.code == "execution.deadline", failed
            until(lambda: ex.state == "Failed", what="the lifecycle Failed")
            until(lambda: _reported(ex, "device.hung") == 1, what="the device.hung report")
        stops = [r.getMessage() for r in caplog.records
                 if r.levelno >= logging.WARNING and "-> stop" in r.getMessage()]
        assert len(stops) == 1 and "execution.deadline" in stops[0], stops
        escalations = [d for d in ex.faults.decisions if "escalation" in d.reason]
        assert [d.status.code for d in escalations] == ["execution.deadline"], escalations
        hung = [d for d in ex.faults.decisions if d.status.code == "device.hung"]
        assert len(hung) == 1 and hung[0].action is Action.NONE, hung
        assert "already Failed" in hung[0].reason and "not counted" in hung[0].reason, hung
        assert hung[0].status.job_id == failed.job_id
        infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO
                 and r.getMessage().removeprefix("INJECTED ").startswith("fault device.hung")]
        assert len(infos) == 1 and "already Failed" in infos[0], infos
    finally:
        ex.shutdown(5.0)


def test_any_report_after_a_stop_is_not_a_second_escalation(tmp_path, caplog):
    """Stepped: a STOP decided (``max_recoveries=0``), then two more device faults of other
    jobs (none of them counted before): each is decided ``none`` and logged at INFO, the
    lifecycle keeps the first failure, and ``reported()`` still counts every one."""
    ex = make_executor(write_calbin(tmp_path), threads=False,
                       recovery=RecoveryPolicy(max_recoveries=0))
    try:
        fault = Status.failure("device.ccu_exception", Category.DEVICE, Phase.STATUS,
                               "the test's fault", job_id=101)
        with caplog.at_level(logging.INFO, logger="calexec.faults"):
            ex.faults.report(fault)
            assert ex.state == "Failed" and ex.failure == fault
            for job_id in (102, 103):
                ex.faults.report(Status.failure("device.hung", Category.DEVICE, Phase.WAIT,
                                                "another job", job_id=job_id))
        actions = [(d.status.job_id, d.action) for d in ex.faults.decisions]
        assert actions == [(101, Action.STOP), (102, Action.NONE), (103, Action.NONE)], actions
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                    and r.name == "calexec.faults"]
        assert len(warnings) == 1 and "-> stop (escalation" in warnings[0], warnings
        assert ex.failure == fault
        assert _reported(ex, "device.hung") == 2 and _reported(ex, "device.ccu_exception") == 1
    finally:
        ex.shutdown(5.0)


def test_a_second_report_while_the_stop_is_still_being_applied_is_not_an_escalation(
        tmp_path, caplog):
    """The hung job's ``device.hung`` reported while the STOP of its ``execution.deadline``
    is still being applied (``request_recovery`` has not ended the lifecycle yet: another
    thread reports meanwhile) is the same incident: decided ``none``, one ``-> stop`` line."""
    ex = make_executor(write_calbin(tmp_path), threads=False,
                       recovery=RecoveryPolicy(max_recoveries=0))
    try:
        request_recovery = ex.request_recovery
        hung = Status.failure("device.hung", Category.DEVICE, Phase.WAIT,
                              "the device never let go", job_id=7)
        states = []

        def meanwhile(decision):
            states.append(ex.state)  # not Failed yet
            if len(states) == 1:  # once: the old code's second STOP comes back here
                ex.faults.report(hung)
            request_recovery(decision)

        ex.request_recovery = meanwhile
        with caplog.at_level(logging.INFO, logger="calexec.faults"):
            ex.faults.report(Status.failure("execution.deadline", Category.DEVICE, Phase.WAIT,
                                            "execution deadline passed", job_id=7))
        assert states == ["Ready"] and ex.state == "Failed", (states, ex.faults.decisions)
        actions = [(d.status.code, d.action) for d in ex.faults.decisions]
        assert actions == [("execution.deadline", Action.STOP),
                           ("device.hung", Action.NONE)], actions
        stops = [r.getMessage() for r in caplog.records if "-> stop" in r.getMessage()]
        assert len(stops) == 1, stops
    finally:
        ex.shutdown(5.0)
