"""Stop 60 (faults): a model switch or recovery whose configure the device refused more than
once in a row (rc 24, ``calrt.map_failed``: §8 DEVICE, reset, restart or escalate). Found by
``/admin/reload`` under load with the emulator's ``MAP_FAIL`` armed at random (``PROB``):
the switch's generation was refused, the device reset, the roll back to the calbin that served
refused too, and the lifecycle ended ``Failed`` (the server 503 for good, ``calexec serve``
exit 3) with the escalation budget (``max_recoveries``) far from spent, where a golden job's
fault of that calbin is configured again within it (``_retry_golden``, stop 52). The refusals
are forced (the next buffer map of each chosen load fails); nothing asserts a duration.
"""

from __future__ import annotations

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.calrt.runtime import Fault, FaultMode
from calexec.drivers.synthetic import calbin as cb
from calexec.machines.executor import ExecutorConfig
from calexec.machines.faults import RecoveryPolicy
from executor_harness import oracle_golden, write_calbin
from lifecycle_hooks import hooked_executor

OTHER_SEED = 6060


@pytest.fixture(scope="module")
def calbins(tmp_path_factory):
    directory = tmp_path_factory.mktemp("probe60")
    main = write_calbin(directory)
    other = str(directory / "other.calbin")
    other_sha = cb.write(other, cb.default_spec(seed=OTHER_SEED))
    return {"main": main, "other": other, "other_sha": other_sha}


def _map_fails_at_loads(ex, device, loads: int) -> list[str]:
    """The next ``loads`` calbin loads each get their first buffer map refused (rc 24): the
    emulator's ``MAP_FAIL`` armed for the next map as each load begins. Answers the paths
    loaded so far (the list grows)."""
    seen: list[str] = []

    def hook(path: str) -> None:
        seen.append(path)
        if len(seen) <= loads:
            assert ex.device.emu.set_fault(Fault.MAP_FAIL, FaultMode.NTH, 1, 0, 0) == 0
            device.on_load = hook
        else:
            ex.device.emu.clear_all_faults()

    device.on_load = hook
    return seen


@pytest.mark.parametrize("how", ["switch_model", "recover", "reload"])
def test_a_configure_the_device_refuses_twice_is_configured_again_within_the_budget(
        calbins, how):
    """The switch's (or recovery's) generation and the roll back's are both refused by the
    device (``calrt.map_failed``); with ``max_recoveries`` 5 the calbin that served is
    configured once more, after the reset the refusal calls for, and serves: never
    ``Failed`` at the second refusal of one recovery. (On the old code: ``Failed``,
    ``calrt.map_failed``.)"""
    ex, device = hooked_executor(ExecutorConfig(
        calbin_path=calbins["main"], recovery=RecoveryPolicy(max_recoveries=5),
        goldens={calbins["other_sha"]: oracle_golden(OTHER_SEED)}))
    try:
        resets = ex.device.emu.counters()["resets_full"]
        loads = _map_fails_at_loads(ex, device, 2)
        if how == "switch_model":
            status = ex.switch_model(calbins["other"])
        elif how == "reload":  # the calbin that serves, switched to again
            status = ex.switch_model(calbins["main"])
        else:
            status = ex.recover(Status.failure("device.ccu_exception", Category.DEVICE,
                                               Phase.RECOVERY, "the test's"))
        assert ex.state == "Ready", (ex.state, status, ex.failure)
        assert len(loads) == 3, loads  # the two refused, and the one that serves
        assert loads[1:] == [calbins["main"]] * 2, loads
        if how == "switch_model":
            assert status.code == "recovery.rolled_back", status
            assert "calrt.map_failed" in status.message, status
        else:
            assert status.ok, status
        assert ex.gen is not None and ex.gen.calbin_path == calbins["main"]
        record = ex.recoveries[-1]
        assert record["refused"] == ["calrt.map_failed"] * 2, record
        # one reset before each generation after a refused configure (and the recovery's own)
        made = ex.device.emu.counters()["resets_full"] - resets
        assert made == (3 if how == "recover" else 2), made
    finally:
        ex.device.emu.clear_all_faults()
        ex.shutdown(5.0)


def test_a_configure_the_device_keeps_refusing_ends_failed_past_the_budget(calbins):
    """The bound: refused more often than ``max_recoveries`` allows in one recovery, the
    lifecycle ends ``Failed`` naming the device's refusal, for the supervisor."""
    ex, device = hooked_executor(ExecutorConfig(
        calbin_path=calbins["main"], recovery=RecoveryPolicy(max_recoveries=2)))
    try:
        loads = _map_fails_at_loads(ex, device, 10)
        status = ex.switch_model(calbins["main"])
        assert not status.ok and status.code == "calrt.map_failed", status
        assert ex.state == "Failed" and ex.failure == status
        # the switch's configure, the roll back, then max_recoveries attempts again (as for
        # a golden job's faults, ``_retry_golden``): never more
        assert len(loads) == 4, loads
    finally:
        ex.device.emu.clear_all_faults()
        ex.shutdown(5.0)
