"""Stop 65 (faults): seeded fault schedules under load, faults that meet a recovery's golden
run.

A job the device keeps after its Wait failed is reported twice: ``execution.deadline`` at its
deadline and ``device.hung`` once ``timeout_grace_s`` passed. The second report belongs to the
incident the first one counted, and counts against no escalation budget (an earlier fix, for a
job of a Ready generation). A golden job of a recovery is reported while the lifecycle is
Configuring/Warming, where no recovery is "under way" for the fault controller: both reports
counted, so a single hung golden job spent two recoveries of ``RecoveryPolicy.max_recoveries``
(met under load: test_load48_faults.py's schedules with the native relay and a second fault
armed for the golden run, seeds 6601-6602), and a switch whose golden job hung went Failed
where its roll back would have served.

And the native relay in Phase B: it infers none of Phase B's jobs (they go to
``infer_with_fixed_task_type``), which nothing said.
"""

from __future__ import annotations

import logging
import shutil

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.machines.faults import RecoveryPolicy
from executor_harness import arm, deadline, fired, prefill, running_executor, write_calbin


@pytest.mark.parametrize("how", ["recover", "switch"])
def test_a_hung_golden_job_spends_one_recovery_of_the_escalation_budget(tmp_path, how):
    """``max_recoveries=1``: a recovery (or a model switch: ``POST /admin/reload``) whose
    golden job hangs is refused once (one count); the next golden attempt (the switch's roll
    back to the calbin that served) serves: Ready. The hung golden job is reported twice
    (``execution.deadline``, then ``device.hung`` after its grace) and both counted, so the
    second report escalated: the lifecycle ended Failed ("escalation: 1 recoveries within
    60.0s", ``calexec serve`` exits 3) for one fault."""
    policy = RecoveryPolicy(drain_grace_s=2.0, max_recoveries=1)
    main = write_calbin(tmp_path)
    other = str(tmp_path / "other.calbin")
    shutil.copyfile(main, other)  # the same model at another path
    with running_executor(main, recovery=policy, golden_timeout_s=1.0,
                          execution_timeout_s=1.0, timeout_grace_s=0.05) as ex:
        arm(ex, "HANG")  # the next job on the device: the first golden job
        if how == "recover":
            status = ex.recover(Status.failure("device.ccu_exception", Category.DEVICE,
                                               Phase.RECOVERY, "the test's reason"))
        else:
            status = ex.switch_model(other)
        assert fired(ex, "HANG") == 1
        reports = [(d.status.code, d.status.job_id, d.reason) for d in ex.faults.decisions]
        assert ex.state == "Ready", (status, ex.state, reports)
        record = ex.recoveries[-1]
        if how == "recover":
            assert status.ok and record["ok"], (status, record)
        else:  # the refused calbin rolled back to the one that served
            assert status.code == "recovery.rolled_back", status
            assert ex.gen is not None and ex.gen.calbin_path == main
        assert len(record["refused"]) == 1, record  # the hung golden attempt
        assert record["to_generation"] == record["from_generation"] + 2, record
        hung = [r for r in reports if r[0] == "device.hung"]
        first = [r for r in reports if r[0] == "execution.deadline"]
        assert len(first) == 1 and "not counted" not in first[0][2], reports
        assert len(hung) == 1 and hung[0][1] == first[0][1], reports
        assert "not counted" in hung[0][2], reports


@pytest.mark.parametrize("capacity", [1, 2])
def test_the_native_relay_in_phase_b_says_it_infers_nothing(tmp_path, caplog, capacity):
    """``calexec serve --native-relay --inflight-capacity 2`` (and ``bench faults`` / ``bench
    soak`` with both flags, met at seeds 6641-6642): Phase B's jobs go to
    ``infer_with_fixed_task_type``, which the relay never calls, so ``relay_submitted`` stayed 0
    for the whole run with no word that the relay asked for was not used. The executor now says
    so at start in Phase B (and only there); the jobs it runs meanwhile are not the relay's."""
    caplog.set_level(logging.INFO, logger="calexec.executor")
    with running_executor(write_calbin(tmp_path), native_relay=True,
                          inflight_capacity=capacity) as ex:
        assert ex.relay_active
        for seq in (1, 2):
            status = ex.enqueue(prefill(seq, [5, 6, 7])).wait_until(deadline())
            assert not isinstance(status, Status), status
        said = [r.getMessage() for r in caplog.records
                if "infer_with_fixed_task_type" in r.getMessage()]
        if capacity == 2:
            assert ex.snapshot()["relay_submitted"] == 0
            assert len(said) == 1 and "none is inferred from it" in said[0], said
        else:
            assert said == [], said
