"""Stop 56 (faults): the control core's shutdown, recovery and model-switch paths, each defect
replayed with its interleaving forced (the stepped emulator holds jobs on the device; a clock
whose ``join`` runs the test's step holds the shutdown at the point a race needs it) rather
than hoped for. Real executor on the bundled emulator; every wait is a bounded poll of a
condition; nothing asserts a duration.
"""

from __future__ import annotations

import threading

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.machines.faults import RecoveryPolicy
from executor_harness import prefill, running_executor, until, write_calbin

DEVICE_FAULT = Status.failure("device.ccu_exception", Category.DEVICE, Phase.RECOVERY,
                              "the test's reason")


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("probe56"))


def on_device(ex, jobs: int) -> bool:
    """The device holds ``jobs`` jobs (the emulator's own count, both engines)."""
    if ex.device is None:
        return False
    held = 0
    for engine in (0, 1):
        rc, count, _stage = ex.device.emu.pending(engine)
        held += count if rc == 0 else 0
    return held == jobs


def recover_in_thread(ex, reason: Status = DEVICE_FAULT, **kw) -> tuple[threading.Thread,
                                                                         list[Status]]:
    out: list[Status] = []
    thread = threading.Thread(target=lambda: out.append(ex.recover(reason, **kw)),
                              name="probe56-recover", daemon=True)
    thread.start()
    return thread, out


# ---- 1. a shutdown cuts a recovery's drain short ------------------------------------------------
def test_a_shutdown_ends_a_recovery_still_draining_the_old_generation_within_its_grace(calbin):
    """A recovery drains generation 1 with a job on a device that finishes nothing,
    ``drain_grace_s`` 30; ``shutdown(2.0)``: the interrupt at half the grace did not end the
    drain, so the shutdown answered ``shutdown.recovery_busy`` with nothing torn down. The
    recovery now stops at the interrupt (no reset, no teardown) and the shutdown's own drain
    takes the job over: not drained within the grace, so ``shutdown.not_drained`` (Failed),
    the generation kept with its buffers; once the device lets go a later shutdown releases
    it and closes the device."""
    with running_executor(calbin, execution_timeout_s=60.0, timeout_grace_s=60.0,
                          recovery=RecoveryPolicy(drain_grace_s=30.0)) as ex:
        emu = ex.device.emu
        assert emu.set_stepped(True) == 0  # the device finishes nothing from now
        try:
            handle = ex.enqueue(prefill(1, [1, 2, 3]))
            until(lambda: on_device(ex, 1), 20, "the job on the device")
            thread, out = recover_in_thread(ex)
            until(lambda: ex.state == "Draining", 20, "the recovery draining")
            status = ex.shutdown(2.0)
            assert status.code == "shutdown.not_drained", status
            assert ex.state == "Failed" and ex.failure == status, (ex.state, ex.failure)
            thread.join(30)
            assert out and out[0].code == "lifecycle.unavailable", out
            assert "stopped by shutdown()" in out[0].message, out[0]
            assert "drained generation 1" in out[0].message, out[0]
            assert ex.recoveries[-1]["reset_kind"] is None, ex.recoveries[-1]
            assert ex.gen is not None and ex.gen.id == 1 and not ex.gen.released, \
                "the generation whose job is on the device was released"
            assert not handle.done
        finally:
            emu.set_stepped(False)  # the device lets go: a later shutdown tears it down
        until(lambda: handle.done and ex.snapshot()["completing"] == 0, 20, "the job ended")
        assert ex.shutdown(5.0) == ex.failure and ex.gen is None
        assert emu.counters() == {}, "the device was never closed"
