"""A device proxy for lifecycle races: the bundled runtime whose device runs a hook at a
generation's teardown (``reset_configuration``) or at a calbin's load, on the thread making
that call (a recovery's, a model switch's), so a test forces a shutdown to begin exactly there
rather than hoping for it. Every load is recorded with whether the executor was stopping then.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.calrt.runtime import CalRT
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from executor_harness import MANIFEST, until


class HookedDevice:
    """The bundled device; ``on_teardown`` runs once at the next ``reset_configuration``,
    ``on_load`` once at the next ``load_calbin`` (given the path), before the real call."""

    def __init__(self, device, stopping: Callable[[], bool]) -> None:
        self._device = device
        self._stopping = stopping
        self.loads: list[tuple[str, bool]] = []
        self.on_teardown: Callable[[], None] | None = None
        self.on_load: Callable[[str], None] | None = None

    def load_calbin(self, path):
        hook, self.on_load = self.on_load, None
        if hook is not None:
            hook(path)
        self.loads.append((path, self._stopping()))
        return self._device.load_calbin(path)

    def reset_configuration(self):
        hook, self.on_teardown = self.on_teardown, None
        if hook is not None:
            hook()
        return self._device.reset_configuration()

    def loads_once_stopping(self) -> list[str]:
        """The calbins loaded once the executor was stopping."""
        return [path for path, stopping in self.loads if stopping]

    def __getattr__(self, name):
        return getattr(self._device, name)


class HookedRuntime:
    """The bundled runtime whose device is a ``HookedDevice`` (``device``)."""

    def __init__(self, runtime: CalRT) -> None:
        self._runtime = runtime
        self.device: HookedDevice | None = None
        self.executor: DeviceExecutor | None = None

    def open_device(self, config):
        rc, device = self._runtime.open_device(config)
        if rc == 0:
            self.device = device = HookedDevice(
                device, lambda: self.executor is not None and self.executor.life.stopping)
        return rc, device

    def __getattr__(self, name):
        return getattr(self._runtime, name)


def lifecycle_steps(ex: DeviceExecutor) -> Callable[[], list[tuple[str, str, str]]]:
    """Record the lifecycle's transitions from now on: a function answering them so far, as
    (event, source, target)."""
    trail: deque = deque(maxlen=256)
    ex.life.run.keep_trail(trail, time.monotonic)
    return lambda: [(event, source, target) for event, source, target, *_ in trail
                    if target is not None]


def hooked_executor(config: ExecutorConfig) -> tuple[DeviceExecutor, HookedDevice]:
    """A started executor on a ``HookedRuntime``, and its device."""
    runtime = HookedRuntime(CalRT.load())
    ex = DeviceExecutor(runtime, MANIFEST, config)
    runtime.executor = ex
    status = ex.start()
    assert status.ok, status
    assert runtime.device is not None
    return ex, runtime.device


class ShutdownWhen:
    """A hook that starts ``ex.shutdown(grace)`` on a thread of its own and returns once the
    shutdown interrupted the caller (``stopping``: half the grace went by): the thread it is
    called on (a recovery's) then goes on with a shutdown begun."""

    def __init__(self, ex: DeviceExecutor, grace: float = 2.0) -> None:
        self.ex = ex
        self.answers: list[Status] = []
        self.thread = threading.Thread(target=lambda: self.answers.append(ex.shutdown(grace)),
                                       name="hook-shutdown", daemon=True)

    def __call__(self, *_args: object) -> None:
        self.thread.start()
        until(lambda: self.ex.life.stopping, 20, "the shutdown interrupting the recovery")

    def join(self, seconds: float = 30.0) -> list[Status]:
        if self.thread.is_alive() or self.thread.ident is not None:
            self.thread.join(seconds)
        return self.answers


# ---- the scenarios (tests/test_core_probe58.py; the lifecycle chart's transitions through
# the executor, tests/test_recovery.py) ----
def shutdown_once_torn_down(main: str, other: str, goldens: dict, how: str) -> None:
    """A ``switch_model`` to ``other`` (its golden in ``goldens``; or a ``recover``) whose
    thread, tearing generation 1 down, waits for a shutdown to interrupt it: asserts that
    nothing is configured once it began and the lifecycle goes Recovering -> Stopped."""
    ex, device = hooked_executor(ExecutorConfig(calbin_path=main, goldens=goldens))
    shutdown = ShutdownWhen(ex)
    steps = lifecycle_steps(ex)
    try:
        device.on_teardown = shutdown
        if how == "switch_model":
            status = ex.switch_model(other)
        else:
            status = ex.recover(Status.failure("lifecycle.probe", Category.LIFECYCLE,
                                               Phase.RECOVERY, "a rebuild"), reset=False)
        answers = shutdown.join()
        assert device.on_teardown is None, "generation 1 was never torn down"
        assert device.loads_once_stopping() == [], device.loads
        assert status.code == "lifecycle.unavailable", status
        assert "shutdown()" in status.message and "nothing configured" in status.message
        assert answers and answers[0].ok, answers
        assert ex.state == "Stopped" and ex.gen is None, (ex.state, ex.gen)
        assert ex.failure is None, ex.failure
        assert steps()[-1] == ("stop", "Recovering", "Stopped"), steps()
    finally:
        shutdown.join()
        ex.shutdown(5.0)


def shutdown_at_a_refused_configure(main: str, garbage: str) -> None:
    """A ``switch_model`` to a calbin the runtime refuses to load, a shutdown beginning at
    that load: asserts the switch ends there, Configuring -> Stopped, nothing rolled back."""
    ex, device = hooked_executor(ExecutorConfig(calbin_path=main))
    shutdown = ShutdownWhen(ex)
    steps = lifecycle_steps(ex)
    try:
        device.on_load = shutdown
        status = ex.switch_model(garbage)
        answers = shutdown.join()
        assert device.loads_once_stopping() == [garbage], device.loads
        assert status.code == "lifecycle.unavailable", status
        assert "no roll back" in status.message and main in status.message, status
        assert answers and answers[0].ok, answers
        assert ex.state == "Stopped" and ex.failure is None, (ex.state, ex.failure)
        assert steps()[-1] == ("stop", "Configuring", "Stopped"), steps()
    finally:
        shutdown.join()
        ex.shutdown(5.0)
