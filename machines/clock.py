"""One clock for the executor, the KV coordinator, the buffer pool, the fault controller and
the jobs (issue 13: "inject one clock"), and the one place where they make their
synchronisation objects.

Every deadline in calexec is an absolute value of ``Clock.monotonic()`` (by default
``time.monotonic()``), and every wait goes through the clock: ``wait(cond, timeout)``,
``wait_event(event, timeout)``, ``sleep``. Conditions, events and the executor's threads are
made by ``condition(lock)``, ``event()`` and ``start_thread(...)``; locks by
``LockOrder.lock(rank)`` (machines/locks.py), which carries the clock so every controller that
gets the executor's ``LockOrder`` also gets its clock. A test, or the interleaving explorer,
replaces the clock (a virtual clock that advances only when every thread is blocked, with
controlled locks and conditions) without touching the code under test.

``SYSTEM`` is the real clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from queue import Queue
from typing import Protocol, TypeVar, cast

#: a queue's item type (``Clock.queue``)
Item = TypeVar("Item")


class LockLike(Protocol):
    """A lock a ``Clock`` condition waits on: ``threading.Lock``, or a ``RankedLock``
    (machines/locks.py) around one."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...

    def release(self) -> None: ...


class Clock:
    """Monotonic time, sleeps and timed condition waits. The default is the system's."""

    __slots__ = ()

    #: this clock's time is the host's (``time.monotonic``): a wait in native code, which
    #: follows the host's time, may stand in for one of its waits (``SubmitRelay``)
    real = True

    def monotonic(self) -> float:
        return time.monotonic()

    def now_us(self) -> int:
        """``monotonic()`` in whole microseconds (job timings, §4.2 ``JobTimings``)."""
        return time.monotonic_ns() // 1000

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def wait(self, cond: threading.Condition, timeout: float | None) -> bool:
        """``cond.wait(timeout)`` (the caller holds ``cond``'s lock). ``None`` is allowed only
        for a documented shutdown-only wait. A timeout beyond ``threading.TIMEOUT_MAX`` (a
        request deadline centuries away, e.g. ``monotonic() + 1e12``) waits that long instead
        of raising OverflowError: every caller re-checks its deadline after a wait."""
        return cond.wait(_bounded(timeout))

    def wait_event(self, event: threading.Event, timeout: float | None) -> bool:
        """``event.wait(timeout)``; ``None`` only for a wait the caller chose to leave open
        (``JobHandle.wait_until(None)``). A timeout beyond ``threading.TIMEOUT_MAX`` as in
        ``wait``."""
        return event.wait(_bounded(timeout))

    def remaining(self, deadline: float) -> float:
        """Seconds until ``deadline`` (an absolute ``monotonic()`` value), never negative."""
        return max(0.0, deadline - self.monotonic())

    # ---- the synchronisation objects the executor makes ---------------------------------------
    def lock(self) -> threading.Lock:
        return threading.Lock()

    def condition(self, lock: LockLike, name: str = "") -> threading.Condition:
        """A condition on ``lock``; ``name`` says its role (``submit_cv``, ``pool``, ...) to a
        clock that observes hand-offs (``calexec bench``'s counting clock)."""
        # Condition duck-types its lock (acquire/release, _is_owned when present); typeshed
        # names only threading's own locks
        return threading.Condition(cast(threading.Lock, lock))

    def event(self) -> threading.Event:
        return threading.Event()

    def rlock(self) -> threading.RLock:
        """A reentrant lock (``threading.RLock``)."""
        return threading.RLock()

    def semaphore(self, value: int = 1) -> threading.Semaphore:
        return threading.Semaphore(value)

    def bounded_semaphore(self, value: int = 1) -> threading.BoundedSemaphore:
        return threading.BoundedSemaphore(value)

    def queue(self, maxsize: int = 0) -> Queue[Item]:
        """A FIFO queue (``queue.Queue``; ``maxsize`` <= 0: unbounded); its item type is the
        caller's (``jobs: Queue[Job] = clock.queue()``)."""
        return Queue(maxsize)

    def start_thread(self, target: Callable[..., object], name: str, args: tuple[object, ...] = ()
                     ) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        return thread

    def join(self, thread: threading.Thread, timeout: float) -> bool:
        """``thread.join(timeout)``: whether it ended. A wait like the others here, so a
        clock that observes waits sees what each was given (a thread made by
        ``start_thread`` joins on its own terms, e.g. the explorer's scheduled threads)."""
        thread.join(_bounded(max(0.0, timeout)))
        return not thread.is_alive()


def _bounded(timeout: float | None) -> float | None:
    """``timeout`` capped at ``threading.TIMEOUT_MAX`` (about 292 years on 64-bit Linux): a
    longer one makes ``Condition.wait`` and ``Event.wait`` raise OverflowError ("timestamp out
    of range for platform time_t"), and a deadline that far away is not reached anyway."""
    if timeout is not None and timeout > threading.TIMEOUT_MAX:
        return threading.TIMEOUT_MAX
    return timeout


SYSTEM = Clock()
