"""Stop 71 (faults): seeded fault schedules under load, and faults met at awkward moments
(a model switch's golden run, a recovery in progress, a cancel, two faults back to back).

1. A recovery drained the old generation for ``RecoveryPolicy.drain_grace_s`` (5 s) before
   its reset even when all that was left on the device was a job the executor had already
   declared hung (``device.hung``: still held after its execution deadline and
   ``timeout_grace_s``), which only that reset ends: every hung job cost the server the whole
   drain grace of 503s (or of requests waiting for Ready), beside the grace the device was
   given to let go. The drain now ends, undrained, once nothing but such jobs is left, and the
   reset follows at once.

Bundled emulator, seeded fault plans; every wait bounded; no timing threshold (the drain grace
is made far longer than any bounded wait of the test, so the old code fails by never
recovering within it).
"""

from __future__ import annotations

import shutil
import threading

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.machines.faults import RecoveryPolicy
from executor_harness import (
    arm,
    deadline,
    expected_greedy,
    fired,
    greedy,
    prefill,
    running_executor,
    settle,
    until,
    write_calbin,
)

PROMPT = [1, 2, 3]
#: a drain grace no bounded wait of these tests reaches: a drain that waits for a job
#: already declared hung never ends within them
ENDLESS_DRAIN = RecoveryPolicy(drain_grace_s=100_000.0)
HUNG = dict(recovery=ENDLESS_DRAIN, execution_timeout_s=0.5, timeout_grace_s=0.05,
            golden_timeout_s=2.0)


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("faults71"))


@pytest.mark.parametrize("capacity", [1, 2])
def test_a_recovery_from_a_hung_job_resets_once_the_job_is_declared_hung(calbin, capacity):
    """The request's job hangs: ``execution.deadline``, then ``device.hung`` after the grace;
    the recovery resets the device and serves generation 2 without waiting its drain grace
    for the hung job (on the old code: 100,000 s)."""
    with running_executor(calbin, inflight_capacity=capacity, **HUNG) as ex:
        arm(ex, "HANG")
        res = ex.enqueue(prefill(1, PROMPT, seconds=30)).wait_until(deadline(30))
        assert isinstance(res, Status) and res.code == "execution.deadline", res
        until(lambda: ex.recoveries and ex.state == "Ready" and not ex.health(), 30,
              "the recovery's end (its drain waited for a job declared hung)")
        record = ex.recoveries[-1]
        assert record["ok"] and record["reset"] and record["to_generation"] == 2, record
        codes = [d.status.code for d in ex.faults.decisions]
        assert codes == ["execution.deadline", "device.hung"], codes
        assert greedy(ex, 2, PROMPT, 2) == expected_greedy(PROMPT, 2)
        snap = settle(ex)
        assert snap["inflight"] == 0 and snap["pending_tokens"] == 0, snap
        assert ex.dispatch.held() == []


@pytest.mark.parametrize("how", ["recover", "switch"])
def test_a_golden_job_that_hangs_is_reset_once_declared_hung(calbin, tmp_path, how):
    """A recovery's (or a model switch's) golden job hangs: the refused generation is torn
    down after the reset its hung job needs, without waiting the drain grace for it, and the
    next attempt serves."""
    other = str(tmp_path / "other.calbin")
    shutil.copyfile(calbin, other)
    with running_executor(calbin, **HUNG) as ex:
        arm(ex, "HANG")  # the next job on the device: the golden's first
        out: list[Status] = []
        if how == "recover":
            call = lambda: ex.recover(Status.failure(  # noqa: E731
                "device.ccu_exception", Category.DEVICE, Phase.RECOVERY, "the test's reason"))
        else:
            call = lambda: ex.switch_model(other)  # noqa: E731
        thread = threading.Thread(target=lambda: out.append(call()), name="test-golden-hang",
                                  daemon=True)
        thread.start()
        thread.join(30)
        assert out, "the recovery still drains a generation whose golden job was declared hung"
        assert out[0].ok or (how == "switch" and out[0].code == "recovery.rolled_back"), out
        assert fired(ex, "HANG") == 1
        until(lambda: ex.state == "Ready" and not ex.health(), 30, "Ready")
        assert len(ex.recoveries[-1]["refused"]) == 1, ex.recoveries[-1]
        assert greedy(ex, 3, PROMPT, 2) == expected_greedy(PROMPT, 2)
