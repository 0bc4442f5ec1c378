"""A runtime whose answers disagree with each other (found while proving the buffer-slot chart's
rules through the executor, issue 24): the executor must still keep every buffer and permit the
runtime holds, and give them back once the runtime lets go.
"""

from __future__ import annotations

import pytest

from calexec.contracts.codes import DeviceJobStatus
from calexec.contracts.status import Status
from calexec.machines.faults import RecordingFaultSink
from executor_harness import arm, deadline, make_executor, prefill, write_calbin


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("inconsistent_runtime"))


class WaitSaysDone:
    """An output buffer whose ``Wait()`` returns success at once, whatever the job does (its
    ``GetStatus`` is the emulator's own answer)."""

    def __init__(self, outbuf) -> None:
        self._outbuf = outbuf

    def __getattr__(self, name):
        return getattr(self._outbuf, name)

    def wait(self, timeout_us):
        return 0


@pytest.mark.xfail(strict=True, reason=(
    "product defect (machines/completion.py Completion._complete): Wait() == 0 with GetStatus RUNNING takes "
    "the Quarantined path with release_permit=slot.runtime_let_go() == False and "
    "on_device=False, so the job's in-flight permit is neither returned nor handed to "
    "the dispatch's held entries: nothing reaps it after the runtime lets go, the device takes no other "
    "job (Phase A) and every drain fails (with the fault controller: recovery.not_drained after "
    "the reset, lifecycle Failed)"))
def test_a_job_running_after_a_successful_wait_gives_its_permit_back_once_the_runtime_lets_go(
        calbin):
    """§6.5/§9.1: Wait() returned success but GetStatus says the job still runs (the rc/status
    double check disagrees): the job fails (``device.status_not_done``), its slot is
    quarantined and its permit is kept while the runtime runs it, as after a failed Wait; once
    the runtime lets go (here a device reset aborts it) the permit comes back and the executor
    is drained (the lifecycle's ``all_submitted_drained``)."""
    ex = make_executor(calbin, threads=False, execution_timeout_s=1.0,
                       fault_sink=RecordingFaultSink())
    try:
        arm(ex, "HANG")  # the job never ends by itself
        for slot in ex.pool.slots:
            slot.outbuf = WaitSaysDone(slot.outbuf)
        handle = ex.enqueue(prefill(1, [1, 2, 3]))
        assert ex.submit_one() and ex.complete_one()
        status = handle.wait_until(deadline())
        assert isinstance(status, Status) and status.code == "device.status_not_done", status
        slot = next(s for s in ex.pool.slots if s.run.state == "Quarantined")
        assert slot.outbuf.get_status()[1] in (DeviceJobStatus.PENDING, DeviceJobStatus.RUNNING)
        assert ex.snapshot()["inflight"] == 1  # kept while the runtime runs the job
        assert ex.device.reset() == 0  # the runtime lets go: the job is aborted
        assert slot.runtime_let_go()
        assert ex.life.all_submitted_drained()  # the lifecycle guard (its own reap)
        assert ex.snapshot()["inflight"] == 0
    finally:  # bounded: with the defect the permit never comes back and no drain ends
        ex.shutdown(grace=0.2)
