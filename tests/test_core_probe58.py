"""Stop 58 (core): the control core's lifecycle and its embedding API, each defect replayed
with its interleaving forced (a device proxy holds the thread of a recovery at the point the
race needs it) rather than hoped for. Real executor on the bundled emulator; every wait is a
bounded poll of a condition or a bounded join; nothing asserts a duration.
"""

from __future__ import annotations

import threading

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.synthetic import calbin as cb
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from executor_harness import (
    MANIFEST,
    deadline,
    oracle_golden,
    prefill,
    running_executor,
    until,
    write_calbin,
)
from lifecycle_hooks import (
    hooked_executor,
    shutdown_at_a_refused_configure,
    shutdown_once_torn_down,
)

OTHER_SEED = 5858


@pytest.fixture(scope="module")
def calbins(tmp_path_factory):
    directory = tmp_path_factory.mktemp("probe58")
    main = write_calbin(directory)
    other = str(directory / "other.calbin")
    other_sha = cb.write(other, cb.default_spec(seed=OTHER_SEED))
    garbage = directory / "garbage.calbin"
    garbage.write_bytes(b"not a calbin" * 64)
    return {"main": main, "other": other, "other_sha": other_sha, "garbage": str(garbage)}


# ---- 1. a shutdown that begins once a recovery tore the old generation down ----------------
@pytest.mark.parametrize("how", ["switch_model", "recover"])
def test_a_shutdown_once_the_old_generation_is_torn_down_configures_nothing(calbins, how):
    """A model switch (or a recovery) tears the serving generation down, then configures the
    target calbin and runs its golden. A ``shutdown`` that began during that teardown (it
    interrupts the recovery at half its grace) did not stop it: the target calbin was loaded,
    configured and mapped once the shutdown had begun, its golden refused (admission
    stopped), and the lifecycle went Warming -> Stopped, the shutdown tearing it down again.
    Nothing is configured once a shutdown began: the lifecycle goes Recovering -> Stopped,
    the call answers ``lifecycle.unavailable`` naming the shutdown, the shutdown answers OK."""
    shutdown_once_torn_down(calbins["main"], calbins["other"],
                            {calbins["other_sha"]: oracle_golden(OTHER_SEED)}, how)


def test_a_shutdown_during_a_refused_configure_ends_stopped_not_failed(calbins):
    """A model switch whose calbin the runtime refuses to load (Configuring), a shutdown
    beginning meanwhile: no roll back was made (stop 57), but the lifecycle ended Failed,
    which ``calexec serve`` reports as exit 3 (a broken device), because the chart had no
    way from Configuring to Stopped once a device was opened. Nothing is left on the device
    and nothing configured: it ends Stopped (``shutdown_requested``) and the shutdown OK."""
    shutdown_at_a_refused_configure(calbins["main"], calbins["garbage"])


def test_a_shutdown_with_grace_to_spare_stops_a_torn_down_switch_at_once(calbins):
    """The same shutdown with a long grace (10 s: the switch may take half of it to finish
    on its own): once it was requested, the switch, its old generation torn down, configures
    nothing (it loaded the calbin again and ran the golden to go live for the shutdown to
    tear it all down); the lifecycle ends Stopped and the shutdown answers OK."""
    ex, device = hooked_executor(ExecutorConfig(calbin_path=calbins["main"]))
    answers: list[Status] = []
    thread = threading.Thread(target=lambda: answers.append(ex.shutdown(10.0)),
                              name="probe58-shutdown", daemon=True)

    def shutdown_requested() -> None:  # on the switch's thread, tearing generation 1 down
        thread.start()
        until(lambda: ex.life.shutdown_requested(), 20, "the shutdown requested")

    try:
        device.on_teardown = shutdown_requested
        status = ex.switch_model(calbins["main"])
        thread.join(30)
        assert [path for path, _ in device.loads] == [calbins["main"]], device.loads
        assert status.code == "lifecycle.unavailable" and "shutdown()" in status.message
        assert answers and answers[0].ok and ex.state == "Stopped", (answers, ex.state)
    finally:
        thread.join(30) if thread.ident is not None else None
        ex.shutdown(5.0)


