"""Stop 56 (faults): the control core's shutdown, recovery and model-switch paths, each defect
replayed with its interleaving forced (the stepped emulator holds jobs on the device; a clock
whose ``join`` runs the test's step holds the shutdown at the point a race needs it) rather
than hoped for. Real executor on the bundled emulator; every wait is a bounded poll of a
condition; nothing asserts a duration.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.calrt.runtime import CalRT
from calexec.machines.clock import Clock
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from calexec.machines.faults import Action, Decision, RecordingFaultSink, RecoveryPolicy
from executor_harness import (
    MANIFEST,
    arm,
    deadline,
    decode,
    jobs_on_device,
    make_executor,
    prefill,
    recover_in_thread,
    running_executor,
    until,
    write_calbin,
)

DEVICE_FAULT = Status.failure("device.ccu_exception", Category.DEVICE, Phase.RECOVERY,
                              "the test's reason")


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("probe56"))






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
            until(lambda: jobs_on_device(ex, 1), 20, "the job on the device")
            thread, out = recover_in_thread(ex, DEVICE_FAULT, "probe56-recover")
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


# ---- 2. a recovery asked for once a shutdown began ----------------------------------------------
class JoinHookClock(Clock):
    """The system clock, whose next ``join`` first runs ``hook`` (once) on the joining
    thread: the shutdown's wait for the previous recovery thread, i.e. after the shutdown
    began and before it holds ``recovery_mu`` or moved the lifecycle to Draining."""

    __slots__ = ("hook",)

    def __init__(self) -> None:
        self.hook: Callable[[], None] | None = None

    def join(self, thread: threading.Thread, timeout: float) -> bool:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return super().join(thread, timeout)


def test_a_recovery_asked_for_once_a_shutdown_began_is_dropped_not_run(calbin):
    """A fault reported while a shutdown waits for the previous recovery thread (the
    lifecycle still Ready): the controller's recovery was taken, its thread got
    ``recovery_mu`` before the shutdown and ran a whole drain, reset and golden run of a
    device about to be closed (or, interrupted, ended as a failed recovery), and its record
    counted in ``calexec_recoveries_total``. A recovery asked for once the shutdown began is
    now dropped, logged and counted (``recoveries_dropped``), as a stale one is."""
    clock = JoinHookClock()
    ex = DeviceExecutor(CalRT.load(), MANIFEST, ExecutorConfig(calbin_path=calbin),
                        clock=clock)
    assert ex.start().ok
    try:
        ex.life.request_recovery(Decision(Action.RESET_REBUILD, DEVICE_FAULT, "first"))
        until(lambda: not ex.life.recovery_active and ex.state == "Ready", 30,
              "the first recovery done")
        assert len(ex.recoveries) == 1 and ex.recoveries[0]["ok"], ex.recoveries

        def fault_now() -> None:
            assert ex.state == "Ready"
            ex.life.request_recovery(Decision(Action.RESET_REBUILD, DEVICE_FAULT, "second"))
            # (the old code: its thread takes ``recovery_mu`` and moves the lifecycle)
            until(lambda: ex.state == "Draining" or not ex.life.recovery_active, 20,
                  "the second recovery taken or dropped")

        clock.hook = fault_now
        status = ex.shutdown(5.0)
        assert clock.hook is None, "the shutdown never waited for the first recovery thread"
        assert status.ok and ex.state == "Stopped", (status, ex.state)
        assert len(ex.recoveries) == 1, ex.recoveries
        assert ex.snapshot()["recoveries_dropped"] == 1
    finally:
        ex.shutdown(5.0)


# ---- 3. a shutdown cuts a refused generation's drain short --------------------------------------
def test_a_shutdown_ends_a_recovery_draining_its_refused_generation_within_its_grace(calbin):
    """A recovery whose golden job the device holds past ``golden_timeout_s`` (2 s) refuses
    generation 2 and drains it before the retry, ``drain_grace_s`` 30; a ``shutdown(2.0)``
    then interrupted the recovery, but that drain went on (the interrupt was checked only
    as it began), so the shutdown answered ``shutdown.recovery_busy`` with nothing torn
    down. The interrupt now ends it: the generation is kept with its buffers (its job is on
    the device), the lifecycle ends Failed, and the shutdown answers within its grace."""
    # golden 2 s: the recovery's (never stepped) misses it by far; the start's, at 0.05 s
    # before, had no margin on a loaded host
    with running_executor(calbin, golden_timeout_s=2.0, execution_timeout_s=60.0,
                          timeout_grace_s=60.0,
                          recovery=RecoveryPolicy(drain_grace_s=30.0)) as ex:
        emu = ex.device.emu
        assert emu.set_stepped(True) == 0  # the device finishes nothing from now
        try:
            thread, out = recover_in_thread(ex, DEVICE_FAULT, "probe56-recover", reset=False)
            until(lambda: ex.state == "Warming" and ex.gen is not None and ex.gen.id == 2
                  and ex.gen.closing and jobs_on_device(ex, 1), 20,
                  "generation 2 refused and fenced, its golden job on the device")
            status = ex.shutdown(2.0)
            assert status.code != "shutdown.recovery_busy", status
            assert ex.state == "Failed" and status == ex.failure, (status, ex.state)
            thread.join(30)
            assert out and out[0] == ex.failure, out
            assert out[0].code == "recovery.generation_on_device", out[0]
            assert "shutdown() stopped its drain" in out[0].message, out[0]
            kept = [gen for gen in ex.life.retired if gen.id == 2]
            assert kept and not kept[0].released, "generation 2 released with its job on it"
        finally:
            emu.set_stepped(False)  # the device lets go: a later shutdown tears it down
        until(lambda: ex.snapshot()["completing"] == 0, 20, "the golden job ended, late")
        assert ex.shutdown(5.0) == ex.failure and ex.gen is None
        assert not ex.life.retired or all(gen.released for gen in ex.life.retired)
        assert emu.counters() == {}, "the device was never closed"


# ---- 4. a device fault of a golden job during a switch or recovery gets its reset ---------------
@pytest.mark.parametrize("switch", [True, False])
def test_a_device_fault_of_a_golden_job_resets_the_device_before_the_next_generation(calbin,
                                                                                     switch):
    """A model switch (reset asked for: none) or a recovery (its reset made before the new
    generation) whose golden job ends with a CCU exception: the fault controller asked for
    a reset and rebuild (§8 DEVICE), refused while the lifecycle was Warming, and the
    generation was refused and the next one configured and served on a device never reset
    after the fault (the switch's record: ``reset_kind`` None). The device is now reset
    before the next generation, and the record says so."""
    with running_executor(calbin) as ex:
        emu = ex.device.emu
        resets = emu.counters()["resets_full"]
        arm(ex, "CCU_EXCEPTION")  # the next job accepted: generation 2's golden prefill
        status = ex.switch_model(calbin) if switch else ex.recover(DEVICE_FAULT)
        assert status.ok and ex.state == "Ready" and ex.gen.id == 3, (status, ex.state)
        record = ex.recoveries[-1]
        assert record["refused"] == ["device.ccu_exception"], record
        assert record["reset_kind"] == "reset", record
        counters = emu.counters()
        assert counters["ccu_exceptions"] == 1, counters
        # the recovery's own reset (before generation 2) and the one the golden's fault
        # calls for (before generation 3)
        assert counters["resets_full"] - resets == (1 if switch else 2), counters
        assert [d.action for d in ex.faults.decisions] == [Action.RESET_REBUILD]


def test_a_device_fault_of_a_golden_job_without_a_safe_reset_ends_failed(calbin):
    """The same with ``reset_kind=none``: the device cannot be reset safely, so the switch
    ends Failed (``recovery.no_safe_reset``, as a device fault met in its drain does) rather
    than serving the next generation on a device never reset after the fault."""
    with running_executor(calbin, recovery=RecoveryPolicy(reset_kind="none")) as ex:
        arm(ex, "CCU_EXCEPTION")
        status = ex.switch_model(calbin)
        assert status.code == "recovery.no_safe_reset", status
        assert "device.ccu_exception" in status.message and "reset_kind=none" in status.message
        assert ex.state == "Failed" and ex.failure == status
        assert ex.shutdown(5.0) == status and ex.device is not None
        assert ex.device.emu.counters() == {}, "the device was never closed"


# ---- 5. a model switch that takes a pending device-fault recovery's turn -----------------------
def test_a_switch_that_replaces_a_pending_device_fault_recovery_makes_its_reset(calbin):
    """A CCU exception of generation 1 (§8 DEVICE: reset and rebuild) left a recovery
    pending, and a ``switch_model`` took the recovery lock first (stepped mode: that order
    every time). The switch drained and rebuilt without a reset (it asks for none) and the
    pending recovery, stale, was dropped: the device was never reset after the fault. The
    switch now makes the reset the recovery it replaces called for."""
    ex = make_executor(calbin, threads=False)
    try:
        resets = ex.device.emu.counters()["resets_full"]
        ex.faults.report(Status.failure("device.ccu_exception", Category.DEVICE, Phase.STATUS,
                                        "a fault of generation 1", generation=1))
        assert ex.life.recovery_pending and ex.faults.last().action is Action.RESET_REBUILD
        assert ex.switch_model(calbin).ok and ex.gen.id == 2
        record = ex.recoveries[-1]
        assert record["reason"] == "lifecycle.model_switch", record
        assert record["reset_kind"] == "reset", record
        assert ex.device.emu.counters()["resets_full"] == resets + 1
        assert ex.life.run_pending_recovery() is None  # covered by the switch: dropped
        assert ex.gen.id == 2 and ex.life.dropped_recoveries == 1 and ex.state == "Ready"
    finally:
        ex.shutdown(5.0)


def test_a_switch_that_replaces_a_pending_rebuild_without_reset_makes_none(calbin):
    """The same with a LIFECYCLE fault pending (§8: drain and rebuild, no reset): the
    switch still resets nothing."""
    ex = make_executor(calbin, threads=False)
    try:
        resets = ex.device.emu.counters()["resets_full"]
        ex.faults.report(Status.failure("calrt.configure_failed", Category.LIFECYCLE,
                                        Phase.STATUS, "a lifecycle fault", generation=1))
        assert ex.life.recovery_pending and ex.faults.last().action is Action.REBUILD
        assert ex.switch_model(calbin).ok and ex.gen.id == 2
        assert ex.recoveries[-1]["reset_kind"] is None, ex.recoveries[-1]
        assert ex.device.emu.counters()["resets_full"] == resets
        assert ex.life.run_pending_recovery() is None and ex.life.dropped_recoveries == 1
    finally:
        ex.shutdown(5.0)


# ---- 6. an Unknown sequence's refusal names the call that resets it ----------------------------
def test_a_request_on_an_unknown_sequence_names_release_sequence(calbin):
    """A sequence whose decode failed after submit (a NaN row; no recovery: a passive fault
    sink) is Unknown: every later request on it, a restart from ``past_len=0`` included,
    answered ``kv.sequence_unknown`` "reset it before reuse", naming no call of the executor's
    surface (an embedder retried a 503 that never clears). It names ``release_sequence``,
    after which the sequence serves again."""
    with running_executor(calbin, fault_sink=RecordingFaultSink()) as ex:
        first = ex.enqueue(prefill(1, [1, 2, 3])).wait_until(deadline())
        assert not isinstance(first, Status), first
        arm(ex, "OUTPUT_NAN")
        failed = ex.enqueue(decode(1, first.argmax, first.kv_len)).wait_until(deadline())
        assert isinstance(failed, Status) and failed.code == "internal.output_not_finite"
        again = ex.enqueue(prefill(1, [1, 2, 3])).wait_until(deadline())
        assert isinstance(again, Status) and again.code == "kv.sequence_unknown", again
        # (stop 57) not UNAVAILABLE, a 503 with a Retry-After that no retry ever clears: a
        # 400 the caller acts on, as kv.sequence_busy; §8's 503 is for a recovering device
        assert again.category is Category.INVALID_REQUEST, again
        assert again.http_status == 400 and again.grpc_code == "INVALID_ARGUMENT", again
        assert "release_sequence(1)" in again.message, again
        assert ex.release_sequence(1, 1.0).ok
        restarted = ex.enqueue(prefill(1, [1, 2, 3])).wait_until(deadline())
        assert not isinstance(restarted, Status) and restarted.argmax == first.argmax, restarted
