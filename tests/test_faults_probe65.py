"""Stop 65 (faults): seeded fault schedules under load, faults that meet a recovery's golden
run.

A job the device keeps after its Wait failed is reported twice: ``execution.deadline`` at its
deadline and ``device.hung`` once ``timeout_grace_s`` passed. The second report belongs to the
incident the first one counted, and counts against no escalation budget (stop 38's fix, for a
job of a Ready generation). A golden job of a recovery is reported while the lifecycle is
Configuring/Warming, where no recovery is "under way" for the fault controller: both reports
counted, so a single hung golden job spent two recoveries of ``RecoveryPolicy.max_recoveries``
(met under load: seeds 6601-6602 of /tmp probe schedules with a second fault armed for the
golden run).
"""

from __future__ import annotations

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.machines.faults import RecoveryPolicy
from executor_harness import arm, fired, running_executor, write_calbin


def test_a_hung_golden_job_spends_one_recovery_of_the_escalation_budget(tmp_path):
    """``max_recoveries=1``: a recovery whose golden job hangs is refused once (one count)
    and the next golden attempt serves: Ready. The hung golden job is reported twice
    (``execution.deadline``, then ``device.hung`` after its grace) and both counted, so the
    second report escalated: the lifecycle ended Failed ("escalation: 1 recoveries within
    60.0s") for one fault."""
    policy = RecoveryPolicy(drain_grace_s=2.0, max_recoveries=1)
    with running_executor(write_calbin(tmp_path), recovery=policy, golden_timeout_s=1.0,
                          execution_timeout_s=1.0, timeout_grace_s=0.05) as ex:
        arm(ex, "HANG")  # the next job on the device: the recovery's first golden job
        status = ex.recover(Status.failure("device.ccu_exception", Category.DEVICE,
                                           Phase.RECOVERY, "the test's reason"))
        assert fired(ex, "HANG") == 1
        reports = [(d.status.code, d.status.job_id, d.reason)
                   for d in ex.faults.decisions]
        assert status.ok and ex.state == "Ready", (status, ex.state, reports)
        record = ex.recoveries[-1]
        assert record["ok"] and len(record["refused"]) == 1, record  # the hung golden attempt
        assert record["to_generation"] == record["from_generation"] + 2, record
        hung = [r for r in reports if r[0] == "device.hung"]
        first = [r for r in reports if r[0] == "execution.deadline"]
        assert len(first) == 1 and "not counted" not in first[0][2], reports
        assert len(hung) == 1 and hung[0][1] == first[0][1], reports
        assert "not counted" in hung[0][2], reports