# ---- 2. a decode stream the executor can never serve ----------------------------------------
@pytest.mark.parametrize("when", ["before start", "after shutdown"])
def test_a_decode_stream_before_start_or_after_shutdown_is_returned_closed(calbins, when):
    """``enqueue`` before ``start()`` (or after ``shutdown()``) returns a handle resolved at
    once with ``lifecycle.unavailable``, and ``decode_sync`` answers it; ``decode_stream``
    returned an open stream (``closed`` False, ``status`` None) whose first ``submit`` only
    then answered, after a shutdown with another text ("device lifecycle is Stopped: no
    model generation is loaded") than the shutdown ``enqueue`` names. The stream is now
    returned closed, its ``status`` what ``enqueue`` answers, and ``submit`` answers it; before
    ``start()`` all three name the missing start (it read "device lifecycle is Configuring",
    a device still configuring, to retry)."""
    ex = DeviceExecutor(CalRT.load(), MANIFEST, ExecutorConfig(calbin_path=calbins["main"]))
    if when == "after shutdown":
        assert ex.start().ok
        assert ex.shutdown(5.0).ok
    expected = "start() was not called" if when == "before start" else "shutdown() called"
    try:
        handle = ex.enqueue(prefill(1, [1, 2, 3]))
        assert handle.done
        refused = handle.wait_until(deadline())
        assert isinstance(refused, Status) and refused.code == "lifecycle.unavailable"
        assert expected in refused.message, refused
        code, synced = ex.decode_sync(prefill(1, [1, 2, 3]))
        assert code != 0 and isinstance(synced, Status)
        assert (synced.code, synced.message) == (refused.code, refused.message), synced
        stream = ex.decode_stream(1, 3, deadline())
        assert stream.closed, "decode_stream returned an open stream it can never serve"
        assert (stream.status.code, stream.status.message) == (refused.code, refused.message)
        assert stream.status.seq_id == 1, stream.status
        submitted = stream.submit(5)
        assert isinstance(submitted, Status) and submitted.message == refused.message
        stream.close()
        assert stream.quiet
    finally:
        ex.shutdown(5.0)
    assert ex.state == "Stopped", ex.state


def test_a_decode_stream_opened_during_a_recovery_stays_open(calbins):
    """The stream closed at birth is only for an executor that can never serve it: one
    opened while a recovery runs stays open, its step admitted once the lifecycle is Ready
    again (as ``enqueue`` queues through a recovery)."""
    ex, device = hooked_executor(ExecutorConfig(calbin_path=calbins["main"]))
    opened: list = []

    def open_a_stream() -> None:  # on the recovery's thread, tearing generation 1 down
        opened.append(ex.decode_stream(1, 0, deadline()))

    try:
        first = ex.enqueue(prefill(1, [1, 2, 3])).wait_until(deadline())
        assert not isinstance(first, Status), first
        assert ex.release_sequence(1).ok
        device.on_teardown = open_a_stream
        assert ex.recover(Status.failure("lifecycle.probe", Category.LIFECYCLE,
                                         Phase.RECOVERY, "a rebuild"), reset=False).ok
        assert opened and not opened[0].closed, opened
        opened[0].close()
    finally:
        ex.shutdown(5.0)


# ---- 3. result(timeout) timing out names the call made ----------------------------------------
def test_result_timing_out_names_result_and_its_timeout(calbins):
    """``handle.result(timeout=0.05)`` on a job the device has not finished answered
    ``wait.deadline`` "wait_until deadline passed", naming a call the caller never made and
    no timeout; it now names ``JobHandle.result(timeout=0.05)``. ``wait_until`` keeps its
    own words."""
    with running_executor(calbins["main"]) as ex:
        emu = ex.device.emu
        assert emu.set_stepped(True) == 0  # the device finishes nothing until released
        try:
            handle = ex.enqueue(prefill(1, [1, 2, 3]))
            timed_out = handle.result(timeout=0.05)
            looked = handle.result(0)
            waited = handle.wait_until(deadline(0.05))
        finally:
            assert emu.set_stepped(False) == 0
        assert isinstance(timed_out, Status) and timed_out.code == "wait.deadline", timed_out
        assert "JobHandle.result(timeout=0.05) timed out" in timed_out.message, timed_out
        assert "wait_until" not in timed_out.message, timed_out
        assert isinstance(looked, Status) and "result(timeout=0)" in looked.message, looked
        assert isinstance(waited, Status) and "wait_until" in waited.message, waited
        assert not isinstance(handle.result(10.0), Status)
