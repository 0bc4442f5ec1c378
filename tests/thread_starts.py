"""Which threads the code under test started: a "no new thread" check over the whole process's
threads (``threading.enumerate()`` before and after) also sees a thread another test left
running start one of its own (or end) inside the window, and fails under CI's load for what
the code under test never did. :func:`recording_thread_starts` notes every
``threading.Thread.start`` in the window with the thread that called it; :meth:`ThreadStarts.ours`
keeps those started by the recording thread, by one of the given roots (the executor's own
threads, say), or by a thread one of these started in the window. :class:`OwnCpu` likewise
measures the CPU of the threads started after it, not of those other tests left running.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


class ThreadStarts:
    """The threads started while recording, each with its starter, in start order."""

    def __init__(self, roots: Iterable[threading.Thread]) -> None:
        self.roots = {threading.current_thread(), *roots}
        self.starts: list[tuple[threading.Thread, threading.Thread]] = []  # (starter, started)

    def ours(self) -> list[threading.Thread]:
        """The threads started in the window by a root or, transitively, by one of ours."""
        owners = set(self.roots)
        found = []
        for starter, thread in list(self.starts):  # start order: a starter comes first
            if starter in owners:
                owners.add(thread)
                found.append(thread)
        return found

    def names(self) -> list[str]:
        return [thread.name for thread in self.ours()]


@contextmanager
def recording_thread_starts(roots: Iterable[threading.Thread] = ()) -> Iterator[ThreadStarts]:
    """Record the threads started inside the ``with`` block (``threading.Thread.start``
    wrapped, restored on exit); ``roots`` own their starts besides the entering thread."""
    record = ThreadStarts(roots)
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        record.starts.append((threading.current_thread(), self))
        real(self)

    threading.Thread.start = start  # type: ignore[method-assign]
    try:
        yield record
    finally:
        threading.Thread.start = real  # type: ignore[method-assign]


class OwnCpu:
    """The CPU time (s) of this process's threads but those already running when it was made
    (a thread another test left running burns CPU of its own, which a whole-process
    ``time.process_time()`` counts), the making thread counted too. ``own = OwnCpu()`` before
    the code under test starts its threads; ``t0 = own.now()`` ... ``own.spent(t0,
    own.now())``. From ``/proc/self/task`` (``threadcpu.snapshot``); the whole process's
    ``time.process_time()`` where there is none."""

    def __init__(self) -> None:
        from calexec.drivers.tools.bench import threadcpu

        self._threadcpu = threadcpu
        here = threading.current_thread().native_id
        first = threadcpu.snapshot()
        self._foreign = None if first is None else set(first) - {here}

    def now(self) -> dict[int, float] | float:
        """A point to measure from or to (:meth:`spent`)."""
        if self._foreign is None:
            return time.process_time()
        snap = self._threadcpu.snapshot() or {}
        return {tid: t.cpu_s for tid, t in snap.items() if tid not in self._foreign}

    @staticmethod
    def spent(before: dict[int, float] | float, after: dict[int, float] | float) -> float:
        """The CPU the own threads spent between two points (a thread that started in
        between: all of its CPU; one that ended: what it spent before is not known)."""
        if isinstance(before, float) or isinstance(after, float):
            return float(after) - float(before)  # type: ignore[arg-type]
        return sum(max(0.0, cpu - before.get(tid, 0.0)) for tid, cpu in after.items())
