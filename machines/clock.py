"""One clock for the executor, the KV coordinator, the buffer pool, the fault controller and
the jobs (issue 13: "inject one clock").

Every deadline in calexec is an absolute value of ``Clock.monotonic()`` (by default
``time.monotonic()``), and every timed wait goes through ``Clock.wait(cond, timeout)`` or
``Clock.sleep``. Tests and the interleaving explorer replace the clock (a virtual clock that
advances only when every thread is blocked) without touching the code under test.

``SYSTEM`` is the real clock; ``DeviceExecutor`` hands its clock to every controller it builds.
"""

from __future__ import annotations

import threading
import time


class Clock:
    """Monotonic time, sleeps and timed condition waits. The default is the system's."""

    __slots__ = ()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def wait(self, cond: threading.Condition, timeout: float | None) -> bool:
        """``cond.wait(timeout)`` (the caller holds ``cond``'s lock). ``None`` is allowed only
        for a documented shutdown-only wait."""
        return cond.wait(timeout)

    def remaining(self, deadline: float) -> float:
        """Seconds until ``deadline`` (an absolute ``monotonic()`` value), never negative."""
        return max(0.0, deadline - self.monotonic())


SYSTEM = Clock()
