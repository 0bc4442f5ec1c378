"""Stop 58 (core): the control core's lifecycle and its embedding API, each defect replayed
with its interleaving forced (a device proxy holds the thread of a recovery at the point the
race needs it) rather than hoped for. Real executor on the bundled emulator; every wait is a
bounded poll of a condition or a bounded join; nothing asserts a duration.
"""

from __future__ import annotations

import pytest

from calexec.drivers.synthetic import calbin as cb
from executor_harness import oracle_golden, write_calbin
from lifecycle_hooks import shutdown_at_a_refused_configure, shutdown_once_torn_down

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

