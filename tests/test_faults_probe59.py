"""Stop 59 (faults): a ``shutdown`` that answered ``shutdown.recovery_busy`` while a model
switch (or a recovery) ran. Its interrupt stays (nothing is configured once a shutdown was
called), so the switch then stopped itself in ``Stopped``; but nothing tore the executor down:
the device stayed open, its threads ran, until some later ``shutdown()``. The interleaving is
forced (the switch's thread, tearing generation 1 down, waits for the shutdown to answer);
nothing asserts a duration.
"""

from __future__ import annotations

import threading

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.synthetic import calbin as cb
from calexec.machines.executor import ExecutorConfig
from executor_harness import oracle_golden, until, write_calbin
from lifecycle_hooks import hooked_executor, lifecycle_steps

OTHER_SEED = 5959


@pytest.fixture(scope="module")
def calbins(tmp_path_factory):
    directory = tmp_path_factory.mktemp("probe59")
    main = write_calbin(directory)
    other = str(directory / "other.calbin")
    other_sha = cb.write(other, cb.default_spec(seed=OTHER_SEED))
    return {"main": main, "other": other, "other_sha": other_sha}


@pytest.mark.parametrize("how", ["switch_model", "recover"])
def test_a_shutdown_that_answered_recovery_busy_is_completed_when_the_recovery_ends(
        calbins, how):
    """``shutdown(0.0)`` while the switch tears generation 1 down answers
    ``shutdown.recovery_busy`` (the switch holds the recovery lock). The switch then stops,
    nothing configured (Recovering -> Stopped), and completes the shutdown that was asked for
    as it ends: the device closed, the threads stopped. A later ``shutdown`` answers OK."""
    ex, device = hooked_executor(ExecutorConfig(
        calbin_path=calbins["main"],
        goldens={calbins["other_sha"]: oracle_golden(OTHER_SEED)}))
    emu = ex.device.emu
    answers: list[Status] = []
    steps = lifecycle_steps(ex)

    def shutdown_now() -> None:  # on the switch's thread, tearing generation 1 down
        thread = threading.Thread(target=lambda: answers.append(ex.shutdown(0.0)),
                                  name="probe59-shutdown", daemon=True)
        thread.start()
        thread.join(30)

    try:
        device.on_teardown = shutdown_now
        if how == "switch_model":
            status = ex.switch_model(calbins["other"])
        else:
            status = ex.recover(Status.failure("lifecycle.probe", Category.LIFECYCLE,
                                               Phase.RECOVERY, "a rebuild"), reset=False)
        assert device.on_teardown is None, "generation 1 was never torn down"
        assert [a.code for a in answers] == ["shutdown.recovery_busy"], answers
        assert status.code == "lifecycle.unavailable" and "shutdown()" in status.message, status
        assert device.loads_once_stopping() == [], device.loads
        assert ("stop", "Recovering", "Stopped") in steps(), steps()
        assert ex.state == "Stopped" and ex.gen is None and ex.failure is None, \
            (ex.state, ex.gen, ex.failure)
        until(lambda: emu.counters() == {}, 20, "the device closed by the shutdown asked for")
        assert ex.shutdown(5.0).ok
    finally:
        ex.shutdown(5.0)
