"""Ranked locks for the executor (spec §5.2).

The spec fixes one acquisition order for the executor's locks::

    lifecycle_mu -> admission_mu -> pool_mu -> submit_mu

and forbids the completion thread from holding any of them while it blocks in ``Wait()``.
``RankedLock`` is a ``threading.Lock`` with a rank. In checking mode (tests, or
``ExecutorConfig.check_lock_order``) every acquisition is checked against the ranks the calling
thread already holds; an out-of-order acquisition is recorded in ``LockOrder.violations`` (and
raised as ``LockOrderViolation`` when ``strict``). ``LockOrder.held_by_current_thread()`` lets the
completion thread prove it holds nothing before ``Wait()``.
"""

from __future__ import annotations

import threading

LIFECYCLE, ADMISSION, POOL, SUBMIT, COMPLETION = range(5)
RANK_NAMES = {
    LIFECYCLE: "lifecycle_mu",
    ADMISSION: "admission_mu",
    POOL: "pool_mu",
    SUBMIT: "submit_mu",
    COMPLETION: "completion_mu",
}


class LockOrderViolation(RuntimeError):
    """A thread acquired a lock of lower or equal rank than one it already holds."""


class LockOrder:
    """Per-executor registry of ranked locks and of the order violations seen."""

    def __init__(self, checking: bool = False, strict: bool = False) -> None:
        self.checking = checking
        self.strict = strict
        self.violations: list[str] = []
        self._local = threading.local()

    def _held(self) -> list[int]:
        held = getattr(self._local, "held", None)
        if held is None:
            held = self._local.held = []
        return held

    def held_by_current_thread(self) -> tuple[str, ...]:
        return tuple(RANK_NAMES[r] for r in self._held())

    def lock(self, rank: int) -> "RankedLock | threading.Lock":
        """A lock of ``rank``: a checking ``RankedLock`` in checking mode, else a plain
        ``threading.Lock`` (the hot path pays nothing for the checks it does not run)."""
        return RankedLock(self, rank) if self.checking else threading.Lock()

    def _before_acquire(self, rank: int) -> None:
        held = self._held()
        if held and held[-1] >= rank:
            message = (
                f"{RANK_NAMES[rank]} acquired while holding {RANK_NAMES[held[-1]]} "
                f"(thread {threading.current_thread().name}); order is "
                "lifecycle_mu -> admission_mu -> pool_mu -> submit_mu"
            )
            self.violations.append(message)
            if self.strict:
                raise LockOrderViolation(message)


class RankedLock:
    """A non-reentrant lock with a rank in the §5.2 order; usable with ``threading.Condition``."""

    __slots__ = ("_order", "rank", "_lock")

    def __init__(self, order: LockOrder, rank: int) -> None:
        self._order = order
        self.rank = rank
        self._lock = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        order = self._order
        if order.checking:
            order._before_acquire(self.rank)
        got = self._lock.acquire(blocking, timeout)
        if got and order.checking:
            order._held().append(self.rank)
        return got

    def release(self) -> None:
        order = self._order
        if order.checking:
            held = order._held()
            if self.rank in held:
                # Remove the most recent entry of this rank (Condition.wait releases/reacquires).
                del held[len(held) - 1 - held[::-1].index(self.rank)]
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def _is_owned(self) -> bool:
        # threading.Condition's fallback probes with acquire(False), which would count as an
        # out-of-order acquisition; a ranked lock is only ever released by its holder.
        return self._lock.locked()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()
