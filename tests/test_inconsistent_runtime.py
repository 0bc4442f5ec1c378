"""A runtime whose answers disagree with each other (found while proving the buffer-slot chart's
rules through the executor, issue 24): the executor must still keep every buffer and permit the
runtime holds, and give them back once the runtime lets go.
"""

from __future__ import annotations

import time

import pytest

from calexec.contracts.codes import DeviceJobStatus
from calexec.contracts.status import Status
from calexec.machines.faults import RecordingFaultSink, RecoveryPolicy
from calexec.machines.job import InferenceResult
from executor_harness import arm, deadline, make_executor, prefill, running_executor, write_calbin


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("inconsistent_runtime"))


class OutbufProxy:
    """An output buffer that answers as the emulator's, except for what a subclass overrides."""

    def __init__(self, outbuf) -> None:
        self._outbuf = outbuf

    def __getattr__(self, name):
        return getattr(self._outbuf, name)


def stepped_prefill_through(ex, proxy: type[OutbufProxy]):
    """Every slot's output buffer wrapped in ``proxy``, one prefill submitted and completed
    (stepped executor): its answer."""
    for slot in ex.pool.slots:
        slot.outbuf = proxy(slot.outbuf)
    handle = ex.enqueue(prefill(1, [1, 2, 3]))
    assert ex.submit_one() and ex.complete_one()
    return handle.wait_until(deadline())


class WaitSaysDone(OutbufProxy):
    """An output buffer whose ``Wait()`` returns success at once, whatever the job does (its
    ``GetStatus`` is the emulator's own answer)."""

    def wait(self, timeout_us):
        return 0


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
        status = stepped_prefill_through(ex, WaitSaysDone)
        assert isinstance(status, Status) and status.code == "device.status_not_done", status
        slot = next(s for s in ex.pool.slots if s.run.state == "Quarantined")
        assert slot.outbuf.get_status()[1] in (DeviceJobStatus.PENDING, DeviceJobStatus.RUNNING)
        assert ex.snapshot()["inflight"] == 1  # kept while the runtime runs the job
        assert ex.kvc.seqs[1].on_device == 1  # §9.1: the sequence waits for the device too
        assert ex.device.reset() == 0  # the runtime lets go: the job is aborted
        assert slot.runtime_let_go()
        assert ex.life.all_submitted_drained()  # the lifecycle guard (its own reap)
        assert ex.snapshot()["inflight"] == 0
        assert ex.kvc.seqs[1].on_device == 0
    finally:  # bounded: with the defect the permit never comes back and no drain ends
        ex.shutdown(grace=0.2)


def test_with_the_fault_controller_the_recovery_reaps_such_a_job_and_serves_again(calbin):
    """§9.1 with the real fault controller: the same job, reported, is aborted by the
    recovery's device reset; the recovery then finds the executor drained (the held permit
    reaped once the runtime let go), rebuilds generation+1 and serves again. (Before the
    fix the permit was never reaped: ``recovery.not_drained``, lifecycle Failed.)"""
    # 3 s: no job here is meant to miss it (Wait says done at once); the recovery's golden
    # and the prefill after it have seconds of margin on a loaded host
    with running_executor(calbin, execution_timeout_s=3.0, timeout_grace_s=0.2,
                          recovery=RecoveryPolicy(drain_grace_s=0.2)) as ex:
        assert ex.gen.id == 1
        arm(ex, "HANG")
        for slot in ex.pool.slots:
            slot.outbuf = WaitSaysDone(slot.outbuf)
        status = ex.enqueue(prefill(1, [1, 2, 3])).wait_until(deadline())
        assert isinstance(status, Status) and status.code == "device.status_not_done", status
        end = deadline()
        while (ex.state not in ("Ready", "Failed") or ex.gen.id == 1
               or ex.life.recovery_active) and time.monotonic() < end:
            time.sleep(0.005)
        assert ex.state == "Ready" and ex.gen.id == 2, (ex.state, ex.failure)
        result = ex.enqueue(prefill(2, [4, 5, 6])).wait_until(deadline())
        assert isinstance(result, InferenceResult), result
        assert ex.snapshot()["inflight"] == 0


class OneElementShort(OutbufProxy):
    """An output buffer whose valid bytes are one BF16 element short of what the job wrote
    (the emulator's OUTPUT_SHORT fault halves the output; this is the boundary)."""

    def valid_bytes(self):
        rc, valid = self._outbuf.valid_bytes()
        return rc, max(valid - 2, 0) if rc == 0 else valid


def test_an_output_one_element_short_of_its_contract_is_refused(calbin):
    """FI09 at its boundary: ``valid_bytes`` one element short of the contract's ByteSize is
    ``internal.output_short`` (the job's logits are not read), as half of it is. (Stop 47: a
    hand mutant that let two bytes through left every test green.)"""
    ex = make_executor(calbin, threads=False, fault_sink=RecordingFaultSink())
    try:
        status = stepped_prefill_through(ex, OneElementShort)
        assert isinstance(status, Status) and status.code == "internal.output_short", status
        assert "contract ByteSize" in status.message
        assert ex.kvc.seqs[1].unknown_reason == "internal.output_short"
    finally:
        ex.shutdown(grace=0.2)
