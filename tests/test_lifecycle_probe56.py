"""Stop 56's lifecycle defects found by the faults probe and fixed by the lead: a recovery or
model switch asked for while the lifecycle cannot recover (Failed, a start or another
recovery still warming up) is refused without being recorded as a recovery; the requests a
shutdown releases from the wait for Ready are told the executor is shutting down."""

from __future__ import annotations

import threading

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.synthetic import calbin as cb
from calexec.machines.faults import RecoveryPolicy
from executor_harness import (
    SEED,
    arm,
    deadline,
    fired,
    prefill,
    running_executor,
    until,
    write_calbin,
)
from test_concurrency_defects import PROMPT, recovery_held_in_warming


@pytest.fixture(scope="module")
def calbins(tmp_path_factory):
    directory = tmp_path_factory.mktemp("life56")
    other = str(directory / "other.calbin")
    cb.write(other, cb.default_spec(seed=SEED ^ 0x5A5A5A))
    return {"main": write_calbin(directory), "other": other}


@pytest.mark.parametrize("call", ["recover", "switch_model"])
def test_a_recovery_asked_for_on_a_failed_lifecycle_is_refused_and_not_recorded(calbins, call):
    """``recover()``/``switch_model()`` on a Failed lifecycle did nothing but added a failed
    record ("cannot recover from lifecycle Failed"), counted in ``snapshot()['recoveries']``
    and ``calexec_recoveries_total`` as a recovery that ran."""
    with running_executor(calbins["main"]) as ex:
        ex.life.fail(Status.failure("test.failed", Category.DEVICE, Phase.RECOVERY,
                                    "the test's failure"))
        assert ex.state == "Failed"
        before = ex.snapshot()["recoveries"]
        status = (ex.recover(Status.failure("test.recover", Category.DEVICE, Phase.RECOVERY,
                                            "the test's"))
                  if call == "recover" else ex.switch_model(calbins["other"]))
        assert not status.ok
        assert status.category is Category.UNAVAILABLE
        assert "cannot recover from lifecycle Failed: nothing was done" in status.message
        assert ex.snapshot()["recoveries"] == before
        assert ex.state == "Failed"


def test_a_recovery_asked_for_while_another_warms_up_runs_once_it_ended(calbins):
    """A second ``recover()`` waits for the first (``recovery_mu``) and then recovers: one
    record each; the refusal above is only for a lifecycle that is not Ready when its turn
    comes."""
    with running_executor(calbins["main"]) as ex:
        release, first = recovery_held_in_warming(ex)
        out: list[Status] = []
        second = threading.Thread(target=lambda: out.append(ex.recover(Status.failure(
            "test.second", Category.DEVICE, Phase.RECOVERY, "the test's second"))))
        second.start()
        release.set()
        first.join(10)
        second.join(20)
        assert out and out[0].ok, out
        assert ex.snapshot()["recoveries"] == 2
        assert ex.state == "Ready"


def test_a_request_a_shutdown_releases_from_the_wait_for_ready_is_told_it_shuts_down(calbins):
    """A request queued through a recovery (``ready_queue_max``) that a shutdown released was
    told "device lifecycle is Warming; not admitting", as if the device only recovered and a
    retry would be served."""
    with running_executor(calbins["main"], ready_queue_max=2) as ex:
        release, recovery = recovery_held_in_warming(ex)
        results: list[object] = []
        waiter = threading.Thread(target=lambda: results.append(
            ex.enqueue(prefill(4, PROMPT, seconds=30)).wait_until(deadline(30))))
        waiter.start()
        until(lambda: ex.snapshot()["waiting_for_ready"] == 1, 5, "the request to queue")
        shutdown = threading.Thread(target=lambda: ex.shutdown(grace=4.0))
        shutdown.start()
        try:
            waiter.join(10)
            assert results, "the request still waits for Ready"
            answer = results[0]
            assert isinstance(answer, Status) and answer.category is Category.UNAVAILABLE
            assert "the executor is shutting down (shutdown() called); not admitting" in \
                answer.message, answer.message
        finally:
            release.set()
            recovery.join(10)
            shutdown.join(20)


@pytest.mark.parametrize("switch", [True, False])
def test_a_configure_the_device_refuses_resets_it_before_the_next_generation(calbins, switch):
    """§8: rc 24 (map broken) is a DEVICE failure: quarantine, reset, restart or escalate.
    A model switch or recovery whose new generation's configure met it (the emulator's
    ``MAP_FAIL``) rolled on to configure the next generation on a device never reset: no job
    failed, so no fault controller heard of it (the record: ``reset_kind`` None). The device
    is now reset before the next generation."""
    with running_executor(calbins["main"]) as ex:
        emu = ex.device.emu
        resets = emu.counters()["resets_full"]
        arm(ex, "MAP_FAIL")  # the next buffer map: generation 2's configure
        status = (ex.switch_model(calbins["main"]) if switch else ex.recover(Status.failure(
            "device.ccu_exception", Category.DEVICE, Phase.RECOVERY, "the test's")))
        assert status.ok and ex.state == "Ready" and ex.gen.id == 3, (status, ex.state)
        record = ex.recoveries[-1]
        assert record["refused"] == ["calrt.map_failed"], record
        assert record["reset_kind"] == "reset", record
        assert fired(ex, "MAP_FAIL") == 1
        # the recovery's own reset (before generation 2), and the one the refused configure
        # calls for (before generation 3)
        assert emu.counters()["resets_full"] - resets == (1 if switch else 2)


def test_a_configure_the_device_refuses_without_a_safe_reset_ends_failed(calbins):
    """The same with ``reset_kind=none``: Failed, ``recovery.no_safe_reset``, as for a device
    fault of a golden job, never the next generation on a device that was not reset."""
    with running_executor(calbins["main"], recovery=RecoveryPolicy(reset_kind="none")) as ex:
        arm(ex, "MAP_FAIL")
        status = ex.switch_model(calbins["main"])
        assert status.code == "recovery.no_safe_reset", status
        assert "calrt.map_failed" in status.message and "reset_kind=none" in status.message
        assert ex.state == "Failed" and ex.failure == status
        assert ex.shutdown(5.0) == status
        assert ex.device.emu.counters() == {}, "the device was never closed"
